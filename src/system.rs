//! system (to be written)

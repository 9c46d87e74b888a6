//! init (to be written)

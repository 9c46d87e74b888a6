//! logging (to be written)

//! Request validation in one place: every malformed field of api.md §2 is
//! refused here with INVALID_ARGUMENT, before anything touches the system.

/// A malformed request: the message says which field and why.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

//! crustd's one error: a gRPC code and a sentence that says what went wrong
//! and what to do. Each module picks its code; `service` only translates.

use std::fmt;

/// The gRPC status codes, one table for the agent, crust-client and crustd.
pub use crust_protocols::code::Code;

/// A failed call: its code and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// What the caller can tell from it.
    pub code: Code,
    /// What went wrong, naming the sandbox, volume, device or socket, and what to do.
    pub message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(m: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, m)
    }
    pub fn not_found(m: impl Into<String>) -> Error {
        Error::new(Code::NotFound, m)
    }
    pub fn precondition(m: impl Into<String>) -> Error {
        Error::new(Code::FailedPrecondition, m)
    }
    pub fn unavailable(m: impl Into<String>) -> Error {
        Error::new(Code::Unavailable, m)
    }
    pub fn internal(m: impl Into<String>) -> Error {
        Error::new(Code::Internal, m)
    }

    /// The same error with `more` appended to its message.
    pub fn and(mut self, more: impl fmt::Display) -> Error {
        self.message = format!("{}; {more}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.message)
    }
}

impl std::error::Error for Error {}

/// Result with crustd's error.
pub type Result<T> = std::result::Result<T, Error>;

//! crustd's one error: a gRPC code and a sentence that says what went wrong
//! and what to do. Each module picks its code; `service` only translates.

use std::fmt;

/// The gRPC status codes crustd answers with (a subset, named as gRPC names them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

/// Upper-case gRPC names, for logs and for codes passed through from the agent.
const NAMES: [(Code, &str); 16] = [
    (Code::Cancelled, "CANCELLED"),
    (Code::Unknown, "UNKNOWN"),
    (Code::InvalidArgument, "INVALID_ARGUMENT"),
    (Code::DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (Code::NotFound, "NOT_FOUND"),
    (Code::AlreadyExists, "ALREADY_EXISTS"),
    (Code::PermissionDenied, "PERMISSION_DENIED"),
    (Code::ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (Code::FailedPrecondition, "FAILED_PRECONDITION"),
    (Code::Aborted, "ABORTED"),
    (Code::OutOfRange, "OUT_OF_RANGE"),
    (Code::Unimplemented, "UNIMPLEMENTED"),
    (Code::Internal, "INTERNAL"),
    (Code::Unavailable, "UNAVAILABLE"),
    (Code::DataLoss, "DATA_LOSS"),
    (Code::Unauthenticated, "UNAUTHENTICATED"),
];

impl Code {
    /// The gRPC name, e.g. `NOT_FOUND`.
    pub fn name(self) -> &'static str {
        NAMES
            .iter()
            .find(|(c, _)| *c == self)
            .map_or("UNKNOWN", |(_, n)| n)
    }

    /// The code with gRPC name `name`; an unknown name is `Unknown`.
    pub fn from_name(name: &str) -> Code {
        NAMES
            .iter()
            .find(|(_, n)| *n == name)
            .map_or(Code::Unknown, |(c, _)| *c)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (c, n) in NAMES {
            assert_eq!(c.name(), n);
            assert_eq!(Code::from_name(n), c);
        }
        assert_eq!(Code::from_name("OK"), Code::Unknown);
        assert_eq!(Code::from_name("CODE_99"), Code::Unknown);
    }
}

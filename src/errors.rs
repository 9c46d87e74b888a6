//! The agent's one error type. Each capability module owns a typed error for
//! what can go wrong there and says which wire code it is; this module
//! gathers them. The mapping of `Code` to ttrpc statuses lives in server.rs.

use std::io;

/// The error classes of the wire contract (api.md §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// A malformed request.
    InvalidArgument,
    /// The volume or subpath does not exist.
    NotFound,
    /// The id or target is taken by something with other parameters.
    AlreadyExists,
    /// The system is not in a state where the request can be honoured.
    FailedPrecondition,
    /// The device did not appear in time.
    DeadlineExceeded,
    /// The requested size is beyond the device.
    OutOfRange,
    /// An unexpected syscall failure.
    Internal,
    /// The operation is not implemented by this agent.
    Unimplemented,
    /// The caller went away; the work was stopped.
    Cancelled,
    /// A bound of the agent was reached (connections, requests in flight, request size).
    ResourceExhausted,
}

impl Code {
    /// The canonical upper-case name, as gRPC and `crustctl` print it.
    pub fn name(self) -> &'static str {
        match self {
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Internal => "INTERNAL",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Cancelled => "CANCELLED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        }
    }
}

/// An unexpected syscall failure: INTERNAL, naming the call, the path and the errno.
#[derive(Debug, thiserror::Error)]
#[error("{call} on {path} failed: {source}")]
pub struct SysError {
    /// The syscall or ioctl, e.g. "statfs" or "EXT4_IOC_RESIZE_FS".
    pub call: &'static str,
    /// The path or object it was applied to.
    pub path: String,
    /// The errno, as an io::Error.
    #[source]
    pub source: io::Error,
}

impl SysError {
    /// Wraps an errno from `call` on `path`.
    pub fn new(
        call: &'static str,
        path: impl std::fmt::Display,
        source: impl Into<io::Error>,
    ) -> Self {
        SysError {
            call,
            path: path.to_string(),
            source: source.into(),
        }
    }

    /// The raw errno, if the error came from the kernel.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

/// Every error an operation can end in.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request was malformed.
    #[error(transparent)]
    Request(#[from] crate::validate::Invalid),
    /// Finding or sizing the disk failed.
    #[error(transparent)]
    Device(#[from] crate::device::Error),
    /// A block volume's device refused or went away.
    #[error(transparent)]
    BlockDevice(#[from] crate::blockdev::Error),
    /// The disk's filesystem could not be identified or does not match.
    #[error(transparent)]
    Probe(#[from] crate::probe::Error),
    /// A mount, bind or unmount failed.
    #[error(transparent)]
    Mount(#[from] crate::mount::Error),
    /// The fsGroup walk failed.
    #[error(transparent)]
    Ownership(#[from] crate::ownership::Error),
    /// Usage could not be read.
    #[error(transparent)]
    Stats(#[from] crate::stats::Error),
    /// Online growth failed.
    #[error(transparent)]
    Grow(#[from] crate::grow::Error),
    /// The volume table refused the operation.
    #[error(transparent)]
    Volume(#[from] crate::volumes::Error),
    /// The work was stopped (shutdown, deadline, caller gone) and undone.
    #[error(transparent)]
    Stopped(#[from] crate::cancel::Stopped),
    /// An unexpected syscall failure outside the modules above.
    #[error(transparent)]
    Sys(#[from] SysError),
    /// A request handler panicked; the agent caught it and goes on.
    #[error("the agent hit an internal fault while handling {0}: {1}; the request changed nothing it could undo, and the agent goes on serving")]
    Panic(&'static str, String),
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::Request(_) => Code::InvalidArgument,
            Error::Device(e) => e.code(),
            Error::BlockDevice(e) => e.code(),
            Error::Probe(e) => e.code(),
            Error::Mount(e) => e.code(),
            Error::Ownership(e) => e.code(),
            Error::Stats(e) => e.code(),
            Error::Grow(e) => e.code(),
            Error::Volume(e) => e.code(),
            Error::Stopped(e) => e.code(),
            Error::Sys(_) | Error::Panic(..) => Code::Internal,
        }
    }
}

/// Shorthand for the agent's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

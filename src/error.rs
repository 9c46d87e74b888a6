//! The agent's one error type: it joins the error of every capability (each
//! of which owns its error and says its code) with the table's own, so the
//! wire has one thing to translate. Nothing below the table imports it.

use crate::code::Code;
use crate::sys::error::SysError;

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
    BlockDevice(#[from] crate::sys::blockdev::Error),
    /// The disk's filesystem could not be identified or does not match.
    #[error(transparent)]
    Probe(#[from] crate::probe::error::Error),
    /// A mount, bind or unmount failed.
    #[error(transparent)]
    Mount(#[from] crate::mount::error::Error),
    /// The fsGroup walk failed.
    #[error(transparent)]
    Ownership(#[from] crate::ownership::error::Error),
    /// Usage could not be read.
    #[error(transparent)]
    Stats(#[from] crate::stats::Error),
    /// Online growth failed.
    #[error(transparent)]
    Grow(#[from] crate::grow::Error),
    /// The volume table refused the operation.
    #[error(transparent)]
    Volume(#[from] crate::volumes::error::Error),
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

/// A mount option the table refused is a mount error.
impl From<crate::mount::options::BadOption> for Error {
    fn from(b: crate::mount::options::BadOption) -> Error {
        Error::Mount(b.into())
    }
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

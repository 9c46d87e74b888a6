//! The agent's one error type: it joins the error of every capability (each
//! of which owns its error and says its code) with the table's own, so the
//! wire has one thing to translate. Nothing below the table imports it.

use crate::sys::error::SysError;

crate::code::coded_errors! {
/// Every error an operation can end in.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(InvalidArgument)]
    #[error(transparent)]
    Request(#[from] crate::validate::Invalid),
    #[code(inner)]
    #[error(transparent)]
    Device(#[from] crate::device::Error),
    #[code(inner)]
    #[error(transparent)]
    BlockDevice(#[from] crate::sys::blockdev::Error),
    #[code(inner)]
    #[error(transparent)]
    Probe(#[from] crate::probe::error::Error),
    #[code(inner)]
    #[error(transparent)]
    Mount(#[from] crate::mount::error::Error),
    #[code(inner)]
    #[error(transparent)]
    Ownership(#[from] crate::ownership::error::Error),
    #[code(inner)]
    #[error(transparent)]
    Stats(#[from] crate::stats::Error),
    #[code(inner)]
    #[error(transparent)]
    Grow(#[from] crate::grow::Error),
    #[code(inner)]
    #[error(transparent)]
    Luks2(#[from] crate::luks2::error::Error),
    #[code(inner)]
    #[error(transparent)]
    Quiesce(#[from] crate::quiesce::Error),
    #[code(inner)]
    #[error(transparent)]
    Keys(#[from] crate::keys::error::Error),
    #[code(inner)]
    #[error(transparent)]
    Mkfs(#[from] crate::mkfs::Error),
    #[code(inner)]
    #[error(transparent)]
    Volume(#[from] crate::volumes::error::Error),
    #[code(inner)]
    #[error(transparent)]
    Lease(#[from] crate::volumes::lease::error::Error),
    #[code(inner)]
    #[error(transparent)]
    Stopped(#[from] crate::cancel::Stopped),
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
    #[code(Internal)]
    #[error("the agent hit an internal fault while handling {0}: {1}; the request changed nothing it could undo, and the agent goes on serving")]
    Panic(&'static str, String),
}
}

/// A mount option the table refused is a mount error.
impl From<crate::mount::options::BadOption> for Error {
    fn from(b: crate::mount::options::BadOption) -> Error {
        Error::Mount(b.into())
    }
}

/// Shorthand for the agent's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! crust-vm's one error: each message says what to do.

use std::io;

use crust_client::qmp::QmpError;

/// What can go wrong driving the VM; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O failure, with what was being done.
    #[error("{0}: {1}")]
    Io(String, #[source] io::Error),
    /// QEMU refused a QMP command or spoke nonsense.
    #[error("QMP: {0}")]
    Qmp(String),
    /// Something did not happen in time.
    #[error("{0}")]
    Timeout(String),
    /// The VM did not come up.
    #[error("{0}")]
    Boot(String),
    /// The guest image could not be built.
    #[error("{0}")]
    Initrd(String),
    /// A bad argument (serial, size, missing state).
    #[error("{0}")]
    Invalid(String),
}

/// Result with this crate's error.
pub type Result<T> = std::result::Result<T, Error>;

impl From<QmpError> for Error {
    fn from(e: QmpError) -> Error {
        Error::Qmp(e.to_string())
    }
}

/// An I/O failure as [`Error::Io`], saying what was being done.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |e| Error::Io(what, e)
}

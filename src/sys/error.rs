//! The one error of the leaves: a syscall that failed where nothing else
//! was expected (INTERNAL), naming the call, the object and the errno.

use std::io;

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

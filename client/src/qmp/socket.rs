//! Where a QMP socket is: a path looked up as it is connected, or a socket
//! file the caller has already found and judged, connected through its
//! descriptor so that what was judged is what is reached.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use crate::address::Address;
use crate::connect::{connect_opened, connect_stream, ConnectError};

/// A QMP socket to connect to.
#[derive(Debug, Clone, Copy)]
pub enum Socket<'a> {
    /// A path, looked up (symbolic links followed) as it is connected.
    Path(&'a Path),
    /// A socket file the caller opened with `O_PATH` and judged, and its
    /// path for messages.
    Opened(BorrowedFd<'a>, &'a Path),
}

impl Socket<'_> {
    /// The socket's path, for messages.
    pub fn path(&self) -> &Path {
        match self {
            Socket::Path(p) | Socket::Opened(_, p) => p,
        }
    }

    /// A stream connected to it within `timeout`.
    pub(crate) fn connect(&self, timeout: Duration) -> Result<OwnedFd, ConnectError> {
        match self {
            Socket::Path(p) => connect_stream(&Address::Unix(p.to_path_buf()), timeout),
            Socket::Opened(fd, p) => connect_opened(*fd, p, timeout),
        }
    }
}

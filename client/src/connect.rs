//! Opening a stream to the agent within a deadline: a Unix socket (std),
//! AF_VSOCK (the `vsock` crate), or the hybrid vsock handshake
//! (`CONNECT PORT\n` → `OK …\n`, hvsock.rs) over a VMM's Unix socket, as
//! Firecracker, Cloud Hypervisor and vhost-device-vsock expect. No raw
//! socket calls: the connect runs blockingly on a helper thread that the
//! deadline outruns, and the handshake uses the stream's timeouts. The
//! connected stream is handed to ttrpc, which owns it from then on. The
//! same bounded connect serves QMP (qmp.rs): any Unix socket a sandbox
//! names may belong to a listener that never accepts.

use std::{
    io,
    os::{
        fd::{AsFd, BorrowedFd, IntoRawFd, OwnedFd},
        unix::net::UnixStream,
    },
    path::Path,
    sync::mpsc,
    time::{Duration, Instant},
};

use crate::address::{Address, AddressError};
use crate::hvsock;
use crate::peer;
use crust_protocols::ttrpc;

/// `sizeof(sockaddr_un.sun_path)`: a path must fit with its NUL.
const MAX_SUN_PATH: usize = 108;

pub use crate::connect_error::ConnectError;

/// Connects to the agent at `addr` and returns a ttrpc client on that stream.
/// `timeout` bounds the whole connection, the hvsock handshake included.
pub fn connect(addr: &Address, timeout: Duration) -> Result<ttrpc::Client, ConnectError> {
    connect_until(addr, Instant::now() + timeout, &mut || true)
}

/// [`connect`] as [`connect_stream_until`] connects.
pub fn connect_until(
    addr: &Address,
    deadline: Instant,
    keep_waiting: &mut dyn FnMut() -> bool,
) -> Result<ttrpc::Client, ConnectError> {
    let stream = connect_stream_until(addr, deadline, keep_waiting)?;
    // ttrpc's client takes the raw fd and closes it when the last clone drops.
    ttrpc::Client::new(stream.into_raw_fd()).map_err(|e| ConnectError::Ttrpc {
        addr: addr.to_string(),
        detail: e.to_string(),
    })
}

/// Connects to `addr` and returns the blocking stream, positioned at the first
/// byte of the ttrpc conversation (for hvsock: just after the `OK` line).
/// `timeout` bounds the whole connection, the hvsock handshake included; a
/// `CONNECT` still unanswered then is kept open until the backend answers
/// (hvsock.rs), but this call returns at its deadline.
pub fn connect_stream(addr: &Address, timeout: Duration) -> Result<OwnedFd, ConnectError> {
    connect_stream_until(addr, Instant::now() + timeout, &mut || true)
}

/// [`connect_stream`] until `deadline`, waiting for a hybrid vsock answer
/// only for as long as `keep_waiting` says so (asked a few times a second:
/// e.g. "the VM still runs"). For callers that know the guest listens and
/// that only load can delay its answer, so a long deadline is right.
pub fn connect_stream_until(
    addr: &Address,
    deadline: Instant,
    keep_waiting: &mut dyn FnMut() -> bool,
) -> Result<OwnedFd, ConnectError> {
    addr.check_connectable()?;
    let timeout = deadline.saturating_duration_since(Instant::now());
    let name = addr.to_string();
    let io_err = |call, source| ConnectError::Io {
        call,
        addr: name.clone(),
        source,
    };
    match addr {
        Address::Unix(path) => {
            let s = connect_unix(&name, path, deadline, timeout)?;
            Ok(OwnedFd::from(s))
        }
        Address::Vsock { cid, port } => {
            let (cid, port) = (*cid, *port);
            let s = within(&name, deadline, timeout, move || {
                vsock::VsockStream::connect_with_cid_port(cid, port)
            })?;
            // The vsock crate hands its descriptor out raw only; a duplicate is an owned one.
            s.as_fd().try_clone_to_owned().map_err(|e| io_err("dup", e))
        }
        Address::Hvsock { path, port } => {
            hvsock::admit(path, *port)?;
            let s = connect_unix(&name, path, deadline, timeout)?;
            let s = hvsock::handshake(s, path, *port, deadline, timeout, keep_waiting)?;
            Ok(OwnedFd::from(s))
        }
    }
}

/// [`connect_stream`] to the Unix socket that `fd` was opened on with
/// `O_PATH` by a caller that judged the file it found there (peer.rs): the
/// connect goes through the descriptor, so it reaches that socket and no
/// other, whatever its path names by then. `path` is for messages.
pub fn connect_opened(
    fd: BorrowedFd<'_>,
    path: &Path,
    timeout: Duration,
) -> Result<OwnedFd, ConnectError> {
    let name = Address::Unix(path.to_path_buf()).to_string();
    let owned = fd.try_clone_to_owned().map_err(|source| ConnectError::Io {
        call: "dup",
        addr: name.clone(),
        source,
    })?;
    let deadline = Instant::now() + timeout;
    let s = within(&name, deadline, timeout, move || {
        peer::connect_opened(owned)
    })?;
    Ok(OwnedFd::from(s))
}

fn connect_unix(
    name: &str,
    path: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<UnixStream, ConnectError> {
    // Address parsing bounds the length; std checks it again.
    if path.as_os_str().len() >= MAX_SUN_PATH {
        return Err(AddressError::PathTooLong {
            addr: name.to_string(),
            len: path.as_os_str().len(),
        }
        .into());
    }
    let path = path.to_path_buf();
    within(name, deadline, timeout, move || UnixStream::connect(path))
}

/// Runs a blocking `connect` on a helper thread and waits for it until
/// `deadline`. std and the vsock crate connect only blockingly; a connect
/// that outlives the deadline (a listener whose backlog is full, a guest
/// that does not answer) is left to finish on its thread, and its stream,
/// if it comes, is closed there.
fn within<S: Send + 'static>(
    name: &str,
    deadline: Instant,
    timeout: Duration,
    connect: impl FnOnce() -> io::Result<S> + Send + 'static,
) -> Result<S, ConnectError> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("crust-connect".into())
        .spawn(move || {
            let _ = tx.send(connect());
        })
        .map_err(|source| ConnectError::Io {
            call: "spawn",
            addr: name.to_string(),
            source,
        })?;
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left) {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) if e.kind() == io::ErrorKind::TimedOut => Err(ConnectError::TimedOut {
            addr: name.to_string(),
            timeout,
        }),
        Ok(Err(source)) => Err(ConnectError::Unreachable {
            addr: name.to_string(),
            source,
        }),
        Err(_) => Err(ConnectError::TimedOut {
            addr: name.to_string(),
            timeout,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn missing_socket_is_unreachable() {
        let dir = tempfile::tempdir().unwrap();
        let addr = Address::Unix(dir.path().join("none.sock"));
        let err = connect_stream(&addr, Duration::from_secs(1)).unwrap_err();
        match &err {
            ConnectError::Unreachable { source, .. } => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOENT))
            }
            other => panic!("{other}"),
        }
        assert!(err.to_string().contains("none.sock"), "{err}");
    }

    #[test]
    fn socket_without_listener_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.sock");
        drop(UnixListener::bind(&path).unwrap());
        let err = connect_stream(&Address::Unix(path), Duration::from_secs(1)).unwrap_err();
        match &err {
            ConnectError::Unreachable { source, .. } => {
                assert_eq!(source.raw_os_error(), Some(libc::ECONNREFUSED))
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn unix_stream_is_returned_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ok.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let fd = connect_stream(&Address::Unix(path), Duration::from_secs(1)).unwrap();
        let flags = rustix::fs::fcntl_getfl(&fd).unwrap();
        assert!(!flags.contains(rustix::fs::OFlags::NONBLOCK));
    }

    #[test]
    fn vsock_to_no_guest_fails_within_the_timeout() {
        // No VM has this context id (or the host has no vsock at all): an
        // error either way, and never later than the timeout.
        let start = Instant::now();
        let err = connect_stream(
            &"vsock://123457:1024".parse().unwrap(),
            Duration::from_millis(500),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                ConnectError::Unreachable { .. } | ConnectError::TimedOut { .. }
            ),
            "{err}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn any_cid_is_refused_before_any_syscall() {
        let err = connect_stream(&"vsock://-1:1024".parse().unwrap(), Duration::from_secs(1))
            .unwrap_err();
        assert!(
            matches!(
                err,
                ConnectError::Address(AddressError::AnyCidForConnect(_))
            ),
            "{err}"
        );
    }
}

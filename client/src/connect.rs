//! Opening a stream to the agent within a deadline: a Unix socket (std),
//! AF_VSOCK (the `vsock` crate), or the hybrid vsock handshake
//! (`CONNECT PORT\n` → `OK …\n`) over a VMM's Unix socket, as Firecracker,
//! Cloud Hypervisor and vhost-device-vsock expect. No raw socket calls: the
//! connect runs blockingly on a helper thread that the deadline outruns, and
//! the handshake uses the stream's timeouts. The connected stream is handed
//! to ttrpc, which owns it from then on.

use std::{
    io::{self, Read, Write},
    os::{
        fd::{AsFd, IntoRawFd, OwnedFd},
        unix::net::UnixStream,
    },
    path::{Path, PathBuf},
    sync::mpsc,
    time::{Duration, Instant},
};

use thiserror::Error;

use crate::address::{Address, AddressError};
use crust_protocols::ttrpc;

/// The longest handshake answer we read before calling the backend broken.
const MAX_HANDSHAKE_LINE: usize = 256;
/// `sizeof(sockaddr_un.sun_path)`: a path must fit with its NUL.
const MAX_SUN_PATH: usize = 108;

/// Why no connection to the agent could be made.
#[derive(Debug, Error)]
pub enum ConnectError {
    #[error(transparent)]
    Address(#[from] AddressError),
    #[error("cannot connect to {addr}: {source}; is the agent, or the VM's vsock backend, running there?")]
    Unreachable { addr: String, source: io::Error },
    #[error("connecting to {addr} timed out after {}: the agent did not accept the connection", secs(*.timeout))]
    TimedOut { addr: String, timeout: Duration },
    #[error("hybrid vsock handshake with {} failed: the backend {reply} instead of OK (is the guest agent listening on port {port}?)", .path.display())]
    Handshake {
        path: PathBuf,
        port: u32,
        reply: String,
    },
    #[error("hybrid vsock handshake with {} timed out after {}: the backend did not answer CONNECT {port} (is the guest agent listening on port {port}?)", .path.display(), secs(*.timeout))]
    HandshakeTimedOut {
        path: PathBuf,
        port: u32,
        timeout: Duration,
    },
    #[error("{call} failed while connecting to {addr}: {source}")]
    Io {
        call: &'static str,
        addr: String,
        source: io::Error,
    },
    #[error("cannot set up the ttrpc client on the connection to {addr}: {detail}")]
    Ttrpc { addr: String, detail: String },
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// Connects to the agent at `addr` and returns a ttrpc client on that stream.
/// `timeout` bounds the whole connection, the hvsock handshake included.
pub fn connect(addr: &Address, timeout: Duration) -> Result<ttrpc::Client, ConnectError> {
    let stream = connect_stream(addr, timeout)?;
    // ttrpc's client takes the raw fd and closes it when the last clone drops.
    ttrpc::Client::new(stream.into_raw_fd()).map_err(|e| ConnectError::Ttrpc {
        addr: addr.to_string(),
        detail: e.to_string(),
    })
}

/// Connects to `addr` and returns the blocking stream, positioned at the first
/// byte of the ttrpc conversation (for hvsock: just after the `OK` line).
pub fn connect_stream(addr: &Address, timeout: Duration) -> Result<OwnedFd, ConnectError> {
    addr.check_connectable()?;
    let deadline = Instant::now() + timeout;
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
            let mut s = connect_unix(&name, path, deadline, timeout)?;
            handshake(&mut s, path, *port, deadline, timeout)?;
            // Back to blocking without timeouts: ttrpc owns the stream from here.
            s.set_read_timeout(None)
                .and_then(|_| s.set_write_timeout(None))
                .map_err(|e| io_err("setsockopt", e))?;
            Ok(OwnedFd::from(s))
        }
    }
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

/// Sets the stream's timeouts to what is left before `deadline`; false
/// when nothing is left.
fn bound(s: &UnixStream, deadline: Instant) -> io::Result<bool> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Ok(false);
    }
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))?;
    Ok(true)
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// The hybrid vsock handshake on a connected Unix stream.
fn handshake(
    s: &mut UnixStream,
    path: &Path,
    port: u32,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), ConnectError> {
    let name = format!("hvsock://{}:{port}", path.display());
    let io_err = |call, source| ConnectError::Io {
        call,
        addr: name.clone(),
        source,
    };
    let timed_out_err = || ConnectError::HandshakeTimedOut {
        path: path.to_path_buf(),
        port,
        timeout,
    };
    let failed = |reply: String| ConnectError::Handshake {
        path: path.to_path_buf(),
        port,
        reply,
    };

    if !bound(s, deadline).map_err(|e| io_err("setsockopt", e))? {
        return Err(timed_out_err());
    }
    // std ignores SIGPIPE in Rust programs: a backend that hung up is EPIPE here.
    match s.write_all(format!("CONNECT {port}\n").as_bytes()) {
        Ok(()) => {}
        Err(e) if timed_out(&e) => return Err(timed_out_err()),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) =>
        {
            return Err(failed(
                "closed the connection before CONNECT was sent".into(),
            ))
        }
        Err(e) => return Err(io_err("send", e)),
    }

    // One byte at a time: whatever follows the newline is the agent's, for ttrpc.
    let mut line = Vec::new();
    loop {
        if !bound(s, deadline).map_err(|e| io_err("setsockopt", e))? {
            return Err(timed_out_err());
        }
        let mut byte = [0u8; 1];
        match s.read(&mut byte) {
            Ok(0) => return Err(failed(describe_reply(&line, true))),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if timed_out(&e) => return Err(timed_out_err()),
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(failed(describe_reply(&line, true)))
            }
            Err(e) => return Err(io_err("recv", e)),
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > MAX_HANDSHAKE_LINE {
            return Err(failed(describe_reply(&line, false)));
        }
    }
    if line.starts_with(b"OK ") {
        Ok(())
    } else {
        Err(failed(describe_reply(&line, false)))
    }
}

/// How the backend answered, for the handshake error message.
fn describe_reply(line: &[u8], closed: bool) -> String {
    let text = String::from_utf8_lossy(line);
    match (line.is_empty(), closed) {
        (true, true) => "closed the connection without answering".to_string(),
        (false, true) => format!("answered {text:?} and closed the connection"),
        (_, false) => format!("answered {text:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        io::{BufRead, BufReader},
        os::unix::net::UnixListener,
        thread,
    };

    /// A one-shot fake hybrid vsock backend: reads the CONNECT line, answers
    /// `reply` and then writes `after` (bytes of the "ttrpc stream").
    fn backend(
        dir: &Path,
        reply: &'static [u8],
        after: &'static [u8],
    ) -> (Address, thread::JoinHandle<String>) {
        let path = dir.join("v.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let handle = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let mut w = stream;
            w.write_all(reply).unwrap();
            w.write_all(after).unwrap();
            line
        });
        (Address::Hvsock { path, port: 1024 }, handle)
    }

    #[test]
    fn hvsock_ok_leaves_the_stream_after_the_newline() {
        let dir = tempfile::tempdir().unwrap();
        let (addr, backend) = backend(dir.path(), b"OK 1073741824\n", b"ttrpc!");
        let fd = connect_stream(&addr, Duration::from_secs(5)).unwrap();
        assert_eq!(backend.join().unwrap(), "CONNECT 1024\n");
        let mut stream = UnixStream::from(fd);
        let mut rest = String::new();
        stream.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "ttrpc!");
    }

    #[test]
    fn hvsock_refusals_name_the_answer_and_the_port() {
        let table: &[(&'static [u8], &str)] = &[
            (b"NOPE\n", "answered \"NOPE\" instead of OK"),
            (b"", "closed the connection without answering instead of OK"),
            (b"OK", "answered \"OK\" and closed the connection"),
            (b"OK\n", "answered \"OK\" instead of OK"),
            (b"ok 5\n", "answered \"ok 5\""),
        ];
        for (reply, want) in table {
            let dir = tempfile::tempdir().unwrap();
            let (addr, backend) = backend(dir.path(), reply, b"");
            let err = connect_stream(&addr, Duration::from_secs(5)).unwrap_err();
            backend.join().unwrap();
            let msg = err.to_string();
            assert!(matches!(err, ConnectError::Handshake { .. }), "{msg}");
            assert!(msg.contains(want), "{reply:?}: {msg}");
            assert!(msg.contains("listening on port 1024"), "{msg}");
            assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        }
    }

    #[test]
    fn hvsock_silent_backend_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let start = Instant::now();
        let err = connect_stream(
            &Address::Hvsock { path, port: 7 },
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(
            matches!(err, ConnectError::HandshakeTimedOut { port: 7, .. }),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(3));
    }

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

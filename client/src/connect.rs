//! Opening a stream to the agent within a deadline: a Unix socket, AF_VSOCK, or
//! the hybrid vsock handshake (`CONNECT PORT\n` → `OK …\n`) over a VMM's Unix
//! socket. The connected stream is handed to ttrpc, which owns it from then on.

use std::{
    io, mem,
    os::{
        fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use thiserror::Error;

use crate::address::{Address, AddressError};
use crust_protocols::ttrpc;

/// The longest handshake answer we read before calling the backend broken.
const MAX_HANDSHAKE_LINE: usize = 256;

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
    let fd = match addr {
        Address::Unix(path) => connect_unix(&name, path, deadline, timeout)?,
        Address::Vsock { cid, port } => {
            // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value.
            let mut sa: libc::sockaddr_vm = unsafe { mem::zeroed() };
            #[allow(clippy::cast_possible_truncation)] // AF_VSOCK (40) fits sa_family_t.
            {
                sa.svm_family = libc::AF_VSOCK as libc::sa_family_t;
            }
            sa.svm_cid = *cid;
            sa.svm_port = *port;
            connect_raw(&name, libc::AF_VSOCK, &sa, deadline, timeout)?
        }
        Address::Hvsock { path, port } => {
            let fd = connect_unix(&name, path, deadline, timeout)?;
            handshake(&fd, path, *port, deadline, timeout)?;
            fd
        }
    };
    set_nonblocking(&fd, false).map_err(|source| ConnectError::Io {
        call: "fcntl",
        addr: name,
        source,
    })?;
    Ok(fd)
}

fn connect_unix(
    name: &str,
    path: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<OwnedFd, ConnectError> {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { mem::zeroed() };
    #[allow(clippy::cast_possible_truncation)] // AF_UNIX (1) fits sa_family_t.
    {
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    }
    let bytes = path.as_os_str().as_bytes();
    // Address parsing bounds the length; keep one byte for the NUL anyway.
    if bytes.len() >= sa.sun_path.len() {
        return Err(AddressError::PathTooLong {
            addr: name.to_string(),
            len: bytes.len(),
        }
        .into());
    }
    for (dst, src) in sa.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    connect_raw(name, libc::AF_UNIX, &sa, deadline, timeout)
}

/// socket + nonblocking connect, waiting for completion until `deadline`.
fn connect_raw<T>(
    name: &str,
    family: libc::c_int,
    sa: &T,
    deadline: Instant,
    timeout: Duration,
) -> Result<OwnedFd, ConnectError> {
    let io_err = |call, source| ConnectError::Io {
        call,
        addr: name.to_string(),
        source,
    };
    // SAFETY: plain syscall with constant arguments; the result is checked.
    let raw = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(io_err("socket", io::Error::last_os_error()));
    }
    // SAFETY: `raw` is a fresh socket that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    loop {
        // SAFETY: `sa` points to a fully initialised sockaddr of the family's
        // type, and the length passed is exactly its size.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                sa as *const T as *const libc::sockaddr,
                socklen::<T>(),
            )
        };
        if rc == 0 {
            return Ok(fd);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EINPROGRESS) => break,
            // A Unix listener with a full backlog: try again until the deadline.
            Some(libc::EAGAIN) => {
                if Instant::now() >= deadline {
                    return Err(ConnectError::TimedOut {
                        addr: name.to_string(),
                        timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            _ => {
                return Err(ConnectError::Unreachable {
                    addr: name.to_string(),
                    source: err,
                })
            }
        }
    }
    if !wait_for(&fd, libc::POLLOUT, deadline).map_err(|e| io_err("poll", e))? {
        return Err(ConnectError::TimedOut {
            addr: name.to_string(),
            timeout,
        });
    }
    let mut so_error: libc::c_int = 0;
    let mut len = socklen::<libc::c_int>();
    // SAFETY: SO_ERROR writes one c_int into `so_error`, whose size is in `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            &mut so_error as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io_err("getsockopt(SO_ERROR)", io::Error::last_os_error()));
    }
    match so_error {
        0 => Ok(fd),
        libc::ETIMEDOUT => Err(ConnectError::TimedOut {
            addr: name.to_string(),
            timeout,
        }),
        e => Err(ConnectError::Unreachable {
            addr: name.to_string(),
            source: io::Error::from_raw_os_error(e),
        }),
    }
}

/// Polls `fd` for `events` until `deadline`; false when the deadline passed.
fn wait_for(fd: &OwnedFd, events: libc::c_short, deadline: Instant) -> io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, count 1.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        if rc > 0 {
            // Errors and hang-ups count as ready: the following call reports them.
            return Ok(true);
        }
    }
}

fn set_nonblocking(fd: &OwnedFd, on: bool) -> io::Result<()> {
    // SAFETY: F_GETFL on an fd we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: F_SETFL with flags derived from the fd's own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The hybrid vsock handshake on a connected, nonblocking Unix stream.
fn handshake(
    fd: &OwnedFd,
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
    let timed_out = || ConnectError::HandshakeTimedOut {
        path: path.to_path_buf(),
        port,
        timeout,
    };
    let failed = |reply: String| ConnectError::Handshake {
        path: path.to_path_buf(),
        port,
        reply,
    };

    let request = format!("CONNECT {port}\n");
    let mut sent = 0;
    while sent < request.len() {
        if !wait_for(fd, libc::POLLOUT, deadline).map_err(|e| io_err("poll", e))? {
            return Err(timed_out());
        }
        // SAFETY: the pointer and length describe the unsent tail of `request`.
        // MSG_NOSIGNAL: a backend that hung up is an error here, not a SIGPIPE.
        let n = unsafe {
            libc::send(
                fd.as_raw_fd(),
                request[sent..].as_ptr().cast(),
                request.len() - sent,
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                Some(libc::EPIPE) | Some(libc::ECONNRESET) => {
                    return Err(failed(
                        "closed the connection before CONNECT was sent".into(),
                    ))
                }
                _ => return Err(io_err("send", err)),
            }
        }
        sent += n as usize;
    }

    // One byte at a time: whatever follows the newline is the agent's, for ttrpc.
    let mut line = Vec::new();
    loop {
        if !wait_for(fd, libc::POLLIN, deadline).map_err(|e| io_err("poll", e))? {
            return Err(timed_out());
        }
        let mut byte = 0u8;
        // SAFETY: reads at most one byte into `byte`.
        let n = unsafe { libc::recv(fd.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                Some(libc::ECONNRESET) => return Err(failed(describe_reply(&line, true))),
                _ => return Err(io_err("recv", err)),
            }
        }
        if n == 0 {
            return Err(failed(describe_reply(&line, true)));
        }
        if byte == b'\n' {
            break;
        }
        line.push(byte);
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

/// The size of a socket address or option type, as the kernel takes it.
fn socklen<T>() -> libc::socklen_t {
    // Socket types are a few hundred bytes at most.
    libc::socklen_t::try_from(mem::size_of::<T>()).unwrap_or(libc::socklen_t::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        io::{BufRead, BufReader, Read, Write},
        os::unix::net::{UnixListener, UnixStream},
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
        // SAFETY: F_GETFL on a valid fd.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0);
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

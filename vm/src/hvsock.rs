//! The host end of hybrid vsock (Firecracker, Cloud Hypervisor, vhost-device-vsock):
//! connect to the Unix socket, send `CONNECT <port>\n`, read `OK <n>\n`; the
//! stream is then the guest's port. Also a ttrpc `AgentClient` over it.
//!
//! A `CONNECT` is never abandoned while the backend may still answer it.
//! vhost-device-vsock 0.3.0 writes the `OK` line with `write_all(..).unwrap()`:
//! if the client closed the stream before the guest accepted (a client-side
//! timeout on a busy machine), that write fails with EPIPE and the panic ends
//! the backend's vring worker thread: the VM's vsock is dead from then on,
//! every later connection waits forever. So a handshake that times out here
//! hands its stream to a reaper thread, which keeps it open until the backend
//! answers (`OK`, or the close that means "nobody listens") or goes away.

use std::io::{self, Read, Write};
use std::os::unix::io::IntoRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crust_protocols::crust_ttrpc::AgentClient;

/// Streams whose `CONNECT` is still unanswered, held at most this many.
/// Past it a timed-out stream is closed (the risk above), so that a caller
/// looping against a dead backend cannot exhaust descriptors.
const MAX_PARKED: usize = 1024;
/// How often the reaper looks at the parked streams.
const REAP_EVERY: Duration = Duration::from_millis(100);

/// Connects to guest port `port` through the hybrid-vsock socket `uds`,
/// waiting up to `timeout` for the backend's answer. Fails when the backend
/// refuses or the guest has nobody listening (the backend then closes the
/// stream instead of answering `OK`). On a timeout the stream is parked,
/// not closed (see the module documentation).
pub fn connect(uds: &Path, port: u32, timeout: Duration) -> io::Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    connect_until(uds, port, deadline, &mut || true)
}

/// [`connect`], waiting for the answer until `deadline` for as long as
/// `keep_waiting` says so (asked a few times a second: e.g. "QEMU still
/// runs"). Used where the guest is known to listen and only load can delay
/// the answer.
pub fn connect_until(
    uds: &Path,
    port: u32,
    deadline: Instant,
    keep_waiting: &mut dyn FnMut() -> bool,
) -> io::Result<UnixStream> {
    let mut s = UnixStream::connect(uds)?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    // Byte by byte: whatever follows the newline belongs to the guest's stream.
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < 64 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !keep_waiting() {
            park(s);
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{} did not answer CONNECT {port} in time (the guest is slow or not there)",
                    uds.display()
                ),
            ));
        }
        s.set_read_timeout(Some(left.min(Duration::from_millis(250))))?;
        match s.read(&mut b) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!(
                        "{} closed the stream: nothing listens on guest port {port} yet",
                        uds.display()
                    ),
                ))
            }
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) => line.push(b[0]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    let line = String::from_utf8_lossy(&line);
    if !line.starts_with("OK ") {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "{} answered {line:?} to CONNECT {port}, not OK",
                uds.display()
            ),
        ));
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok(s)
}

fn parked() -> &'static Mutex<Vec<UnixStream>> {
    static PARKED: OnceLock<Mutex<Vec<UnixStream>>> = OnceLock::new();
    PARKED.get_or_init(|| {
        // One reaper for the process, started with the first parked stream.
        let _ = std::thread::Builder::new()
            .name("hvsock-reaper".into())
            .spawn(reap);
        Mutex::new(Vec::new())
    })
}

/// Keeps `s` open until the backend answers its `CONNECT`.
fn park(s: UnixStream) {
    if s.set_nonblocking(true).is_err() {
        return;
    }
    let mut p = parked().lock().unwrap_or_else(|e| e.into_inner());
    if p.len() < MAX_PARKED {
        p.push(s);
    }
}

/// How many streams wait for their answer (for tests and diagnostics).
pub fn parked_count() -> usize {
    parked().lock().unwrap_or_else(|e| e.into_inner()).len()
}

/// Closes each parked stream once its answer came: the `OK` line (closing
/// an accepted connection is safe) or the end of the stream.
fn reap() {
    loop {
        std::thread::sleep(REAP_EVERY);
        let mut p = parked().lock().unwrap_or_else(|e| e.into_inner());
        p.retain_mut(|s| {
            let mut b = [0u8; 256];
            match s.read(&mut b) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
                // Answered (OK and perhaps data), closed, or broken: let go.
                _ => false,
            }
        });
    }
}

/// A ttrpc client for the agent on guest port `port` behind `uds`.
pub fn agent_client(uds: &Path, port: u32, timeout: Duration) -> io::Result<AgentClient> {
    client_of(connect(uds, port, timeout)?)
}

/// A ttrpc client over an established hybrid-vsock stream.
pub fn client_of(s: UnixStream) -> io::Result<AgentClient> {
    let client = crust_protocols::ttrpc::Client::new(s.into_raw_fd())
        .map_err(|e| io::Error::other(format!("ttrpc client: {e}")))?;
    Ok(AgentClient::new(client))
}

/// A ttrpc context that gives up after `d`.
pub fn ctx(d: Duration) -> crust_protocols::ttrpc::context::Context {
    crust_protocols::ttrpc::context::with_timeout(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;

    /// A backend that reads CONNECT, waits `delay`, answers OK, and reports
    /// whether its write of OK succeeded (what vhost-device-vsock unwraps).
    fn slow_backend(l: UnixListener, delay: Duration) -> std::thread::JoinHandle<io::Result<()>> {
        std::thread::spawn(move || {
            let (s, _) = l.accept()?;
            let mut r = io::BufReader::new(s.try_clone()?);
            let mut line = String::new();
            r.read_line(&mut line)?;
            assert_eq!(line, "CONNECT 1024\n");
            std::thread::sleep(delay);
            (&s).write_all(b"OK 1024\n")
        })
    }

    #[test]
    fn a_timed_out_connect_is_held_until_the_backend_answers() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("v.sock");
        let backend = slow_backend(
            UnixListener::bind(&path).unwrap(),
            Duration::from_millis(700),
        );
        let e = connect(&path, 1024, Duration::from_millis(100)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(parked_count() >= 1);
        // The late OK found its stream open: the backend's write succeeded
        // (vhost-device-vsock would have panicked on EPIPE here).
        backend
            .join()
            .unwrap()
            .expect("the backend could write its answer");
        let deadline = Instant::now() + Duration::from_secs(5);
        while parked_count() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(parked_count(), 0, "answered streams are let go");
    }

    #[test]
    fn nobody_listening_is_a_quick_refusal() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = io::BufReader::new(s);
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            // Dropped: the backend's "nobody listens on that port".
        });
        let e = connect(&path, 1024, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
        t.join().unwrap();
    }
}

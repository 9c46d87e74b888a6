//! The hybrid vsock handshake of Firecracker, Cloud Hypervisor and
//! vhost-device-vsock: on a connected Unix stream, send `CONNECT PORT\n`,
//! read `OK …\n`; the stream is then the guest's port.
//!
//! A `CONNECT` is never abandoned while the backend may still answer it.
//! vhost-device-vsock 0.3.0 writes the `OK` line with
//! `write_all(..).unwrap()`: if the client closed the stream before the
//! guest accepted (a client-side deadline on a busy machine), that write
//! fails with EPIPE and the panic ends the backend's vring worker thread, so
//! the VM's vsock is dead from then on and every later connection waits for
//! ever (`vm/vhost-device-vsock-0.3.0.patch`). So a handshake that runs out
//! of time hands its stream to a reaper thread, which keeps it open until
//! the backend answers (`OK`, or the close that means "nobody listens") or
//! goes away. The caller gets its timeout at once all the same.
//!
//! What one backend can make a process hold is bounded: with
//! [`MAX_PARKED_PER_BACKEND`] of its `CONNECT`s unanswered (a guest hung or
//! paused, or a backend that lost the VM's vsock), no new one is sent to it
//! ([`admit`] refuses at once) until one is answered. So a sandbox whose
//! guest never answers costs a few descriptors, not the process's limit.

use std::{
    io::{self, Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use crust_protocols::sync::LockExt;

use crate::connect_error::ConnectError;

/// The longest handshake answer read before calling the backend broken.
const MAX_LINE: usize = 256;
/// How long one read waits before the caller's `keep_waiting` is asked again.
const SLICE: Duration = Duration::from_millis(250);
/// Unanswered `CONNECT`s held for one backend; a new `CONNECT` to a backend
/// with this many is refused before it is sent ([`admit`]).
pub const MAX_PARKED_PER_BACKEND: usize = 8;
/// Unanswered `CONNECT`s held in all, whatever the backends. Past it a
/// timed-out stream is closed (the risk above) rather than held.
const MAX_PARKED: usize = 256;
/// How often the reaper looks at the parked streams.
const REAP_EVERY: Duration = Duration::from_millis(100);

/// Runs the handshake for guest port `port` on `s`, connected to the
/// backend at `path`. Waits for the answer until `deadline`, and for as
/// long as `keep_waiting` says so (asked a few times a second, e.g. "the VM
/// still runs"). On success the stream is blocking, without timeouts, at the
/// first byte after the `OK` line. Whenever it gives up after `CONNECT` was
/// sent, the stream is parked, not closed (module documentation).
pub(crate) fn handshake(
    mut s: UnixStream,
    path: &Path,
    port: u32,
    deadline: Instant,
    timeout: Duration,
    keep_waiting: &mut dyn FnMut() -> bool,
) -> Result<UnixStream, ConnectError> {
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

    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(timed_out());
    }
    s.set_write_timeout(Some(left))
        .map_err(|e| io_err("setsockopt", e))?;
    // A write that fails or times out has not sent the whole line: the
    // backend never asked the guest, so closing the stream is safe. std
    // ignores SIGPIPE in Rust programs: a backend that hung up is EPIPE here.
    match s.write_all(format!("CONNECT {port}\n").as_bytes()) {
        Ok(()) => {}
        Err(e) if is_timeout(&e) => return Err(timed_out()),
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

    // From here the backend may be asking the guest: give up only by parking.
    // One byte at a time: whatever follows the newline is the guest's.
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            park(s, path);
            return Err(timed_out());
        }
        if !keep_waiting() {
            park(s, path);
            return Err(ConnectError::HandshakeGivenUp {
                path: path.to_path_buf(),
                port,
            });
        }
        if let Err(e) = s.set_read_timeout(Some(left.min(SLICE))) {
            park(s, path);
            return Err(io_err("setsockopt", e));
        }
        let mut byte = [0u8; 1];
        match s.read(&mut byte) {
            Ok(0) => return Err(failed(describe_reply(&line, true))),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => continue,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(failed(describe_reply(&line, true)))
            }
            Err(e) => return Err(io_err("recv", e)),
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > MAX_LINE {
            return Err(failed(describe_reply(&line, false)));
        }
    }
    if !line.starts_with(b"OK ") {
        return Err(failed(describe_reply(&line, false)));
    }
    // Back to blocking without timeouts: the caller owns the stream from here.
    s.set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
        .map_err(|e| io_err("setsockopt", e))?;
    Ok(s)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
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

/// Streams whose `CONNECT` is unanswered, with their backend, until the
/// reaper lets them go.
static PARKED: OnceLock<Mutex<Vec<(PathBuf, UnixStream)>>> = OnceLock::new();

fn parked() -> &'static Mutex<Vec<(PathBuf, UnixStream)>> {
    PARKED.get_or_init(|| {
        // One reaper for the process, started with the first parked stream.
        let _ = std::thread::Builder::new()
            .name("hvsock-reaper".into())
            .spawn(reap);
        Mutex::new(Vec::new())
    })
}

/// Keeps `s` open until the backend at `path` answers its `CONNECT`.
fn park(s: UnixStream, path: &Path) {
    if s.set_nonblocking(true).is_err() {
        return;
    }
    let mut p = parked().locked();
    let mine = p.iter().filter(|(b, _)| b == path).count();
    if p.len() < MAX_PARKED && mine < MAX_PARKED_PER_BACKEND {
        p.push((path.to_path_buf(), s));
    }
}

/// Refuses, before anything is sent, a `CONNECT` to the backend at `path`
/// while [`MAX_PARKED_PER_BACKEND`] of its earlier ones are unanswered.
pub(crate) fn admit(path: &Path, port: u32) -> Result<(), ConnectError> {
    let Some(p) = PARKED.get() else {
        return Ok(());
    };
    let waiting = p.locked().iter().filter(|(b, _)| b == path).count();
    if waiting >= MAX_PARKED_PER_BACKEND {
        return Err(ConnectError::Unanswered {
            path: path.to_path_buf(),
            port,
            waiting,
        });
    }
    Ok(())
}

/// How many hybrid vsock `CONNECT`s this process gave up on are still
/// unanswered (their streams held open until the answer comes).
pub fn unanswered() -> usize {
    PARKED.get().map_or(0, |p| p.locked().len())
}

/// Waits until every `CONNECT` this process gave up on has been answered
/// (or its backend has gone), for at most `max`; answers how many are still
/// unanswered. For a process about to exit: exiting closes every stream,
/// the held ones too. Returns at once when there are none.
pub fn settle(max: Duration) -> usize {
    let deadline = Instant::now() + max;
    loop {
        let left = unanswered();
        if left == 0 || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(REAP_EVERY);
    }
}

/// Closes each parked stream once its answer came: the `OK` line (closing
/// an accepted connection is safe) or the end of the stream.
fn reap() {
    loop {
        std::thread::sleep(REAP_EVERY);
        let mut p = parked().locked();
        p.retain_mut(|(_, s)| {
            let mut b = [0u8; 256];
            match s.read(&mut b) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
                // Answered (OK and perhaps data), closed, or broken: let go.
                _ => false,
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::address::Address;
    use std::{
        io::{BufRead, BufReader},
        os::unix::net::UnixListener,
        sync::mpsc,
        thread,
    };

    /// What `connect::connect_stream` does for a hybrid vsock address: the
    /// backend's admission, the unix connect, the handshake (here, so that
    /// the handshake's tests need nothing of the modules above it).
    fn connect_stream(addr: &Address, timeout: Duration) -> Result<UnixStream, ConnectError> {
        connect_stream_until(addr, Instant::now() + timeout, &mut || true)
    }

    fn connect_stream_until(
        addr: &Address,
        deadline: Instant,
        keep_waiting: &mut dyn FnMut() -> bool,
    ) -> Result<UnixStream, ConnectError> {
        let Address::Hvsock { path, port } = addr else {
            panic!("{addr} is not hvsock")
        };
        admit(path, *port)?;
        let s = UnixStream::connect(path).map_err(|source| ConnectError::Unreachable {
            addr: addr.to_string(),
            source,
        })?;
        let timeout = deadline.saturating_duration_since(Instant::now());
        handshake(s, path, *port, deadline, timeout, keep_waiting)
    }

    /// Accepts one connection on `l`, as a backend does, and reads its
    /// CONNECT line: (the stream, a reader of what follows, the line).
    fn accept_connect(l: &UnixListener) -> (UnixStream, BufReader<UnixStream>, String) {
        let (s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        (s, r, line)
    }

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
            let (mut w, _, line) = accept_connect(&listener);
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
        let mut stream = fd;
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

    /// When the fake backend answers CONNECT.
    enum Answer {
        After(Duration),
        /// When the test says so (after the client has given up).
        When(mpsc::Receiver<()>),
    }

    /// A backend that reads CONNECT, answers OK when told, then reports
    /// whether its write of OK succeeded (what vhost-device-vsock 0.3.0
    /// unwraps) and how long the client kept the stream open after it.
    fn late_backend(
        dir: &Path,
        answer: Answer,
    ) -> (Address, thread::JoinHandle<(io::Result<()>, Duration)>) {
        let path = dir.join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        let handle = thread::spawn(move || {
            let (s, mut r, line) = accept_connect(&l);
            assert_eq!(line, "CONNECT 1024\n");
            match answer {
                Answer::After(d) => thread::sleep(d),
                Answer::When(go) => go.recv().unwrap(),
            }
            let wrote = (&s).write_all(b"OK 1024\n");
            // The client's end is closed once the answer came: EOF here.
            let t = Instant::now();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest);
            (wrote, t.elapsed())
        });
        (Address::Hvsock { path, port: 1024 }, handle)
    }

    #[test]
    fn a_timed_out_connect_is_kept_open_until_the_backend_answers() {
        let dir = tempfile::tempdir().unwrap();
        let (go, gate) = mpsc::channel();
        let (addr, backend) = late_backend(dir.path(), Answer::When(gate));
        let err = connect_stream(&addr, Duration::from_millis(100)).unwrap_err();
        assert!(
            matches!(err, ConnectError::HandshakeTimedOut { port: 1024, .. }),
            "{err}"
        );
        assert!(unanswered() >= 1);
        // The guest answers only now, after the caller had its timeout. The
        // late OK found its stream open: the backend's write succeeded
        // (vhost-device-vsock 0.3.0 panics on that EPIPE), and the stream
        // was let go once answered.
        go.send(()).unwrap();
        let (wrote, closed_after) = backend.join().unwrap();
        wrote.expect("the backend could write its answer");
        assert!(closed_after < Duration::from_secs(30), "{closed_after:?}");
    }

    #[test]
    fn a_caller_that_stops_waiting_leaves_the_connect_open_too() {
        let dir = tempfile::tempdir().unwrap();
        let (go, gate) = mpsc::channel();
        let (addr, backend) = late_backend(dir.path(), Answer::When(gate));
        let mut asked = 0;
        let mut keep_waiting = || {
            asked += 1;
            asked < 2
        };
        let err = connect_stream_until(
            &addr,
            Instant::now() + Duration::from_secs(300),
            &mut keep_waiting,
        )
        .unwrap_err();
        assert!(
            matches!(err, ConnectError::HandshakeGivenUp { port: 1024, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("gave up"), "{err}");
        go.send(()).unwrap();
        let (wrote, _) = backend.join().unwrap();
        wrote.expect("the backend could write its answer");
    }

    /// Calls to a guest that never answers must not each park one more
    /// stream, up to 1,024: the descriptors of the whole process.
    #[test]
    fn a_backend_that_never_answers_holds_a_few_descriptors_and_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        // Accepts and reads CONNECT, never answers: a hung or paused guest.
        let held = std::sync::Arc::new(Mutex::new(Vec::new()));
        let h = held.clone();
        thread::spawn(move || {
            for s in l.incoming().flatten() {
                h.lock().unwrap().push(s);
            }
        });
        let addr = Address::Hvsock {
            path: path.clone(),
            port: 1024,
        };
        let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
        for _ in 0..MAX_PARKED_PER_BACKEND {
            let err = connect_stream(&addr, Duration::from_millis(50)).unwrap_err();
            assert!(
                matches!(err, ConnectError::HandshakeTimedOut { .. }),
                "{err}"
            );
        }
        let before = fds();
        let t0 = Instant::now();
        for _ in 0..200 {
            let err = connect_stream(&addr, Duration::from_secs(30)).unwrap_err();
            assert!(matches!(err, ConnectError::Unanswered { .. }), "{err}");
            assert!(err.to_string().contains("still unanswered"), "{err}");
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(fds() <= before + 2, "{} > {before}", fds());
        assert_eq!(
            held.lock().unwrap().len(),
            MAX_PARKED_PER_BACKEND,
            "no CONNECT sent past the bound"
        );
        // Another backend is not refused.
        let (other, backend) = super::tests::backend_ok(dir.path());
        connect_stream(&other, Duration::from_secs(5)).unwrap();
        backend.join().unwrap();
        // Once the backend answers (here: closes), it is admitted again.
        held.lock().unwrap().clear();
        let t = Instant::now();
        while admit(&path, 1024).is_err() {
            assert!(t.elapsed() < Duration::from_secs(5));
            thread::sleep(REAP_EVERY);
        }
    }

    /// A backend in `dir` answering one CONNECT with OK.
    pub(super) fn backend_ok(dir: &Path) -> (Address, thread::JoinHandle<String>) {
        let d = dir.join("ok");
        std::fs::create_dir_all(&d).unwrap();
        backend(&d, b"OK 1\n", b"")
    }

    #[test]
    fn a_slow_answer_within_the_deadline_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        // Longer than one read slice: the handshake keeps reading.
        let (addr, backend) = late_backend(dir.path(), Answer::After(Duration::from_millis(600)));
        let fd = connect_stream(&addr, Duration::from_secs(120)).unwrap();
        drop(fd);
        let (wrote, _) = backend.join().unwrap();
        wrote.unwrap();
    }

    #[test]
    fn nobody_listening_on_the_guest_port_is_a_quick_refusal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        let t = thread::spawn(move || {
            let _connection = accept_connect(&l);
            // Dropped: the backend's "nobody listens on that port".
        });
        let t0 = Instant::now();
        let err = connect_stream(
            &Address::Hvsock { path, port: 1024 },
            Duration::from_secs(30),
        )
        .unwrap_err();
        assert!(matches!(err, ConnectError::Handshake { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("closed the connection without answering"),
            "{err}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        t.join().unwrap();
    }

    #[test]
    fn an_endless_answer_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let _ = s.write_all(&[b'O'; 4096]);
            }
        });
        let err = connect_stream(
            &Address::Hvsock { path, port: 1024 },
            Duration::from_secs(30),
        )
        .unwrap_err();
        assert!(matches!(err, ConnectError::Handshake { .. }), "{err}");
    }
}

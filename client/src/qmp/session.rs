//! One QMP session: JSON lines over QEMU's monitor socket, bounded in time
//! and in line length, with the events that arrive between replies kept.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use thiserror::Error;

use crate::connect::ConnectError;
use crate::peer::Peer;
use crate::qmp::refusal::Refusal;
use crate::qmp::socket::Socket;

/// The longest line read from QEMU (its replies to the queries made here
/// are a few KiB; a flat node list of a busy VM some hundreds).
pub const MAX_LINE: u64 = 16 << 20;

/// The most events read before QEMU's greeting (ones it emitted as the
/// client connected); more is not QEMU.
const MAX_EARLY_EVENTS: usize = 64;

/// Why a QMP session or command failed. Every message names the socket.
#[derive(Debug, Error)]
pub enum QmpError {
    /// QEMU answered the command with an error.
    #[error("QEMU refused {command}: {desc} ({class})")]
    Refused {
        /// The command, e.g. `device_add`.
        command: String,
        /// QEMU's error class, e.g. `GenericError`.
        class: String,
        /// QEMU's description.
        desc: String,
        /// What it means, from `class` and `desc`: what callers act on.
        refusal: Refusal,
    },
    /// The socket is missing, nobody listens there, or the connect failed otherwise.
    #[error("cannot connect to QEMU's QMP socket {}: {source}{}", .path.display(), why_unreachable(.source))]
    Unreachable { path: PathBuf, source: io::Error },
    /// Something listens but did not accept within the timeout.
    #[error("QEMU did not accept a connection on its QMP socket {} within {timeout:?}: is its monitor wedged, or is that not QEMU?", .path.display())]
    NotAccepted { path: PathBuf, timeout: Duration },
    /// The monitor accepted but did not greet within the timeout.
    #[error("QEMU did not greet on its QMP socket {} within {timeout:?}: is another client (crust-vm, a management tool) holding the monitor?", .path.display())]
    NoGreeting { path: PathBuf, timeout: Duration },
    /// No answer within the timeout.
    #[error("QEMU did not answer on {} within {timeout:?}", .path.display())]
    Silent { path: PathBuf, timeout: Duration },
    /// The conversation broke: closed, unreadable, not JSON, not QMP, a line too long.
    #[error("{detail}")]
    Broken { path: PathBuf, detail: String },
    /// The caller refused the process that listens on the socket
    /// ([`Qmp::connect_vetted`]); nothing was sent. `why` is the caller's
    /// sentence.
    #[error("{why}")]
    Vetoed {
        path: PathBuf,
        /// The process that listens there.
        pid: u32,
        why: String,
    },
}

/// What an unreachable socket most likely means.
fn why_unreachable(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::NotFound => " the socket does not exist (has the VM gone?)",
        io::ErrorKind::ConnectionRefused => " nobody listens there (has QEMU exited?)",
        _ => "",
    }
}

/// Why the VMM behind the QMP socket `path` is gone, if it is: the socket
/// does not exist, or nobody listens there (the connect is refused). A
/// monitor that accepts, even one busy with another client that will not
/// greet for a while, is not gone. Connects and closes at once; sends nothing.
pub fn gone(path: &Path, timeout: Duration) -> Option<String> {
    gone_at(Socket::Path(path), timeout)
}

/// [`gone`] for `socket`. A socket the caller opened exists: only a refused
/// connect says the VMM is gone.
pub fn gone_at(socket: Socket<'_>, timeout: Duration) -> Option<String> {
    let path = socket.path();
    if let Socket::Path(p) = socket {
        if let Err(e) = std::fs::symlink_metadata(p) {
            if e.kind() == io::ErrorKind::NotFound {
                return Some(format!("its QMP socket {} does not exist", p.display()));
            }
        }
    }
    match socket.connect(timeout) {
        Err(ConnectError::Unreachable { source: e, .. })
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
            ) =>
        {
            Some(format!(
                "nobody listens on its QMP socket {} ({e})",
                path.display()
            ))
        }
        _ => None,
    }
}

/// One open QMP session in command mode.
pub struct Qmp {
    /// Where replies and events are read.
    reader: BufReader<UnixStream>,
    /// Where commands are written.
    writer: UnixStream,
    /// Events seen while waiting for replies, oldest first.
    events: Vec<Value>,
    /// The socket, for messages.
    path: PathBuf,
    /// How long one reply may take.
    timeout: Duration,
}

impl QmpError {
    /// What QEMU's refusal means; `None` when QEMU did not refuse (the
    /// session failed instead).
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            QmpError::Refused { refusal, .. } => Some(*refusal),
            _ => None,
        }
    }
}

impl std::fmt::Debug for Qmp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Qmp({})", self.path.display())
    }
}

impl Qmp {
    /// Connects to QEMU at `path`, reads the greeting and leaves negotiation
    /// mode. The connect, and every read and write after it, waits at most
    /// `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        Qmp::connect_vetted(Socket::Path(path), timeout, |_| Ok(()))
    }

    /// [`Qmp::connect`] to `socket`, and before a byte is read or written,
    /// while the connection is open, `vet` judges the process that listens
    /// there ([`Peer`]: its pid, and whether it still lives): a monitor whose
    /// process it refuses hears nothing, and the session is
    /// [`QmpError::Vetoed`] with `vet`'s words. Every call asks anew: a
    /// process judged on one connection says nothing of the next.
    pub fn connect_vetted(
        socket: Socket<'_>,
        timeout: Duration,
        vet: impl FnOnce(&Peer) -> Result<(), String>,
    ) -> Result<Qmp, QmpError> {
        let path = socket.path();
        let writer = match socket.connect(timeout) {
            Ok(fd) => UnixStream::from(fd),
            Err(ConnectError::Unreachable { source, .. }) => {
                return Err(QmpError::Unreachable {
                    path: path.to_path_buf(),
                    source,
                })
            }
            Err(ConnectError::TimedOut { .. }) => {
                return Err(QmpError::NotAccepted {
                    path: path.to_path_buf(),
                    timeout,
                })
            }
            Err(e) => {
                return Err(QmpError::Broken {
                    path: path.to_path_buf(),
                    detail: format!(
                        "cannot connect to QEMU's QMP socket {}: {e}",
                        path.display()
                    ),
                })
            }
        };
        let peer = Peer::of(writer.as_fd()).map_err(|e| QmpError::Broken {
            path: path.to_path_buf(),
            detail: format!(
                "cannot tell which process serves the QMP socket {} (SO_PEERCRED, SO_PEERPIDFD): {e}",
                path.display()
            ),
        })?;
        vet(&peer).map_err(|why| QmpError::Vetoed {
            path: path.to_path_buf(),
            pid: peer.pid,
            why,
        })?;
        Qmp::greet(writer, path, timeout)
    }

    /// Reads the greeting on the connected `writer` and leaves negotiation mode.
    fn greet(writer: UnixStream, path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let broken = |e: io::Error| QmpError::Broken {
            path: path.to_path_buf(),
            detail: format!("QMP socket {}: {e}", path.display()),
        };
        writer.set_read_timeout(Some(timeout)).map_err(broken)?;
        writer.set_write_timeout(Some(timeout)).map_err(broken)?;
        let reader = BufReader::new(writer.try_clone().map_err(broken)?);
        let mut q = Qmp {
            reader,
            writer,
            events: Vec::new(),
            path: path.to_path_buf(),
            timeout,
        };
        // QEMU may write an event it emitted just as this client connected
        // (a DEVICE_DELETED from an earlier session's device_del) before
        // its greeting: kept, as events between replies are, a few at most.
        let mut greeting = Value::Null;
        for _ in 0..MAX_EARLY_EVENTS {
            greeting = q.read().map_err(|e| match e {
                QmpError::Silent { path, timeout } => QmpError::NoGreeting { path, timeout },
                other => other,
            })?;
            if greeting.get("event").is_none() {
                break;
            }
            q.events.push(std::mem::take(&mut greeting));
        }
        if greeting.get("QMP").is_none() {
            return Err(q.broken(format!(
                "{} did not greet like QMP: {greeting}",
                path.display()
            )));
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    /// The socket this session talks on.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn broken(&self, detail: String) -> QmpError {
        QmpError::Broken {
            path: self.path.clone(),
            detail,
        }
    }

    fn read(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = match (&mut self.reader).take(MAX_LINE).read_line(&mut line) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(QmpError::Silent {
                    path: self.path.clone(),
                    timeout: self.timeout,
                })
            }
            Err(e) => {
                return Err(self.broken(format!("cannot read QMP {}: {e}", self.path.display())))
            }
        };
        if n == 0 {
            return Err(self.broken(format!(
                "QEMU closed its QMP socket {} (has the VM gone?)",
                self.path.display()
            )));
        }
        if !line.ends_with('\n') && u64::try_from(n).is_ok_and(|n| n >= MAX_LINE) {
            return Err(self.broken(format!(
                "{} sent a line longer than {MAX_LINE} bytes: that is not QEMU",
                self.path.display()
            )));
        }
        serde_json::from_str(&line).map_err(|e| {
            self.broken(format!(
                "QEMU sent a line that is not JSON on {}: {e}: {line:?}",
                self.path.display()
            ))
        })
    }

    /// Runs one command and returns its `return` value. Events that arrive
    /// before the reply are kept for [`Qmp::wait_event`].
    pub fn execute(&mut self, cmd: &str, args: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": cmd });
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        if let Err(e) = self.writer.write_all(line.as_bytes()) {
            return Err(self.broken(format!(
                "cannot send {cmd} to QMP {}: {e}",
                self.path.display()
            )));
        }
        loop {
            let m = self.read()?;
            if m.get("event").is_some() {
                self.events.push(m);
            } else if let Some(r) = m.get("return") {
                return Ok(r.clone());
            } else if let Some(e) = m.get("error") {
                let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                let (class, desc) = (s("class"), s("desc"));
                return Err(QmpError::Refused {
                    command: cmd.to_string(),
                    refusal: Refusal::of(&class, &desc),
                    class,
                    desc,
                });
            }
        }
    }

    /// Waits up to `timeout` for event `name` whose `data` satisfies `pred`;
    /// `Ok(None)` when it did not come. Events seen earlier are searched
    /// first; the session is usable after a wait that ran out.
    pub fn wait_event(
        &mut self,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Option<Value>, QmpError> {
        let matches =
            |m: &Value| m.get("event").and_then(Value::as_str) == Some(name) && pred(&m["data"]);
        if let Some(i) = self.events.iter().position(matches) {
            return Ok(Some(self.events.remove(i)));
        }
        let deadline = Instant::now() + timeout;
        let restore = self.timeout;
        let found = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break Ok(None);
            }
            let _ = self.writer.set_read_timeout(Some(left));
            match self.read() {
                Ok(m) if matches(&m) => break Ok(Some(m)),
                Ok(m) if m.get("event").is_some() => self.events.push(m),
                Ok(_) => {}
                // A read that timed out is only the end of this wait.
                Err(QmpError::Silent { .. }) => {}
                Err(e) => break Err(e),
            }
        };
        let _ = self.writer.set_read_timeout(Some(restore));
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::address::Address;
    use crate::connect::connect_stream;
    use crate::qmp::fake::qemu;
    use std::os::unix::net::UnixListener;

    /// The process behind the socket is asked about before anything is
    /// exchanged; one refused hears not even qmp_capabilities, and each
    /// connect asks again.
    #[test]
    fn a_vetted_connect_asks_about_the_listener_first_and_every_time() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let st = qemu(&p);
        let e = Qmp::connect_vetted(Socket::Path(&p), Duration::from_secs(5), |peer| {
            Err(format!("not {}", peer.pid))
        })
        .unwrap_err();
        match &e {
            QmpError::Vetoed { pid, why, .. } => {
                assert_eq!(*pid, std::process::id());
                assert_eq!(why, &format!("not {pid}"));
                assert_eq!(e.to_string(), *why);
            }
            other => panic!("{other:?}"),
        }
        let mut asked = 0;
        for _ in 0..2 {
            let mut q = Qmp::connect_vetted(Socket::Path(&p), Duration::from_secs(5), |peer| {
                asked += 1;
                (peer.pid == std::process::id() && peer.lives().unwrap())
                    .then_some(())
                    .ok_or_else(|| "a stranger".to_string())
            })
            .unwrap();
            q.execute("block_resize", None).unwrap();
        }
        assert_eq!(asked, 2);
        assert_eq!(st.lock().unwrap().log, ["block_resize null"; 2]);
    }

    /// A socket opened with O_PATH is the one reached, whatever its path
    /// names by the time of the connect.
    #[test]
    fn an_opened_socket_is_reached_through_its_descriptor() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let first = qemu(&p);
        let fd = rustix::fs::open(
            &p,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        std::fs::rename(&p, t.path().join("moved.sock")).unwrap();
        let second = qemu(&p);
        let opened = Socket::Opened(fd.as_fd(), &p);
        let mut q = Qmp::connect_vetted(opened, Duration::from_secs(5), |_| Ok(())).unwrap();
        q.execute("block_resize", None).unwrap();
        assert_eq!(q.path(), p);
        assert_eq!(gone_at(opened, Duration::from_secs(1)), None);
        assert_eq!(first.lock().unwrap().log.len(), 1);
        assert!(second.lock().unwrap().log.is_empty());
    }

    /// Seen under a real VM: a DEVICE_DELETED emitted as a new client
    /// connected came before QEMU's greeting, and the session was refused.
    #[test]
    fn an_event_before_the_greeting_is_kept_not_refused() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let l = UnixListener::bind(&p).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut w = s.try_clone().unwrap();
            let ev = json!({"event": "DEVICE_DELETED", "data": {"device": "d1"}});
            writeln!(w, "{ev}").unwrap();
            writeln!(w, "{}", json!({"QMP": {"version": {}, "capabilities": []}})).unwrap();
            for line in BufReader::new(s).lines() {
                let Ok(_) = line else { break };
                writeln!(w, "{}", json!({"return": {}})).unwrap();
            }
        });
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        let got = q
            .wait_event(
                "DEVICE_DELETED",
                |d| d["device"] == "d1",
                Duration::from_millis(100),
            )
            .unwrap();
        assert!(got.is_some(), "the early event was kept");
        // A stream of events that never greets is not QEMU.
        let p2 = t.path().join("noisy.sock");
        let l = UnixListener::bind(&p2).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..1000 {
                if writeln!(s, "{}", json!({"event": "X"})).is_err() {
                    break;
                }
            }
        });
        let e = Qmp::connect(&p2, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("did not greet like QMP"), "{e}");
    }

    #[test]
    fn events_between_replies_are_kept() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let img = t.path().join("img");
        std::fs::write(&img, b"x").unwrap();
        let st = qemu(&p);
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        q.execute(
            "blockdev-add",
            Some(json!({"node-name": "n1", "driver": "host_device", "filename": img})),
        )
        .unwrap();
        q.execute("device_add", Some(json!({"id": "d1", "drive": "n1"})))
            .unwrap();
        // QEMU's DEVICE_DELETED events follow device_del's reply, and come
        // before the next reply: they are kept.
        q.execute("device_del", Some(json!({"id": "d1"}))).unwrap();
        match q.execute("bad", None) {
            Err(e @ QmpError::Refused { .. }) => {
                assert_eq!(
                    e.to_string(),
                    "QEMU refused bad: The command bad has not been found (CommandNotFound)"
                );
                assert_eq!(e.refusal(), Some(Refusal::Other));
            }
            other => panic!("{other:?}"),
        }
        let e = q
            .wait_event(
                "DEVICE_DELETED",
                |d| d["device"] == "d1",
                Duration::from_secs(1),
            )
            .unwrap();
        assert!(e.is_some());
        let t0 = Instant::now();
        let none = q
            .wait_event(
                "DEVICE_DELETED",
                |d| d["device"] == "d2",
                Duration::from_millis(300),
            )
            .unwrap();
        assert!(none.is_none() && t0.elapsed() >= Duration::from_millis(300));
        // The session still works after a wait ran out.
        assert_eq!(q.execute("qom-list", None).unwrap()[0]["name"], "type");
        let log = std::mem::take(&mut st.lock().unwrap().log);
        assert_eq!(log[2..], [r#"device_del {"id":"d1"}"#, "bad null"]);
    }

    #[test]
    fn vanished_or_silent_monitor_says_which() {
        let t = tempfile::tempdir().unwrap();
        let gone_path = t.path().join("gone.sock");
        let e = Qmp::connect(&gone_path, Duration::from_secs(1))
            .err()
            .unwrap();
        assert!(matches!(e, QmpError::Unreachable { .. }), "{e}");
        assert!(e.to_string().contains("does not exist"), "{e}");
        assert!(gone(&gone_path, Duration::from_secs(1)).is_some());
        // Nobody listens on a socket that is left behind: gone as well.
        let dead = t.path().join("dead.sock");
        drop(UnixListener::bind(&dead).unwrap());
        let e = Qmp::connect(&dead, Duration::from_secs(1)).err().unwrap();
        assert!(e.to_string().contains("nobody listens"), "{e}");
        assert!(gone(&dead, Duration::from_secs(1)).is_some());
        // A socket that accepts but never greets (QEMU busy with another
        // client): not gone, and said so.
        let p = t.path().join("silent.sock");
        let _l = UnixListener::bind(&p).unwrap();
        let e = Qmp::connect(&p, Duration::from_millis(300)).err().unwrap();
        assert!(matches!(e, QmpError::NoGreeting { .. }), "{e}");
        assert!(e.to_string().contains("did not greet"), "{e}");
        assert_eq!(gone(&p, Duration::from_secs(1)), None);
    }

    #[test]
    fn a_socket_that_never_accepts_or_never_ends_a_line_is_given_up() {
        let t = tempfile::tempdir().unwrap();
        // A listener that never accepts: once its backlog is full, a plain
        // connect would block for ever. Fill it with connections kept open.
        let p = t.path().join("full.sock");
        let l = UnixListener::bind(&p).unwrap();
        let addr = Address::Unix(p.clone());
        let mut held = Vec::new();
        // A connect into the backlog returns at once; the first that waits
        // a whole second has found it full.
        while let Ok(s) = connect_stream(&addr, Duration::from_secs(1)) {
            held.push(s);
            assert!(held.len() < 100_000, "the backlog never filled");
        }
        let t0 = Instant::now();
        let e = Qmp::connect(&p, Duration::from_millis(300)).err().unwrap();
        assert!(matches!(e, QmpError::NotAccepted { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("did not accept a connection") && msg.contains("full.sock"),
            "{msg}"
        );
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        // Closing the listener ends the connects left waiting on their threads.
        drop(l);
        // A "monitor" that sends one endless line.
        let p = t.path().join("endless.sock");
        let l = UnixListener::bind(&p).unwrap();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let chunk = vec![b'x'; 1 << 20];
                while s.write_all(&chunk).is_ok() {}
            }
        });
        let e = Qmp::connect(&p, Duration::from_secs(30)).err().unwrap();
        assert!(matches!(e, QmpError::Broken { .. }), "{e}");
        assert!(e.to_string().contains("longer than"), "{e}");
    }

    #[test]
    fn what_is_not_qmp_is_broken() {
        let t = tempfile::tempdir().unwrap();
        for (name, greeting) in [("json.sock", "{\"hello\": 1}\n"), ("text.sock", "hi\n")] {
            let p = t.path().join(name);
            let l = UnixListener::bind(&p).unwrap();
            std::thread::spawn(move || {
                if let Ok((mut s, _)) = l.accept() {
                    let _ = s.write_all(greeting.as_bytes());
                    std::thread::sleep(Duration::from_secs(5));
                }
            });
            let e = Qmp::connect(&p, Duration::from_secs(30)).err().unwrap();
            assert!(matches!(e, QmpError::Broken { .. }), "{name}: {e}");
            assert!(e.to_string().contains(name), "{e}");
        }
    }
}

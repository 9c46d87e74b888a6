//! A QMP session: JSON lines over QEMU's unix socket. QEMU serves one client
//! per monitor socket at a time, so a session lives for one operation and is
//! closed after it (crust-vm and other users get their turn); the caller
//! serializes sessions per sandbox. Asynchronous events that arrive between
//! replies are kept for `wait_event`. The socket is whatever a sandbox's
//! `sandbox.json` names, so connecting has a deadline (a listener that
//! never accepts fills its backlog and would block a plain connect for
//! ever) and a line longer than [`MAX_LINE`] ends the session.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::error::{Error, Result};

/// The longest line read from QEMU (its replies to crustd's queries are a
/// few KiB; a flat node list of a busy VM some hundreds).
pub const MAX_LINE: u64 = 16 << 20;

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

/// Why a QMP command failed.
#[derive(Debug)]
pub enum QmpError {
    /// QEMU answered the command with an error (its class and description).
    Refused { class: String, desc: String },
    /// No conversation: socket gone, closed or garbled.
    Broken(Error),
    /// QEMU said nothing within the timeout.
    Silent(Error),
}

impl QmpError {
    /// As crustd's error: a broken or silent monitor is UNAVAILABLE; a refusal
    /// is FAILED_PRECONDITION with QEMU's words and what was being done.
    pub fn during(self, what: &str) -> Error {
        match self {
            QmpError::Refused { class, desc } => {
                Error::precondition(format!("QEMU refused {what}: {desc} ({class})"))
            }
            QmpError::Broken(e) | QmpError::Silent(e) => e.and(format!("while {what}")),
        }
    }
}

/// Why the VMM behind the QMP socket `path` is gone, if it is: the socket
/// does not exist, or nobody listens there (the connect is refused). A
/// monitor that accepts, even one busy with another client that will not
/// greet for a while, is not gone. Connects and closes at once; sends nothing.
pub fn gone(path: &Path, timeout: Duration) -> Option<String> {
    if let Err(e) = std::fs::symlink_metadata(path) {
        if e.kind() == io::ErrorKind::NotFound {
            return Some(format!("its QMP socket {} does not exist", path.display()));
        }
    }
    let addr = crust_client::Address::Unix(path.to_path_buf());
    match crust_client::connect_stream(&addr, timeout) {
        Err(crust_client::ConnectError::Unreachable { source: e, .. })
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

impl Qmp {
    /// Connects to QEMU at `path`, reads the greeting and leaves negotiation
    /// mode. Every read waits at most `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp> {
        let addr = crust_client::Address::Unix(path.to_path_buf());
        let writer = match crust_client::connect_stream(&addr, timeout) {
            Ok(fd) => UnixStream::from(fd),
            Err(crust_client::ConnectError::Unreachable { source: e, .. }) => {
                let why = match e.kind() {
                    io::ErrorKind::NotFound => "the socket does not exist (has the VM gone?)",
                    io::ErrorKind::ConnectionRefused => "nobody listens there (has QEMU exited?)",
                    _ => "",
                };
                return Err(Error::unavailable(format!(
                    "cannot connect to QEMU's QMP socket {}: {e} {why}",
                    path.display()
                )));
            }
            Err(crust_client::ConnectError::TimedOut { .. }) => {
                return Err(Error::unavailable(format!(
                    "QEMU did not accept a connection on its QMP socket {} within {timeout:?}: is its monitor wedged, or is that not QEMU?",
                    path.display()
                )))
            }
            Err(e) => {
                return Err(Error::unavailable(format!(
                    "cannot connect to QEMU's QMP socket {}: {e}",
                    path.display()
                )))
            }
        };
        let io = |e: io::Error| Error::unavailable(format!("QMP socket {}: {e}", path.display()));
        writer.set_read_timeout(Some(timeout)).map_err(io)?;
        writer.set_write_timeout(Some(timeout)).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        let mut q = Qmp {
            reader,
            writer,
            events: Vec::new(),
            path: path.to_path_buf(),
            timeout,
        };
        let greeting = q.read().map_err(|e| match e {
            QmpError::Broken(e) => e,
            QmpError::Silent(e) => e.and(
                "QEMU did not greet: is another client (crust-vm, a management tool) holding the monitor?",
            ),
            QmpError::Refused { desc, .. } => Error::unavailable(desc),
        })?;
        if greeting.get("QMP").is_none() {
            return Err(Error::unavailable(format!(
                "{} did not greet like QMP: {greeting}",
                path.display()
            )));
        }
        q.execute("qmp_capabilities", None)
            .map_err(|e| e.during("qmp_capabilities"))?;
        Ok(q)
    }

    fn read(&mut self) -> std::result::Result<Value, QmpError> {
        let mut line = String::new();
        let n = (&mut self.reader)
            .take(MAX_LINE)
            .read_line(&mut line)
            .map_err(|e| {
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    QmpError::Silent(Error::unavailable(format!(
                        "QEMU did not answer on {} within {:?}",
                        self.path.display(),
                        self.timeout
                    )))
                } else {
                    QmpError::Broken(Error::unavailable(format!(
                        "cannot read QMP {}: {e}",
                        self.path.display()
                    )))
                }
            })?;
        if n == 0 {
            return Err(QmpError::Broken(Error::unavailable(format!(
                "QEMU closed its QMP socket {} (has the VM gone?)",
                self.path.display()
            ))));
        }
        if !line.ends_with('\n') && u64::try_from(n).is_ok_and(|n| n >= MAX_LINE) {
            return Err(QmpError::Broken(Error::unavailable(format!(
                "{} sent a line longer than {MAX_LINE} bytes: that is not QEMU",
                self.path.display()
            ))));
        }
        serde_json::from_str(&line).map_err(|e| {
            QmpError::Broken(Error::unavailable(format!(
                "QEMU sent a line that is not JSON on {}: {e}: {line:?}",
                self.path.display()
            )))
        })
    }

    /// Runs one command and returns its `return` value.
    pub fn execute(
        &mut self,
        cmd: &str,
        args: Option<Value>,
    ) -> std::result::Result<Value, QmpError> {
        let mut msg = json!({ "execute": cmd });
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(|e| {
            QmpError::Broken(Error::unavailable(format!(
                "cannot send {cmd} to QMP {}: {e}",
                self.path.display()
            )))
        })?;
        loop {
            let m = self.read()?;
            if m.get("event").is_some() {
                self.events.push(m);
            } else if let Some(r) = m.get("return") {
                return Ok(r.clone());
            } else if let Some(e) = m.get("error") {
                let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                return Err(QmpError::Refused {
                    class: s("class"),
                    desc: s("desc"),
                });
            }
        }
    }

    /// Waits up to `timeout` for event `name` whose `data` satisfies `pred`;
    /// `Ok(None)` when it did not come. Earlier events are searched first.
    pub fn wait_event(
        &mut self,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Option<Value>> {
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
                Err(QmpError::Silent(_)) => {}
                Err(e) => break Err(e.during(&format!("waiting for {name}"))),
            }
        };
        let _ = self.writer.set_read_timeout(Some(restore));
        found
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A stand-in QEMU monitor for tests: it greets, answers each command
    //! with a closure's reply, and can send events before a reply.

    use super::*;
    use std::os::unix::net::UnixListener;
    use std::sync::{Arc, Mutex};

    /// What the fake answers: (events to send first, the reply).
    pub type Script = dyn FnMut(&str, &Value) -> (Vec<Value>, Value) + Send;

    /// Serves QMP sessions at `path` one after another (like QEMU) until dropped.
    /// Every command is logged as `"cmd"` or `"cmd ARGS"`.
    pub fn serve(path: &Path, mut script: Box<Script>) -> Arc<Mutex<Vec<String>>> {
        let l = UnixListener::bind(path).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { return };
                let mut w = s.try_clone().unwrap();
                let r = BufReader::new(s);
                if writeln!(w, "{}", json!({"QMP": {"version": {}, "capabilities": []}})).is_err() {
                    continue;
                }
                for line in r.lines() {
                    let Ok(line) = line else { break };
                    let m: Value = serde_json::from_str(&line).unwrap();
                    let cmd = m["execute"].as_str().unwrap().to_string();
                    let args = m.get("arguments").cloned().unwrap_or(Value::Null);
                    if cmd != "qmp_capabilities" {
                        let entry = if args.is_null() {
                            cmd.clone()
                        } else {
                            format!("{cmd} {args}")
                        };
                        log2.lock().unwrap().push(entry);
                    }
                    let (events, reply) = if cmd == "qmp_capabilities" {
                        (vec![], json!({"return": {}}))
                    } else {
                        script(&cmd, &args)
                    };
                    for e in events {
                        let _ = writeln!(w, "{e}");
                    }
                    let _ = writeln!(w, "{reply}");
                }
            }
        });
        log
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    #[test]
    fn events_between_replies_are_kept() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        fake::serve(
            &p,
            Box::new(|cmd, _| match cmd {
                "device_del" => (
                    vec![
                        json!({"event": "DEVICE_DELETED", "data": {"path": "/x/virtio-backend"}}),
                        json!({"event": "DEVICE_DELETED", "data": {"device": "d1", "path": "/x"}}),
                    ],
                    json!({"return": {}}),
                ),
                "bad" => (
                    vec![],
                    json!({"error": {"class": "GenericError", "desc": "no such thing"}}),
                ),
                _ => (vec![], json!({"return": [1]})),
            }),
        );
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        assert_eq!(q.execute("x", None).unwrap(), json!([1]));
        q.execute("device_del", Some(json!({"id": "d1"}))).unwrap();
        match q.execute("bad", None) {
            Err(QmpError::Refused { class, desc }) => {
                assert_eq!(
                    (class.as_str(), desc.as_str()),
                    ("GenericError", "no such thing")
                )
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
        assert_eq!(q.execute("x", None).unwrap(), json!([1]));
    }

    #[test]
    fn vanished_or_silent_monitor_is_unavailable() {
        let t = tempfile::tempdir().unwrap();
        let e = Qmp::connect(&t.path().join("gone.sock"), Duration::from_secs(1))
            .err()
            .unwrap();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("does not exist"), "{e}");
        // A socket that accepts but never greets (QEMU busy with another client).
        let p = t.path().join("silent.sock");
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let e = Qmp::connect(&p, Duration::from_millis(300)).err().unwrap();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("did not greet"), "{e}");
    }

    #[test]
    fn a_socket_that_never_accepts_or_never_ends_a_line_is_given_up() {
        let t = tempfile::tempdir().unwrap();
        // A listener that never accepts: once its backlog is full, a plain
        // connect would block for ever. Fill it with connections kept open.
        let p = t.path().join("full.sock");
        let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let addr = crust_client::Address::Unix(p.clone());
        let mut held = Vec::new();
        // A connect into the backlog returns at once; the first that waits
        // a whole second has found it full.
        while let Ok(s) = crust_client::connect_stream(&addr, Duration::from_secs(1)) {
            held.push(s);
            assert!(held.len() < 100_000, "the backlog never filled");
        }
        let t0 = Instant::now();
        let e = Qmp::connect(&p, Duration::from_millis(300)).err().unwrap();
        assert_eq!(e.code, Code::Unavailable);
        assert!(
            e.message.contains("did not accept a connection") && e.message.contains("full.sock"),
            "{e}"
        );
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        // Closing the listener ends the connects left waiting on their threads.
        drop(l);
        // A "monitor" that sends one endless line.
        let p = t.path().join("endless.sock");
        let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let chunk = vec![b'x'; 1 << 20];
                while s.write_all(&chunk).is_ok() {}
            }
        });
        let e = Qmp::connect(&p, Duration::from_secs(30)).err().unwrap();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("longer than"), "{e}");
    }
}

impl std::fmt::Debug for Qmp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Qmp({})", self.path.display())
    }
}

//! A small QMP client: JSON lines over QEMU's Unix socket. Commands are sent
//! one at a time; events read while waiting are kept for `wait_event`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::Error;

/// A QMP session in command mode.
pub struct Qmp {
    /// Where answers and events are read.
    reader: BufReader<UnixStream>,
    /// Where commands are written.
    writer: UnixStream,
    /// Events seen while waiting for command answers, oldest first.
    events: Vec<Value>,
}

impl Qmp {
    /// Connects, reads the greeting and negotiates capabilities.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, Error> {
        let io = |e| Error::Io(format!("cannot talk to QMP at {}", path.display()), e);
        let writer = UnixStream::connect(path).map_err(io)?;
        writer.set_read_timeout(Some(timeout)).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        let mut q = Qmp {
            reader,
            writer,
            events: Vec::new(),
        };
        let greeting = q.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(Error::Qmp(format!("unexpected QMP greeting {greeting}")));
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    fn read_message(&mut self) -> Result<Value, Error> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(|e| Error::Io("cannot read from QMP".into(), e))?;
        if n == 0 {
            return Err(Error::Qmp("QEMU closed the QMP socket".into()));
        }
        serde_json::from_str(&line)
            .map_err(|e| Error::Qmp(format!("bad QMP message {line:?}: {e}")))
    }

    /// Runs one command; returns its `return` value or its error as `Error::Qmp`.
    pub fn execute(&mut self, cmd: &str, args: Option<Value>) -> Result<Value, Error> {
        let mut msg = json!({ "execute": cmd });
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .map_err(|e| Error::Io(format!("cannot send {cmd} to QMP"), e))?;
        loop {
            let m = self.read_message()?;
            if m.get("event").is_some() {
                self.events.push(m);
            } else if let Some(r) = m.get("return") {
                return Ok(r.clone());
            } else if let Some(e) = m.get("error") {
                let desc = e
                    .get("desc")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown error");
                return Err(Error::Qmp(format!("{cmd} failed: {desc}")));
            }
        }
    }

    /// Waits up to `timeout` for event `name` whose data satisfies `pred`.
    pub fn wait_event(
        &mut self,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Value, Error> {
        let matches =
            |m: &Value| m.get("event").and_then(Value::as_str) == Some(name) && pred(&m["data"]);
        if let Some(i) = self.events.iter().position(matches) {
            return Ok(self.events.remove(i));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(format!(
                    "no {name} event from QEMU within {timeout:?}"
                )));
            }
            self.writer
                .set_read_timeout(Some(left))
                .map_err(|e| Error::Io("QMP socket".into(), e))?;
            match self.read_message() {
                Ok(m) if matches(&m) => return Ok(m),
                Ok(m) if m.get("event").is_some() => self.events.push(m),
                Ok(_) => {}
                Err(Error::Io(_, e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

//! Readiness, pushed and not polled (the crate's documentation says why):
//! the agent's `READY=1` on the notify socket, or, for an agent that does
//! not announce, a poll once the console has shown it listening; then the
//! first GetAgentInfo.

use std::io::{self, Read};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use crust_protocols::crust::{GetAgentInfoRequest, GetAgentInfoResponse};
use crust_protocols::crust_ttrpc::AgentClient;

use crate::accel::Accel;
use crate::error::{Error, Result};
use crate::options::{VmOptions, INFO_TIMEOUT, POLL_AFTER_LISTENING};
use crate::process::{alive, tail};
use crate::vm::{agent_address, ctx, Readiness, Vm};

/// Reads one notification (sd_notify: `KEY=VALUE` lines) and says whether
/// it holds `READY=1`. Bounded: 4 KiB, 5 s. The end of the message is its
/// newline, not the end of the stream (hybrid vsock relays no half-close).
fn ready_message(s: UnixStream) -> bool {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    let mut s = s;
    while buf.len() < 4096 {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if buf.split(|&b| b == b'\n').any(|l| l == b"READY=1") {
            return true;
        }
    }
    buf.split(|&b| b == b'\n').any(|l| l == b"READY=1")
}

/// Whether the guest console shows the agent's "listening" line (text or JSON log).
fn console_says_listening(console: &Path) -> bool {
    let text = tail(console, 64 << 10);
    text.contains(" INFO listening ") || text.contains("\"msg\":\"listening\"")
}

/// Listens where the backend hands over the guest's READY (when `notify`).
pub(crate) fn listen_for_ready(
    dir: &Path,
    name: &str,
    notify: bool,
) -> Result<Option<UnixListener>> {
    if !notify {
        return Ok(None);
    }
    let path = dir.join(name);
    let l = UnixListener::bind(&path)
        .map_err(|e| Error::Io(format!("cannot listen on {}", path.display()), e))?;
    l.set_nonblocking(true)
        .map_err(|e| Error::Io("cannot make the notify socket non-blocking".into(), e))?;
    Ok(Some(l))
}

impl Vm {
    /// The boot failed: why, with what the guest printed last.
    fn boot_failure(&self, why: String) -> Error {
        Error::Timeout(format!(
            "{why}.\nconsole.log (end): {}",
            tail(&self.dir.join("console.log"), 3000)
        ))
    }

    fn qemu_exited(&self) -> Error {
        Error::Boot(format!(
            "QEMU exited before the agent was ready.\nqemu.log: {}\nconsole.log (end): {}",
            tail(&self.dir.join("qemu.log"), 2000),
            tail(&self.dir.join("console.log"), 3000)
        ))
    }

    /// Waits for the agent's READY on the notify socket; without one (an
    /// agent that does not announce, or `notify` off), polls the agent once
    /// the console has shown it listening for [`POLL_AFTER_LISTENING`],
    /// never before (module documentation).
    pub(crate) fn wait_ready(
        &mut self,
        notify: Option<&UnixListener>,
        deadline: Instant,
        opts: &VmOptions,
        accel: Accel,
    ) -> Result<Readiness> {
        let mut listening_since: Option<Instant> = None;
        let mut last_poll: Option<Instant> = None;
        loop {
            if !self.qemu_running() {
                return Err(self.qemu_exited());
            }
            if let Some(l) = notify {
                match l.accept() {
                    Ok((s, _)) => {
                        if ready_message(s) {
                            return Ok(Readiness::Notified);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(Error::Io("accept on the notify socket".into(), e)),
                }
            }
            if listening_since.is_none() && console_says_listening(&self.dir.join("console.log")) {
                listening_since = Some(Instant::now());
            }
            if listening_since.is_some_and(|t| t.elapsed() >= POLL_AFTER_LISTENING)
                && !matches!(last_poll, Some(t) if t.elapsed() < Duration::from_millis(200))
            {
                last_poll = Some(Instant::now());
                let addr = self.agent_addr(opts.port);
                let qemu_pid = self.state.qemu_pid;
                let dir = self.dir.clone();
                let mut up = || alive(qemu_pid, &dir);
                if crust_client::connect_stream_until(&addr, deadline, &mut up).is_ok() {
                    return Ok(Readiness::Polled);
                }
            }
            if Instant::now() > deadline {
                let seen = if listening_since.is_some() {
                    "the console shows the agent listening, but it never answered"
                } else if opts.notify {
                    "no READY came on the notify socket and the console never showed the agent listening"
                } else {
                    "the console never showed the agent listening"
                };
                return Err(self.boot_failure(format!(
                    "the agent was not ready within {:?} ({} accel): {seen} ({})",
                    opts.boot_timeout,
                    accel.name(),
                    agent_address(&self.dir, opts.port)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// GetAgentInfo from an agent known to be ready: each connection waits
    /// for its answer (never abandoned: crust-client), each call gets
    /// [`INFO_TIMEOUT`], until `deadline`.
    pub(crate) fn first_info(
        &mut self,
        deadline: Instant,
        opts: &VmOptions,
        accel: Accel,
    ) -> Result<GetAgentInfoResponse> {
        loop {
            if !self.qemu_running() {
                return Err(self.qemu_exited());
            }
            let last;
            let addr = self.agent_addr(opts.port);
            let qemu_pid = self.state.qemu_pid;
            let dir = self.dir.clone();
            let mut up = || alive(qemu_pid, &dir);
            match crust_client::connect_until(&addr, deadline, &mut up).map(AgentClient::new) {
                Ok(client) => {
                    match client.get_agent_info(ctx(INFO_TIMEOUT), &GetAgentInfoRequest::new()) {
                        Ok(info) => return Ok(info),
                        Err(e) => last = format!("GetAgentInfo: {e}"),
                    }
                }
                Err(e) => last = e.to_string(),
            }
            if Instant::now() > deadline {
                return Err(self.boot_failure(format!(
                    "the agent said it was ready but did not answer on {} within {:?} ({} accel): {last}",
                    agent_address(&self.dir, opts.port),
                    opts.boot_timeout,
                    accel.name()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

//! A running VM: its directory, its recorded state (pids, disks), and the
//! ways to it (the agent, QMP); taken over by another process with
//! `attach`. Booting it is `up.rs`; its processes are `process.rs`.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use crust_client::qmp::Qmp;
use crust_client::Address;
use crust_protocols::crust::GetAgentInfoResponse;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::ttrpc;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::error::{io_err, Error, Result};
use crate::files;
use crate::options::{NOTIFY_PORT, SANDBOX_FILE};

/// A ttrpc context that gives up after `d`, for calls on [`Vm::agent`].
pub fn ctx(d: Duration) -> ttrpc::context::Context {
    ttrpc::context::with_duration(d)
}

/// One hot-plugged disk, as recorded in the state file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Disk {
    /// The raw image file on the host.
    pub image: PathBuf,
    /// QEMU's block node name.
    pub node: String,
    /// QEMU's device id.
    pub device: String,
    pub read_only: bool,
}

/// What `DIR/state.json` holds, so another process can drive or stop the VM.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct State {
    pub(crate) qemu_pid: u32,
    /// 0 when the backend is not ours (`VmOptions::vhost_socket`).
    pub(crate) vhost_pid: u32,
    pub(crate) port: u32,
    pub(crate) disks: BTreeMap<String, Disk>,
}

/// How `up` learnt that the agent was ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The agent's `READY=1` on [`NOTIFY_PORT`].
    Notified,
    /// Polled, once the console showed the agent listening.
    Polled,
}

pub struct Vm {
    /// The VM's directory (absolute).
    pub(crate) dir: PathBuf,
    /// The directory, opened without following a symlink: every file crust-vm
    /// writes there is created relative to it.
    pub(crate) dir_fd: OwnedFd,
    /// Pids and disks.
    pub(crate) state: State,
    /// QEMU, when this process started it (so it can be reaped).
    pub(crate) qemu: Option<Child>,
    /// The vsock backend, when this process started it.
    pub(crate) vhost: Option<Child>,
    /// What the agent said when it first answered (only after `up`).
    pub(crate) boot_info: Option<GetAgentInfoResponse>,
    /// How readiness was learnt, and when (after QEMU started) (only after `up`).
    pub(crate) ready: Option<(Readiness, Duration)>,
    /// Set by `down` and `detach`: Drop leaves the processes alone.
    pub(crate) released: bool,
}

/// The `hvsock://` address of the agent of the VM in `dir`.
pub fn agent_address(dir: &Path, port: u32) -> String {
    format!("hvsock://{}:{port}", dir.join("vsock.sock").display())
}

/// Checks a virtio-blk serial by the rule the agent applies
/// (`crust_protocols::names::serial`: 1–20 bytes of `[A-Za-z0-9._-]`).
pub fn check_serial(serial: &str) -> Result<()> {
    crust_protocols::names::serial(serial)
        .map_err(|e| Error::Invalid(format!("{e}: choose another serial")))
}

/// QEMU names for a disk with `serial`: (block node, device id).
pub fn disk_names(serial: &str) -> (String, String) {
    (format!("crust-{serial}"), format!("dev-{serial}"))
}

/// The unix socket the backend connects the guest's READY to.
pub(crate) fn notify_socket_name() -> String {
    format!("vsock.sock_{NOTIFY_PORT}")
}

impl Vm {
    /// Takes over the VM running in `dir` (started by another process).
    pub fn attach(dir: &Path) -> Result<Vm> {
        let dir =
            fs::canonicalize(dir).map_err(io_err(format!("cannot resolve {}", dir.display())))?;
        let state = read_state(&dir)?;
        let dir_fd =
            files::open_dir(&dir).map_err(io_err(format!("cannot open {}", dir.display())))?;
        Ok(Vm {
            dir,
            dir_fd,
            state,
            qemu: None,
            vhost: None,
            boot_info: None,
            ready: None,
            released: true,
        })
    }

    /// Leaves the processes running when this value is dropped (the CLI's `up`).
    pub fn detach(mut self) {
        self.released = true;
    }

    /// The VM's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The agent's address, `hvsock://DIR/vsock.sock:PORT`.
    pub fn address(&self) -> String {
        agent_address(&self.dir, self.state.port)
    }

    /// The hybrid-vsock Unix socket.
    pub fn vsock_path(&self) -> PathBuf {
        self.dir.join("vsock.sock")
    }

    /// Guest port `port` through the hybrid-vsock socket.
    pub(crate) fn agent_addr(&self, port: u32) -> Address {
        Address::Hvsock {
            path: self.vsock_path(),
            port,
        }
    }

    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// What the agent answered first (set by `up`).
    pub fn boot_info(&self) -> Option<&GetAgentInfoResponse> {
        self.boot_info.as_ref()
    }

    /// How `up` learnt the agent was ready, and how long after QEMU started.
    pub fn readiness(&self) -> Option<(Readiness, Duration)> {
        self.ready
    }

    /// Pids of QEMU and the vsock backend.
    pub fn pids(&self) -> (u32, u32) {
        (self.state.qemu_pid, self.state.vhost_pid)
    }

    /// A fresh ttrpc client for the agent.
    pub fn agent(&self) -> Result<AgentClient> {
        crust_client::connect(&self.agent_addr(self.state.port), Duration::from_secs(5))
            .map(AgentClient::new)
            .map_err(|e| {
                Error::Io(
                    format!("cannot reach the agent at {}", self.address()),
                    io::Error::other(e),
                )
            })
    }

    /// The disks hot-plugged so far, by serial.
    pub fn disks(&self) -> &BTreeMap<String, Disk> {
        &self.state.disks
    }

    /// Runs one QMP command (for checks beyond hotplug/resize/unplug).
    pub fn qmp_execute(
        &self,
        cmd: &str,
        args: Option<serde_json::Value>,
    ) -> Result<serde_json::Value> {
        Ok(self.qmp()?.execute(cmd, args)?)
    }

    pub(crate) fn qmp(&self) -> Result<Qmp> {
        Ok(Qmp::connect(
            &self.dir.join("qmp.sock"),
            Duration::from_secs(30),
        )?)
    }

    /// Writes `DIR/sandbox.json`, the entry crustd's sandbox registry reads
    /// (docs/crustd.md): `{"qmp": "DIR/qmp.sock", "agent":
    /// "hvsock://DIR/vsock.sock:PORT", "qemu_pid": PID}`. `crust-vm up --dir
    /// REGISTRY/<sandbox>` thus makes a CRUST sandbox, whose monitor crustd
    /// uses only while QEMU's own process serves it.
    /// Written once the agent answers, so crustd never sees a VM still booting.
    /// Written atomically (files.rs: no planted symlink is followed).
    pub(crate) fn write_sandbox_entry(&self) -> Result<()> {
        let text = json!({
            "qmp": self.dir.join("qmp.sock"),
            "agent": self.address(),
            "qemu_pid": self.state.qemu_pid,
        })
        .to_string();
        files::write_atomic(&self.dir_fd, SANDBOX_FILE, text.as_bytes()).map_err(io_err(format!(
            "cannot write {}",
            self.dir.join(SANDBOX_FILE).display()
        )))
    }

    pub(crate) fn save(&self) -> Result<()> {
        let text =
            serde_json::to_string_pretty(&self.state).map_err(|e| Error::Invalid(e.to_string()))?;
        files::write_atomic(&self.dir_fd, "state.json", text.as_bytes()).map_err(io_err(format!(
            "cannot write {}",
            self.dir.join("state.json").display()
        )))
    }
}

pub(crate) fn read_state(dir: &Path) -> Result<State> {
    let path = dir.join("state.json");
    let text = fs::read_to_string(&path).map_err(io_err(format!(
        "no VM state in {} (was crust-vm up run with this --dir?)",
        dir.display()
    )))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Invalid(format!("{} is not valid VM state: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials() {
        for (s, ok) in [
            ("vol-0123456789abcdef", true),
            ("a", true),
            ("A.b_c-9", true),
            ("", false),
            ("vol-0123456789abcdefg", false), // 21 bytes
            ("has space", false),
            ("comma,x", false),
            ("é", false),
        ] {
            assert_eq!(check_serial(s).is_ok(), ok, "{s:?}");
        }
        assert_eq!(
            disk_names("v1"),
            ("crust-v1".to_string(), "dev-v1".to_string())
        );
        // QEMU node names: at most 31 characters.
        assert!(disk_names("vol-0123456789abcdef").0.len() <= 31);
    }

    #[test]
    fn attach_without_state_explains() {
        let d = tempfile::tempdir().unwrap();
        let err = Vm::attach(d.path()).err().expect("no state");
        assert!(err.to_string().contains("crust-vm up"), "{err}");
    }
}

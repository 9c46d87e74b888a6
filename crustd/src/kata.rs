//! Kata Containers' sandboxes, found from Kata's own files when crustd runs
//! with `--kata-runtime-dir` (off by default): no `sandbox.json` needed.
//!
//! Where Kata's Go runtime (`src/runtime/virtcontainers`) keeps them, read
//! from its source:
//!
//! - `<run>/sbs/<id>/persist.json` (`persist/fs/fs.go`: `RunStoragePath()`
//!   = `/run/vc/sbs`, file `persist.json`, mode 0600 in a 0700 directory):
//!   the sandbox's state, whose `AgentState.URL` is the agent's address as
//!   `types.VSock.String()` or `types.HybridVSock.String()` write it,
//!   `vsock://CID:1024` (QEMU, vhost-vsock) or `hvsock://UDS:1024`
//!   (Firecracker, Cloud Hypervisor). crust-agent runs in the same guest on
//!   its own port, so crustd takes the CID (or the hybrid vsock's socket)
//!   and its own port.
//! - `<run>/vm/<id>/extra-monitor.sock` (`qemu.go`:
//!   `extraMonitorSocketPath` = `BuildSocketPath(VMStorePath, id,
//!   "extra-monitor.sock")`, `VMStorePath` = `RunVMStoragePath()` =
//!   `/run/vc/vm`): QEMU's second monitor, made only when Kata's QEMU
//!   configuration has `enable_debug = true` and `extra_monitor_socket =
//!   "qmp"` (`[hypervisor.qemu]`); the one tools that drive Kata's QEMU
//!   from outside use. Kata's own monitor stays Kata's.
//!
//! Both files are Kata's, so untrusted: read through directory fds without
//! following a symlink, bounded, and checked like a `sandbox.json`.

use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use crust_client::Address;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::files::{self, ReadError};

/// Kata's default runtime directory.
pub const DEFAULT_RUN: &str = "/run/vc";
/// The largest `persist.json` read (a sandbox with many devices writes tens of KiB).
pub const MAX_PERSIST: u64 = 4 << 20;
/// The name of QEMU's extra monitor in `<run>/vm/<id>/`.
pub const EXTRA_MONITOR: &str = "extra-monitor.sock";

#[derive(Deserialize)]
struct Persist {
    #[serde(rename = "AgentState")]
    agent_state: AgentState,
}

#[derive(Deserialize)]
struct AgentState {
    #[serde(rename = "URL")]
    url: String,
}

/// Whether Kata has a sandbox `id` under `run` (its `persist.json` is there).
pub fn has(run: &Path, id: &str) -> bool {
    files::open_dir(&run.join("sbs"))
        .and_then(|d| files::open_dir_at(d.as_fd(), id))
        .is_ok_and(|fd| files::exists_at(fd.as_fd(), "persist.json"))
}

/// The agent's address in the text of a `persist.json`, with crust-agent's
/// `port` in place of kata-agent's.
pub fn agent_of(text: &[u8], port: u32) -> std::result::Result<Address, String> {
    let p: Persist = serde_json::from_slice(text).map_err(|e| e.to_string())?;
    let url = p.agent_state.url;
    let kata: Address = url
        .parse()
        .map_err(|e: crust_client::AddressError| format!("AgentState.URL {url:?}: {e}"))?;
    let ours = match kata {
        Address::Vsock { cid, .. } => Address::Vsock { cid, port },
        Address::Hvsock { path, .. } => Address::Hvsock { path, port },
        Address::Unix(_) => {
            return Err(format!(
                "AgentState.URL {url:?} is not a vsock or hybrid vsock address"
            ))
        }
    };
    ours.check_connectable().map_err(|e| e.to_string())?;
    Ok(ours)
}

/// Sandbox `id`'s QMP socket and crust-agent's address, from Kata's files
/// under `run`: NOT_FOUND when Kata has no such sandbox, FAILED_PRECONDITION
/// when its files are not as Kata writes them or its QEMU has no extra
/// monitor.
pub fn vm(run: &Path, id: &str, port: u32) -> Result<(PathBuf, Address)> {
    let sbs = run.join("sbs").join(id);
    let persist = sbs.join("persist.json");
    let dir = files::open_dir(&run.join("sbs"))
        .and_then(|d| files::open_dir_at(d.as_fd(), id))
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => Error::not_found(format!(
                "no sandbox {id}: neither crustd's registry nor Kata ({}) has it",
                sbs.display()
            )),
            _ => Error::precondition(format!(
                "{} is not a directory Kata made (a symbolic link is not followed): {e}",
                sbs.display()
            )),
        })?;
    let text = match files::read_bounded(dir.as_fd(), "persist.json", MAX_PERSIST) {
        Ok(t) => t,
        Err(ReadError::Missing) => {
            return Err(Error::not_found(format!(
                "no sandbox {id}: Kata has no {}",
                persist.display()
            )))
        }
        Err(e) => {
            return Err(Error::precondition(format!(
                "{} is not Kata's sandbox state: {e}",
                persist.display()
            )))
        }
    };
    let agent = agent_of(&text, port).map_err(|why| {
        Error::precondition(format!(
            "{} is not Kata's sandbox state: {why}",
            persist.display()
        ))
    })?;
    let qmp = run.join("vm").join(id).join(EXTRA_MONITOR);
    match std::fs::symlink_metadata(&qmp) {
        Err(_) => Err(Error::precondition(format!(
            "Kata's QEMU for sandbox {id} has no extra monitor at {}: set enable_debug = true and extra_monitor_socket = \"qmp\" under [hypervisor.qemu] in Kata's configuration, so crustd can hot-plug disks",
            qmp.display()
        ))),
        // QEMU makes the socket itself: anything else there (a symlink
        // to another VM's monitor, a file) is not followed.
        Ok(m) if !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            Err(Error::precondition(format!(
                "{} is not the socket Kata's QEMU makes (a symbolic link is not followed)",
                qmp.display()
            )))
        }
        Ok(_) => Ok((qmp, agent)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state Kata's Go runtime writes (fields as `persistapi.SandboxState`
    /// marshals them), cut to what matters around the agent's URL.
    const PERSIST: &str = r#"{"PersistVersion":2,"State":"running","SandboxContainer":"c1","SandboxCgroupPath":"/kubepods/pod1","HypervisorState":{"Pid":4242,"Type":"qemu","UUID":"8c1c0e4e","VirtiofsDaemonPid":4243},"AgentState":{"URL":"vsock://2389470134:1024"},"Network":{"NetNsPath":"/var/run/netns/cni-1","Endpoints":[]},"Config":{"HypervisorType":"qemu","KataAgentConfig":{"KernelModules":null}}}"#;

    #[test]
    fn the_agent_is_kata_agents_cid_on_our_port() {
        let a = agent_of(PERSIST.as_bytes(), 2857).unwrap();
        assert_eq!(a.to_string(), "vsock://2389470134:2857");
        let hv = PERSIST.replace(
            "vsock://2389470134:1024",
            "hvsock:///run/vc/firecracker/abc/root/kata.hvsock:1024",
        );
        assert_eq!(
            agent_of(hv.as_bytes(), 2857).unwrap().to_string(),
            "hvsock:///run/vc/firecracker/abc/root/kata.hvsock:2857"
        );
        for bad in [
            r#"{}"#,
            r#"{"AgentState":{"URL":"unix:///run/x.sock"}}"#,
            r#"{"AgentState":{"URL":"tcp://1.2.3.4:1024"}}"#,
            r#"{"AgentState":{"URL":"vsock://-1:1024"}}"#,
            r#"{"AgentState":{"URL":7}}"#,
            "not json",
        ] {
            assert!(agent_of(bad.as_bytes(), 2857).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_sandbox_is_found_only_as_kata_lays_it_out() {
        let t = tempfile::tempdir().unwrap();
        let run = t.path();
        assert_eq!(
            vm(run, "sb1", 2857).unwrap_err().code,
            crate::error::Code::NotFound
        );
        std::fs::create_dir_all(run.join("sbs/sb1")).unwrap();
        std::fs::write(run.join("sbs/sb1/persist.json"), PERSIST).unwrap();
        assert!(has(run, "sb1"));
        // No extra monitor: said how to turn it on.
        let e = vm(run, "sb1", 2857).unwrap_err();
        assert!(e.message.contains("extra_monitor_socket"), "{e}");
        std::fs::create_dir_all(run.join("vm/sb1")).unwrap();
        let _l =
            std::os::unix::net::UnixListener::bind(run.join("vm/sb1").join(EXTRA_MONITOR)).unwrap();
        let (qmp, agent) = vm(run, "sb1", 2857).unwrap();
        assert_eq!(qmp, run.join("vm/sb1/extra-monitor.sock"));
        assert_eq!(agent.to_string(), "vsock://2389470134:2857");
        // A symlink where QEMU's socket should be is not followed.
        std::fs::create_dir_all(run.join("vm/sb3")).unwrap();
        std::os::unix::fs::symlink(
            run.join("vm/sb1").join(EXTRA_MONITOR),
            run.join("vm/sb3").join(EXTRA_MONITOR),
        )
        .unwrap();
        std::fs::create_dir_all(run.join("sbs/sb3")).unwrap();
        std::fs::write(run.join("sbs/sb3/persist.json"), PERSIST).unwrap();
        let e = vm(run, "sb3", 2857).unwrap_err();
        assert!(e.message.contains("not the socket"), "{e}");
        // A symlink where Kata's directory should be is not followed.
        std::os::unix::fs::symlink(run.join("sbs/sb1"), run.join("sbs/sb2")).unwrap();
        assert!(!has(run, "sb2"));
        assert_eq!(
            vm(run, "sb2", 2857).unwrap_err().code,
            crate::error::Code::FailedPrecondition
        );
    }
}

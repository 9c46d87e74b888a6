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
//! - `HypervisorState.Pid` in the same `persist.json`
//!   (`persist/api/hypervisor.go`, `Pid int`; `qemu.go`'s `Save` writes the
//!   pid QEMU wrote to its `-pidfile`, or 0 when QEMU is not running): the
//!   process that serves the extra monitor. crustd connects only to a
//!   monitor that process serves, while it lives, and only when its command
//!   line names this sandbox as Kata names its QEMU, `-name sandbox-<id>`
//!   (monitor.rs, hypervisor.rs): `persist.json` is a file anyone who
//!   writes there can copy from another sandbox's, so its pid alone would
//!   prove only that the monitor is *some* sandbox's VM's.
//!
//! Both files are Kata's, so untrusted: resolved beneath the runtime
//! directory (the operator's, whose own path may hold links) with no
//! symbolic link in any component (`sbs`, `vm`, the sandbox's directory,
//! the file) and no other name (a hard link of another sandbox's file),
//! bounded, and checked like a `sandbox.json`.

use std::fmt;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crust_client::{Address, AddressError};
use serde::Deserialize;

use crate::files::{self, ReadError, SocketError};
use crate::monitor::{Monitor, Owner, Recorder, Unproven};

crust_protocols::coded_errors! {
/// Why Kata's files give no sandbox crustd can use.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(NotFound)]
    #[error("no sandbox {id}: neither crustd's registry nor Kata ({}) has it", .run.display())]
    NoRun { id: String, run: PathBuf },
    #[code(FailedPrecondition)]
    #[error("cannot open Kata's runtime directory {}: {source}", .run.display())]
    Run { run: PathBuf, source: Arc<io::Error> },
    #[code(NotFound)]
    #[error("no sandbox {id}: neither crustd's registry nor Kata has it ({} does not exist)", .persist.display())]
    NoPersist { id: String, persist: PathBuf },
    /// Not a file crustd may read.
    #[code(FailedPrecondition)]
    #[error("{} is not Kata's sandbox state: {why}", .persist.display())]
    Unreadable { persist: PathBuf, why: ReadError },
    #[code(FailedPrecondition)]
    #[error("{} is not Kata's sandbox state: {why}", .persist.display())]
    Invalid { persist: PathBuf, why: Invalid },
    #[code(FailedPrecondition)]
    #[error("Kata's QEMU for sandbox {id} has no extra monitor at {}: set enable_debug = true and extra_monitor_socket = \"qmp\" under [hypervisor.qemu] in Kata's configuration, so crustd can hot-plug disks", .qmp.display())]
    NoMonitor { id: String, qmp: PathBuf },
    #[code(FailedPrecondition)]
    #[error("{} is not the socket Kata's QEMU makes: {why}", .qmp.display())]
    NotTheSocket { qmp: PathBuf, why: SocketError },
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// What makes a `persist.json` not one Kata writes.
#[derive(Debug, Clone)]
pub enum Invalid {
    /// Not JSON of Kata's shape.
    Json(Arc<serde_json::Error>),
    /// `AgentState.URL` is not an address.
    Url { url: String, why: AddressError },
    /// `AgentState.URL` is an address, but not over vsock.
    NotVsock { url: String },
    /// crust-agent's address could not be connected to.
    Unconnectable(AddressError),
    /// `HypervisorState.Pid` is not a process id.
    Pid(i64),
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::Json(e) => write!(f, "{e}"),
            Invalid::Url { url, why } => write!(f, "AgentState.URL {url:?}: {why}"),
            Invalid::NotVsock { url } => write!(
                f,
                "AgentState.URL {url:?} is not a vsock or hybrid vsock address"
            ),
            Invalid::Unconnectable(e) => write!(f, "{e}"),
            Invalid::Pid(n) => write!(f, "HypervisorState.Pid {n} is not a process id"),
        }
    }
}

/// Kata's default runtime directory.
pub const DEFAULT_RUN: &str = "/run/vc";
/// The largest `persist.json` read (a sandbox with many devices writes tens of KiB).
pub const MAX_PERSIST: u64 = 4 << 20;
/// The name of QEMU's extra monitor in `<run>/vm/<id>/`.
pub const EXTRA_MONITOR: &str = "extra-monitor.sock";
/// The name of the sandbox's state in `<run>/sbs/<id>/`.
pub const PERSIST: &str = "persist.json";

#[derive(Deserialize)]
struct Persist {
    #[serde(rename = "AgentState")]
    agent_state: AgentState,
    #[serde(rename = "HypervisorState", default)]
    hypervisor_state: Option<HypervisorState>,
}

#[derive(Deserialize)]
struct AgentState {
    #[serde(rename = "URL")]
    url: String,
}

#[derive(Deserialize)]
struct HypervisorState {
    #[serde(rename = "Pid", default)]
    pid: Option<i64>,
}

/// What crustd takes from a `persist.json`.
#[derive(Debug, PartialEq, Eq)]
pub struct State {
    /// crust-agent's address: kata-agent's, on crust-agent's port.
    pub agent: Address,
    /// The hypervisor's pid; `None` when Kata wrote 0 or nothing.
    pub hypervisor_pid: Option<u32>,
}

/// Where `persist.json` of sandbox `id` is beneath the runtime directory.
fn persist_rel(id: &str) -> PathBuf {
    Path::new("sbs").join(id).join(PERSIST)
}

/// Where the extra monitor of sandbox `id` is beneath the runtime directory.
fn monitor_rel(id: &str) -> PathBuf {
    Path::new("vm").join(id).join(EXTRA_MONITOR)
}

/// Whether Kata has a sandbox `id` under `run`: something is at its
/// `persist.json`, with no symbolic link on the way there.
pub fn has(run: &Path, id: &str) -> bool {
    files::open_dir(run).is_ok_and(|root| files::exists_beneath(root.as_fd(), &persist_rel(id)))
}

/// What the text of a `persist.json` says, with crust-agent's `port` in
/// place of kata-agent's.
pub fn parse(text: &[u8], port: u32) -> Result<State, Invalid> {
    let p: Persist = serde_json::from_slice(text).map_err(|e| Invalid::Json(Arc::new(e)))?;
    let url = p.agent_state.url;
    let kata: Address = match url.parse() {
        Ok(a) => a,
        Err(why) => return Err(Invalid::Url { url, why }),
    };
    let ours = match kata {
        Address::Vsock { cid, .. } => Address::Vsock { cid, port },
        Address::Hvsock { path, .. } => Address::Hvsock { path, port },
        Address::Unix(_) => return Err(Invalid::NotVsock { url }),
    };
    ours.check_connectable().map_err(Invalid::Unconnectable)?;
    let hypervisor_pid = match p.hypervisor_state.and_then(|h| h.pid) {
        None | Some(0) => None,
        Some(n) => Some(
            u32::try_from(n)
                .ok()
                .filter(|&n| i32::try_from(n).is_ok())
                .ok_or(Invalid::Pid(n))?,
        ),
    };
    Ok(State {
        agent: ours,
        hypervisor_pid,
    })
}

/// Sandbox `id`'s QMP monitor and crust-agent's address, from Kata's files
/// under `run`: NOT_FOUND when Kata has no such sandbox, FAILED_PRECONDITION
/// when its files are not as Kata writes them or its QEMU has no extra
/// monitor. The monitor is found again, and its process proved, on every
/// connection (monitor.rs).
pub fn vm(run: &Path, id: &str, port: u32) -> Result<(Monitor, Address)> {
    let root = files::open_dir(run).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => Error::NoRun {
            id: id.to_string(),
            run: run.to_path_buf(),
        },
        _ => Error::Run {
            run: run.to_path_buf(),
            source: Arc::new(e),
        },
    })?;
    let persist = run.join(persist_rel(id));
    let text = match files::read_bounded_beneath(root.as_fd(), &persist_rel(id), MAX_PERSIST) {
        Ok(t) => t,
        Err(ReadError::Missing) => {
            return Err(Error::NoPersist {
                id: id.to_string(),
                persist,
            })
        }
        Err(why) => return Err(Error::Unreadable { persist, why }),
    };
    let state = match parse(&text, port) {
        Ok(s) => s,
        Err(why) => return Err(Error::Invalid { persist, why }),
    };
    let monitor = Monitor::beneath(
        Arc::new(root),
        run,
        monitor_rel(id),
        owner(
            id,
            state.hypervisor_pid,
            &persist,
            &run.join(monitor_rel(id)),
        ),
    );
    check_monitor(id, &monitor)?;
    Ok((monitor, state.agent))
}

/// Whose process must serve sandbox `id`'s extra monitor `qmp`: the pid
/// Kata recorded in `persist`, which it must have recorded.
fn owner(id: &str, pid: Option<u32>, persist: &Path, qmp: &Path) -> Owner {
    match pid {
        Some(pid) => Owner::Pid {
            pid,
            recorded: Recorder::Kata {
                sandbox: id.to_string(),
                persist: persist.to_path_buf(),
            },
        },
        None => Owner::Unproven(Unproven {
            sandbox: id.to_string(),
            persist: persist.to_path_buf(),
            qmp: qmp.to_path_buf(),
        }),
    }
}

/// Sandbox `id`'s extra monitor is there as Kata's QEMU makes it: a socket
/// with no symbolic link on its path. Said before anything is claimed, with
/// how to make Kata's QEMU open one.
fn check_monitor(id: &str, m: &Monitor) -> Result<()> {
    match m.find() {
        Ok(_) => Ok(()),
        Err(SocketError::Missing) => Err(Error::NoMonitor {
            id: id.to_string(),
            qmp: m.path.clone(),
        }),
        Err(why) => Err(Error::NotTheSocket {
            qmp: m.path.clone(),
            why,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_client::qmp::fake;
    use crust_protocols::code::Code;
    use std::os::unix::fs::symlink;
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    /// The state Kata's Go runtime writes (fields as `persistapi.SandboxState`
    /// marshals them), cut to what matters around the agent's URL.
    const PERSIST: &str = r#"{"PersistVersion":2,"State":"running","SandboxContainer":"c1","SandboxCgroupPath":"/kubepods/pod1","HypervisorState":{"Pid":4242,"Type":"qemu","UUID":"8c1c0e4e","VirtiofsDaemonPid":4243},"AgentState":{"URL":"vsock://2389470134:1024"},"Network":{"NetNsPath":"/var/run/netns/cni-1","Endpoints":[]},"Config":{"HypervisorType":"qemu","KataAgentConfig":{"KernelModules":null}}}"#;

    #[test]
    fn the_agent_is_kata_agents_cid_on_our_port() {
        let a = parse(PERSIST.as_bytes(), 2857).unwrap().agent;
        assert_eq!(a.to_string(), "vsock://2389470134:2857");
        let hv = PERSIST.replace(
            "vsock://2389470134:1024",
            "hvsock:///run/vc/firecracker/abc/root/kata.hvsock:1024",
        );
        assert_eq!(
            parse(hv.as_bytes(), 2857).unwrap().agent.to_string(),
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
            assert!(parse(bad.as_bytes(), 2857).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_hypervisor_is_the_pid_kata_recorded() {
        assert_eq!(
            parse(PERSIST.as_bytes(), 2857).unwrap().hypervisor_pid,
            Some(4242)
        );
        let url = r#""AgentState":{"URL":"vsock://3:1024"}"#;
        // Kata writes 0 while its QEMU is not running; older or other
        // writers may leave it out: no pid, so nothing can be proved.
        for none in [
            format!("{{{url}}}"),
            format!(r#"{{{url},"HypervisorState":{{}}}}"#),
            format!(r#"{{{url},"HypervisorState":null}}"#),
            format!(r#"{{{url},"HypervisorState":{{"Pid":0}}}}"#),
            format!(r#"{{{url},"HypervisorState":{{"Pid":null}}}}"#),
        ] {
            assert_eq!(
                parse(none.as_bytes(), 2857).unwrap().hypervisor_pid,
                None,
                "{none}"
            );
        }
        for bad in [
            "-1",
            "2147483648",
            "1.5",
            "\"4242\"",
            "99999999999999999999",
        ] {
            let text = format!(r#"{{{url},"HypervisorState":{{"Pid":{bad}}}}}"#);
            assert!(parse(text.as_bytes(), 2857).is_err(), "{bad}");
        }
    }

    /// Sandbox `id`'s persist.json under `run`, with `pid` as
    /// HypervisorState.Pid (none: left out), and its `vm/<id>/` directory.
    fn persist(run: &Path, id: &str, pid: Option<u32>) {
        std::fs::create_dir_all(run.join("sbs").join(id)).unwrap();
        let hs = pid.map_or(String::new(), |p| {
            format!(r#","HypervisorState":{{"Pid":{p}}}"#)
        });
        let text = format!(r#"{{"AgentState":{{"URL":"vsock://3:1024"}}{hs}}}"#);
        std::fs::write(run.join(persist_rel(id)), text).unwrap();
        std::fs::create_dir_all(run.join("vm").join(id)).unwrap();
    }

    /// Kata's layout for sandbox `id` under `run`, `pid` recorded, and a
    /// stand-in QEMU at its extra monitor, served on a thread of this
    /// process (which the kernel names as its listener).
    fn lay_out(run: &Path, id: &str, pid: Option<u32>) -> fake::Qemu {
        persist(run, id, pid);
        fake::qemu(&run.join(monitor_rel(id)))
    }

    /// Kata's layout for sandbox `id` under `run` with its own stand-in
    /// hypervisor, named `name` (Kata's QEMU: `sandbox-<id>`), recorded as
    /// its HypervisorState.Pid and listening on its extra monitor.
    fn lay_out_named(run: &Path, id: &str, name: &str) -> (fake::Qemu, fake::Hypervisor) {
        std::fs::create_dir_all(run.join("vm").join(id)).unwrap();
        let (q, h) = fake::qemu_of(&run.join(monitor_rel(id)), name);
        persist(run, id, Some(h.pid()));
        (q, h)
    }

    #[test]
    fn a_sandbox_is_found_only_as_kata_lays_it_out() {
        let t = tempfile::tempdir().unwrap();
        let run = t.path();
        assert_eq!(vm(run, "sb1", 2857).unwrap_err().code(), Code::NotFound);
        std::fs::create_dir_all(run.join("sbs/sb1")).unwrap();
        std::fs::write(run.join("sbs/sb1/persist.json"), PERSIST).unwrap();
        assert!(has(run, "sb1"));
        // No extra monitor: said how to turn it on.
        let e = vm(run, "sb1", 2857).unwrap_err();
        assert!(e.to_string().contains("extra_monitor_socket"), "{e}");
        std::fs::create_dir_all(run.join("vm/sb1")).unwrap();
        let _l = UnixListener::bind(run.join("vm/sb1").join(EXTRA_MONITOR)).unwrap();
        let (qmp, agent) = vm(run, "sb1", 2857).unwrap();
        assert_eq!(qmp.path, run.join("vm/sb1/extra-monitor.sock"));
        assert_eq!(agent.to_string(), "vsock://2389470134:2857");
        assert!(matches!(qmp.owner(), Owner::Pid { pid: 4242, .. }));
        // A symlink where QEMU's socket should be is not followed.
        std::fs::create_dir_all(run.join("vm/sb3")).unwrap();
        symlink(
            run.join("vm/sb1").join(EXTRA_MONITOR),
            run.join("vm/sb3").join(EXTRA_MONITOR),
        )
        .unwrap();
        std::fs::create_dir_all(run.join("sbs/sb3")).unwrap();
        std::fs::write(run.join("sbs/sb3/persist.json"), PERSIST).unwrap();
        let e = vm(run, "sb3", 2857).unwrap_err();
        assert!(e.to_string().contains("not the socket"), "{e}");
        // A symlink where Kata's directory should be is not followed.
        symlink(run.join("sbs/sb1"), run.join("sbs/sb2")).unwrap();
        assert!(!has(run, "sb2"));
        assert_eq!(
            vm(run, "sb2", 2857).unwrap_err().code(),
            Code::FailedPrecondition
        );
    }

    /// Each way an attacker who writes in Kata's runtime directory could
    /// point sandbox B at sandbox A's monitor: refused before anything is
    /// sent to A's, as files are found (the next test: as the peer proves
    /// itself, by its pid, its command line, its being alive).
    #[test]
    fn no_link_leads_one_sandbox_to_another_vms_monitor() {
        let t = tempfile::tempdir().unwrap();
        let run = t.path().join("vc");
        let (_a, a) = lay_out_named(&run, "a", "sandbox-a,debug-threads=on");
        let timeout = Duration::from_secs(5);
        let (qmp, _) = vm(&run, "a", 2857).unwrap();
        assert!(
            qmp.connect(timeout).is_ok(),
            "A's own monitor, served by its recorded and named QEMU"
        );
        // vm/b1 a symlink to vm/a.
        persist(&run, "b1", Some(1));
        std::fs::remove_dir(run.join("vm/b1")).unwrap();
        symlink(run.join("vm/a"), run.join("vm/b1")).unwrap();
        let e = vm(&run, "b1", 2857).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(
            e.to_string().contains("symbolic link lies on its path"),
            "{e}"
        );
        // sbs/b2 a symlink to sbs/a (its persist.json names A's pid).
        symlink(run.join("sbs/a"), run.join("sbs/b2")).unwrap();
        let e = vm(&run, "b2", 2857).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(
            e.to_string().contains("symbolic link lies on its path"),
            "{e}"
        );
        // B's persist.json a hard link of A's, or B's extra monitor a hard
        // link of A's socket: a file with two names is neither's.
        std::fs::create_dir_all(run.join("sbs/b3")).unwrap();
        std::fs::hard_link(run.join(persist_rel("a")), run.join(persist_rel("b3"))).unwrap();
        for id in ["b3", "a"] {
            let e = vm(&run, id, 2857).unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
            assert!(e.to_string().contains("it has 2 names"), "{id}: {e}");
        }
        std::fs::remove_file(run.join(persist_rel("b3"))).unwrap();
        persist(&run, "b4", Some(a.pid()));
        std::fs::hard_link(run.join(monitor_rel("a")), run.join(monitor_rel("b4"))).unwrap();
        let e = vm(&run, "b4", 2857).unwrap_err();
        assert!(e.to_string().contains("it has 2 names"), "{e}");
        std::fs::remove_file(run.join(monitor_rel("b4"))).unwrap();
        // `vm` and `sbs` themselves links beneath the runtime directory.
        let run2 = t.path().join("vc2");
        std::fs::create_dir_all(run2.join("sbs")).unwrap();
        std::fs::copy(run.join(persist_rel("a")), run2.join("a.json")).unwrap();
        std::fs::create_dir_all(run2.join("sbs/a")).unwrap();
        std::fs::rename(run2.join("a.json"), run2.join(persist_rel("a"))).unwrap();
        symlink(run.join("vm"), run2.join("vm")).unwrap();
        let e = vm(&run2, "a", 2857).unwrap_err();
        assert!(
            e.to_string().contains("symbolic link lies on its path"),
            "{e}"
        );
        let run3 = t.path().join("vc3");
        std::fs::create_dir_all(&run3).unwrap();
        symlink(run.join("sbs"), run3.join("sbs")).unwrap();
        symlink(run.join("vm"), run3.join("vm")).unwrap();
        assert!(!has(&run3, "a"));
        let e = vm(&run3, "a", 2857).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        // The runtime directory itself, the operator's, may be reached by a link.
        let op = t.path().join("op-link");
        symlink(&run, &op).unwrap();
        assert!(vm(&op, "a", 2857).unwrap().0.connect(timeout).is_ok());
    }

    /// The same, as the peer proves itself: a monitor served by another
    /// process than the one recorded, by another sandbox's QEMU, by a
    /// process that has exited, or with no process recorded.
    #[test]
    fn no_monitor_is_trusted_that_the_wrong_process_serves() {
        let t = tempfile::tempdir().unwrap();
        let run = t.path().join("vc");
        let timeout = Duration::from_secs(5);
        // B's own monitor, and a persist.json naming someone else's pid.
        let _b5 = lay_out(&run, "b5", Some(1));
        let (qmp, _) = vm(&run, "b5", 2857).unwrap();
        let e = qmp.connect(timeout).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        let me = std::process::id();
        assert!(
            e.to_string()
                .contains(&format!("served by process {me}, not by process 1"))
                && e.to_string().contains("HypervisorState.Pid"),
            "{e}"
        );
        // B's persist.json naming the process that serves B's monitor, but
        // that process is sandbox A's QEMU by its command line (A's QEMU
        // reached at B's path, or A's persist.json copied for B).
        let (_b6, _a_again) = lay_out_named(&run, "b6", "sandbox-a");
        let (qmp, _) = vm(&run, "b6", 2857).unwrap();
        let e = qmp.connect(timeout).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(
            e.to_string().contains("is not sandbox b6's QEMU")
                && e.to_string().contains("-name sandbox-b6")
                && e.to_string().contains("has -name sandbox-a"),
            "{e}"
        );
        // This test's process serving a monitor recorded as B's: no -name.
        let _b7 = lay_out(&run, "b7", Some(me));
        let (qmp, _) = vm(&run, "b7", 2857).unwrap();
        assert!(qmp
            .connect(timeout)
            .unwrap_err()
            .to_string()
            .contains("is not sandbox b7's QEMU"));
        // The recorded, named process listened, then exited; its socket is
        // served on: its pid proves nothing any more.
        let (_b8, mut b8) = lay_out_named(&run, "b8", "sandbox-b8");
        let (qmp, _) = vm(&run, "b8", 2857).unwrap();
        assert!(qmp.connect(timeout).is_ok());
        b8.exit();
        let e = qmp.connect(timeout).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains("has exited"), "{e}");
        // No pid recorded: refused, saying why, without a connect.
        let _b9 = lay_out(&run, "b9", None);
        let (qmp, _) = vm(&run, "b9", 2857).unwrap();
        let e = qmp.connect(timeout).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(
            e.to_string().contains("recorded no hypervisor process"),
            "{e}"
        );
    }
}

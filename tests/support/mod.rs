//! The agent under test in the host tests: a running agent on a unix
//! socket, a rig that checks what it left behind, and a raw ttrpc client to
//! talk to it. Loop disks, what a test needs and the request builders come
//! from crust-testkit.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[allow(unused_imports)]
pub use crust_testkit::agent::{
    bind_req, code, ctx, fs_group, message, publish_req, said, stats_req, unmount_req,
    unpublish_req,
};
#[allow(unused_imports)]
pub use crust_testkit::child::own_mount_namespace;
#[allow(unused_imports)]
pub use crust_testkit::{allocated, mode, mounts_of, needs, run, LoopDisk};

pub mod rig;

pub mod raw;

pub use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::ttrpc;

/// A ttrpc client of the agent at `addr` (`unix:///path`), on a socket
/// whose fd number no other client of this process had recently.
///
/// ttrpc 0.10's sync client reads its socket from a thread that can outlive
/// the client: a client dropped just as its connection sees data or EOF (the
/// agent killed, say) can still read once from its old fd number, and if a
/// new client (of this test or of one running beside it) got that number,
/// that read swallows the new client's response and its call times out.
/// Seen about once in 500 kill-and-restart cycles with plain
/// `ttrpc::Client::connect`. A fresh fd number for every socket makes such a
/// stray read miss.
pub fn connect(addr: &str) -> ttrpc::Result<AgentClient> {
    use std::os::fd::IntoRawFd;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static RANGE: OnceLock<(u64, u64)> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let (lo, hi) = *RANGE.get_or_init(|| {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let lim = getrlimit(Resource::Nofile);
        let hard = lim.maximum.unwrap_or(1 << 20);
        let want = hard.min(1 << 16);
        let soft = match lim.current {
            Some(cur) if cur < want => {
                let raised = Rlimit {
                    current: Some(want),
                    maximum: lim.maximum,
                };
                if setrlimit(Resource::Nofile, raised).is_ok() {
                    want
                } else {
                    cur
                }
            }
            Some(cur) => cur,
            None => want,
        };
        // Low numbers stay for everything else the process opens.
        (soft / 2, soft.saturating_sub(16).max(soft / 2 + 1))
    });
    let path = addr
        .strip_prefix("unix://")
        .ok_or_else(|| ttrpc::Error::Others(format!("{addr} is not unix:///path")))?;
    let stream = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| ttrpc::Error::Others(format!("connect {path}: {e}")))?;
    let n = lo + NEXT.fetch_add(1, Ordering::Relaxed) % (hi - lo);
    let fd = rustix::io::fcntl_dupfd_cloexec(&stream, i32::try_from(n).unwrap_or(i32::MAX))
        .map_err(|e| ttrpc::Error::Others(format!("dup the socket of {path}: {e}")))?;
    drop(stream);
    ttrpc::Client::new(fd.into_raw_fd()).map(AgentClient::new)
}

/// A crust-agent process serving on a unix socket with its own root.
pub struct Agent {
    pub child: Child,
    pub root: PathBuf,
    pub sock: PathBuf,
    pub dir: tempfile::TempDir,
}

/// The agent under test: this build's, or `CRUST_TEST_AGENT_BIN` (to replay
/// the tests against another build, e.g. an older commit's).
pub fn agent_bin() -> String {
    std::env::var("CRUST_TEST_AGENT_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_crust-agent").to_string())
}

impl Agent {
    pub fn start() -> Agent {
        let dir = tempfile::tempdir().unwrap();
        Agent::start_in(dir)
    }

    /// Starts an agent with extra flags (e.g. `--log-format json`).
    pub fn start_with(extra: &[&str]) -> Agent {
        Agent::start_in_with(tempfile::tempdir().unwrap(), extra)
    }

    /// Starts (or restarts) an agent whose root and socket live in `dir`.
    pub fn start_in(dir: tempfile::TempDir) -> Agent {
        Agent::start_in_with(dir, &[])
    }

    fn start_in_with(dir: tempfile::TempDir, extra: &[&str]) -> Agent {
        let root = dir.path().join("root");
        let sock = dir.path().join("agent.sock");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("agent.log"))
            .unwrap();
        let child = Command::new(agent_bin())
            .args([
                "--listen",
                &format!("unix://{}", sock.display()),
                "--root",
                root.to_str().unwrap(),
                "--log-level",
                "debug",
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let a = Agent {
            child,
            root,
            sock,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if a.try_client().is_some() {
                return a;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "agent did not listen on {}; log:\n{}",
            a.sock.display(),
            a.log()
        );
    }

    pub fn addr(&self) -> String {
        format!("unix://{}", self.sock.display())
    }

    fn try_client(&self) -> Option<AgentClient> {
        std::os::unix::net::UnixStream::connect(&self.sock).ok()?;
        connect(&self.addr()).ok()
    }

    pub fn client(&self) -> AgentClient {
        connect(&self.addr()).expect("connect to the agent")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// SIGKILL, leaving mounts and state behind; gives back the directory for a restart.
    pub fn kill9(mut self) -> tempfile::TempDir {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::mem::replace(&mut self.dir, dir)
    }

    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }

    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// The peak resident set (VmHWM), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    fn status_kib(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // Ask for a clean shutdown so mounts go away with the agent.
            if let Ok(c) = connect(&self.addr()) {
                let _ = c.shutdown(ctx(), &pb::ShutdownRequest::new());
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && self.child.try_wait().ok().flatten().is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether `path` is a mount point.
pub fn is_mount(path: &Path) -> bool {
    let table = crust_agent::sys::mountinfo::read().unwrap();
    crust_agent::sys::mountinfo::mount_at(&table, path).is_some()
}

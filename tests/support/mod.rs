//! Shared pieces of the host tests: loop disks with real filesystems, a
//! running agent on a unix socket, and a raw ttrpc client to talk to it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../fixtures/disks.rs"]
mod disks;
#[allow(unused_imports)]
pub use disks::{cannot_run, mounts_of, run, LoopDisk};

pub mod rig;

pub mod raw;

pub use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::ttrpc;

/// True when the tests can make loop devices and mount (root with mkfs
/// tools); otherwise says why the test skips, or fails it when
/// `CRUST_REQUIRE_PRIVILEGED=1` (the Makefile's test targets, CI).
pub fn privileged() -> bool {
    let root = rustix::process::geteuid().is_root();
    let tools = ["mkfs.ext4", "mkfs.xfs", "losetup"].iter().all(|t| {
        Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let test = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_string();
    root && tools
        || cannot_run(
            &test,
            &format!("needs root, losetup, mkfs.ext4 and mkfs.xfs (root={root}, tools={tools})"),
        )
}

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

/// A call context with a generous timeout.
pub fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_timeout(60_000_000_000)
}

/// A call's result in one line: `OK {fields}` or `CODE: message`.
pub fn said<M: crust_protocols::protobuf::MessageFull>(r: &ttrpc::Result<M>) -> String {
    match r {
        Ok(m) => format!(
            "OK {{{}}}",
            crust_protocols::protobuf::text_format::print_to_string(m).trim()
        ),
        Err(ttrpc::Error::RpcStatus(s)) => format!("{:?}: {}", s.code(), s.message()),
        Err(e) => format!("transport error: {e}"),
    }
}

/// The gRPC code name of a failed call.
pub fn code<T: std::fmt::Debug>(r: ttrpc::Result<T>) -> String {
    match r {
        Err(ttrpc::Error::RpcStatus(s)) => format!("{:?}", s.code()),
        other => panic!("expected an error status, got {other:?}"),
    }
}

/// The message of a failed call.
pub fn message<T: std::fmt::Debug>(r: ttrpc::Result<T>) -> String {
    match r {
        Err(ttrpc::Error::RpcStatus(s)) => s.message().to_string(),
        other => panic!("expected an error status, got {other:?}"),
    }
}

/// A publish by device path; `fs` "block" asks for a block volume.
pub fn publish_req(id: &str, device: &str, fs: &str) -> pb::PublishVolumeRequest {
    let mut r = pb::PublishVolumeRequest::new();
    r.volume_id = id.into();
    r.set_device_path(device.into());
    if fs == "block" {
        r.volume_mode = pb::VolumeMode::BLOCK.into();
    } else {
        r.fs_type = fs.into();
    }
    r
}

pub fn unpublish_req(id: impl Into<String>) -> pb::UnpublishVolumeRequest {
    let mut r = pb::UnpublishVolumeRequest::new();
    r.volume_id = id.into();
    r
}

pub fn stats_req(id: impl Into<String>) -> pb::GetVolumeStatsRequest {
    let mut r = pb::GetVolumeStatsRequest::new();
    r.volume_id = id.into();
    r
}

pub fn unmount_req(target: impl Into<String>) -> pb::UnmountRequest {
    let mut r = pb::UnmountRequest::new();
    r.target = target.into();
    r
}

pub fn fs_group(
    gid: u32,
    policy: pb::FsGroupChangePolicy,
) -> crust_protocols::protobuf::MessageField<pb::FsGroup> {
    let mut g = pb::FsGroup::new();
    g.gid = gid;
    g.change_policy = policy.into();
    crust_protocols::protobuf::MessageField::some(g)
}

pub fn bind_req(
    id: &str,
    target: &Path,
    subpath: &str,
    ro: bool,
    rro: pb::RecursiveReadOnly,
) -> pb::BindMountRequest {
    let mut r = pb::BindMountRequest::new();
    r.volume_id = id.into();
    r.target = target.display().to_string();
    r.subpath = subpath.into();
    r.read_only = ro;
    r.recursive_read_only = rro.into();
    r
}

/// Whether `path` is a mount point.
pub fn is_mount(path: &Path) -> bool {
    let table = crust_agent::sys::mountinfo::read().unwrap();
    crust_agent::sys::mountinfo::mount_at(&table, path).is_some()
}

/// Set in the child that `own_mount_namespace` starts: the name of the test
/// it runs.
const OWN_NS: &str = "CRUST_TEST_OWN_MOUNT_NAMESPACE";

/// For a test that makes mounts no other test may see (a mount point whose
/// name is not UTF-8 breaks every reader of the shared mount table that
/// expects text, other engineers' tests and tools included): runs the
/// calling test again, alone, in a child process with a mount namespace of
/// its own (`unshare --mount`, propagation private), and answers false once
/// it passed there (panicking with its output if it failed). In that child
/// it answers true: run the test's body.
///
/// The child first detaches its copies of loop-device mounts it inherited,
/// so they do not keep other tests' disks busy while it runs.
pub fn own_mount_namespace() -> bool {
    let test = std::thread::current()
        .name()
        .unwrap_or_default()
        .to_string();
    if std::env::var(OWN_NS).is_ok_and(|t| t == test) {
        for m in crust_agent::sys::mountinfo::read().unwrap_or_default() {
            if m.source.starts_with("/dev/loop") {
                let _ = rustix::mount::unmount(&m.mount_point, rustix::mount::UnmountFlags::DETACH);
            }
        }
        return true;
    }
    let have = Command::new("unshare")
        .arg("--help")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        cannot_run(
            &test,
            "needs unshare (util-linux) for a mount namespace of its own",
        );
        return false;
    }
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", &test, "--nocapture", "--test-threads=1"])
        .env(OWN_NS, &test)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} failed in its own mount namespace:\n{text}"
    );
    eprintln!("{test} passed in its own mount namespace");
    false
}

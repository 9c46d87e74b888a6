//! Who may talk to the agent over vsock: by default only the host (CID 2).
//! Two guests share one vhost-device-vsock (its sibling-VM forwarding, one
//! group), so the second guest's agent can reach the first one's port 2857 (the default):
//! it is told to announce its readiness there (`crust.notify=vsock-stream:
//! 3:2857`), which makes it connect as peer CID 4. The first agent must
//! refuse that connection at accept and say so on its console; with
//! `crust.vsock_peers=host,4` it must take it.
//! Run with `make test-vm` (ignored by a plain `cargo test`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crust_protocols::crust::GetAgentInfoRequest;
use crust_testkit::vm::options;
use crust_vm::{ctx, Vm};

/// A vhost-device-vsock serving guests 3 (`a/`) and 4 (`b/`) in one group.
struct Backend {
    child: Child,
    a: PathBuf,
    b: PathBuf,
}

impl Backend {
    fn start(work: &Path) -> Backend {
        let (a, b) = (work.join("a"), work.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let bin = std::env::var_os("CRUST_VHOST_DEVICE_VSOCK")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("vhost-device-vsock"));
        let vm = |cid: u32, d: &Path| {
            format!(
                "guest-cid={cid},socket={},uds-path={}",
                d.join("vhost.sock").display(),
                d.join("vsock.sock").display()
            )
        };
        let log = std::fs::File::create(work.join("vhost.log")).unwrap();
        let child = Command::new(bin)
            .arg("--vm")
            .arg(vm(3, &a))
            .arg("--vm")
            .arg(vm(4, &b))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("vhost-device-vsock (make deps)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(a.join("vhost.sock").exists() && b.join("vhost.sock").exists()) {
            assert!(Instant::now() < deadline, "the backend made no sockets");
            std::thread::sleep(Duration::from_millis(20));
        }
        Backend { child, a, b }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn guest(dir: &Path, cid: u32, append: &str, notify: bool) -> Vm {
    let mut o = options(dir);
    o.vhost_socket = Some(dir.join("vhost.sock"));
    o.cid = cid;
    o.notify = notify;
    o.append = append.into();
    Vm::up(o).unwrap_or_else(|e| panic!("guest {cid} boots: {e}"))
}

/// Waits up to 60 s for `pred` on guest `vm`'s console; returns the console.
fn console_until(vm: &Vm, pred: impl Fn(&str) -> bool) -> (bool, String) {
    match crust_testkit::vm::console_until(vm, Duration::from_secs(60), pred) {
        Ok(text) => (true, text),
        Err(text) => (false, text),
    }
}

/// Guest 3 with `append`, then guest 4, whose agent connects to guest 3's
/// agent; returns guest 3's console once guest 4's attempt shows there.
fn sibling_connects(append: &str, shows: impl Fn(&str) -> bool) -> (bool, String) {
    let tmp = tempfile::tempdir().unwrap();
    let be = Backend::start(tmp.path());
    let mut a = guest(&be.a, 3, append, true);
    let mut b = guest(&be.b, 4, "crust.notify=vsock-stream:3:2857", false);
    let (ok, console) = console_until(&a, shows);
    // Whatever a sibling did, the host still gets answers.
    a.agent()
        .unwrap()
        .get_agent_info(ctx(Duration::from_secs(10)), &GetAgentInfoRequest::new())
        .expect("guest 3's agent still answers the host");
    b.down().unwrap();
    a.down().unwrap();
    // Down leaves a shared backend's sockets alone: it serves other guests.
    assert!(be.a.join("vsock.sock").exists() && be.b.join("vhost.sock").exists());
    (ok, console)
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn another_guest_is_refused_by_default_and_taken_when_listed() {
    let refused = |t: &str| {
        t.lines().any(|l| {
            l.contains("connection refused: this vsock peer may not talk to the agent")
                && l.contains("peer=\"cid 4 ")
        })
    };
    let opened = |t: &str| {
        t.lines().any(|l| {
            l.contains("connection from a vsock peer other than the host")
                && l.contains("peer=\"cid 4 ")
        })
    };
    let (ok, console) = sibling_connects("", refused);
    assert!(ok, "guest 3 did not refuse guest 4:\n{console}");
    // Refused at accept: no connection was opened for it.
    assert!(!opened(&console), "{console}");

    let (ok, console) = sibling_connects("crust.vsock_peers=host,4", opened);
    assert!(ok, "guest 3 did not take guest 4's connection:\n{console}");
    assert!(!refused(&console), "{console}");
}

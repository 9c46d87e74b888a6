//! Whose monitor crustd plugs a disk through. Kata's sandboxes, found from
//! Kata's files (`--kata-runtime-dir`), laid out as someone who writes in
//! Kata's runtime directory would lay them out to send sandbox B's disk into
//! sandbox A's VM: a link for B's VM directory, for B's state directory, for
//! the monitor, a hard link of A's monitor or of A's `persist.json`, a copy
//! of A's `persist.json`, A's socket moved to B's path once A's pid is B's
//! QEMU's, a `persist.json` naming another process, none at all, links
//! among Kata's own directories. Each is refused with nothing plugged in
//! any fake QEMU and nothing asked of any agent; A's own disk still
//! publishes. And a `sandbox.json` that records `qemu_pid` is held to it on
//! every call. crustd as a process, its QEMUs fakes served by this test
//! process, each with a stand-in hypervisor process as the listener the
//! kernel names (its command line `-name sandbox-<id>`, as Kata starts its
//! QEMU); another VM's hypervisor a process of its own. Needs root (loop
//! devices, and `/proc/sys/kernel/ns_last_pid` to have a pid taken again),
//! and Linux 6.5 or later (`SO_PEERPIDFD`) for the pid taken again.

mod fakes;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};

use crust_protocols::ttrpc;
use crust_testkit::crustd::{code, req, Crustd};
use crust_testkit::LoopDisk;

/// Another VM's hypervisor: a process of its own, killed when dropped.
struct Hypervisor(Child);

impl Hypervisor {
    fn start() -> Hypervisor {
        Hypervisor(Command::new("sleep").arg("600").spawn().unwrap())
    }
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Hypervisor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Kata's runtime directory as Kata's Go runtime lays it out.
struct Kata {
    run: PathBuf,
}

impl Kata {
    fn sbs(&self, id: &str) -> PathBuf {
        self.run.join("sbs").join(id)
    }
    fn vm(&self, id: &str) -> PathBuf {
        self.run.join("vm").join(id)
    }
    fn monitor(&self, id: &str) -> PathBuf {
        self.vm(id).join("extra-monitor.sock")
    }

    /// `sbs/<id>/persist.json` (0600 in a 0700 directory) naming the agent
    /// behind the hybrid vsock `agent` and `pid` as HypervisorState.Pid.
    fn persist(&self, id: &str, pid: u32, agent: &Path) {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.sbs(id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let text = serde_json::json!({
            "PersistVersion": 2,
            "State": "running",
            "HypervisorState": {"Pid": pid, "Type": "qemu"},
            "AgentState": {"URL": format!("hvsock://{}:1024", agent.display())},
        });
        std::fs::write(dir.join("persist.json"), text.to_string()).unwrap();
        std::fs::set_permissions(
            dir.join("persist.json"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
    }

    /// `vm/<id>/` made, for a monitor or a link to one.
    fn vm_dir(&self, id: &str) -> PathBuf {
        std::fs::create_dir_all(self.vm(id)).unwrap();
        self.vm(id)
    }
}

/// A node as the Kata tests lay it out: loop devices (needed), a
/// registry, Kata's runtime directory `run/vc` with `vm/a` made for A's
/// monitor, and the one fake agent, behind a hybrid vsock, that every
/// sandbox's `persist.json` names.
struct Node {
    agent_sock: PathBuf,
    agent: Arc<Mutex<fakes::AgentState>>,
    _server: ttrpc::Server,
    kata: Kata,
    reg: PathBuf,
    t: tempfile::TempDir,
}

impl Node {
    fn new() -> Node {
        let (t, reg, []) = fakes::sandboxes([]);
        std::fs::create_dir_all(&reg).unwrap();
        let kata = Kata {
            run: t.path().join("run/vc"),
        };
        let agent_sock = t.path().join("a-vsock.sock");
        let (agent, _server) = fakes::hvsock_agent(&agent_sock);
        kata.vm_dir("a");
        Node {
            agent_sock,
            agent,
            _server,
            kata,
            reg,
            t,
        }
    }

    /// Sandbox A: its QEMU served here at its monitor, its stand-in
    /// hypervisor (`-name sandbox-a`) recorded in its `persist.json`.
    fn sandbox_a(&self) -> (fakes::Qemu, fakes::Hypervisor) {
        let (qemu, vmm) = fakes::qemu_of(&self.kata.monitor("a"), "sandbox-a");
        self.kata.persist("a", vmm.pid(), &self.agent_sock);
        (qemu, vmm)
    }

    /// crustd serving the registry, finding Kata's sandboxes in `run/vc`.
    fn crustd(&self) -> Crustd {
        let run = self.kata.run.display().to_string();
        Crustd::start(&self.reg, &["--kata-runtime-dir", &run])
    }
}

fn plugged(q: &fakes::Qemu) -> Vec<String> {
    q.lock()
        .unwrap()
        .log
        .iter()
        .filter(|l| l.starts_with("blockdev-add") || l.starts_with("device_add"))
        .cloned()
        .collect()
}

/// Sandbox A (its QEMU served here, its stand-in hypervisor `-name
/// sandbox-a` recorded as its pid) and one B for each way to point B at A's
/// monitor: each B refused, nothing plugged anywhere, no agent asked; A's
/// own refused while its monitor has other names, then published; and an
/// unpublish refused while A's record names another process, each call
/// proving anew.
#[test]
#[ignore = "needs root: make test runs it"]
fn no_link_in_katas_files_sends_a_disk_into_another_vm() {
    let n = Node::new();
    let me = std::process::id();
    let b_vmm = Hypervisor::start();
    let other = b_vmm.pid();
    let (qemu_a, a_vmm) = n.sandbox_a();
    let a_pid = a_vmm.pid();

    // vm/b-vm-link is a link to vm/a: the monitor is A's, by a path whose
    // last component is a socket (once not refused).
    n.kata.persist("b-vm-link", other, &n.agent_sock);
    std::os::unix::fs::symlink(n.kata.vm("a"), n.kata.vm("b-vm-link")).unwrap();
    // sbs/b-sbs-link is a link to sbs/a (whose state names A's pid), and
    // B's monitor a hard link of A's.
    std::os::unix::fs::symlink(n.kata.sbs("a"), n.kata.sbs("b-sbs-link")).unwrap();
    n.kata.vm_dir("b-sbs-link");
    std::fs::hard_link(n.kata.monitor("a"), n.kata.monitor("b-sbs-link")).unwrap();
    // B's monitor a link to A's.
    n.kata.persist("b-sock-link", other, &n.agent_sock);
    n.kata.vm_dir("b-sock-link");
    std::os::unix::fs::symlink(n.kata.monitor("a"), n.kata.monitor("b-sock-link")).unwrap();
    // B's monitor a hard link of A's: the same socket, served by A's QEMU,
    // while Kata recorded B's own QEMU.
    n.kata.persist("b-hard-link", other, &n.agent_sock);
    n.kata.vm_dir("b-hard-link");
    std::fs::hard_link(n.kata.monitor("a"), n.kata.monitor("b-hard-link")).unwrap();
    // B's own monitor, and a persist.json naming another process.
    n.kata.persist("b-wrong-pid", other, &n.agent_sock);
    n.kata.vm_dir("b-wrong-pid");
    let qemu_wrong = fakes::qemu(&n.kata.monitor("b-wrong-pid"));
    // B's own monitor, and no hypervisor recorded (Kata writes 0 while its
    // QEMU does not run).
    n.kata.persist("b-no-pid", 0, &n.agent_sock);
    n.kata.vm_dir("b-no-pid");
    let qemu_none = fakes::qemu(&n.kata.monitor("b-no-pid"));

    let disk = LoopDisk::new(32, None);
    let dev = disk.path();
    let d = n.crustd();
    let k = d.client();
    let not_followed = "a symbolic link lies on its path";
    let proved = format!("served by process {me}, not by process {other}");
    for (id, want, says) in [
        ("b-vm-link", "FAILED_PRECONDITION", not_followed),
        ("b-sbs-link", "NOT_FOUND", "no sandbox b-sbs-link"),
        ("b-sock-link", "FAILED_PRECONDITION", not_followed),
        ("b-hard-link", "FAILED_PRECONDITION", "it has 3 names"),
        ("b-wrong-pid", "FAILED_PRECONDITION", proved.as_str()),
        (
            "b-no-pid",
            "FAILED_PRECONDITION",
            "recorded no hypervisor process",
        ),
        // A's own monitor, while it has other names than A's.
        ("a", "FAILED_PRECONDITION", "it has 3 names"),
    ] {
        let (c, m) = code(k.publish(req(id, &dev, "ext4")));
        assert_eq!(c, want, "{id}: {m}");
        assert!(m.contains(says), "{id}: {m}");
        for q in [&qemu_a, &qemu_wrong, &qemu_none] {
            assert!(plugged(q).is_empty(), "{id}: {:?}", plugged(q));
        }
        assert!(n.agent.lock().unwrap().log.is_empty(), "{id}");
        let st = std::fs::read_to_string(n.reg.join(id).join("crustd.json")).unwrap_or_default();
        assert!(!st.contains(&dev), "{id}: {st}");
    }
    assert!(code(k.publish(req("b-wrong-pid", &dev, "ext4")))
        .1
        .contains("HypervisorState.Pid"));

    // A's own, its other names gone: its recorded, named QEMU serves it.
    for id in ["b-sbs-link", "b-hard-link"] {
        std::fs::remove_file(n.kata.monitor(id)).unwrap();
    }
    k.publish(req("a", &dev, "ext4")).unwrap();
    assert_eq!(plugged(&qemu_a).len(), 2, "{:?}", plugged(&qemu_a));
    assert_eq!(n.agent.lock().unwrap().log.len(), 1);

    // Each call proves its monitor again: A's record now naming another
    // process, Unpublish is refused before the guest is asked to let go.
    n.kata.persist("a", other, &n.agent_sock);
    let (c, m) = code(k.unpublish("a", &dev));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(
        m.contains(&format!(
            "served by process {a_pid}, not by process {other}"
        )),
        "{m}"
    );
    assert_eq!(
        n.agent.lock().unwrap().log.len(),
        1,
        "the agent was not asked"
    );
    assert!(!qemu_a
        .lock()
        .unwrap()
        .log
        .iter()
        .any(|l| l.starts_with("device_del")));
    n.kata.persist("a", a_pid, &n.agent_sock);
    k.unpublish("a", &dev).unwrap();
    assert!(qemu_a.lock().unwrap().devices.is_empty());
}

/// Links among Kata's own directories beneath the runtime directory (`vm`,
/// `sbs`) are not followed; the runtime directory itself, the operator's,
/// may be reached through one.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_link_among_katas_directories_is_not_followed() {
    let n = Node::new();
    let (qemu, a_vmm) = n.sandbox_a();
    // `vm` a link to the real one; `sbs` its own.
    let vm_linked = Kata {
        run: n.t.path().join("vm-linked"),
    };
    vm_linked.persist("a", a_vmm.pid(), &n.agent_sock);
    std::os::unix::fs::symlink(n.kata.run.join("vm"), vm_linked.run.join("vm")).unwrap();
    // Both `sbs` and `vm` links to the real ones.
    let all_linked = n.t.path().join("all-linked");
    std::fs::create_dir_all(&all_linked).unwrap();
    for d in ["sbs", "vm"] {
        std::os::unix::fs::symlink(n.kata.run.join(d), all_linked.join(d)).unwrap();
    }
    let disk = LoopDisk::new(32, None);
    let dev = disk.path();
    for (run, want) in [
        (vm_linked.run.clone(), "FAILED_PRECONDITION"),
        (all_linked, "NOT_FOUND"),
    ] {
        let d = Crustd::start(&n.reg, &["--kata-runtime-dir", run.to_str().unwrap()]);
        let (c, m) = code(d.client().publish(req("a", &dev, "ext4")));
        assert_eq!(c, want, "{}: {m}", run.display());
        assert!(plugged(&qemu).is_empty(), "{:?}", plugged(&qemu));
        assert!(n.agent.lock().unwrap().log.is_empty());
        drop(d);
        let _ = std::fs::remove_dir_all(n.reg.join("a"));
    }
    let op = n.t.path().join("operators-link");
    std::os::unix::fs::symlink(&n.kata.run, &op).unwrap();
    let d = Crustd::start(&n.reg, &["--kata-runtime-dir", op.to_str().unwrap()]);
    let k = d.client();
    k.publish(req("a", &dev, "ext4")).unwrap();
    assert_eq!(plugged(&qemu).len(), 2);
    k.unpublish("a", &dev).unwrap();
}

/// A `sandbox.json` that records `qemu_pid`: the monitor's process must be
/// it, on every call; one that records none is taken as before.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_sandbox_json_that_records_qemu_pid_is_held_to_it() {
    let (_t, _reg, sb, disk, d) = fakes::pod_a(32, &[]);
    let me = std::process::id();
    let other_vmm = Hypervisor::start();
    let other = other_vmm.pid();
    let entry = |pid: Option<u32>| {
        let mut e = serde_json::json!({
            "qmp": sb.dir.join("qmp.sock"),
            "agent": format!("unix://{}", sb.dir.join("agent.sock").display()),
        });
        if let Some(p) = pid {
            e["qemu_pid"] = p.into();
        }
        std::fs::write(sb.dir.join("sandbox.json"), e.to_string()).unwrap();
    };
    let dev = disk.path();
    let k = d.client();

    entry(Some(other));
    let (c, m) = code(k.publish(req("pod-a", &dev, "ext4")));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(
        m.contains(&format!("served by process {me}, not by process {other}"))
            && m.contains("qemu_pid in")
            && m.contains("pod-a/sandbox.json"),
        "{m}"
    );
    assert!(plugged(&sb.qemu).is_empty());
    assert!(sb.agent.lock().unwrap().log.is_empty());

    entry(Some(me));
    k.publish(req("pod-a", &dev, "ext4")).unwrap();
    assert_eq!(plugged(&sb.qemu).len(), 2);

    entry(Some(other));
    let (c, m) = code(k.unpublish("pod-a", &dev));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(!sb.agent_was_asked("unpublish"));
    assert_eq!(sb.qemu.lock().unwrap().devices.len(), 1);

    // No qemu_pid: whoever listens is taken, as before the key existed.
    entry(None);
    k.unpublish("pod-a", &dev).unwrap();
    assert!(sb.qemu.lock().unwrap().devices.is_empty());
}

/// The record's pid is bound to the sandbox by the process's own command
/// line, and a Kata file with a second name is no sandbox's: B's
/// `persist.json` a hard link of A's (a regular file, no symbolic link on
/// the way) with B's monitor a hard link of A's socket is refused; so is a
/// plain copy of A's `persist.json` with A's socket moved to B's path (no
/// link at all: A's own QEMU, alive, serves it, and its command line names
/// sandbox a). Nothing is plugged into A's VM, nothing recorded for B.
#[test]
#[ignore = "needs root: make test runs it"]
fn hard_links_of_both_katas_files_never_send_a_disk_into_another_vm() {
    let n = Node::new();
    let (qemu_a, a_vmm) = n.sandbox_a();
    std::fs::create_dir_all(n.kata.sbs("b")).unwrap();
    std::fs::hard_link(
        n.kata.sbs("a").join("persist.json"),
        n.kata.sbs("b").join("persist.json"),
    )
    .unwrap();
    n.kata.vm_dir("b");
    std::fs::hard_link(n.kata.monitor("a"), n.kata.monitor("b")).unwrap();

    let disk = LoopDisk::new(32, None);
    let dev = disk.path();
    let d = n.crustd();
    let k = d.client();
    let refused = |id: &str, says: &str| {
        let (c, m) = code(k.publish(req(id, &dev, "ext4")));
        assert_eq!(c, "FAILED_PRECONDITION", "{id}: {m}");
        assert!(m.contains(says), "{id}: {m}");
        let into_a = plugged(&qemu_a);
        assert!(
            into_a.is_empty(),
            "{id}'s disk went into A's VM: {into_a:?}"
        );
        assert!(n.agent.lock().unwrap().log.is_empty(), "{id}");
        let st = std::fs::read_to_string(n.reg.join(id).join("crustd.json")).unwrap_or_default();
        assert!(!st.contains(&dev), "{id}: {st}");
    };
    refused("b", "it has 2 names");

    // A copy instead of a link, and A's socket moved to B's path.
    std::fs::remove_file(n.kata.sbs("b").join("persist.json")).unwrap();
    std::fs::copy(
        n.kata.sbs("a").join("persist.json"),
        n.kata.sbs("b").join("persist.json"),
    )
    .unwrap();
    std::fs::remove_file(n.kata.monitor("b")).unwrap();
    std::fs::rename(n.kata.monitor("a"), n.kata.monitor("b")).unwrap();
    refused(
        "b",
        &format!(
            "process {}, which serves the QMP socket {}, is not sandbox b's QEMU: Kata starts that with -name sandbox-b, and its command line has -name sandbox-a",
            a_vmm.pid(),
            n.kata.monitor("b").display()
        ),
    );

    // Moved back, A's own disk goes into A's VM.
    std::fs::rename(n.kata.monitor("b"), n.kata.monitor("a")).unwrap();
    k.publish(req("a", &dev, "ext4")).unwrap();
    assert_eq!(plugged(&qemu_a).len(), 2);
    k.unpublish("a", &dev).unwrap();
}

/// A fake QEMU at `path` whose hypervisor, named sandbox a, listened there
/// and exited, and the hypervisor that took its pid afterwards, named
/// `name`. The kernel hands out the pid after
/// `/proc/sys/kernel/ns_last_pid`; when another process on the machine
/// takes the freed pid first, all is made again with another.
fn a_qemu_whose_pid_is_taken_again(path: &Path, name: &str) -> (fakes::Qemu, fakes::Hypervisor) {
    for _ in 0..50 {
        let _ = std::fs::remove_file(path);
        let (q, mut a) = fakes::qemu_of(path, "sandbox-a");
        let pid = a.pid();
        a.exit();
        for _ in 0..10 {
            std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
            let b = fakes::Hypervisor::named(name);
            if b.pid() == pid {
                return (q, b);
            }
        }
    }
    panic!("no process could be given a pid freed a moment before");
}

/// A pid is proof only while its process lives: A's QEMU listened on its
/// monitor and exited, its socket served on by a process that shares it
/// (here, this test's fake); its pid is then B's QEMU's (named sandbox-b,
/// recorded in B's own `persist.json`), and A's socket is moved to B's
/// path. The listener's pid and the recorded one agree, and /proc/<pid>
/// shows sandbox b's QEMU, but the process that listened is gone: refused,
/// nothing plugged into A's VM. (Linux 6.5 or later: crustd holds the
/// listener itself, `SO_PEERPIDFD`; docs/crustd.md §7 says what an older
/// kernel leaves open.)
#[test]
#[ignore = "needs root: make test runs it"]
fn a_pid_taken_again_by_another_sandboxs_qemu_never_sends_a_disk_into_another_vm() {
    let n = Node::new();
    let (qemu_a, b_vmm) = a_qemu_whose_pid_is_taken_again(&n.kata.monitor("a"), "sandbox-b");
    let pid = b_vmm.pid();
    n.kata.persist("b", pid, &n.agent_sock);
    n.kata.vm_dir("b");
    std::fs::rename(n.kata.monitor("a"), n.kata.monitor("b")).unwrap();

    let disk = LoopDisk::new(32, None);
    let dev = disk.path();
    let d = n.crustd();
    let (c, m) = code(d.client().publish(req("b", &dev, "ext4")));
    let into_a = plugged(&qemu_a);
    assert!(
        c == "FAILED_PRECONDITION" && into_a.is_empty(),
        "sandbox b's disk went into sandbox a's VM: {c}: {m}, plugged there: {into_a:?}"
    );
    assert!(
        m.contains(&format!(
            "process {pid}, the hypervisor Kata recorded for sandbox b"
        )) && m.contains("has exited"),
        "{m}"
    );
    assert!(n.agent.lock().unwrap().log.is_empty());
}

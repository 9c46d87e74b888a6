//! What one sandbox does costs no other, and no path frees a
//! device a VM may still write. crustd as a process, driven by crustd-ctl's
//! client, against fake sandboxes whose QEMU opens each plugged device
//! read-write as QEMU does (tests/fakes), with loop devices as host
//! volumes. Needs root.

mod fakes;

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_kubelet::code_name;
use crust_testkit::crustd::{code, req, state, Crustd};
use crust_testkit::LoopDisk;
use fakes::OnPublish;

/// A call naming a sandbox whose sandbox.json is missing, or another
/// sandbox's publish of the same device, releases none of that sandbox's
/// claims and O_EXCL holds while the VM's QEMU still has the device open
/// read-write: were they released, the host could mount it and a second
/// sandbox publish it. Nothing frees a device a process still has open.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_missing_sandbox_json_frees_nothing_a_vm_still_writes() {
    let (_t, reg, [a, b]) = fakes::sandboxes(["pod-a", "pod-b"]);
    let disk = LoopDisk::new(32, Some("ext4"));
    let dev = disk.path();
    let mut d = Crustd::start(&reg, &["--qmp-timeout", "2"]);
    let k = d.client();
    k.publish(req("pod-a", &dev, "ext4")).unwrap();
    assert!(!disk.host_can_mount(&dev));

    // The runtime rewrites pod-a's entry (removed, not yet written again);
    // its VM runs on and has the disk open read-write.
    let entry = a.dir.join("sandbox.json");
    let saved = std::fs::read(&entry).unwrap();
    std::fs::remove_file(&entry).unwrap();
    let held = |k: &crust_kubelet::Kubelet| {
        // Calls naming pod-a answer NOT_FOUND and free nothing.
        assert_eq!(code(k.stats("pod-a", &dev)).0, "NOT_FOUND");
        assert_eq!(code(k.publish(req("pod-a", &dev, "ext4"))).0, "NOT_FOUND");
        assert_eq!(code(k.expand("pod-a", &dev, 0)).0, "NOT_FOUND");
        assert!(
            !disk.host_can_mount(&dev),
            "the host mounted a disk a VM writes"
        );
        // Another sandbox's publish: refused, naming the process that has it open.
        let (c, m) = code(k.publish(req("pod-b", &dev, "ext4")));
        assert_eq!(c, "FAILED_PRECONDITION", "{m}");
        assert!(m.contains("pod-a"), "{m}");
        assert!(
            m.contains(&format!("process {}", std::process::id())),
            "{m}"
        );
        assert!(b.qemu.lock().unwrap().log.is_empty(), "pod-b was plugged");
        // Unpublish in pod-a cannot ask the VM, and the VM still writes: refused, nothing changes.
        let (c, m) = code(k.unpublish("pod-a", &dev));
        assert_eq!(c, "FAILED_PRECONDITION", "{m}");
        assert!(m.contains("sandbox.json is missing"), "{m}");
        assert_eq!(state(&a.dir)["volumes"][&dev]["phase"], "published");
    };
    held(&k);
    // A restart while the entry is missing claims and holds the disk again.
    d.kill_and_restart();
    let k = d.client();
    held(&k);

    // The entry is back: Unpublish unplugs (the VM closes the disk) and frees it.
    std::fs::write(&entry, &saved).unwrap();
    k.unpublish("pod-a", &dev).unwrap();
    assert!(a.qemu.lock().unwrap().open.is_empty());
    k.publish(req("pod-b", &dev, "ext4")).unwrap();

    // A VM that is really gone (its process ended, its entry removed) holds
    // nothing: another sandbox's publish frees its volume and takes the disk.
    fakes::die(&b.qemu);
    std::fs::remove_file(b.dir.join("sandbox.json")).unwrap();
    k.publish(req("pod-a", &dev, "ext4")).unwrap();
    assert!(
        state(&b.dir)["volumes"].get(&dev).is_none(),
        "{}",
        state(&b.dir)
    );
    k.unpublish("pod-a", &dev).unwrap();
    assert!(disk.host_can_mount(&dev));
}

/// A hybrid vsock backend whose guest never answers CONNECT (hung, paused,
/// or a vhost-device-vsock that lost the VM's vsock): it accepts and reads,
/// and keeps every connection. Answers how many it was sent.
fn silent_backend(path: &Path) -> Arc<Mutex<Vec<std::os::unix::net::UnixStream>>> {
    let l = UnixListener::bind(path).unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let h = held.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            h.lock().unwrap().push(s);
        }
    });
    held
}

/// pod-hung: a live QEMU, an agent behind a vsock that never answers, and
/// a published volume recorded (its stats go to the agent).
struct HungSandbox {
    _qemu: fakes::Qemu,
    /// The CONNECTs the silent vsock backend was sent.
    sent: Arc<Mutex<Vec<std::os::unix::net::UnixStream>>>,
    /// The published volume's disk.
    disk: LoopDisk,
}

impl HungSandbox {
    fn lay_out(reg: &Path) -> HungSandbox {
        let hung_dir = reg.join("pod-hung");
        std::fs::create_dir_all(&hung_dir).unwrap();
        let qemu = fakes::qemu(&hung_dir.join("qmp.sock"));
        let sent = silent_backend(&hung_dir.join("vsock.sock"));
        std::fs::write(
            hung_dir.join("sandbox.json"),
            serde_json::json!({"qmp": "qmp.sock", "agent": format!("hvsock://{}:1024", hung_dir.join("vsock.sock").display())}).to_string(),
        )
        .unwrap();
        let disk = LoopDisk::new(16, None);
        let hv = disk.path();
        let rdev = {
            use std::os::unix::fs::MetadataExt;
            let r = std::fs::metadata(&hv).unwrap().rdev();
            format!("{}:{}", rustix::fs::major(r), rustix::fs::minor(r))
        };
        std::fs::write(
            hung_dir.join("crustd.json"),
            serde_json::json!({"volumes": {hv.clone(): {
                "volume_id": "crustd-0000000000000001", "serial": "cr-0000000000000001",
                "node": "crustd-0000000000000001", "device": "crustd-dev-0000000000000001",
                "rdev": rdev, "host_target_path": "/t", "guest_path": "/run/crust/volumes/crustd-0000000000000001",
                "file_system": "ext4", "read_only": false, "block": false, "phase": "published"}}})
            .to_string(),
        )
        .unwrap();
        HungSandbox {
            _qemu: qemu,
            sent,
            disk,
        }
    }
}

/// Node scale: were every agent call to a guest that never answers CONNECT
/// to park a stream without time limit, and crustd to keep systemd's soft
/// limit on open files, a few hundred failed calls would make every
/// sandbox's calls fail with "Too many open files". One hung sandbox's
/// calls hold a bounded few descriptors and threads,
/// and another sandbox's publishes, stats and unpublishes go on meanwhile.
#[test]
#[ignore = "needs root: make test runs it"]
fn one_hung_sandbox_costs_only_itself() {
    let (_t, reg, [ok]) = fakes::sandboxes(["pod-ok"]);
    let hung = HungSandbox::lay_out(&reg);
    let (sent, hv) = (&hung.sent, hung.disk.path());
    let disks: Vec<LoopDisk> = (0..3).map(|_| LoopDisk::new(16, None)).collect();
    // systemd's default soft limit is 1,024; this one is lower still.
    let d = Crustd::start(&reg, &["--agent-timeout", "1", "--soft-nofile=256"]);
    let baseline = d.open_files();

    // kubelet's periodic stats and retried publishes into pod-hung, from
    // many threads, for a while.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let codes = Arc::new(Mutex::new(
        std::collections::BTreeMap::<String, usize>::new(),
    ));
    let flood: Vec<_> = (0..24)
        .map(|i| {
            let (k, stop, codes, hv) = (d.client(), stop.clone(), codes.clone(), hv.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let r = if i % 3 == 0 {
                        k.publish_within(req("pod-hung", &hv, "ext4"), Duration::from_secs(2))
                            .map(|_| ())
                    } else {
                        k.stats_within("pod-hung", &hv, Duration::from_secs(2))
                            .map(|_| ())
                    };
                    let (c, m) = match r {
                        Ok(()) => ("OK".to_string(), String::new()),
                        Err(s) => (code_name(s.code()), s.message().to_string()),
                    };
                    assert!(!m.contains("Too many open files"), "{m}");
                    *codes.lock().unwrap().entry(c).or_default() += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));

    // Meanwhile pod-ok works, each call about as quick as alone.
    let k = d.client();
    let mut slowest = Duration::ZERO;
    for round in 0..3 {
        for disk in &disks {
            let t0 = Instant::now();
            k.publish_within(req("pod-ok", &disk.path(), "ext4"), Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("round {round}: {e:?}"));
            k.stats_within("pod-ok", &disk.path(), Duration::from_secs(10))
                .unwrap();
            k.unpublish_within("pod-ok", &disk.path(), Duration::from_secs(10))
                .unwrap();
            slowest = slowest.max(t0.elapsed());
        }
    }
    assert!(slowest < Duration::from_secs(5), "{slowest:?}");
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for f in flood {
        f.join().unwrap();
    }
    let codes = codes.lock().unwrap().clone();
    let calls: usize = codes.values().sum();
    assert!(calls >= 60, "{codes:?}");
    assert!(!codes.contains_key("OK"), "{codes:?}");
    // What pod-hung holds: a few descriptors, whatever the number of calls.
    let open = d.open_files();
    assert!(
        open < baseline + 40,
        "{open} files open after {calls} calls ({baseline} before)"
    );
    assert!(
        sent.lock().unwrap().len() <= 16,
        "{} CONNECTs sent to a guest that never answered",
        sent.lock().unwrap().len()
    );
    assert!(ok.qemu.lock().unwrap().devices.is_empty());
    let (soft, hard) = d.nofile();
    assert_eq!(
        soft, hard,
        "crustd raises its soft limit on open files to the hard one"
    );
}

/// crustd stores no guest path the agent answers unchecked: a 700 KB path
/// of control bytes would make a 4.2 MB crustd.json, which crustd then
/// refuses to read, so that every call for the sandbox, Unpublish
/// included, would be FAILED_PRECONDITION for the VM's life. The guest's
/// answers are checked and refused when wrong.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_hostile_guest_path_is_refused_and_the_sandbox_stays_usable() {
    let (_t, _reg, sb, disk, mut d) = fakes::pod_a(32, &[]);
    let other = LoopDisk::new(32, None);
    let (dev, dev2) = (disk.path(), other.path());
    let k = d.client();
    k.publish(req("pod-a", &dev2, "ext4")).unwrap();
    for hostile in [
        "\u{1}".repeat(700_000),
        "/etc/passwd".to_string(),
        "/run/crust/volumes/../../../etc".to_string(),
    ] {
        sb.agent.lock().unwrap().on_publish = OnPublish::Path(hostile);
        let (c, m) = code(k.publish(req("pod-a", &dev, "ext4")));
        assert_eq!(c, "FAILED_PRECONDITION", "{m}");
        assert!(m.contains("refuses") && m.len() < 1000, "{m}");
        // Undone, recorded nothing, and the state is small and readable.
        let st = std::fs::metadata(sb.dir.join("crustd.json")).unwrap().len();
        assert!(st < 4096, "{st}");
        assert!(state(&sb.dir)["volumes"].get(&dev).is_none());
        assert!(sb.qemu.lock().unwrap().open.len() == 1);
    }
    // The sandbox's calls all work, across a restart too.
    sb.agent.lock().unwrap().on_publish = OnPublish::Ok;
    d.kill_and_restart();
    let k = d.client();
    k.stats("pod-a", &dev2).unwrap();
    k.publish(req("pod-a", &dev, "ext4")).unwrap();
    k.unpublish("pod-a", &dev).unwrap();
    k.unpublish("pod-a", &dev2).unwrap();
    assert!(sb.qemu.lock().unwrap().open.is_empty());
}

/// A call's work that goes on after kubelet gave up is not run again by
/// the retry: a retry of a publish that outlived its caller publishes
/// in the guest once, joining the first.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_retry_joins_a_publish_that_outlived_its_caller() {
    let (_t, _reg, sb, disk, d) = fakes::pod_a(32, &[]);
    let dev = disk.path();
    let k = d.client();
    // QEMU is slow to open the disk: the caller gives up meanwhile.
    sb.qemu
        .lock()
        .unwrap()
        .delay
        .insert("blockdev-add".into(), Duration::from_secs(2));
    let (c, m) = code(k.publish_within(req("pod-a", &dev, "ext4"), Duration::from_secs(1)));
    assert!(
        matches!(c.as_str(), "DEADLINE_EXCEEDED" | "CANCELLED"),
        "{c}: {m}"
    );
    let r = k
        .publish_within(req("pod-a", &dev, "ext4"), Duration::from_secs(10))
        .unwrap();
    assert!(r.guest_path.ends_with(&format!(
        "volumes/{}",
        state(&sb.dir)["volumes"][&dev]["volume_id"]
            .as_str()
            .unwrap()
    )));
    assert_eq!(sb.agent.lock().unwrap().told.len(), 1, "published twice");
    let q = sb.qemu.lock().unwrap();
    assert_eq!(
        q.log.iter().filter(|l| l.starts_with("device_add")).count(),
        1
    );
}

/// A call waits for a busy volume's lock no longer than its caller's
/// deadline, and does no work once its caller is gone: here another publish (other
/// parameters) that gave up while the first ran leaves no trace.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_call_whose_caller_gave_up_while_it_waited_does_nothing() {
    let (_t, _reg, sb, disk, d) = fakes::pod_a(32, &[]);
    let dev = disk.path();
    sb.agent.lock().unwrap().on_publish = OnPublish::Slow(Duration::from_secs(2));
    let k = d.client();
    let first = {
        let (k, dev) = (d.client(), dev.clone());
        std::thread::spawn(move || k.publish(req("pod-a", &dev, "ext4")).unwrap())
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut ro = req("pod-a", &dev, "ext4");
    ro.read_only = true;
    let t0 = Instant::now();
    let (c, _) = code(k.publish_within(ro, Duration::from_millis(500)));
    assert!(
        matches!(c.as_str(), "DEADLINE_EXCEEDED" | "CANCELLED"),
        "{c}"
    );
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    first.join().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let log = sb.agent_log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(!log[0].ends_with(" ro"), "{log:?}");
}

/// While the guest is asked to let go of a disk (up to --unplug-timeout),
/// no lock of the sandbox is held, so that no other volume of the sandbox
/// waits.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_guest_slow_to_release_one_disk_stalls_no_other_volume() {
    let (_t, reg, [sb]) = fakes::sandboxes(["pod-a"]);
    let (one, two) = (LoopDisk::new(16, None), LoopDisk::new(16, None));
    let d = Crustd::start(&reg, &["--unplug-timeout", "6"]);
    let k = d.client();
    k.publish(req("pod-a", &one.path(), "ext4")).unwrap();
    sb.qemu.lock().unwrap().never_release = true;
    let leaving = {
        let (k, dev) = (d.client(), one.path());
        std::thread::spawn(move || code(k.unpublish("pod-a", &dev)))
    };
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    k.publish(req("pod-a", &two.path(), "ext4")).unwrap();
    k.stats("pod-a", &two.path()).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let (c, m) = leaving.join().unwrap();
    assert_eq!(c, "UNAVAILABLE", "{m}");
    assert!(m.contains("did not release"), "{m}");
    // Still recorded and held: the next unpublish finishes it once the guest lets go.
    assert_eq!(
        state(&sb.dir)["volumes"][&one.path()]["phase"],
        "unplugging"
    );
    sb.qemu.lock().unwrap().never_release = false;
    {
        let mut q = sb.qemu.lock().unwrap();
        q.devices.clear();
    }
    k.unpublish("pod-a", &one.path()).unwrap();
    k.unpublish("pod-a", &two.path()).unwrap();
}

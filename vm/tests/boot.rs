//! Boots the real guest (`make initrd` output) under QEMU and checks the
//! harness end to end: the agent answers as PID 1 with a boot timeline, disks
//! come and go over QMP, and `down` leaves no process behind.
//! Run with `make test-vm` (these tests are ignored by a plain `cargo test`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crust_protocols::crust::{GetAgentInfoRequest, GetCapabilitiesRequest};
use crust_testkit::vm::options as opts;
use crust_vm::{alive, ctx, Error, Readiness, Vm};
use serde_json::{json, Value};

/// The block node QEMU knows by `name`, if any.
fn node(vm: &Vm, name: &str) -> Option<Value> {
    let nodes = vm
        .qmp_execute("query-named-block-nodes", Some(json!({"flat": true})))
        .unwrap();
    nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node-name"] == name)
        .cloned()
}

fn gone(pid: u32, dir: &Path) -> bool {
    // Give the reaper a moment: a zombie counts as gone.
    for _ in 0..50 {
        if !alive(pid, dir) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn boot_info_hotplug_resize_unplug_down() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vm");
    let mut vm = Vm::up(opts(&dir)).expect("the VM boots and the agent answers");

    // Readiness was pushed: the agent announced READY over vsock, crust-vm
    // did not poll the guest while it booted.
    let (how, took) = vm.readiness().unwrap();
    assert_eq!(how, Readiness::Notified, "after {took:?}");
    let console = std::fs::read_to_string(vm.console_log()).unwrap();
    assert!(
        console.contains("readiness announced") && console.contains("vsock-stream:2:1025"),
        "{console}"
    );

    // The agent runs as the kernel's init and recorded its boot.
    let info = vm.boot_info().unwrap().clone();
    assert!(info.init_mode, "{info:?}");
    let kernel = std::fs::read_dir(crust_vm::default_build_dir().join("kernel/lib/modules"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    assert_eq!(info.kernel_release, kernel.to_string_lossy());
    // The agent listens once the vsock stack is in; the other modules (virtio_blk, xfs)
    // load after, so modules_loaded_ms is 0 until they are done, then later than listening.
    let mut b = info.boot.clone().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while b.modules_loaded_ms == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        b = vm
            .agent()
            .unwrap()
            .get_agent_info(ctx(Duration::from_secs(10)), &GetAgentInfoRequest::new())
            .unwrap()
            .boot
            .unwrap();
    }
    assert!(b.agent_start_ms > 0, "{b:?}");
    assert!(b.agent_start_ms <= b.mounts_done_ms, "{b:?}");
    assert!(b.mounts_done_ms <= b.listening_ms, "{b:?}");
    assert!(b.listening_ms <= b.modules_loaded_ms, "{b:?}");
    eprintln!(
        "boot timeline (ms since kernel start): agent {} mounts {} modules {} listening {}",
        b.agent_start_ms, b.mounts_done_ms, b.modules_loaded_ms, b.listening_ms
    );

    // A second connection works too, and another RPC.
    let agent = vm.agent().unwrap();
    let ctx = || crust_vm::ctx(Duration::from_secs(5));
    agent
        .get_capabilities(ctx(), &GetCapabilitiesRequest::new())
        .expect("GetCapabilities");
    let again = agent
        .get_agent_info(ctx(), &GetAgentInfoRequest::new())
        .unwrap();
    assert!(again.uptime_ms >= info.uptime_ms);

    // Hot-plug, grow, unplug; QEMU's view checked after each step.
    let img = tmp.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let serial = "vol-0123456789abcdef";
    vm.hotplug(&img, serial, false).unwrap();
    let (node_name, _) = crust_vm::disk_names(serial);
    let n = node(&vm, &node_name).expect("the node exists after hotplug");
    assert_eq!(n["image"]["virtual-size"], 64 << 20);
    assert_eq!(n["ro"], false);

    // Bad requests change nothing.
    assert!(matches!(
        vm.hotplug(&img, serial, false),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        vm.hotplug(&img, "bad serial", false),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(vm.resize(serial, 1 << 20), Err(Error::Invalid(_))));
    assert!(matches!(vm.resize("nope", 1 << 30), Err(Error::Invalid(_))));
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 64 << 20);

    vm.resize(serial, 128 << 20).unwrap();
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 128 << 20);
    assert_eq!(
        node(&vm, &node_name).unwrap()["image"]["virtual-size"],
        128 << 20
    );

    // Unplug completes only when the guest has ejected the device (DEVICE_DELETED).
    vm.unplug(serial).unwrap();
    assert!(node(&vm, &node_name).is_none());
    assert!(vm.disks().is_empty());

    // Read-only attach.
    vm.hotplug(&img, "ro-disk", true).unwrap();
    assert_eq!(node(&vm, "crust-ro-disk").unwrap()["ro"], true);
    vm.unplug("ro-disk").unwrap();

    let (qemu, vhost) = vm.pids();
    let how = vm.down().unwrap();
    assert!(how.starts_with("agent shut down"), "{how}");
    assert!(gone(qemu, vm.dir()) && gone(vhost, vm.dir()));
    assert!(!vm.vsock_path().exists());
    assert!(std::fs::read_to_string(vm.console_log())
        .unwrap()
        .contains("reboot: Power down"));
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn cli_up_in_background_and_down_from_another_process() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vm");
    let o = opts(&dir);
    let cli = env!("CARGO_BIN_EXE_crust-vm");
    let out = Command::new(cli)
        .arg("up")
        .arg("--dir")
        .arg(&dir)
        .arg("--kernel")
        .arg(&o.kernel)
        .arg("--initrd")
        .arg(&o.initrd)
        .args(["--append", "crust.log=debug"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let addr = String::from_utf8(out.stdout).unwrap();
    let dir = std::fs::canonicalize(&dir).unwrap();
    assert_eq!(
        addr.trim(),
        format!(
            "hvsock://{}/vsock.sock:{}",
            dir.display(),
            crust_protocols::DEFAULT_PORT
        )
    );

    // The processes outlived the CLI; a second `up` on the same dir is refused.
    let vm = Vm::attach(&dir).unwrap();
    let (qemu, vhost) = vm.pids();
    assert!(alive(qemu, &dir) && alive(vhost, &dir));
    let again = Command::new(cli)
        .arg("up")
        .arg("--dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already runs"));

    let img = tmp.path().join("d.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let run = |args: &[&str]| {
        let st = Command::new(cli)
            .args(args)
            .arg("--dir")
            .arg(&dir)
            .status()
            .unwrap();
        assert!(st.success(), "crust-vm {args:?}");
    };
    run(&[
        "hotplug",
        "--image",
        img.to_str().unwrap(),
        "--serial",
        "s1",
    ]);
    run(&["resize", "--serial", "s1", "--bytes", "67108864"]);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 64 << 20);
    run(&["unplug", "--serial", "s1"]);
    run(&["down"]);
    assert!(gone(qemu, &dir) && gone(vhost, &dir));
    // Down again: no state left, a clear error.
    let st = Command::new(cli)
        .arg("down")
        .arg("--dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!st.status.success());
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn dropping_a_vm_that_was_not_brought_down_kills_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vm");
    let vm = Vm::up(opts(&dir)).unwrap();
    let (qemu, vhost) = vm.pids();
    let dir = vm.dir().to_path_buf();
    drop(vm);
    assert!(gone(qemu, &dir) && gone(vhost, &dir));
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn ctrl_alt_del_reaches_pid1_as_an_orderly_shutdown() {
    let tmp = tempfile::tempdir().unwrap();
    let mut vm = Vm::up(opts(&tmp.path().join("vm"))).unwrap();
    // With Ctrl-Alt-Del turned into SIGINT for init, the agent's handler
    // powers off; without it the kernel would restart at once.
    let key = |k: &str| json!({"type": "qcode", "data": k});
    vm.qmp_execute(
        "send-key",
        Some(json!({"keys": [key("ctrl"), key("alt"), key("delete")]})),
    )
    .unwrap();
    assert!(
        vm.wait_powered_off(Duration::from_secs(20)),
        "QEMU still runs after Ctrl-Alt-Del"
    );
    let console = std::fs::read_to_string(vm.console_log()).unwrap();
    assert!(console.contains("reboot: Power down"), "{console}");
    assert!(!console.contains("Restarting system"), "{console}");
    let how = vm.down().unwrap();
    assert_eq!(how, "QEMU was not running");
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_hotplugged_disk_is_found_by_serial_grown_online_and_released() {
    use crust_protocols::crust::{
        ExpandVolumeRequest, GetVolumeStatsRequest, PublishVolumeRequest, UnpublishVolumeRequest,
        VolumeUsage,
    };
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("ext4.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&img)
        .status()
        .unwrap();
    assert!(mkfs.success());

    let mut vm = Vm::up(opts(&tmp.path().join("vm"))).unwrap();
    let agent = vm.agent().unwrap();
    let ctx = || crust_vm::ctx(Duration::from_secs(30));
    vm.hotplug(&img, "vol-e2e", false).unwrap();

    let mut req = PublishVolumeRequest::new();
    req.volume_id = "v1".into();
    req.set_serial("vol-e2e".into());
    req.fs_type = "ext4".into();
    let pubd = agent
        .publish_volume(ctx(), &req)
        .expect("the guest finds the disk by serial");
    assert!(pubd.device.starts_with("/dev/vd"), "{pubd:?}");

    let total = |agent: &crust_protocols::crust_ttrpc::AgentClient| {
        let mut r = GetVolumeStatsRequest::new();
        r.volume_id = "v1".into();
        let st = agent.get_volume_stats(ctx(), &r).unwrap();
        let bytes = st
            .usage
            .iter()
            .find(|u| {
                u.unit.enum_value_or_default() == crust_protocols::crust::volume_usage::Unit::BYTES
            })
            .map(|u: &VolumeUsage| u.total)
            .unwrap();
        bytes
    };
    let before = total(&agent);
    assert!(before > 40 << 20 && before <= 64 << 20, "{before}");

    // Grow on the host, then online in the guest (ext4 needs CAP_SYS_RESOURCE: the guest has it).
    vm.resize("vol-e2e", 128 << 20).unwrap();
    let mut ex = ExpandVolumeRequest::new();
    ex.volume_id = "v1".into();
    ex.required_bytes = 128 << 20;
    ex.timeout_ms = 10_000;
    let grown = agent
        .expand_volume(ctx(), &ex)
        .expect("online growth in the guest");
    assert_eq!(grown.device_bytes, 128 << 20);
    let after = total(&agent);
    assert!(after > before + (50 << 20), "{before} -> {after}");

    let mut un = UnpublishVolumeRequest::new();
    un.volume_id = "v1".into();
    assert!(agent.unpublish_volume(ctx(), &un).unwrap().was_published);
    vm.unplug("vol-e2e").unwrap();
    vm.down().unwrap();

    // The filesystem on the host image is clean and grown.
    let fsck = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
    );
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn planted_symlinks_in_the_vm_directory_change_nothing() {
    // Someone who can write in the VM's directory plants symlinks at every
    // name crust-vm writes (its temporaries included, under the names it
    // used to use), aimed at a file that must not change.
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let dir = tmp.path().join("vm");
    std::fs::create_dir(&dir).unwrap();
    let planted = [
        "state.json.tmp",
        "sandbox.json.tmp",
        "state.json",
        "sandbox.json",
        "vhost.log",
        "qemu.log",
        "console.log",
    ];
    for name in planted {
        std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
    }
    let mut vm = Vm::up(opts(&dir)).expect("the VM boots");
    let img = tmp.path().join("d.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    vm.hotplug(&img, "s1", false).unwrap(); // state.json is written again
    vm.unplug("s1").unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    for name in [
        "state.json",
        "sandbox.json",
        "vhost.log",
        "qemu.log",
        "console.log",
    ] {
        let md = std::fs::symlink_metadata(dir.join(name)).unwrap();
        assert!(
            md.file_type().is_file(),
            "{name} is not a file crust-vm made"
        );
    }
    let entry: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sandbox.json")).unwrap()).unwrap();
    assert_eq!(entry["agent"], vm.address());
    assert!(std::fs::read_to_string(vm.console_log())
        .unwrap()
        .contains("listening"));
    vm.down().unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn boots_under_cpu_io_and_memory_load() {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // Under load the guest's driver set-up, the backend and QEMU all run
    // late: the timing that made vhost-device-vsock drop its queues when the
    // host polled during boot. Readiness is pushed now, so every boot must
    // come up, by READY. (scripts/boot-under-load.sh does 20 under a cargo build.)
    let tmp = tempfile::tempdir().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..2 {
        let stop = stop.clone();
        load.push(std::thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                std::hint::black_box(x);
            }
        }));
    }
    {
        let (stop, path) = (stop.clone(), tmp.path().join("io"));
        load.push(std::thread::spawn(move || {
            let block = vec![7u8; 1 << 20];
            while !stop.load(Ordering::Relaxed) {
                let mut f = std::fs::File::create(&path).unwrap();
                for _ in 0..64 {
                    f.write_all(&block).unwrap();
                }
                f.sync_data().unwrap();
            }
        }));
    }
    {
        let stop = stop.clone();
        load.push(std::thread::spawn(move || {
            let mut mem = vec![0u8; 1 << 30];
            while !stop.load(Ordering::Relaxed) {
                for page in mem.chunks_mut(4096) {
                    page[0] = page[0].wrapping_add(1);
                }
            }
        }));
    }
    let mut times = Vec::new();
    for i in 0..3 {
        let mut vm = Vm::up(opts(&tmp.path().join(format!("vm{i}"))))
            .unwrap_or_else(|e| panic!("boot {i} under load: {e}"));
        let (how, took) = vm.readiness().unwrap();
        assert_eq!(how, Readiness::Notified, "boot {i}");
        times.push(took);
        vm.down().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    eprintln!("boots under load, QEMU start to READY: {times:?}");
}

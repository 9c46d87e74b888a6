//! The proof of crustd against a real sandbox: a VM started by crust-vm
//! (agent as PID 1 under QEMU), registered by `crust-vm up` writing its
//! sandbox.json, and crustd driven over its socket by the CRUST client that
//! crustd-ctl generates from the .proto (not crustd's code), with loop
//! devices on the host as host_volume_id: ext4 with fsGroup, xfs, growth end
//! to end, a crustd restart in the middle, unpublish (the disk leaves the
//! guest), and the filesystems checked on the host afterwards.
//! One VM for the whole walk (TCG is slow); a second for Kata's
//! direct-volume records. Run with `make test-vm`.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use crust_kubelet::{bytes, code_name, pb};
use crust_testkit::crustd::{ctl, kata, kata_writer, Crustd};
use crust_testkit::vm::options;
use crust_testkit::{allocated, run, LoopDisk, Mounted};
use crust_vm::Vm;

const SANDBOX: &str = "pod-vm-1";

fn req(dev: &str, fs: &str, gid: Option<i64>) -> pb::RuntimePublishVolumeRequest {
    pb::RuntimePublishVolumeRequest {
        sandbox_id: SANDBOX.into(),
        host_volume_id: dev.into(),
        host_target_path: format!("/var/lib/kubelet/pods/uid/volumes/{fs}"),
        file_system: fs.into(),
        mount_options: vec!["noatime".into()],
        fsgroup_gid: gid,
        fsgroup_policy: "Always".into(),
        ..Default::default()
    }
}

/// A loop device with a filesystem and files owned by 1234:1234, mode
/// 0700/0600, and the blocks of a 48 MiB file deleted on the host still
/// held by its image file (the host's mount does not discard).
fn volume(mib: u64, fs: &str) -> LoopDisk {
    let d = LoopDisk::new(mib, Some(fs));
    let m = Mounted::new(&d.device, fs, "");
    std::fs::write(m.path.join("big"), vec![0x5a; 48 << 20]).unwrap();
    run("sync", &[]);
    std::fs::remove_file(m.path.join("big")).unwrap();
    std::fs::create_dir_all(m.path.join("data/deep")).unwrap();
    for i in 0..20 {
        std::fs::write(m.path.join(format!("data/deep/f{i}")), format!("{i}")).unwrap();
    }
    run(
        "chown",
        &["-R", "1234:1234", m.path.join("data").to_str().unwrap()],
    );
    run(
        "chmod",
        &["-R", "go-rwx", m.path.join("data").to_str().unwrap()],
    );
    d
}

/// Whether the guest has a disk with `serial`: the agent waits 1 s for it.
fn guest_sees(vm: &Vm, serial: &str) -> bool {
    let c = vm.agent().unwrap();
    let mut r = crust_protocols::crust::PublishVolumeRequest::new();
    r.volume_id = "probe".into();
    r.set_serial(serial.into());
    r.fs_type = "ext4".into();
    r.timeout_ms = 1000;
    match c.publish_volume(crust_vm::ctx(Duration::from_secs(30)), &r) {
        Err(crust_protocols::ttrpc::Error::RpcStatus(s)) => {
            format!("{:?}", s.code()) != "DEADLINE_EXCEEDED"
        }
        _ => true,
    }
}

/// Block mode (volumeMode: Block): the raw device, hot-plugged and
/// published by the agent as a device, never mounted; unpublished, it
/// leaves the guest.
fn a_block_volume_is_published_as_its_device(k: &crust_kubelet::Kubelet, vm: &Vm) {
    let raw = LoopDisk::new(64, None);
    let mut b = req(&raw.path(), "", Some(4321));
    b.block = true;
    b.mount_options.clear();
    let pb_ = k.publish(b.clone()).unwrap();
    assert!(
        pb_.guest_path.starts_with("/run/crust/volumes/crustd-"),
        "{pb_:?}"
    );
    assert_eq!(k.publish(b).unwrap(), pb_, "idempotent");
    let (_, raw_total, _) = bytes(&k.stats(SANDBOX, &raw.path()).unwrap()).unwrap();
    assert_eq!(
        raw_total,
        64 << 20,
        "a block volume's total is its device's size"
    );
    let guest = vm
        .agent()
        .unwrap()
        .list_volumes(crust_vm::ctx(Duration::from_secs(30)), &Default::default())
        .unwrap();
    let raw_serial = guest
        .volumes
        .iter()
        .find(|v| v.volume_mode == crust_protocols::crust::VolumeMode::BLOCK.into())
        .expect("the guest lists a BLOCK volume")
        .serial
        .clone();
    k.unpublish(SANDBOX, &raw.path()).unwrap();
    assert!(
        !guest_sees(vm, &raw_serial),
        "the block disk is still in the guest"
    );
}

/// Growth end to end: the host grows the loop device, crustd resizes
/// QEMU's disk and has the agent grow ext4 online (its statfs total was
/// `total_before`).
fn grown_online(k: &crust_kubelet::Kubelet, ext4: &LoopDisk, total_before: i64) {
    let e = ext4.path();
    ext4.resize(512);
    let t0 = Instant::now();
    let cap = k.expand(SANDBOX, &e, 512 << 20).unwrap();
    eprintln!(
        "RuntimeExpandVolume ext4 128 -> 512 MiB: {:?}",
        t0.elapsed()
    );
    assert!(cap >= 500 << 20, "{cap}");
    let (_, e_total1, _) = bytes(&k.stats(SANDBOX, &e).unwrap()).unwrap();
    assert!(e_total1 > total_before * 3, "{total_before} -> {e_total1}");
    assert_eq!(
        code_name(k.expand(SANDBOX, &e, 1 << 30).unwrap_err().code()),
        "OUT_OF_RANGE"
    );
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn kubelet_through_crustd_into_a_real_guest() {
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let ext4 = volume(128, "ext4");
    let xfs = volume(320, "xfs");
    let (e, x) = (ext4.path(), xfs.path());

    let opts = options(&reg.join(SANDBOX));
    let mut vm = Vm::up(opts).expect("the VM boots and the agent answers");
    let entry: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(reg.join(SANDBOX).join("sandbox.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(entry["agent"], vm.address().as_str());
    // QEMU's own process, which crustd requires behind the monitor.
    assert_eq!(entry["qemu_pid"], vm.pids().0);

    let mut d = Crustd::start(&reg, &[]);
    let k = d.client();
    assert_eq!(k.file_systems().unwrap().file_systems, ["ext4", "xfs"]);

    // ext4 with fsGroup: hot-plug + publish, end to end.
    let t0 = Instant::now();
    let pe = k.publish(req(&e, "ext4", Some(4321))).unwrap();
    eprintln!(
        "RuntimePublishVolume ext4 (hot-plug + mount + fsGroup): {:?}",
        t0.elapsed()
    );
    assert!(
        pe.guest_path.starts_with("/run/crust/volumes/crustd-"),
        "{pe:?}"
    );
    // Held exclusively while QEMU has it open (QEMU opens without O_EXCL):
    // the host cannot mount it behind the guest.
    assert!(!host_mounts(&ext4), "the host mounted a published disk");
    // xfs, no fsGroup.
    let px = k.publish(req(&x, "xfs", None)).unwrap();
    assert_ne!(pe.guest_path, px.guest_path);
    consistent_snapshot_and_trim(&k, &ext4, &xfs, t.path());

    // The guest has both, as the agent reports them.
    let list = vm
        .agent()
        .unwrap()
        .list_volumes(crust_vm::ctx(Duration::from_secs(30)), &Default::default())
        .unwrap();
    let mut fss: Vec<&str> = list.volumes.iter().map(|v| v.fs_type.as_str()).collect();
    fss.sort();
    assert_eq!(fss, ["ext4", "xfs"]);
    let xfs_serial = list
        .volumes
        .iter()
        .find(|v| v.fs_type == "xfs")
        .unwrap()
        .serial
        .clone();

    a_block_volume_is_published_as_its_device(&k, &vm);

    let (_, e_total0, _) = bytes(&k.stats(SANDBOX, &e).unwrap()).unwrap();
    let sx = k.stats(SANDBOX, &x).unwrap();
    assert!(!sx.volume_condition.unwrap().abnormal);

    // crustd restarted in the middle: the next calls carry on, nothing plugged twice.
    d.kill_and_restart();
    assert!(
        !host_mounts(&ext4),
        "the host mounted a published disk after a crustd restart"
    );
    let k = d.client();
    assert_eq!(k.publish(req(&e, "ext4", Some(4321))).unwrap(), pe);

    grown_online(&k, &ext4, e_total0);

    // Unpublish xfs: the disk leaves the guest.
    assert!(guest_sees(&vm, &xfs_serial));
    k.unpublish(SANDBOX, &x).unwrap();
    assert!(
        !guest_sees(&vm, &xfs_serial),
        "the xfs disk is still in the guest"
    );
    assert_eq!(
        code_name(k.stats(SANDBOX, &x).unwrap_err().code()),
        "NOT_FOUND"
    );
    k.unpublish(SANDBOX, &x).unwrap();

    // Another restart, then the ext4 volume goes too.
    d.kill_and_restart();
    let k = d.client();
    k.unpublish(SANDBOX, &e).unwrap();
    let state = std::fs::read_to_string(reg.join(SANDBOX).join("crustd.json")).unwrap();
    assert!(state.contains("\"volumes\": {}"), "{state}");
    drop(d);
    vm.down().unwrap();

    // On the host: clean, grown, owned by the pod's group.
    run("e2fsck", &["-f", "-n", &e]);
    run("xfs_repair", &["-n", &x]);
    let m = Mounted::new(&ext4.device, "ext4", "ro");
    let md = std::fs::metadata(m.path.join("data/deep/f3")).unwrap();
    assert_eq!(md.gid(), 4321);
    assert_eq!(
        md.mode() & 0o070,
        0o060,
        "group rw from fsGroup: {:o}",
        md.mode()
    );
    let sv = df_bytes(&m.path);
    assert!(sv > 400 << 20, "{sv}");
}

/// The way a backup tool takes a consistent snapshot through crustd:
/// freeze both volumes (their journals hold the fsGroup walk's changes),
/// copy the images on the host, thaw; the copies need no journal replay
/// (xfs: only the covering records every xfs freeze leaves, semantics.md
/// §10) and hold the walk's changes. Then a trim through crustd punches the
/// blocks deleted on the host out of the image (discard=unmap).
fn consistent_snapshot_and_trim(
    k: &crust_kubelet::Kubelet,
    ext4: &LoopDisk,
    xfs: &LoopDisk,
    dir: &std::path::Path,
) {
    let pair = [
        (SANDBOX.to_string(), ext4.path()),
        (SANDBOX.to_string(), xfs.path()),
    ];
    let f = k.freeze(&pair, 60_000, None).unwrap();
    let copies = [
        (dir.join("ext4.snap"), &ext4.image, "ext4"),
        (dir.join("xfs.snap"), &xfs.image, "xfs"),
    ];
    for (copy, img, _) in &copies {
        std::fs::copy(img, copy).unwrap();
    }
    k.thaw(&f.freeze_id).unwrap();
    for (copy, _, fs) in &copies {
        let p = copy.to_str().unwrap();
        if *fs == "ext4" {
            let h = run("dumpe2fs", &["-h", p]);
            let features = h
                .lines()
                .find(|l| l.starts_with("Filesystem features"))
                .unwrap();
            assert!(!features.contains("needs_recovery"), "{f:?}: {features}");
            run("e2fsck", &["-f", "-n", p]);
        } else {
            let m = dir.join("replay");
            std::fs::create_dir_all(&m).unwrap();
            run("mount", &["-o", "loop,nouuid", p, m.to_str().unwrap()]);
            run("umount", &[m.to_str().unwrap()]);
            run("xfs_repair", &["-n", "-f", p]);
        }
        if *fs == "ext4" {
            let m = dir.join("snapcheck");
            std::fs::create_dir_all(&m).unwrap();
            run("mount", &["-o", "loop,ro,noload", p, m.to_str().unwrap()]);
            let gid = std::fs::metadata(m.join("data/deep/f3")).map(|md| md.gid());
            run("umount", &[m.to_str().unwrap()]);
            assert_eq!(gid.unwrap(), 4321, "the walk's change is in the snapshot");
        }
    }
    let before = allocated(&ext4.image);
    let trimmed = k.trim(SANDBOX, &ext4.path(), 0).unwrap();
    let after = allocated(&ext4.image);
    assert!(
        before.saturating_sub(after) >= 40 << 20,
        "the image holds {before} then {after} bytes after a trim of {trimmed} bytes"
    );
    assert!(k.health(SANDBOX, &ext4.path()).unwrap().is_empty());
}

/// Whether the host can mount `disk` now (read-only, no journal replay, so
/// a failed hold writes nothing); unmounts it again.
fn host_mounts(disk: &LoopDisk) -> bool {
    let at = disk.scratch("host");
    let ok = std::process::Command::new("mount")
        .args(["-t", "ext4", "-o", "ro,noload", &disk.path()])
        .arg(&at)
        .output()
        .unwrap()
        .status
        .success();
    if ok {
        run("umount", &[at.to_str().unwrap()]);
    }
    ok
}

fn df_bytes(p: &std::path::Path) -> u64 {
    let out = run("df", &["-B1", "--output=size", p.to_str().unwrap()]);
    out.lines().nth(1).unwrap().trim().parse().unwrap()
}

/// A direct-assigned volume as a CSI driver hands it to Kata today, in a
/// real guest: a record written by Go's encoders exactly as Kata's package
/// writes it (tests/kata_writer), RuntimePublishDirectVolume (fsGroup and
/// options from the record; a SELinux context option the guest has no use
/// for left out), `crustd-ctl direct-volume stats` and `resize`, a blank
/// scratch disk formatted on the host by createFilesystem, unpublish, and
/// the filesystems clean on the host after.
/// `kata-runtime direct-volume add`, as Kata's own code files them: `vol`
/// on the ext4 disk `e` (an fsGroup, an option, an SELinux label the guest
/// leaves out), `scratch` on the blank disk `b`, to be formatted.
fn filed_as_kata_files_them(
    writer: &std::path::Path,
    r: &str,
    vol: &str,
    e: &str,
    scratch: &str,
    b: &str,
) {
    let label = r#"context="system_u:object_r:container_file_t:s0:c1,c2""#;
    kata(
        writer,
        &[
            "add",
            r,
            vol,
            e,
            "ext4",
            "fsGroup=4321",
            "-o",
            "noatime",
            "-o",
            label,
        ],
    );
    kata(
        writer,
        &["add", r, scratch, b, "ext4", "createFilesystem=true"],
    );
}

/// crustd-ctl direct-volume stats and resize, through the sandbox-id file
/// (`ctl` runs crustd-ctl and reads its JSON).
fn resized_through_its_record(
    ctl: &impl Fn(&[&str]) -> serde_json::Value,
    ext4: &LoopDisk,
    vol: &str,
) {
    let s = ctl(&["direct-volume", "stats", "--volume-path", vol]);
    let total0 = s["usage"][0]["total"].as_i64().unwrap();
    assert!(total0 > 100 << 20, "{s}");
    ext4.resize(512);
    let t0 = Instant::now();
    let grown = ctl(&[
        "direct-volume",
        "resize",
        "--volume-path",
        vol,
        "--size",
        &(512u64 << 20).to_string(),
    ]);
    eprintln!("direct-volume resize 128 -> 512 MiB: {:?}", t0.elapsed());
    assert!(
        grown["capacity_bytes"].as_i64().unwrap() >= 500 << 20,
        "{grown}"
    );
    let s = ctl(&["direct-volume", "stats", "--volume-path", vol]);
    assert!(s["usage"][0]["total"].as_i64().unwrap() > total0 * 3, "{s}");
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_kata_direct_volume_in_a_real_guest() {
    const SB: &str = "pod-vm-direct";
    let writer = kata_writer();
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let root = t.path().join("direct-volumes");
    let r = root.to_str().unwrap();
    let ext4 = volume(128, "ext4");
    let blank = LoopDisk::new(64, None);
    let (e, b) = (ext4.path(), blank.path());
    let vol = "/var/lib/kubelet/pods/0f3c-uid/volumes/kubernetes.io~csi/pvc-direct/mount";
    let scratch = "/var/lib/kubelet/pods/0f3c-uid/volumes/kubernetes.io~csi/scratch/mount";
    filed_as_kata_files_them(&writer, r, vol, &e, scratch, &b);

    let opts = options(&reg.join(SB));
    let mut vm = Vm::up(opts).expect("the VM boots and the agent answers");
    let d = Crustd::start(&reg, &["--direct-volumes", r]);
    let k = d.client();
    let sock = d.socket.to_str().unwrap().to_string();
    let ctl = |args: &[&str]| {
        let mut all = vec!["--socket", &sock, "--direct-volumes", r];
        all.extend_from_slice(args);
        let (c, out, err) = ctl(&all);
        assert_eq!(c, 0, "crustd-ctl {args:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };

    // Record to publish complete: read, checked, hot-plugged, mounted, fsGroup.
    let t0 = Instant::now();
    let p = k.publish_direct(SB, vol, false).unwrap();
    eprintln!(
        "RuntimePublishDirectVolume ext4 (record to publish complete: hot-plug + mount + fsGroup): {:?}",
        t0.elapsed()
    );
    assert_eq!(p.host_volume_id, e);
    assert_eq!(
        kata(&writer, &["sandbox", r, vol]),
        SB,
        "the sandbox-id file, as Kata's lookup finds it"
    );
    // The guest mounted it with the record's option and without the label.
    let list = vm
        .agent()
        .unwrap()
        .list_volumes(crust_vm::ctx(Duration::from_secs(30)), &Default::default())
        .unwrap();
    assert_eq!(list.volumes.len(), 1);
    let console = std::fs::read_to_string(vm.console_log()).unwrap_or_default();
    assert!(
        console.contains("SELinux options left out"),
        "the guest's log does not say the context option was left out"
    );

    resized_through_its_record(&ctl, &ext4, vol);

    // A blank scratch disk: formatted on the host, then mounted in the guest.
    let t0 = Instant::now();
    k.publish_direct(SB, scratch, false).unwrap();
    eprintln!(
        "RuntimePublishDirectVolume createFilesystem (mkfs.ext4 on the host + hot-plug + mount): {:?}",
        t0.elapsed()
    );
    let s = ctl(&["direct-volume", "stats", "--volume-path", scratch]);
    assert!(s["usage"][0]["total"].as_i64().unwrap() > 40 << 20, "{s}");

    // Unpublish: the disks leave the guest, the sandbox-id files go.
    for dev in [&e, &b] {
        k.unpublish(SB, dev).unwrap();
    }
    for v in [vol, scratch] {
        assert!(!root
            .join(crustd::direct::encode(v.as_bytes()))
            .join(SB)
            .exists());
    }
    let list = vm
        .agent()
        .unwrap()
        .list_volumes(crust_vm::ctx(Duration::from_secs(30)), &Default::default())
        .unwrap();
    assert!(list.volumes.is_empty(), "{:?}", list.volumes);
    drop(d);
    vm.down().unwrap();

    // On the host: clean, grown, the pod's group on the files; the scratch disk ext4.
    run("e2fsck", &["-f", "-n", &e]);
    run("e2fsck", &["-f", "-n", &b]);
    let m = Mounted::new(&ext4.device, "ext4", "ro");
    let md = std::fs::metadata(m.path.join("data/deep/f3")).unwrap();
    assert_eq!(md.gid(), 4321);
    assert!(df_bytes(&m.path) > 400 << 20);
}

/// crustd finds a Kata sandbox from Kata's own files (`--kata-runtime-dir`),
/// with no sandbox.json: `sbs/<id>/persist.json` written as Kata's Go
/// runtime writes it (0600 in a 0700 directory, `AgentState.URL` naming
/// kata-agent's port 1024), and QEMU's extra monitor at
/// `vm/<id>/extra-monitor.sock`. Our QEMU VM stands in for Kata's: its
/// hybrid vsock is in the URL (Kata writes `hvsock://` for Firecracker and
/// Cloud Hypervisor, `vsock://CID` for its QEMU, whose vhost-vsock these
/// machines lack), and the extra monitor is its QMP socket moved to Kata's
/// path: the same socket inode, with that one name, as QEMU makes it there
/// for Kata (a symlink or a second name is refused). `HypervisorState.Pid`
/// is our QEMU's pid, as Kata records its QEMU's, and our QEMU is started
/// with `-name sandbox-<id>`, as Kata starts its own: crustd sends nothing
/// on a monitor another process serves, nor on one served by a process
/// whose command line names another sandbox. crustd takes the guest from
/// the URL and its own agent port.
#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_kata_sandbox_is_found_from_katas_files() {
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    let id = "0f3c1a9e7b2d4c58a6e1f2b3c4d5e6f7";
    let vm_dir = t.path().join("qemu");
    let reg = t.path().join("sandboxes");
    std::fs::create_dir_all(&reg).unwrap();
    let run_vc = t.path().join("run/vc");
    let mut opts = options(&vm_dir);
    opts.name = format!("sandbox-{id}");
    let mut vm = Vm::up(opts).expect("the VM boots and the agent answers");
    let sbs = run_vc.join("sbs").join(id);
    std::fs::create_dir_all(&sbs).unwrap();
    std::fs::set_permissions(&sbs, std::fs::Permissions::from_mode(0o700)).unwrap();
    let persist = serde_json::json!({
        "PersistVersion": 2,
        "State": "running",
        "HypervisorState": {"Pid": vm.pids().0, "Type": "qemu"},
        "AgentState": {"URL": format!("hvsock://{}:1024", vm_dir.join("vsock.sock").display())},
        "Config": {"HypervisorType": "qemu"}
    });
    std::fs::write(sbs.join("persist.json"), persist.to_string()).unwrap();
    std::fs::set_permissions(
        sbs.join("persist.json"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let vmd = run_vc.join("vm").join(id);
    std::fs::create_dir_all(&vmd).unwrap();
    let extra = vmd.join("extra-monitor.sock");
    std::fs::rename(vm_dir.join("qmp.sock"), &extra).unwrap();

    // Without the flag, crustd does not know the sandbox.
    let d = Crustd::start(&reg, &[]);
    let disk = volume(128, "ext4");
    let mut r = req(&disk.path(), "ext4", Some(4321));
    r.sandbox_id = id.into();
    assert_eq!(
        code_name(d.client().publish(r.clone()).unwrap_err().code()),
        "NOT_FOUND"
    );
    drop(d);
    let run_arg = run_vc.display().to_string();
    let d = Crustd::start(&reg, &["--kata-runtime-dir", &run_arg]);
    let k = d.client();
    let p = k.publish(r).unwrap();
    assert!(
        p.guest_path.starts_with("/run/crust/volumes/crustd-"),
        "{p:?}"
    );
    assert!(bytes(&k.stats(id, &disk.path()).unwrap()).is_some());
    // crustd's own state in its registry, no sandbox.json there.
    assert!(reg.join(id).join("crustd.json").is_file());
    assert!(!reg.join(id).join("sandbox.json").exists());
    k.unpublish(id, &disk.path()).unwrap();
    drop(d);
    std::fs::rename(&extra, vm_dir.join("qmp.sock")).unwrap();
    vm.down().unwrap();
}

//! The agent as PID 1 in a real QEMU guest, driven over hybrid vsock while
//! disks are hot-plugged, grown and pulled out over QMP: every volume
//! operation on ext4 and xfs, with the result read back from the image on
//! the host after the guest has shut down.
//! Run with `make test` (these tests need `make initrd` output and root).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::ttrpc;
use crust_testkit::agent::code;
use crust_testkit::run;
use crust_testkit::vm::{boot, ctx, publish};
use crust_vm::Vm;

/// A formatted image with some foreign-owned content, made on the host.
fn image(dir: &Path, name: &str, fs: &str, mib: u64) -> PathBuf {
    crust_testkit::vm::image(dir, name, fs, mib, |m| {
        std::fs::create_dir_all(m.join("data/deep/er")).unwrap();
        for i in 0..20 {
            std::fs::write(m.join(format!("data/deep/f{i}")), format!("file {i}")).unwrap();
        }
        std::fs::write(m.join("data/hello"), b"hello from the host").unwrap();
        run(
            "chown",
            &["-R", "1234:1234", m.join("data").to_str().unwrap()],
        );
        run("chmod", &["-R", "go-rwx", m.join("data").to_str().unwrap()]);
    })
}

/// Mounts the image read-only on the host and returns (gid, mode) of `rel`.
fn owner_on_host(img: &Path, rel: &str) -> (u32, u32) {
    let m = img.with_extension("check");
    std::fs::create_dir_all(&m).unwrap();
    run(
        "mount",
        &["-o", "loop,ro", img.to_str().unwrap(), m.to_str().unwrap()],
    );
    let md = std::fs::symlink_metadata(m.join(rel));
    run("umount", &[m.to_str().unwrap()]);
    let md = md.unwrap();
    (md.gid(), md.mode() & 0o7777)
}

fn fsck_clean(img: &Path, fs: &str) {
    match fs {
        "ext4" => run("e2fsck", &["-f", "-n", img.to_str().unwrap()]),
        _ => run("xfs_repair", &["-n", "-f", img.to_str().unwrap()]),
    };
}

fn stats(c: &AgentClient, id: &str) -> pb::GetVolumeStatsResponse {
    crust_testkit::vm::stats(c, id).unwrap()
}

fn bytes_total(s: &pb::GetVolumeStatsResponse) -> i64 {
    s.usage
        .iter()
        .find(|u| u.unit.enum_value() == Ok(pb::volume_usage::Unit::BYTES))
        .unwrap()
        .total
}

fn expand(c: &AgentClient, id: &str, bytes: i64) -> ttrpc::Result<pb::ExpandVolumeResponse> {
    let mut r = pb::ExpandVolumeRequest::new();
    r.volume_id = id.into();
    r.required_bytes = bytes;
    r.timeout_ms = 30_000;
    c.expand_volume(ctx(), &r)
}

/// ext4 and xfs side by side: publish before and after the hot-plug, fsGroup,
/// stats, online growth with ExpandVolume sent right after block_resize,
/// binds with recursive read-only, Shutdown, then the images checked on the host.
#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn volumes_in_a_real_guest() {
    let tmp = tempfile::tempdir().unwrap();
    let ext4 = image(tmp.path(), "ext4.img", "ext4", 128);
    let xfs = image(tmp.path(), "xfs.img", "xfs", 320);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();

    // ext4: the publish is waiting by serial before the disk exists.
    let waiting = {
        let c = vm.agent().unwrap();
        std::thread::spawn(move || {
            let t = Instant::now();
            (publish(&c, "vol-e", "ser-ext4", "ext4", Some(4321)), t)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let plugged = Instant::now();
    vm.hotplug(&ext4, "ser-ext4", false).unwrap();
    let (r, _) = waiting.join().unwrap();
    let r = r.expect("publish by serial completes once the disk arrives");
    eprintln!("hot-plug to publish complete: {:?}", plugged.elapsed());
    assert!(r.device.starts_with("/dev/vd"), "{r:?}");
    let own = r.ownership.as_ref().unwrap();
    assert!(
        own.visited >= 24 && own.changed >= 24 && own.errors == 0,
        "{own:?}"
    );

    // xfs: hot-plugged first, then published.
    vm.hotplug(&xfs, "ser-xfs", false).unwrap();
    let r = publish(&c, "vol-x", "ser-xfs", "xfs", Some(4321)).unwrap();
    assert!(r.device.starts_with("/dev/vd") && !r.already_published);
    assert!(
        publish(&c, "vol-x", "ser-xfs", "xfs", Some(4321))
            .unwrap()
            .already_published
    );
    // Wrong filesystem for the disk: refused, nothing mounted.
    assert_eq!(
        code(publish(&c, "vol-bad", "ser-xfs", "ext4", None)),
        "FAILED_PRECONDITION"
    );

    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    let serials: Vec<&str> = list.volumes.iter().map(|v| v.serial.as_str()).collect();
    assert_eq!(serials, vec!["ser-ext4", "ser-xfs"]);

    // Stats before growth.
    let e0 = bytes_total(&stats(&c, "vol-e"));
    let x0 = bytes_total(&stats(&c, "vol-x"));
    assert!(!stats(&c, "vol-e").condition.abnormal && !stats(&c, "vol-x").condition.abnormal);

    // Growth: block_resize on the host, ExpandVolume at once; the agent waits for the guest to see it.
    for (serial, id, size) in [
        ("ser-ext4", "vol-e", 512u64 << 20),
        ("ser-xfs", "vol-x", 1u64 << 30),
    ] {
        vm.resize(serial, size).unwrap();
        let t = Instant::now();
        let r = expand(&c, id, size as i64).unwrap();
        eprintln!(
            "{id}: grown to {} bytes in {:?}",
            r.capacity_bytes,
            t.elapsed()
        );
        assert_eq!(r.device_bytes as u64, size);
        assert!(
            r.capacity_bytes as u64 > size * 9 / 10 && r.capacity_bytes as u64 <= size,
            "{r:?}"
        );
    }
    assert!(bytes_total(&stats(&c, "vol-e")) > 3 * e0);
    assert!(bytes_total(&stats(&c, "vol-x")) > 2 * x0);
    // Beyond the disk: OUT_OF_RANGE after the wait.
    let mut r = pb::ExpandVolumeRequest::new();
    r.volume_id = "vol-x".into();
    r.required_bytes = 4 << 30;
    r.timeout_ms = 500;
    assert_eq!(code(c.expand_volume(ctx(), &r)), "OUT_OF_RANGE");

    // Binds: recursive read-only is applied by this kernel.
    let mut b = pb::BindMountRequest::new();
    b.volume_id = "vol-e".into();
    b.subpath = "data".into();
    b.target = "/run/crust/pods/p1/data".into();
    b.read_only = true;
    b.recursive_read_only = pb::RecursiveReadOnly::ENABLED.into();
    let br = c.bind_mount(ctx(), &b).unwrap();
    assert!(br.recursive_read_only_applied && !br.already_mounted);
    b.subpath = "data/../..".into();
    assert_eq!(code(c.bind_mount(ctx(), &b)), "INVALID_ARGUMENT");
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!(
        list.volumes[0].bind_targets,
        vec!["/run/crust/pods/p1/data"]
    );

    // Unpublish ext4 explicitly; leave xfs mounted for Shutdown to take care of.
    let mut u = pb::UnpublishVolumeRequest::new();
    u.volume_id = "vol-e".into();
    assert!(c.unpublish_volume(ctx(), &u).unwrap().was_published);
    let how = vm.down().unwrap();
    assert!(how.contains("1 volumes unmounted"), "{how}");

    // On the host: both filesystems are clean, grown, and carry the ownership.
    for (img, fs) in [(&ext4, "ext4"), (&xfs, "xfs")] {
        fsck_clean(img, fs);
        assert_eq!(owner_on_host(img, "data/hello"), (4321, 0o660), "{fs}");
        let (gid, mode) = owner_on_host(img, "data/deep");
        assert_eq!((gid, mode & 0o2770), (4321, 0o2770), "{fs}");
    }
}

fn block_publish(
    c: &AgentClient,
    id: &str,
    serial: &str,
    read_only: bool,
) -> ttrpc::Result<pb::PublishVolumeResponse> {
    let mut r = pb::PublishVolumeRequest::new();
    r.volume_id = id.into();
    r.set_serial(serial.into());
    r.volume_mode = pb::VolumeMode::BLOCK.into();
    r.read_only = read_only;
    r.timeout_ms = 60_000;
    c.publish_volume(ctx(), &r)
}

fn unpublish(c: &AgentClient, id: &str) -> bool {
    let mut u = pb::UnpublishVolumeRequest::new();
    u.volume_id = id.into();
    c.unpublish_volume(ctx(), &u).unwrap().was_published
}

fn listed(c: &AgentClient, id: &str) -> pb::VolumeInfo {
    c.list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap()
        .volumes
        .into_iter()
        .find(|v| v.volume_id == id)
        .unwrap_or_else(|| panic!("{id} is not listed"))
}

/// sha256 of the first `bytes` of `img`.
fn sha256_prefix(img: &Path, bytes: u64) -> String {
    let out = run(
        "sh",
        &[
            "-c",
            &format!("head -c {bytes} {} | sha256sum", img.to_str().unwrap()),
        ],
    );
    out.split_whitespace().next().unwrap().to_string()
}

/// A 64 MiB image whose first 8 MiB are random, in `dir`.
fn random_image(dir: &Path) -> PathBuf {
    let raw = dir.join("raw.img");
    std::fs::File::create(&raw)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    run(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", raw.display()),
            "bs=1M",
            "count=8",
            "conv=notrunc",
            "status=none",
        ],
    );
    raw
}

/// A BLOCK publish by serial, sent before the disk `raw` is plugged,
/// completes once it arrives; listed and its stats are the device's.
fn published_by_serial_before_it_is_plugged(vm: &mut Vm, c: &AgentClient, raw: &Path) {
    let waiting = {
        let c = vm.agent().unwrap();
        std::thread::spawn(move || block_publish(&c, "raw", "ser-raw", false))
    };
    std::thread::sleep(Duration::from_millis(500));
    let plugged = Instant::now();
    vm.hotplug(raw, "ser-raw", false).unwrap();
    let r = waiting
        .join()
        .unwrap()
        .expect("a BLOCK publish by serial completes once the disk arrives");
    eprintln!(
        "hot-plug to BLOCK publish complete: {:?}",
        plugged.elapsed()
    );
    assert_eq!(r.guest_path, "/run/crust/volumes/raw");
    assert!(
        r.device.starts_with("/dev/vd") && r.ownership.is_none(),
        "{r:?}"
    );
    let v = listed(c, "raw");
    assert_eq!(v.volume_mode, pb::VolumeMode::BLOCK.into());
    assert_eq!(
        (v.fs_type.as_str(), v.read_only, v.device_bytes),
        ("", false, 64 << 20)
    );
    let s = stats(c, "raw");
    assert_eq!(s.usage.len(), 1);
    assert_eq!((s.usage[0].total, s.usage[0].used), (64 << 20, 0));
    assert!(!s.condition.abnormal, "{:?}", s.condition);
}

/// Block volumes (KEP-565) in the guest, then a filesystem's disk pulled
/// out, on one VM: publish BLOCK by serial before and after the hot-plug,
/// list, stats, a bind onto a file, growth after block_resize, a read-only
/// publish whose flag the host sees (BLKROGET), unpublish, and a block
/// volume's disk unplugged while published. The image is checked on the
/// host: the agent never wrote a byte of it. Pulling a mounted filesystem's
/// disk turns its condition abnormal too, and the agent keeps serving.
#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn block_volumes_and_hot_unplug_in_a_real_guest() {
    let tmp = tempfile::tempdir().unwrap();
    let raw = random_image(tmp.path());
    let original = sha256_prefix(&raw, 64 << 20);
    let img = image(tmp.path(), "gone.img", "ext4", 64);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();

    published_by_serial_before_it_is_plugged(&mut vm, &c, &raw);

    let mut b = pb::BindMountRequest::new();
    b.volume_id = "raw".into();
    b.target = "/run/crust/pods/p2/volumeDevices/raw".into();
    assert!(!c.bind_mount(ctx(), &b).unwrap().already_mounted);
    b.read_only = true;
    assert_eq!(code(c.bind_mount(ctx(), &b)), "FAILED_PRECONDITION");

    // Growth: ExpandVolume right after block_resize waits for the guest to see it.
    vm.resize("ser-raw", 96 << 20).unwrap();
    let t = Instant::now();
    let e = expand(&c, "raw", 96 << 20).unwrap();
    eprintln!(
        "block volume grown to {} bytes in {:?}",
        e.device_bytes,
        t.elapsed()
    );
    assert_eq!((e.capacity_bytes, e.device_bytes), (96 << 20, 96 << 20));
    assert_eq!(bytes_total(&stats(&c, "raw")), 96 << 20);
    assert_eq!(
        listed(&c, "raw").bind_targets,
        vec!["/run/crust/pods/p2/volumeDevices/raw"]
    );
    assert!(unpublish(&c, "raw"));
    assert!(!unpublish(&c, "raw"));

    // Read-only, with the disk already there: the kernel's flag, seen from the host.
    let grown = sha256_prefix(&raw, 96 << 20);
    let r = block_publish(&c, "raw-ro", "ser-raw", true).unwrap();
    assert!(!r.already_published);
    assert!(listed(&c, "raw-ro").read_only, "BLKROGET says read-only");
    b.volume_id = "raw-ro".into();
    b.target = "/run/crust/pods/p3/raw".into();
    c.bind_mount(ctx(), &b).unwrap();
    assert!(!stats(&c, "raw-ro").condition.abnormal);
    assert!(unpublish(&c, "raw-ro"));
    // Writable again: a read-write publish sees the flag cleared.
    block_publish(&c, "raw", "ser-raw", false).unwrap();
    assert!(
        !listed(&c, "raw").read_only,
        "the agent cleared the flag it set"
    );

    // Pulled out while published: abnormal, and it still unpublishes.
    vm.unplug("ser-raw").unwrap();
    let s = stats(&c, "raw");
    assert!(s.condition.abnormal, "{:?}", s.condition);
    eprintln!("block condition after unplug: {}", s.condition.message);
    assert!(unpublish(&c, "raw"));
    assert_eq!(
        sha256_prefix(&raw, 96 << 20),
        grown,
        "a read-only cycle leaves the image byte-identical"
    );
    assert_eq!(
        sha256_prefix(&raw, 64 << 20),
        original,
        "the agent never wrote to the disk"
    );

    // A mounted filesystem's disk pulled out.
    vm.hotplug(&img, "ser-gone", false).unwrap();
    publish(&c, "vol-g", "ser-gone", "ext4", None).unwrap();
    assert!(!stats(&c, "vol-g").condition.abnormal);
    vm.unplug("ser-gone").unwrap();
    let s = stats(&c, "vol-g");
    assert!(s.condition.abnormal, "{:?}", s.condition);
    eprintln!("condition after unplug: {}", s.condition.message);
    let info = c
        .get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .unwrap();
    assert!(info.init_mode);
    let mut u = pb::UnpublishVolumeRequest::new();
    u.volume_id = "vol-g".into();
    let _ = c.unpublish_volume(ctx(), &u);
    vm.down().unwrap();
}

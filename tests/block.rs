//! Block volumes (KEP-565) on loop devices, through the real agent: the
//! disk's node bound onto a file, writes through binds landing in the image,
//! read-only that holds against every way of writing (BLKROSET, not the
//! mount flag), the image untouched by a read-only cycle, sizes, growth,
//! every refusal changing nothing, Shutdown and restart recovery.

mod support;

use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use support::*;

fn block_req(id: &str, device: &str, read_only: bool) -> pb::PublishVolumeRequest {
    let mut r = publish_req(id, device, "block");
    r.read_only = read_only;
    r
}

/// A loop disk of `mb` MiB whose first 4 MiB are random: contents for a
/// checksum to notice any change.
fn raw_disk(mb: u64) -> LoopDisk {
    let d = LoopDisk::new(mb, None);
    run(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", d.image.display()),
            "bs=1M",
            "count=4",
            "conv=notrunc",
            "status=none",
        ],
    );
    d
}

fn sha256(path: &Path) -> String {
    run("sha256sum", &[path.to_str().unwrap()])
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

fn sys_ro(d: &LoopDisk) -> String {
    std::fs::read_to_string(format!("/sys/block/{}/ro", d.name()))
        .unwrap()
        .trim()
        .to_string()
}

fn rdev(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().rdev()
}

fn list(c: &crust_protocols::crust_ttrpc::AgentClient) -> Vec<pb::VolumeInfo> {
    c.list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap()
        .volumes
}

/// Everything a refused request must leave as it was: the mounts beneath
/// the root, the list, the state files, the nodes beneath the root, and the
/// disks' read-only flags.
fn scene(a: &Agent, c: &crust_protocols::crust_ttrpc::AgentClient, disks: &[&LoopDisk]) -> String {
    let mounts: Vec<String> = crust_agent::sys::mountinfo::read()
        .unwrap()
        .into_iter()
        .filter(|m| m.mount_point.starts_with(&a.root))
        .map(|m| {
            format!(
                "{} {} {:?} {}",
                m.mount_id,
                m.mount_point.display(),
                m.root,
                m.mount_options
            )
        })
        .collect();
    let mut nodes = Vec::new();
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let md = std::fs::symlink_metadata(e.path()).unwrap();
            out.push(format!(
                "{} {:o} {}",
                e.path().display(),
                md.mode(),
                md.len()
            ));
            if md.is_dir() {
                walk(&e.path(), out);
            }
        }
    }
    walk(&a.root, &mut nodes);
    nodes.sort();
    let ro: Vec<String> = disks.iter().map(|d| sys_ro(d)).collect();
    format!(
        "mounts {mounts:#?}\nlist {:?}\nnodes {nodes:#?}\nro {ro:?}",
        list(c)
    )
}

/// Tries every way a process holding the node at `path` could write to the
/// device; returns the ones that were not refused.
fn writes_that_got_through(path: &Path) -> Vec<String> {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let mut through = Vec::new();
    let open = |write: bool, extra: i32| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(extra)
            .open(path)
    };
    // write(2), buffered: open for writing may succeed, the write may not.
    if let Ok(mut f) = std::fs::OpenOptions::new().write(true).open(path) {
        if f.write_all(&[0xa5; 4096])
            .and_then(|_| f.sync_all())
            .is_ok()
        {
            through.push("write".to_string());
        }
    }
    // pwrite(2) further in.
    if let Ok(f) = open(true, 0) {
        if f.write_all_at(&[0x5a; 4096], 1 << 20).is_ok() {
            through.push("pwrite".to_string());
        }
    }
    // O_DIRECT, past the page cache.
    if let Ok(f) = open(true, libc::O_DIRECT) {
        let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let buf = unsafe { std::alloc::alloc_zeroed(layout) };
        // SAFETY: `buf` is a live allocation of 4096 bytes, aligned for O_DIRECT,
        // freed right after; the fd is open.
        let n = unsafe { libc::pwrite(f.as_raw_fd(), buf.cast(), 4096, 4096) };
        // SAFETY: `buf` came from `alloc_zeroed` with this layout.
        unsafe { std::alloc::dealloc(buf, layout) };
        if n >= 0 {
            through.push("O_DIRECT pwrite".to_string());
        }
    }
    // A shared writable mapping, flushed with msync.
    if let Ok(f) = open(true, 0) {
        // SAFETY: a fresh mapping chosen by the kernel; the fd is open.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p != libc::MAP_FAILED {
            // SAFETY: `p` maps 4096 writable bytes until the munmap below.
            let synced = unsafe {
                std::ptr::write_bytes(p.cast::<u8>(), 0x77, 4096);
                libc::msync(p, 4096, libc::MS_SYNC)
            };
            // SAFETY: `p` is the mapping made above, unmapped once.
            unsafe { libc::munmap(p, 4096) };
            through.push(format!("mmap MAP_SHARED (msync returned {synced})"));
        }
    }
    // fallocate: punching a hole discards data.
    if let Ok(f) = open(true, 0) {
        // SAFETY: plain syscall on an open fd.
        let r = unsafe {
            libc::fallocate(
                f.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                4096,
            )
        };
        if r == 0 {
            through.push("fallocate punch hole".to_string());
        }
    }
    // BLKDISCARD and BLKZEROOUT: a range of [start, length].
    for (name, nr) in [("BLKDISCARD", 119u8), ("BLKZEROOUT", 127u8)] {
        if let Ok(f) = open(true, 0) {
            let range: [u64; 2] = [0, 4096];
            let req = libc::c_ulong::from(0x12u8) << 8 | libc::c_ulong::from(nr);
            // SAFETY: both ioctls read two u64 through the pointer, which
            // points at `range`, alive for the call.
            let r = unsafe { libc::ioctl(f.as_raw_fd(), req as _, range.as_ptr()) };
            if r == 0 {
                through.push(name.to_string());
            }
        }
    }
    through
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_read_only_bind_of_a_device_node_does_not_stop_writes() {
    // The premise of BLKROSET: the kernel checks a mount's read-only flag
    // for files, directories and symlinks, not for device nodes.
    needs::loop_devices_and_mkfs();
    let d = raw_disk(8);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("node");
    std::fs::write(&file, b"").unwrap();
    run("mount", &["--bind", &d.path(), file.to_str().unwrap()]);
    run("mount", &["-o", "remount,bind,ro", file.to_str().unwrap()]);
    let before = sha256(&d.image);
    let through = writes_that_got_through(&file);
    run("umount", &[file.to_str().unwrap()]);
    // Every way the read-only test tries works here, so none of them can
    // pass there for a reason of its own.
    assert_eq!(
        through.len(),
        7,
        "a read-only bind of the node refused some writes ({through:?}): the premise changed"
    );
    assert_ne!(sha256(&d.image), before);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn block_volume_publish_bind_write_stats_expand_unpublish() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let caps = c
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
    assert!(caps
        .capabilities
        .contains(&pb::Capability::CAPABILITY_BLOCK_VOLUME.into()));
    let d = raw_disk(64);

    let r = c
        .publish_volume(ctx(), &block_req("raw", &d.path(), false))
        .unwrap();
    let gp = a.root.join("volumes/raw");
    assert_eq!(
        PathBuf::from(&r.guest_path),
        std::fs::canonicalize(&a.root).unwrap().join("volumes/raw")
    );
    assert_eq!(r.device, d.path());
    assert!(!r.already_published && r.ownership.is_none());
    // The guest path is the disk's node, bound there: mountinfo shows it.
    let md = std::fs::metadata(&gp).unwrap();
    assert!(md.file_type().is_block_device());
    assert_eq!(md.rdev(), rdev(&d.device));
    assert!(is_mount(Path::new(&r.guest_path)));
    assert_eq!(sys_ro(&d), "0");
    let again = c
        .publish_volume(ctx(), &block_req("raw", &d.path(), false))
        .unwrap();
    assert!(again.already_published);

    let v = &list(&c)[0];
    assert_eq!(v.volume_mode, pb::VolumeMode::BLOCK.into());
    assert_eq!(
        (v.fs_type.as_str(), v.read_only, v.device_bytes),
        ("", false, 64 << 20)
    );

    // A bind onto a file target, created 0600 with its directories.
    let target = a.root.join("pods/p1/volumeDevices/raw");
    c.bind_mount(
        ctx(),
        &bind_req("raw", &target, "", false, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    assert_eq!(rdev(&target), rdev(&d.device));
    let again = c
        .bind_mount(
            ctx(),
            &bind_req("raw", &target, "", false, pb::RecursiveReadOnly::DISABLED),
        )
        .unwrap();
    assert!(again.already_mounted);

    // Bytes written through the bind, without an fsync: the unpublish flushes them.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&target)
            .unwrap();
        f.write_all_at(b"written through the bind", 8 << 20)
            .unwrap();
    }

    let s = c.get_volume_stats(ctx(), &stats_req("raw")).unwrap();
    assert_eq!(s.usage.len(), 1, "{s:?}");
    let u = &s.usage[0];
    assert_eq!(u.unit, pb::volume_usage::Unit::BYTES.into());
    assert_eq!((u.total, u.used, u.available), (64 << 20, 0, 0));
    assert!(!s.condition.abnormal, "{}", s.condition.message);

    // Expand: at or below the size answers at once; growth is waited for.
    let mut er = pb::ExpandVolumeRequest::new();
    er.volume_id = "raw".into();
    let e = c.expand_volume(ctx(), &er).unwrap();
    assert_eq!((e.capacity_bytes, e.device_bytes), (64 << 20, 64 << 20));
    d.resize(96);
    er.required_bytes = 96 << 20;
    er.timeout_ms = 5000;
    let e = c.expand_volume(ctx(), &er).unwrap();
    assert_eq!((e.capacity_bytes, e.device_bytes), (96 << 20, 96 << 20));
    er.required_bytes = 200 << 20;
    er.timeout_ms = 300;
    assert_eq!(code(c.expand_volume(ctx(), &er)), "OUT_OF_RANGE");
    let s = c.get_volume_stats(ctx(), &stats_req("raw")).unwrap();
    assert_eq!(s.usage[0].total, 96 << 20);

    let un = c.unpublish_volume(ctx(), &unpublish_req("raw")).unwrap();
    assert!(un.was_published);
    assert!(!gp.exists() && !target.exists(), "the files are removed");
    let image = std::fs::read(&d.image).unwrap();
    assert_eq!(&image[8 << 20..(8 << 20) + 24], b"written through the bind");
    assert!(
        !c.unpublish_volume(ctx(), &unpublish_req("raw"))
            .unwrap()
            .was_published
    );
    assert!(crust_agent::sys::mountinfo::read()
        .unwrap()
        .iter()
        .all(|m| !m.mount_point.starts_with(&a.root)));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_read_only_block_volume_refuses_every_write_and_is_left_byte_identical() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let d = raw_disk(16);
    let before = sha256(&d.image);
    c.publish_volume(ctx(), &block_req("ro", &d.path(), true))
        .unwrap();
    assert_eq!(sys_ro(&d), "1", "BLKROSET for as long as it is published");
    let v = &list(&c)[0];
    assert!(v.read_only, "ListVolumes reports the kernel's BLKROGET");
    let gp = a.root.join("volumes/ro");
    assert_eq!(
        std::fs::metadata(&gp).unwrap().permissions().mode() & 0o7777,
        std::fs::metadata(&d.device).unwrap().permissions().mode() & 0o7777,
        "the guest path shows the node"
    );
    let ro_bind = a.root.join("pods/p/ro");
    let rw_bind = a.root.join("pods/p/rw");
    c.bind_mount(
        ctx(),
        &bind_req("ro", &ro_bind, "", true, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    c.bind_mount(
        ctx(),
        &bind_req("ro", &rw_bind, "", false, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    for p in [&gp, &ro_bind, &rw_bind, &d.device] {
        let through = writes_that_got_through(p);
        assert!(
            through.is_empty(),
            "{}: {through:?} got through",
            p.display()
        );
    }
    let s = c.get_volume_stats(ctx(), &stats_req("ro")).unwrap();
    assert!(!s.condition.abnormal, "{}", s.condition.message);
    c.unpublish_volume(ctx(), &unpublish_req("ro")).unwrap();
    assert_eq!(sys_ro(&d), "0", "writable again after unpublish");
    assert_eq!(
        sha256(&d.image),
        before,
        "the agent never touches a block volume's contents"
    );
    // And the flag was the agent's to clear only because it set it: a disk
    // already read-only stays so.
    run("blockdev", &["--setro", &d.path()]);
    c.publish_volume(ctx(), &block_req("ro2", &d.path(), true))
        .unwrap();
    c.unpublish_volume(ctx(), &unpublish_req("ro2")).unwrap();
    assert_eq!(sys_ro(&d), "1", "a flag the agent did not set stays");
    run("blockdev", &["--setrw", &d.path()]);
}

/// Publishes refused, with their codes: block and filesystem fields mixed,
/// a device that is another volume's or mounted elsewhere (`other`), an id
/// taken (b1 on `raw`; fs1 is on `ext4`).
fn refused_publishes(
    raw: &LoopDisk,
    ext4: &LoopDisk,
    other: &LoopDisk,
) -> Vec<(&'static str, pb::PublishVolumeRequest, &'static str)> {
    let with = |f: &dyn Fn(&mut pb::PublishVolumeRequest)| {
        let mut r = block_req("b9", &other.path(), false);
        f(&mut r);
        r
    };
    vec![
        (
            "fs_type with BLOCK",
            with(&|r| r.fs_type = "ext4".into()),
            "INVALID_ARGUMENT",
        ),
        (
            "mount options with BLOCK",
            with(&|r| r.mount_options = vec!["noatime".into()]),
            "INVALID_ARGUMENT",
        ),
        (
            "fs_group with BLOCK",
            with(&|r| r.fs_group = fs_group(2000, pb::FsGroupChangePolicy::ALWAYS)),
            "INVALID_ARGUMENT",
        ),
        (
            "an unknown mode",
            with(&|r| r.volume_mode = crust_protocols::protobuf::EnumOrUnknown::from_i32(7)),
            "INVALID_ARGUMENT",
        ),
        (
            "a block device as a filesystem volume",
            publish_req("fs9", &raw.path(), "ext4"),
            "FAILED_PRECONDITION",
        ),
        (
            "a filesystem volume's device as a block volume",
            block_req("b9", &ext4.path(), false),
            "FAILED_PRECONDITION",
        ),
        (
            "a device mounted elsewhere as a block volume",
            block_req("b9", &other.path(), false),
            "FAILED_PRECONDITION",
        ),
        (
            "the same id as a filesystem",
            publish_req("b1", &raw.path(), "ext4"),
            "ALREADY_EXISTS",
        ),
        (
            "the same id read-only",
            block_req("b1", &raw.path(), true),
            "ALREADY_EXISTS",
        ),
    ]
}

/// Binds refused, with their codes: what a block volume cannot be bound
/// as (at `t`), and targets of the wrong kind beneath `root`.
fn refused_binds(root: &Path, t: &Path) -> Vec<(&'static str, pb::BindMountRequest, &'static str)> {
    vec![
        (
            "a subpath",
            bind_req("b1", t, "x", false, pb::RecursiveReadOnly::DISABLED),
            "INVALID_ARGUMENT",
        ),
        (
            "recursive read-only",
            bind_req("b1", t, "", true, pb::RecursiveReadOnly::IF_POSSIBLE),
            "INVALID_ARGUMENT",
        ),
        (
            "a read-only bind of a read-write block volume",
            bind_req("b1", t, "", true, pb::RecursiveReadOnly::DISABLED),
            "FAILED_PRECONDITION",
        ),
        (
            "a directory as a block bind target",
            bind_req(
                "b1",
                &root.join("pods/dir-target"),
                "",
                false,
                pb::RecursiveReadOnly::DISABLED,
            ),
            "INVALID_ARGUMENT",
        ),
        (
            "a file as a filesystem bind target",
            bind_req(
                "fs1",
                &root.join("pods/file-target"),
                "",
                false,
                pb::RecursiveReadOnly::DISABLED,
            ),
            "INVALID_ARGUMENT",
        ),
    ]
}

#[test]
#[ignore = "needs root: make test runs it"]
fn block_refusals_have_their_codes_and_change_nothing() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let raw = raw_disk(16);
    let ext4 = LoopDisk::new(64, Some("ext4"));
    let other = LoopDisk::new(64, Some("ext4"));
    c.publish_volume(ctx(), &block_req("b1", &raw.path(), false))
        .unwrap();
    c.publish_volume(ctx(), &publish_req("fs1", &ext4.path(), "ext4"))
        .unwrap();
    std::fs::create_dir_all(a.root.join("pods/dir-target")).unwrap();
    std::fs::write(a.root.join("pods/file-target"), b"").unwrap();
    let foreign = other.scratch("m");
    run("mount", &[&other.path(), foreign.to_str().unwrap()]);
    let disks = [&raw, &ext4, &other];
    let before = scene(&a, &c, &disks);

    for (what, req, want) in refused_publishes(&raw, &ext4, &other) {
        let r = c.publish_volume(ctx(), &req);
        assert_eq!(code(r), want, "{what}");
        assert_eq!(scene(&a, &c, &disks), before, "{what} changed something");
    }
    let r = c.publish_volume(ctx(), &publish_req("fs9", &raw.path(), "ext4"));
    assert!(
        message(r).contains("b1"),
        "the message names the volume holding the device"
    );

    let t = a.root.join("pods/t");
    for (what, req, want) in refused_binds(&a.root, &t) {
        let r = c.bind_mount(ctx(), &req);
        assert_eq!(code(r), want, "{what}");
        assert_eq!(scene(&a, &c, &disks), before, "{what} changed something");
    }
    let m = message(c.bind_mount(
        ctx(),
        &bind_req("b1", &t, "", true, pb::RecursiveReadOnly::DISABLED),
    ));
    assert!(
        m.contains("read-only") && m.contains("publish the volume read-only"),
        "{m}"
    );
    run("umount", &[foreign.to_str().unwrap()]);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn block_condition_sees_a_removed_bind_and_a_flag_set_behind_the_agents_back() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let d = raw_disk(16);
    c.publish_volume(ctx(), &block_req("raw", &d.path(), false))
        .unwrap();
    let stats = || {
        c.get_volume_stats(ctx(), &stats_req("raw"))
            .unwrap()
            .condition
    };
    assert!(!stats().abnormal);
    run("blockdev", &["--setro", &d.path()]);
    let cond = stats();
    assert!(
        cond.abnormal && cond.message.contains("read-only"),
        "{}",
        cond.message
    );
    assert!(list(&c)[0].read_only, "list shows the kernel's flag");
    run("blockdev", &["--setrw", &d.path()]);
    assert!(!stats().abnormal);
    let gp = a.root.join("volumes/raw");
    run("umount", &[gp.to_str().unwrap()]);
    let cond = stats();
    assert!(
        cond.abnormal && cond.message.contains("removed"),
        "{}",
        cond.message
    );
    let mut er = pb::ExpandVolumeRequest::new();
    er.volume_id = "raw".into();
    assert_eq!(code(c.expand_volume(ctx(), &er)), "FAILED_PRECONDITION");
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("raw"))
            .unwrap()
            .was_published
    );
    assert!(!gp.exists());
}

#[test]
#[ignore = "needs root: make test runs it"]
fn block_volumes_come_back_after_a_restart_and_go_at_shutdown() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let ro = raw_disk(16);
    let rw = raw_disk(16);
    let before = sha256(&ro.image);
    c.publish_volume(ctx(), &block_req("ro", &ro.path(), true))
        .unwrap();
    c.publish_volume(ctx(), &block_req("rw", &rw.path(), false))
        .unwrap();
    let t1 = a.root.join("pods/a/ro");
    let t2 = a.root.join("pods/a/rw");
    c.bind_mount(
        ctx(),
        &bind_req("ro", &t1, "", true, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    c.bind_mount(
        ctx(),
        &bind_req("rw", &t2, "", false, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    let listed = list(&c);
    let dir = a.kill9();
    let a = Agent::start_in(dir);
    let c = a.client();
    let mut again = list(&c);
    again.sort_by(|x, y| x.volume_id.cmp(&y.volume_id));
    let mut listed = listed;
    listed.sort_by(|x, y| x.volume_id.cmp(&y.volume_id));
    assert_eq!(again, listed, "taken back as they were");
    assert_eq!(sys_ro(&ro), "1", "still read-only after the restart");
    // Repeats are idempotent against the adopted state.
    assert!(
        c.publish_volume(ctx(), &block_req("ro", &ro.path(), true))
            .unwrap()
            .already_published
    );
    assert!(
        c.bind_mount(
            ctx(),
            &bind_req("rw", &t2, "", false, pb::RecursiveReadOnly::DISABLED)
        )
        .unwrap()
        .already_mounted
    );
    // A bind removed while the agent was down is dropped at the next start.
    let dir = a.kill9();
    run("umount", &[t2.to_str().unwrap()]);
    let mut a = Agent::start_in(dir);
    let c = a.client();
    let rwv = list(&c).into_iter().find(|v| v.volume_id == "rw").unwrap();
    assert!(rwv.bind_targets.is_empty(), "{rwv:?}");
    let r = c.shutdown(ctx(), &pb::ShutdownRequest::new()).unwrap();
    assert_eq!(r.volumes_unmounted, 2);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.alive() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(crust_agent::sys::mountinfo::read()
        .unwrap()
        .iter()
        .all(|m| !m.mount_point.starts_with(&a.root)));
    assert_eq!(sys_ro(&ro), "0", "Shutdown gives the device back writable");
    assert_eq!(sha256(&ro.image), before);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_block_bind_no_record_explains_is_taken_down_at_start() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let d = raw_disk(16);
    c.publish_volume(ctx(), &block_req("raw", &d.path(), false))
        .unwrap();
    let t = a.root.join("pods/x/dev");
    c.bind_mount(
        ctx(),
        &bind_req("raw", &t, "", false, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    let dir = a.kill9();
    // The record is lost: the guest path and the bind are orphans.
    std::fs::remove_file(
        dir.path()
            .join("root")
            .join(crust_agent::validate::STATE_DIR)
            .join("raw.vol"),
    )
    .unwrap();
    let a = Agent::start_in(dir);
    let c = a.client();
    assert!(list(&c).is_empty());
    let left: Vec<_> = crust_agent::sys::mountinfo::read()
        .unwrap()
        .into_iter()
        .filter(|m| m.mount_point.starts_with(&a.root))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // And the disk can be published again.
    c.publish_volume(ctx(), &block_req("raw", &d.path(), false))
        .unwrap();
}

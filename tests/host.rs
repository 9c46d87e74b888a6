//! The real agent on a unix socket, driving every operation on loop devices
//! with real ext4 and xfs: results read back from the kernel and the disk.

mod support;

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use crust_protocols::crust_ttrpc::AgentClient;
use support::*;

#[test]
#[ignore = "needs root: make test runs it"]
fn serves_the_basic_calls() {
    // Recursive read-only is offered only where the agent can make mounts.
    needs::root();
    let a = Agent::start();
    let c = a.client();
    let caps = c
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
    let caps: Vec<pb::Capability> = caps
        .capabilities
        .iter()
        .map(|c| c.enum_value().unwrap())
        .collect();
    assert!(caps.contains(&pb::Capability::CAPABILITY_VOLUME_STATS));
    assert!(
        caps.contains(&pb::Capability::CAPABILITY_RECURSIVE_READ_ONLY),
        "this kernel has mount_setattr"
    );
    let fs = c
        .get_supported_file_systems(ctx(), &pb::GetSupportedFileSystemsRequest::new())
        .unwrap();
    assert!(
        fs.file_systems.contains(&"ext4".to_string()),
        "{:?}",
        fs.file_systems
    );
    let info = c
        .get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .unwrap();
    assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    assert!(!info.init_mode);
    assert!(info.rss_bytes > 0);
    assert!(info.boot.listening_ms >= info.boot.agent_start_ms && info.boot.agent_start_ms > 0);
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert!(list.volumes.is_empty());
}

#[test]
fn shutdown_exits_cleanly() {
    let mut a = Agent::start();
    let r = a
        .client()
        .shutdown(ctx(), &pb::ShutdownRequest::new())
        .unwrap();
    assert_eq!(r.volumes_unmounted, 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while a.alive() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = a
        .child
        .try_wait()
        .unwrap()
        .expect("agent exited after Shutdown");
    assert!(status.success());
}

#[test]
fn survives_garbage_closed_connections_and_load() {
    let mut a = Agent::start();
    // Warm up, then take the baseline.
    for _ in 0..50 {
        a.client()
            .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
            .unwrap();
    }
    let fds0 = a.fd_count();
    let rss0 = a.rss_kib();
    // Garbage: a header announcing a huge message, random bytes, a half header, then hang up.
    for junk in [
        &b"\xff\xff\xff\xff\x00\x00\x00\x01\x01\x00"[..],
        b"hello world, not ttrpc at all",
        b"\x00\x00",
    ] {
        let mut s = std::os::unix::net::UnixStream::connect(&a.sock).unwrap();
        let _ = s.write_all(junk);
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let _ = s.read(&mut [0u8; 64]);
    }
    // A well-formed request whose connection closes before the answer.
    {
        let c = a.client();
        let _ = c.publish_volume(
            ttrpc_ctx_ms(1),
            &publish_req("v", "/dev/nonexistent", "ext4"),
        );
    }
    // A malformed request: the agent answers an error, not a crash.
    assert_eq!(
        code(
            a.client()
                .publish_volume(ctx(), &publish_req("../bad", "/dev/x", "ext4"))
        ),
        "INVALID_ARGUMENT"
    );
    // 16 clients × 63 calls.
    let sock = a.addr();
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let c = connect(&sock).unwrap();
                for i in 0..63 {
                    if i % 3 == 0 {
                        c.get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
                            .unwrap();
                    } else if i % 3 == 1 {
                        c.list_volumes(ctx(), &pb::ListVolumesRequest::new())
                            .unwrap();
                    } else {
                        let e = c.get_volume_stats(ctx(), &stats_req("nope"));
                        assert_eq!(code(e), "NOT_FOUND");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(a.alive(), "agent died; log:\n{}", a.log());
    std::thread::sleep(Duration::from_millis(300));
    let fds1 = a.fd_count();
    let rss1 = a.rss_kib();
    assert!(fds1 <= fds0 + 2, "fds grew from {fds0} to {fds1}");
    // Worker threads may settle at a slightly different count; a leak per call would show as megabytes.
    assert!(rss1 < rss0 + 1024, "RSS grew from {rss0} KiB to {rss1} KiB");
    a.client()
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
}

fn ttrpc_ctx_ms(ms: u64) -> crust_protocols::ttrpc::context::Context {
    crust_protocols::ttrpc::context::with_timeout(
        i64::try_from(Duration::from_millis(ms).as_nanos()).unwrap_or(i64::MAX),
    )
}

/// Content with foreign ownership, a private file and a symlink out, put on
/// `disk` before the agent sees it.
fn foreign_content(disk: &LoopDisk) {
    let m = tempfile::tempdir().unwrap();
    run("mount", &[&disk.path(), m.path().to_str().unwrap()]);
    std::fs::create_dir_all(m.path().join("data/sub")).unwrap();
    std::fs::write(m.path().join("data/file"), b"hello").unwrap();
    std::fs::set_permissions(
        m.path().join("data/file"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::os::unix::fs::symlink("/etc/passwd", m.path().join("data/link")).unwrap();
    run("umount", &[m.path().to_str().unwrap()]);
}

/// Publishes `disk` with an fsGroup: the walk changed the files, followed
/// no symlink; again is idempotent, a different one ALREADY_EXISTS, the
/// same disk under another id refused. The request and the guest path.
fn published_with_fs_group(
    a: &Agent,
    c: &AgentClient,
    disk: &LoopDisk,
    fs: &str,
) -> (pb::PublishVolumeRequest, std::path::PathBuf) {
    let id = format!("vol-{fs}");
    let mut req = publish_req(&id, &disk.path(), fs);
    req.mount_options = vec!["noatime".into()];
    req.fs_group = fs_group(2345, pb::FsGroupChangePolicy::ALWAYS);
    let r = c.publish_volume(ctx(), &req).unwrap();
    let gp = a.root.join("volumes").join(&id);
    assert_eq!(Path::new(&r.guest_path), gp);
    assert_eq!(r.device, disk.path());
    assert!(!r.already_published);
    let own = r.ownership.as_ref().expect("ownership report");
    assert!(
        !own.skipped && own.visited >= 5 && own.changed >= 4 && own.errors == 0,
        "{own:?}"
    );
    assert_eq!(mounts_of(&disk.path()), vec![gp.display().to_string()]);
    assert_eq!(std::fs::metadata(gp.join("data/file")).unwrap().gid(), 2345);
    assert_eq!(
        std::fs::metadata(gp.join("data/file")).unwrap().mode() & 0o7777,
        0o660
    );
    assert_eq!(
        std::fs::metadata(gp.join("data/sub")).unwrap().mode() & 0o2070,
        0o2070
    );
    assert_ne!(
        std::fs::metadata("/etc/passwd").unwrap().gid(),
        2345,
        "a symlink was followed"
    );

    // Idempotent publish; a different one is ALREADY_EXISTS; the same disk under another id is refused.
    assert!(c.publish_volume(ctx(), &req).unwrap().already_published);
    let mut other = req.clone();
    other.read_only = true;
    assert_eq!(code(c.publish_volume(ctx(), &other)), "ALREADY_EXISTS");
    let mut twin = req.clone();
    twin.volume_id = "twin".into();
    assert_eq!(code(c.publish_volume(ctx(), &twin)), "FAILED_PRECONDITION");

    (req, gp)
}

/// Stats: usage follows a write; the condition is ok.
fn stats_follow_a_write(c: &AgentClient, id: &str, gp: &Path) {
    let sr = stats_req(id);
    let s0 = c.get_volume_stats(ctx(), &sr).unwrap();
    assert!(!s0.condition.abnormal, "{}", s0.condition.message);
    let bytes0 = s0
        .usage
        .iter()
        .find(|u| u.unit.enum_value() == Ok(pb::volume_usage::Unit::BYTES))
        .unwrap()
        .clone();
    std::fs::write(gp.join("big"), vec![7u8; 8 << 20]).unwrap();
    rustix::fs::sync();
    let s1 = c.get_volume_stats(ctx(), &sr).unwrap();
    let bytes1 = s1
        .usage
        .iter()
        .find(|u| u.unit.enum_value() == Ok(pb::volume_usage::Unit::BYTES))
        .unwrap()
        .clone();
    assert!(
        bytes1.used >= bytes0.used + (7 << 20),
        "{bytes0:?} → {bytes1:?}"
    );
    assert!(bytes1.available <= bytes1.total);
    let st = rustix::fs::statfs(gp).unwrap();
    assert_eq!(bytes1.available as u64, st.f_bavail * st.f_frsize as u64);
}

/// Binds: a read-only subpath bind refuses writes; the target is beneath
/// the root; a missing subpath or one through a symlink is refused. The target.
fn bound_read_only(a: &Agent, c: &AgentClient, id: &str, fs: &str) -> std::path::PathBuf {
    let target = a.root.join("pods/p1/data");
    let br = c
        .bind_mount(
            ctx(),
            &bind_req(id, &target, "data", true, pb::RecursiveReadOnly::DISABLED),
        )
        .unwrap();
    assert!(!br.recursive_read_only_applied && !br.already_mounted);
    assert_eq!(std::fs::read(target.join("file")).unwrap(), b"hello");
    let err = std::fs::write(target.join("new"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    assert!(
        c.bind_mount(
            ctx(),
            &bind_req(id, &target, "data", true, pb::RecursiveReadOnly::DISABLED)
        )
        .unwrap()
        .already_mounted
    );
    assert_eq!(
        code(c.bind_mount(
            ctx(),
            &bind_req(id, &target, "", true, pb::RecursiveReadOnly::DISABLED)
        )),
        "ALREADY_EXISTS"
    );
    assert_eq!(
        code(c.bind_mount(
            ctx(),
            &bind_req(
                id,
                &a.root.join("x"),
                "missing",
                false,
                pb::RecursiveReadOnly::DISABLED
            )
        )),
        "NOT_FOUND"
    );
    assert_eq!(
        code(c.bind_mount(
            ctx(),
            &bind_req(
                id,
                &a.root.join("x"),
                "data/link",
                false,
                pb::RecursiveReadOnly::DISABLED
            )
        )),
        "INVALID_ARGUMENT"
    );
    assert!(!is_mount(&a.root.join("x")));
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!(list.volumes.len(), 1);
    assert_eq!(
        list.volumes[0].bind_targets,
        vec![target.display().to_string()]
    );
    assert_eq!(list.volumes[0].fs_type, fs);

    target
}

/// Unpublish takes the binds with it, a second one is a no-op; read back
/// from the disk, data and ownership are there.
fn unpublished_and_read_back(c: &AgentClient, disk: &LoopDisk, id: &str, target: &Path) {
    let ur = unpublish_req(id);
    assert!(c.unpublish_volume(ctx(), &ur).unwrap().was_published);
    assert!(!c.unpublish_volume(ctx(), &ur).unwrap().was_published);
    assert!(mounts_of(&disk.path()).is_empty());
    assert!(!is_mount(target));

    // Read back from the disk: data and ownership are there.
    let m = tempfile::tempdir().unwrap();
    run(
        "mount",
        &["-o", "ro", &disk.path(), m.path().to_str().unwrap()],
    );
    let md = std::fs::metadata(m.path().join("data/file")).unwrap();
    let big = std::fs::metadata(m.path().join("big")).map(|m| m.len());
    run("umount", &[m.path().to_str().unwrap()]);
    assert_eq!((md.gid(), md.mode() & 0o777), (2345, 0o660));
    assert_eq!(big.unwrap(), 8 << 20);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn publish_fsgroup_stats_bind_unpublish_ext4_and_xfs() {
    needs::loop_devices_and_mkfs();
    for fs in ["ext4", "xfs"] {
        let disk = LoopDisk::new(300, Some(fs));
        foreign_content(&disk);
        let a = Agent::start();
        let c = a.client();
        let (req, gp) = published_with_fs_group(&a, &c, &disk, fs);
        let id = req.volume_id.clone();
        stats_follow_a_write(&c, &id, &gp);
        let target = bound_read_only(&a, &c, &id, fs);
        unpublished_and_read_back(&c, &disk, &id, &target);
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn error_codes_have_their_triggers() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let blank = LoopDisk::new(64, None);
    let ext4 = LoopDisk::new(64, Some("ext4"));
    // FAILED_PRECONDITION: no filesystem, and the wrong one. Nothing is written to either disk.
    let before = std::fs::read(&blank.image).unwrap();
    let e = c.publish_volume(ctx(), &publish_req("blank", &blank.path(), "ext4"));
    assert_eq!(code(e.clone()), "FAILED_PRECONDITION");
    assert!(message(e).contains(&blank.path()));
    assert_eq!(
        std::fs::read(&blank.image).unwrap(),
        before,
        "the blank disk was written to"
    );
    assert_eq!(
        code(c.publish_volume(ctx(), &publish_req("wrong", &ext4.path(), "xfs"))),
        "FAILED_PRECONDITION"
    );
    assert!(mounts_of(&ext4.path()).is_empty());
    // FAILED_PRECONDITION: the disk is mounted by someone else already.
    let elsewhere = tempfile::tempdir().unwrap();
    run("mount", &[&ext4.path(), elsewhere.path().to_str().unwrap()]);
    let e = c.publish_volume(ctx(), &publish_req("taken", &ext4.path(), "ext4"));
    run("umount", &[elsewhere.path().to_str().unwrap()]);
    assert_eq!(code(e.clone()), "FAILED_PRECONDITION");
    assert!(message(e).contains("already mounted"));
    // FAILED_PRECONDITION: something else is mounted where the volume goes.
    let squat = a.root.join("volumes/squat");
    std::fs::create_dir_all(&squat).unwrap();
    run("mount", &["-t", "tmpfs", "tmpfs", squat.to_str().unwrap()]);
    let e = c.publish_volume(ctx(), &publish_req("squat", &ext4.path(), "ext4"));
    run("umount", &[squat.to_str().unwrap()]);
    assert_eq!(code(e), "FAILED_PRECONDITION");
    assert!(mounts_of(&ext4.path()).is_empty());
    // INVALID_ARGUMENT: not a block device, bad option rejected by the kernel.
    assert_eq!(
        code(c.publish_volume(ctx(), &publish_req("v", "/dev/null", "ext4"))),
        "INVALID_ARGUMENT"
    );
    let mut bad_opt = publish_req("v", &ext4.path(), "ext4");
    bad_opt.mount_options = vec!["no_such_option_xyz".into()];
    assert_eq!(code(c.publish_volume(ctx(), &bad_opt)), "INVALID_ARGUMENT");
    assert!(mounts_of(&ext4.path()).is_empty());
    // DEADLINE_EXCEEDED: no disk has this serial.
    let mut by_serial = pb::PublishVolumeRequest::new();
    by_serial.volume_id = "s".into();
    by_serial.set_serial("no-such-serial".into());
    by_serial.fs_type = "ext4".into();
    by_serial.timeout_ms = 300;
    assert_eq!(
        code(c.publish_volume(ctx(), &by_serial)),
        "DEADLINE_EXCEEDED"
    );
    // NOT_FOUND: stats, expand and bind of a volume that is not published.
    let sr = stats_req("ghost");
    assert_eq!(code(c.get_volume_stats(ctx(), &sr)), "NOT_FOUND");
    let mut er = pb::ExpandVolumeRequest::new();
    er.volume_id = "ghost".into();
    assert_eq!(code(c.expand_volume(ctx(), &er)), "NOT_FOUND");
    assert_eq!(
        code(c.bind_mount(
            ctx(),
            &bind_req(
                "ghost",
                &a.root.join("g"),
                "",
                false,
                pb::RecursiveReadOnly::DISABLED
            )
        )),
        "NOT_FOUND"
    );
    errors_of_published_volumes(&a, &c, &ext4);
}

/// The errors of calls on published volumes: expand of a read-only one,
/// binds onto a taken target, RRO without read-only, a target outside the
/// root; an unmount of nothing is no error.
fn errors_of_published_volumes(a: &Agent, c: &AgentClient, ext4: &LoopDisk) {
    // FAILED_PRECONDITION: expand of a read-only volume.
    let mut ro = publish_req("ro", &ext4.path(), "ext4");
    ro.read_only = true;
    c.publish_volume(ctx(), &ro).unwrap();
    let mut er = pb::ExpandVolumeRequest::new();
    er.volume_id = "ro".into();
    assert_eq!(code(c.expand_volume(ctx(), &er)), "FAILED_PRECONDITION");
    // ALREADY_EXISTS: the target is another volume's bind, or a mount of something else.
    let other = LoopDisk::new(64, Some("ext4"));
    c.publish_volume(ctx(), &publish_req("two", &other.path(), "ext4"))
        .unwrap();
    let shared = a.root.join("pods/shared");
    let ro_bind = |id: &str, t: &Path| bind_req(id, t, "", true, pb::RecursiveReadOnly::DISABLED);
    c.bind_mount(ctx(), &ro_bind("ro", &shared)).unwrap();
    let e = c.bind_mount(ctx(), &ro_bind("two", &shared));
    assert_eq!(code(e.clone()), "ALREADY_EXISTS");
    assert!(message(e).contains("volume ro"));
    let busy = a.root.join("pods/busy");
    std::fs::create_dir_all(&busy).unwrap();
    run("mount", &["-t", "tmpfs", "tmpfs", busy.to_str().unwrap()]);
    let e = c.bind_mount(ctx(), &ro_bind("two", &busy));
    run("umount", &[busy.to_str().unwrap()]);
    assert_eq!(code(e), "ALREADY_EXISTS");
    assert_eq!(mounts_of(&other.path()).len(), 1, "only the volume itself");
    // INVALID_ARGUMENT: RRO without read-only; a target outside the root.
    assert_eq!(
        code(c.bind_mount(
            ctx(),
            &bind_req(
                "ro",
                &a.root.join("t"),
                "",
                false,
                pb::RecursiveReadOnly::ENABLED
            )
        )),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        code(c.bind_mount(
            ctx(),
            &bind_req(
                "ro",
                Path::new("/tmp/outside"),
                "",
                true,
                pb::RecursiveReadOnly::DISABLED
            )
        )),
        "INVALID_ARGUMENT"
    );
    let mut un = unmount_req("relative/path");
    assert_eq!(code(c.unmount(ctx(), &un)), "INVALID_ARGUMENT");
    // Unmount of something not mounted is a no-op.
    un.target = a.root.join("never").display().to_string();
    assert!(!c.unmount(ctx(), &un).unwrap().was_mounted);
    assert!(a
        .client()
        .get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .is_ok());
}

#[test]
#[ignore = "needs root: make test runs it"]
fn growth_xfs_for_real_ext4_by_capability() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let xfs = LoopDisk::new(300, Some("xfs"));
    c.publish_volume(ctx(), &publish_req("x", &xfs.path(), "xfs"))
        .unwrap();
    let mut er = pb::ExpandVolumeRequest::new();
    er.volume_id = "x".into();
    // Already large enough: no change.
    er.required_bytes = 100 << 20;
    let r0 = c.expand_volume(ctx(), &er).unwrap();
    assert_eq!(r0.device_bytes, 300 << 20);
    // Beyond the device, which never grows: OUT_OF_RANGE after the wait.
    er.required_bytes = 1 << 30;
    er.timeout_ms = 300;
    assert_eq!(code(c.expand_volume(ctx(), &er)), "OUT_OF_RANGE");
    // The device grows while the agent waits.
    let grower = {
        let image = xfs.image.clone();
        let dev = xfs.path();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            std::fs::OpenOptions::new()
                .write(true)
                .open(&image)
                .unwrap()
                .set_len(1 << 30)
                .unwrap();
            run("losetup", &["-c", &dev]);
        })
    };
    er.timeout_ms = 10_000;
    let r = c.expand_volume(ctx(), &er).unwrap();
    grower.join().unwrap();
    assert_eq!(r.device_bytes, 1 << 30);
    let st = rustix::fs::statfs(a.root.join("volumes/x")).unwrap();
    assert!(
        st.f_blocks * st.f_frsize as u64 > 900 << 20,
        "statfs total did not grow"
    );
    assert!(
        r.capacity_bytes as u64 > 900 << 20 && r.capacity_bytes as u64 <= 1 << 30,
        "{r:?}"
    );

    let ext4 = LoopDisk::new(64, Some("ext4"));
    c.publish_volume(ctx(), &publish_req("e", &ext4.path(), "ext4"))
        .unwrap();
    ext4.resize(128);
    er.volume_id = "e".into();
    er.required_bytes = 0;
    let caps = c
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
    let can = caps
        .capabilities
        .iter()
        .any(|c| c.enum_value() == Ok(pb::Capability::CAPABILITY_VOLUME_RESIZE));
    let r = c.expand_volume(ctx(), &er);
    if can {
        assert!(r.unwrap().capacity_bytes > 100 << 20);
    } else {
        let msg = message(r.clone());
        assert_eq!(code(r), "FAILED_PRECONDITION");
        assert!(msg.contains("CAP_SYS_RESOURCE"), "{msg}");
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn recursive_read_only_makes_the_difference() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let disk = LoopDisk::new(64, Some("ext4"));
    c.publish_volume(ctx(), &publish_req("r", &disk.path(), "ext4"))
        .unwrap();
    let gp = a.root.join("volumes/r");
    std::fs::create_dir(gp.join("sub")).unwrap();
    run(
        "mount",
        &["-t", "tmpfs", "tmpfs", gp.join("sub").to_str().unwrap()],
    );
    let plain = a.root.join("plain");
    let rro = a.root.join("rro");
    let r1 = c
        .bind_mount(
            ctx(),
            &bind_req("r", &plain, "", true, pb::RecursiveReadOnly::DISABLED),
        )
        .unwrap();
    let r2 = c
        .bind_mount(
            ctx(),
            &bind_req("r", &rro, "", true, pb::RecursiveReadOnly::ENABLED),
        )
        .unwrap();
    assert!(!r1.recursive_read_only_applied && r2.recursive_read_only_applied);
    std::fs::write(plain.join("sub/ok"), b"x").expect("DISABLED leaves submounts writable");
    let e = std::fs::write(rro.join("sub/no"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    assert_eq!(
        std::fs::write(rro.join("top"), b"x")
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EROFS)
    );
    let r3 = c
        .bind_mount(
            ctx(),
            &bind_req(
                "r",
                &a.root.join("ifp"),
                "",
                true,
                pb::RecursiveReadOnly::IF_POSSIBLE,
            ),
        )
        .unwrap();
    assert!(r3.recursive_read_only_applied);
    let un = unmount_req(rro.display().to_string());
    assert!(c.unmount(ctx(), &un).unwrap().was_mounted);
    assert!(!c.unmount(ctx(), &un).unwrap().was_mounted);
    assert!(!is_mount(&rro));
    let ur = unpublish_req("r");
    // The tmpfs under the volume is unmounted with it.
    assert!(c.unpublish_volume(ctx(), &ur).unwrap().was_published);
    assert!(mounts_of(&disk.path()).is_empty());
}

#[test]
#[ignore = "needs root: make test runs it"]
fn restart_after_kill_takes_the_volumes_back() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(300, Some("xfs"));
    let a = Agent::start();
    let c = a.client();
    c.publish_volume(ctx(), &publish_req("keep", &disk.path(), "xfs"))
        .unwrap();
    let target = a.root.join("pods/k");
    c.bind_mount(
        ctx(),
        &bind_req("keep", &target, "", true, pb::RecursiveReadOnly::ENABLED),
    )
    .unwrap();
    let lost = a.root.join("pods/lost");
    c.bind_mount(
        ctx(),
        &bind_req("keep", &lost, "", false, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    let dir = a.kill9();
    // While the agent is down, one bind goes away behind its back.
    run("umount", &[lost.to_str().unwrap()]);
    let b = Agent::start_in(dir);
    let list = b
        .client()
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!(list.volumes.len(), 1, "{}", b.log());
    assert_eq!(list.volumes[0].volume_id, "keep");
    assert_eq!(
        list.volumes[0].bind_targets,
        vec![target.display().to_string()]
    );
    // The pruned table was written back: a second restart agrees.
    let b = Agent::start_in(b.kill9());
    let c = b.client();
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!(
        list.volumes[0].bind_targets,
        vec![target.display().to_string()]
    );
    let sr = stats_req("keep");
    assert!(!c.get_volume_stats(ctx(), &sr).unwrap().condition.abnormal);
    let ur = unpublish_req("keep");
    assert!(c.unpublish_volume(ctx(), &ur).unwrap().was_published);
    assert!(mounts_of(&disk.path()).is_empty());
}

#[test]
#[ignore = "needs root: make test runs it"]
fn concurrent_publish_of_one_id_mounts_once() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let addr = a.addr();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (addr, dev) = (addr.clone(), disk.path());
            std::thread::spawn(move || {
                let c = connect(&addr).unwrap();
                c.publish_volume(ctx(), &publish_req("same", &dev, "ext4"))
                    .unwrap()
                    .already_published
            })
        })
        .collect();
    let already: Vec<bool> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(already.iter().filter(|a| !**a).count(), 1, "{already:?}");
    assert_eq!(mounts_of(&disk.path()).len(), 1);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn stats_condition_turns_abnormal() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let stats = |id: &str| {
        let sr = stats_req(id);
        c.get_volume_stats(ctx(), &sr).unwrap()
    };
    // Unmounted behind the agent's back.
    let d1 = LoopDisk::new(64, Some("ext4"));
    c.publish_volume(ctx(), &publish_req("u", &d1.path(), "ext4"))
        .unwrap();
    assert!(!stats("u").condition.abnormal);
    run("umount", &[a.root.join("volumes/u").to_str().unwrap()]);
    let s = stats("u");
    assert!(s.condition.abnormal, "{:?}", s.condition);
    // Publishing it again is not "already published": the mount is gone.
    let again = c.publish_volume(ctx(), &publish_req("u", &d1.path(), "ext4"));
    assert_eq!(code(again), "FAILED_PRECONDITION");
    let ur = unpublish_req("u");
    assert!(c.unpublish_volume(ctx(), &ur).unwrap().was_published);
    let back = c
        .publish_volume(ctx(), &publish_req("u", &d1.path(), "ext4"))
        .unwrap();
    assert!(!back.already_published);
    assert!(!stats("u").condition.abnormal);
    // ext4 errors: remounted read-only by errors=remount-ro, errors_count above zero.
    let d2 = LoopDisk::new(64, Some("ext4"));
    let mut req = publish_req("e", &d2.path(), "ext4");
    req.mount_options = vec!["errors=remount-ro".into()];
    c.publish_volume(ctx(), &req).unwrap();
    let name = d2.device.file_name().unwrap().to_str().unwrap().to_string();
    std::fs::write(format!("/sys/fs/ext4/{name}/trigger_fs_error"), b"1").unwrap();
    let s = stats("e");
    assert!(s.condition.abnormal && !s.usage.is_empty(), "{:?}", s);
    assert!(a
        .client()
        .get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .is_ok());
}

#[test]
#[ignore = "needs root: make test runs it"]
fn sigterm_unmounts_and_exits() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let mut a = Agent::start();
    a.client()
        .publish_volume(ctx(), &publish_req("t", &disk.path(), "ext4"))
        .unwrap();
    assert_eq!(mounts_of(&disk.path()).len(), 1);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(a.child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while a.alive() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = a
        .child
        .try_wait()
        .unwrap()
        .expect("agent exited after SIGTERM");
    assert!(status.success(), "{status:?}");
    assert!(
        mounts_of(&disk.path()).is_empty(),
        "SIGTERM left the volume mounted"
    );
}

#[test]
#[ignore = "needs root: make test runs it"]
fn an_ro_option_makes_the_volume_read_only() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let mut req = publish_req("ro-opt", &disk.path(), "ext4");
    req.mount_options = vec!["noatime,ro".into()];
    req.fs_group = fs_group(777, pb::FsGroupChangePolicy::ALWAYS);
    let r = c.publish_volume(ctx(), &req).unwrap();
    assert!(
        r.ownership.skipped,
        "a read-only volume's ownership is left alone"
    );

    let gp = a.root.join("volumes/ro-opt");
    assert_ne!(std::fs::metadata(&gp).unwrap().gid(), 777);
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert!(list.volumes[0].read_only);
    let sr = stats_req("ro-opt");
    assert!(!c.get_volume_stats(ctx(), &sr).unwrap().condition.abnormal);
    let mut er = pb::ExpandVolumeRequest::new();
    er.volume_id = "ro-opt".into();
    assert_eq!(code(c.expand_volume(ctx(), &er)), "FAILED_PRECONDITION");
}

/// kubelet's SELinux context options (KEP-1710's relabel on mount) in a
/// guest without SELinux are left out of the mount and said so in the
/// answer and the log: mount(2) would refuse them (no security module
/// claims `context=`), and so would the publish.
#[test]
#[ignore = "needs root: make test runs it"]
fn selinux_context_options_are_left_out_without_selinux() {
    needs::loop_devices_and_mkfs();
    if crust_agent::sys::sysfs::Sysfs::system().selinux_enabled() {
        // Then they go to the kernel as given (src/mount/selinux.rs's tests).
        eprintln!("this host has SELinux: the options would be passed through, not left out");
        return;
    }
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let label = r#"context="system_u:object_r:container_file_t:s0:c1,c2""#;
    let mut req = publish_req("vol-se", &disk.path(), "ext4");
    req.mount_options = vec![
        "noatime".into(),
        label.into(),
        "fscontext=system_u:object_r:fs_t:s0,nodev".into(),
    ];
    let r = c.publish_volume(ctx(), &req).unwrap();
    assert_eq!(
        r.options_not_applied,
        [label, "fscontext=system_u:object_r:fs_t:s0"]
    );
    let gp = a.root.join("volumes/vol-se").display().to_string();
    // Bytes, decoded for display: another test may have a mount whose path is not UTF-8.
    let table = std::fs::read("/proc/self/mountinfo").unwrap();
    let line = String::from_utf8_lossy(&table)
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(gp.as_str()))
        .unwrap_or_else(|| panic!("{gp} is not mounted"))
        .to_string();
    assert!(
        line.contains("noatime") && line.contains("nodev") && !line.contains("context"),
        "{line}"
    );
    // The same request again: idempotent, and says the same.
    let again = c.publish_volume(ctx(), &req).unwrap();
    assert!(again.already_published);
    assert_eq!(again.options_not_applied, r.options_not_applied);
    assert!(a.log().contains("SELinux options left out"), "{}", a.log());
}

//! Idmapped binds (KEP-127) through the real agent on loop devices: ids
//! read and written through the bind in both directions, with a subpath,
//! recursive read-only and an fsGroup; the refusals; a restart.

mod support;

use std::path::Path;

use crust_protocols::crust_ttrpc::AgentClient;
use crust_testkit::ids::{as_ids, owner};
use support::*;

/// CRI's IDMapping.
fn range(container_id: u32, host_id: u32, length: u32) -> pb::IDMapping {
    pb::IDMapping {
        container_id,
        host_id,
        length,
        ..Default::default()
    }
}

/// A bind of `id` (or `subpath` of it) at `target` for a pod whose uid
/// and gid 0 are host 100000, for 65536 ids.
fn pod_bind(id: &str, target: &Path, subpath: &str, rro: bool) -> pb::BindMountRequest {
    let mode = if rro {
        pb::RecursiveReadOnly::ENABLED
    } else {
        pb::RecursiveReadOnly::DISABLED
    };
    let mut r = bind_req(id, target, subpath, rro, mode);
    r.uid_mappings = vec![range(0, 100000, 65536)];
    r.gid_mappings = vec![range(0, 100000, 65536)];
    r
}

/// Publishes `disk` as `id` (ext4, fsGroup `group` if any) with
/// `data/mine` and the directory `pod` owned on disk by 1000:1000. The
/// guest path.
fn published(
    a: &Agent,
    c: &AgentClient,
    id: &str,
    disk: &LoopDisk,
    group: Option<u32>,
) -> std::path::PathBuf {
    let mut req = publish_req(id, &disk.path(), "ext4");
    let gp = a.root.join("volumes").join(id);
    c.publish_volume(ctx(), &req).unwrap();
    std::fs::create_dir_all(gp.join("data")).unwrap();
    std::fs::write(gp.join("data/mine"), b"1000's").unwrap();
    std::fs::create_dir(gp.join("pod")).unwrap();
    for p in ["data/mine", "pod"] {
        std::os::unix::fs::chown(gp.join(p), Some(1000), Some(1000)).unwrap();
    }
    if let Some(g) = group {
        // Published again with the fsGroup: the walk sets the group on disk.
        c.unpublish_volume(ctx(), &unpublish_req(id)).unwrap();
        req.fs_group = fs_group(g, pb::FsGroupChangePolicy::ALWAYS);
        c.publish_volume(ctx(), &req).unwrap();
    }
    gp
}

/// Makes the file `name` in the directory `dir` (opened by root) as uid
/// and gid `id`.
fn make_as(id: u32, dir: &Path, name: &'static str) -> rustix::io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let dir = std::fs::File::open(dir).unwrap();
    as_ids(id, id, move || {
        let flags = OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC;
        rustix::fs::openat(&dir, name, flags, Mode::from_raw_mode(0o644)).map(drop)
    })
}

/// The proof: a file owned on disk by 1000 is seen through the
/// bind as 101000 from the host, and a file made through it by 101000
/// lands on disk as 1000. Listed with its mappings; a repeat is
/// already_mounted; other mappings at that target ALREADY_EXISTS.
#[test]
#[ignore = "needs root: make test runs it"]
fn an_idmapped_bind_maps_ids_both_ways() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let gp = published(&a, &c, "idm", &disk, None);
    let t = a.root.join("pods/p/vol");
    let req = pod_bind("idm", &t, "", false);
    let r = c.bind_mount(ctx(), &req).unwrap();
    assert!(!r.already_mounted);
    assert_eq!(owner(&t.join("data/mine")), (101000, 101000));
    assert_eq!(
        owner(&gp.join("data/mine")),
        (1000, 1000),
        "the volume itself is not mapped"
    );
    // The bind's directory opened by root: the pod reaches it through its
    // own mount, not through the agent's 0750 directories above it.
    assert_eq!(make_as(101000, &t.join("pod"), "made"), Ok(()));
    assert_eq!(owner(&gp.join("pod/made")), (1000, 1000));
    let e = make_as(4242, &t.join("pod"), "stray");
    assert_eq!(
        e,
        Err(rustix::io::Errno::OVERFLOW),
        "an id the map leaves out"
    );

    let listed = &volumes(&c)[0].binds[0];
    assert_eq!(listed.target, t.display().to_string());
    assert_eq!(
        (listed.uid_mappings.clone(), listed.gid_mappings.clone()),
        (req.uid_mappings.clone(), req.gid_mappings.clone())
    );
    assert!(c.bind_mount(ctx(), &req).unwrap().already_mounted);
    let mut other = req.clone();
    other.uid_mappings = vec![range(0, 200000, 65536)];
    assert_eq!(code(c.bind_mount(ctx(), &other)), "ALREADY_EXISTS");
    let mut plain = req.clone();
    plain.uid_mappings.clear();
    plain.gid_mappings.clear();
    assert_eq!(code(c.bind_mount(ctx(), &plain)), "ALREADY_EXISTS");
    assert_eq!(
        owner(&t.join("data/mine")),
        (101000, 101000),
        "still the first bind"
    );
    assert!(
        c.unmount(ctx(), &unmount_req(t.display().to_string()))
            .unwrap()
            .was_mounted
    );
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("idm"))
            .unwrap()
            .was_published
    );
    assert!(mounts_of(&disk.path()).is_empty());
}

/// A subpath, recursively read-only, of a volume with an fsGroup: the walk
/// wrote the group on disk as kubelet does, and the bind maps it.
#[test]
#[ignore = "needs root: make test runs it"]
fn idmap_with_a_subpath_rro_and_an_fs_group() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let gp = published(&a, &c, "grp", &disk, Some(2345));
    assert_eq!(owner(&gp.join("data/mine")), (1000, 2345));
    let t = a.root.join("pods/p/ro");
    let r = c
        .bind_mount(ctx(), &pod_bind("grp", &t, "data", true))
        .unwrap();
    assert!(r.recursive_read_only_applied);
    assert_eq!(owner(&t.join("mine")), (101000, 102345));
    let e = std::fs::write(t.join("new"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    let m = crust_agent::sys::mountinfo::read().unwrap();
    let e = m.iter().find(|e| e.mount_point == t).unwrap();
    assert!(e.idmapped() && e.read_only(), "{e:?}");
    assert_eq!(e.root, Path::new("/data"));
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("grp"))
            .unwrap()
            .was_published
    );
    assert!(mounts_of(&disk.path()).is_empty());
}

/// A block volume refuses mappings (FAILED_PRECONDITION); mappings that
/// overlap, overflow, are empty or come alone are INVALID_ARGUMENT; each
/// changes nothing. The capability is offered.
#[test]
#[ignore = "needs root: make test runs it"]
fn refusals_change_nothing() {
    needs::loop_devices_and_mkfs();
    let (fs_disk, raw) = (LoopDisk::new(64, Some("ext4")), LoopDisk::new(16, None));
    let a = Agent::start();
    let c = a.client();
    let caps = c
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
    assert!(caps
        .capabilities
        .contains(&pb::Capability::CAPABILITY_IDMAPPED_BINDS.into()));
    c.publish_volume(ctx(), &publish_req("fs", &fs_disk.path(), "ext4"))
        .unwrap();
    c.publish_volume(ctx(), &publish_req("raw", &raw.path(), "block"))
        .unwrap();
    let t = a.root.join("pods/p/x");
    let r = c.bind_mount(ctx(), &pod_bind("raw", &t, "", false));
    assert_eq!(code(r.clone()), "FAILED_PRECONDITION");
    assert!(message(r).contains("block volume"));
    let bad: Vec<(Vec<pb::IDMapping>, Vec<pb::IDMapping>)> = vec![
        (
            vec![range(0, 100000, 10), range(5, 200000, 10)],
            vec![range(0, 1, 1)],
        ),
        (
            vec![range(0, 100000, 10), range(20, 100005, 10)],
            vec![range(0, 1, 1)],
        ),
        (vec![range(0, 4294967290, 10)], vec![range(0, 1, 1)]),
        (vec![range(0, 100000, 0)], vec![range(0, 1, 1)]),
        (vec![range(0, 100000, 1)], vec![]),
        (vec![], vec![range(0, 100000, 1)]),
        (
            (0..341).map(|i| range(i, 1000 + i, 1)).collect(),
            vec![range(0, 1, 1)],
        ),
    ];
    for (uids, gids) in bad {
        let mut r = pod_bind("fs", &t, "", false);
        (r.uid_mappings, r.gid_mappings) = (uids, gids);
        assert_eq!(code(c.bind_mount(ctx(), &r)), "INVALID_ARGUMENT", "{r:?}");
    }
    assert!(!a.root.join("pods").exists(), "nothing made");
    assert!(volumes(&c).iter().all(|v| v.binds.is_empty()));
    assert_eq!(mounts_of(&fs_disk.path()).len(), 1);
    for id in ["fs", "raw"] {
        c.unpublish_volume(ctx(), &unpublish_req(id)).unwrap();
    }
}

/// A restarted agent takes an idmapped bind back with its mappings; a
/// record that says plain for a bind that is idmapped (as an older agent
/// rewrites it) makes the restart take it down, and the next bind makes
/// it again.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_restart_takes_idmapped_binds_back_as_recorded() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&a, &c, "keep", &disk, None);
    let (kept, lost) = (a.root.join("pods/kept"), a.root.join("pods/lost"));
    for t in [&kept, &lost] {
        c.bind_mount(ctx(), &pod_bind("keep", t, "", false))
            .unwrap();
    }
    let dir = a.kill9();
    let record = dir.path().join("root/state/keep.vol");
    let text =
        std::fs::read_to_string(&record).unwrap_or_else(|e| panic!("{}: {e}", record.display()));
    let lost_line = format!("bind_idmap={}\t", lost.display());
    let older: String = text
        .lines()
        .filter(|l| !l.starts_with(&lost_line))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(older, text, "the record had the line");
    std::fs::write(&record, older).unwrap();

    let b = Agent::start_in(dir);
    let c = b.client();
    let v = &volumes(&c)[0];
    assert_eq!(v.bind_targets, [kept.display().to_string()], "{}", b.log());
    assert_eq!(v.binds[0].uid_mappings, [range(0, 100000, 65536)]);
    assert!(!mounts_of(&disk.path()).contains(&lost.display().to_string()));
    assert!(b.log().contains("not idmapped as recorded"), "{}", b.log());
    assert!(
        c.bind_mount(ctx(), &pod_bind("keep", &kept, "", false))
            .unwrap()
            .already_mounted
    );
    assert_eq!(owner(&kept.join("data/mine")), (101000, 101000));
    let again = c
        .bind_mount(ctx(), &pod_bind("keep", &lost, "", false))
        .unwrap();
    assert!(!again.already_mounted);
    assert_eq!(owner(&lost.join("data/mine")), (101000, 101000));
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("keep"))
            .unwrap()
            .was_published
    );
    assert!(mounts_of(&disk.path()).is_empty());
}

/// The embed API takes the same mappings (it serves crust.v1's messages)
/// and lists them.
#[test]
#[ignore = "needs root: make test runs it"]
fn the_embed_api_binds_with_mappings() {
    use crust_agent::embed::{pb as epb, Table};
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let root = tempfile::tempdir().unwrap();
    let t = Table::open(root.path()).unwrap();
    let mut p = epb::PublishVolumeRequest::new();
    p.volume_id = "e".into();
    p.set_device_path(disk.path());
    p.fs_type = "ext4".into();
    let gp = std::path::PathBuf::from(t.publish(&p, None).unwrap().guest_path);
    std::fs::write(gp.join("f"), b"x").unwrap();
    std::os::unix::fs::chown(gp.join("f"), Some(7), Some(8)).unwrap();
    let target = std::fs::canonicalize(root.path()).unwrap().join("pods/e");
    let req = pod_bind("e", &target, "", false);
    assert!(!t.bind(&req, None).unwrap().already_mounted);
    assert_eq!(owner(&target.join("f")), (100007, 100008));
    let listed = t.list();
    assert_eq!(listed.volumes[0].binds[0].gid_mappings, req.gid_mappings);
    let mut u = epb::UnpublishVolumeRequest::new();
    u.volume_id = "e".into();
    assert!(t.unpublish(&u, None).unwrap().was_published);
    assert!(mounts_of(&disk.path()).is_empty());
}

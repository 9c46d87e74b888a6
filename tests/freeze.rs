//! Freeze and thaw, trim and health through the real agent on loop devices
//! with real ext4 and xfs: a write into a frozen volume is seen to block
//! from the host, and every refusal changes nothing. A freeze is a lease:
//! only its id, its timer, an unpublish, the agent stopping or a forced
//! thaw ends it, and a late thaw never ends a newer freeze.

mod support;

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::*;

fn freeze_req(ids: &[&str], timeout_ms: u32) -> pb::FreezeVolumesRequest {
    let mut r = pb::FreezeVolumesRequest::new();
    r.volume_ids = ids.iter().map(|s| s.to_string()).collect();
    r.timeout_ms = timeout_ms;
    r
}

fn thaw_req(freeze_id: &str) -> pb::ThawVolumesRequest {
    let mut r = pb::ThawVolumesRequest::new();
    r.freeze_id = freeze_id.into();
    r
}

fn force_req(ids: &[&str]) -> pb::ThawVolumesRequest {
    let mut r = pb::ThawVolumesRequest::new();
    r.volume_ids = ids.iter().map(|s| s.to_string()).collect();
    r.force = true;
    r
}

/// The text of freeze `id`'s record under the agent's root.
fn record(root: &Path, id: &str) -> String {
    std::fs::read_to_string(root.join(FREEZES_DIR).join(format!("{id}.freeze"))).unwrap_or_default()
}

/// Whether a write into `dir` is held back (for 500 ms): the volume is frozen.
fn blocks(dir: &str, name: &str) -> Option<mpsc::Receiver<()>> {
    let done = write_in(Path::new(dir), name);
    done.recv_timeout(Duration::from_millis(500))
        .is_err()
        .then_some(done)
}

fn health_req(id: &str) -> pb::GetVolumeHealthRequest {
    let mut r = pb::GetVolumeHealthRequest::new();
    r.volume_id = id.into();
    r
}

fn trim_req(id: &str) -> pb::TrimVolumeRequest {
    let mut r = pb::TrimVolumeRequest::new();
    r.volume_id = id.into();
    r
}

/// Writes a file under `dir` on a thread of its own and says when the
/// write (and its fsync) is done.
fn write_in(dir: &Path, name: &str) -> mpsc::Receiver<()> {
    let (tx, rx) = mpsc::channel();
    let path = dir.join(name);
    std::thread::spawn(move || {
        use std::io::Write;
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(b"written").unwrap();
        f.sync_all().unwrap();
        let _ = tx.send(());
    });
    rx
}

/// Publishes `disk` as `id`, answering its guest path.
fn publish(c: &AgentClient, id: &str, disk: &LoopDisk, fs: &str) -> String {
    c.publish_volume(ctx(), &publish_req(id, &disk.path(), fs))
        .unwrap()
        .guest_path
}

use crust_agent::validate::FREEZES_DIR;
use crust_protocols::crust_ttrpc::AgentClient;

#[test]
#[ignore = "needs root: make test runs it"]
fn a_frozen_volume_blocks_writes_until_thawed_and_says_so_everywhere() {
    needs::loop_devices_and_mkfs();
    for fs in ["ext4", "xfs"] {
        let disk = LoopDisk::new(320, Some(fs));
        let a = Agent::start();
        let c = a.client();
        let path = publish(&c, "v", &disk, fs);
        let unix_ms = || {
            u64::try_from(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis(),
            )
            .unwrap()
        };
        let before = unix_ms();
        let f = c
            .freeze_volumes(ctx(), &freeze_req(&["v"], 30_000))
            .unwrap();
        let after = unix_ms();
        assert!(
            (before + 30_000..=after + 30_000).contains(&f.thaw_at_unix_ms),
            "{before} {} {after}",
            f.thaw_at_unix_ms
        );
        assert!(f.freeze_id.starts_with("freeze-"), "{}", f.freeze_id);
        assert_eq!(f.timeout_ms, 30_000);
        // The write blocks, seen from the host.
        let done = write_in(Path::new(&path), "during");
        assert!(
            done.recv_timeout(Duration::from_millis(700)).is_err(),
            "{fs}: a write went through a frozen volume"
        );
        // The list says it, with the time left.
        let l = c
            .list_volumes(ctx(), &pb::ListVolumesRequest::new())
            .unwrap();
        assert_eq!(l.volumes[0].freeze_id, f.freeze_id);
        assert!(l.volumes[0].frozen_ms_left > 20_000 && l.volumes[0].frozen_ms_left <= 30_000);
        // A second freeze is refused, naming the freeze that holds it.
        let again = c.freeze_volumes(ctx(), &freeze_req(&["v"], 0));
        assert_eq!(code(again.clone()), "FAILED_PRECONDITION");
        assert!(message(again).contains(&f.freeze_id));
        // What writes is refused while frozen; stats still answer.
        let mut e = pb::ExpandVolumeRequest::new();
        e.volume_id = "v".into();
        assert_eq!(code(c.expand_volume(ctx(), &e)), "FAILED_PRECONDITION");
        let target = a.root.join("binds/t");
        let b = bind_req("v", &target, "", false, pb::RecursiveReadOnly::DISABLED);
        let refused = c.bind_mount(ctx(), &b);
        assert!(message(refused).contains("is frozen by"));
        assert!(!target.exists(), "a refused bind made its target");
        assert_eq!(
            code(c.trim_volume(ctx(), &trim_req("v"))),
            "FAILED_PRECONDITION"
        );
        assert!(
            !c.get_volume_stats(ctx(), &stats_req("v"))
                .unwrap()
                .condition
                .abnormal
        );
        // Recorded before it was frozen, by its id.
        assert!(record(&a.root, &f.freeze_id).contains("volume=v\tpending"));
        // Thaw by its id: the write ends, and thawing again is fine.
        let t = c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id)).unwrap();
        assert_eq!(t.thawed, vec!["v".to_string()]);
        done.recv_timeout(Duration::from_secs(10))
            .expect("the write ends after the thaw");
        let t = c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id)).unwrap();
        assert!(t.thawed.is_empty());
        let l = c
            .list_volumes(ctx(), &pb::ListVolumesRequest::new())
            .unwrap();
        assert_eq!(l.volumes[0].freeze_id, "");
        assert!(record(&a.root, &f.freeze_id).contains("volume=v\tended\tthawed\t"));
        c.unpublish_volume(ctx(), &unpublish_req("v")).unwrap();
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_freeze_is_all_or_none() {
    needs::loop_devices_and_mkfs();
    let (d1, d2) = (LoopDisk::new(64, Some("ext4")), LoopDisk::new(64, None));
    let a = Agent::start();
    let c = a.client();
    let path = publish(&c, "fs", &d1, "ext4");
    publish(&c, "blk", &d2, "block");
    // An unknown id: NOT_FOUND; a block volume: FAILED_PRECONDITION. Both
    // leave the first volume writable.
    for (ids, want) in [
        (vec!["fs", "nope"], "NOT_FOUND"),
        (vec!["fs", "blk"], "FAILED_PRECONDITION"),
    ] {
        let r = c.freeze_volumes(ctx(), &freeze_req(&ids, 0));
        assert_eq!(code(r), want, "{ids:?}");
        write_in(Path::new(&path), "after")
            .recv_timeout(Duration::from_secs(10))
            .expect("the volume a failed freeze froze first is thawed");
    }
    // Bad requests: INVALID_ARGUMENT, nothing frozen.
    let many: Vec<String> = (0..65).map(|n| format!("v{n}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    for (ids, timeout) in [
        (vec![], 0),
        (many, 0),
        (vec!["fs", "fs"], 0),
        (vec!["../x"], 0),
        (vec!["fs"], 600_001),
    ] {
        let r = c.freeze_volumes(ctx(), &freeze_req(&ids, timeout));
        assert_eq!(code(r), "INVALID_ARGUMENT", "{ids:?} {timeout}");
    }
    // A thaw names its freeze, or forces volumes; never volumes alone.
    let mut both = force_req(&["fs"]);
    both.freeze_id = "f-1".into();
    let mut ids_and_id = thaw_req("f-1");
    ids_and_id.volume_ids = vec!["fs".into()];
    for (r, why) in [
        (force_req(&[]), "neither"),
        (pb::ThawVolumesRequest::new(), "neither"),
        (thaw_req("../x"), "freeze_id"),
        (thaw_req(&"x".repeat(129)), "freeze_id"),
        (both, "force ends whatever"),
        (ids_and_id, "takes no volume_ids"),
        (
            {
                let mut r = force_req(&["fs"]);
                r.force = false;
                r
            },
            "another caller's freeze",
        ),
    ] {
        let r = c.thaw_volumes(ctx(), &r);
        assert_eq!(code(r.clone()), "INVALID_ARGUMENT", "{why}");
        assert!(
            why == "neither" || message(r.clone()).contains(why),
            "{}",
            message(r)
        );
    }
    let mut own = freeze_req(&["fs"], 0);
    own.freeze_id = "-x".into();
    assert_eq!(code(c.freeze_volumes(ctx(), &own)), "INVALID_ARGUMENT");
    assert_eq!(
        code(c.thaw_volumes(ctx(), &thaw_req("f-never"))),
        "NOT_FOUND"
    );
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert!(l.volumes.iter().all(|v| v.freeze_id.is_empty()));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_freeze_nobody_thaws_ends_by_itself_and_the_thaw_says_when() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(320, Some("xfs"));
    let a = Agent::start();
    let c = a.client();
    let path = publish(&c, "v", &disk, "xfs");
    let start = Instant::now();
    let f = c.freeze_volumes(ctx(), &freeze_req(&["v"], 1_000)).unwrap();
    write_in(Path::new(&path), "waits")
        .recv_timeout(Duration::from_secs(10))
        .expect("the freeze ended at its timeout");
    assert!(start.elapsed() >= Duration::from_millis(900));
    let r = c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id));
    assert_eq!(code(r.clone()), "ABORTED");
    assert!(message(r).contains("thawed by the agent when its timeout passed"));
    assert!(a.log().contains("freeze ended by itself"));
    assert!(record(&a.root, &f.freeze_id).contains("ended\ttimeout"));
    // A new freeze starts afresh.
    let g = c.freeze_volumes(ctx(), &freeze_req(&["v"], 0)).unwrap();
    assert_ne!(f.freeze_id, g.freeze_id);
    assert_eq!(
        c.thaw_volumes(ctx(), &thaw_req(&g.freeze_id))
            .unwrap()
            .thawed
            .len(),
        1
    );
}

/// Backup A's freeze ends at its timeout while its snapshot is slow;
/// backup B freezes the volume; A's late thaw answers ABORTED and leaves
/// B's freeze in force (a write still blocks); B's thaw is OK.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_late_thaw_never_ends_the_next_backups_freeze() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let path = publish(&c, "v1", &disk, "ext4");
    let fa = c
        .freeze_volumes(ctx(), &freeze_req(&["v1"], 1_000))
        .unwrap();
    write_in(Path::new(&path), "between")
        .recv_timeout(Duration::from_secs(10))
        .expect("A's freeze ended at its timeout");
    let fb = c
        .freeze_volumes(ctx(), &freeze_req(&["v1"], 60_000))
        .unwrap();
    let late = c.thaw_volumes(ctx(), &thaw_req(&fa.freeze_id));
    assert_eq!(code(late.clone()), "ABORTED", "{}", message(late));
    let held = blocks(&path, "during-b").expect("A's late thaw ended B's freeze");
    let t = c.thaw_volumes(ctx(), &thaw_req(&fb.freeze_id)).unwrap();
    assert_eq!(t.thawed, vec!["v1".to_string()]);
    held.recv_timeout(Duration::from_secs(10))
        .expect("B's thaw lets the write go");
}

/// A caller's own id: a retried call answers the same freeze; a forced
/// thaw ends it and its own thaw hears so; the id is never taken again.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_callers_id_and_a_forced_thaw() {
    needs::loop_devices_and_mkfs();
    let (d1, d2) = (
        LoopDisk::new(64, Some("ext4")),
        LoopDisk::new(320, Some("xfs")),
    );
    let a = Agent::start();
    let c = a.client();
    let (p1, p2) = (publish(&c, "a", &d1, "ext4"), publish(&c, "b", &d2, "xfs"));
    let mut own = freeze_req(&["a", "b"], 60_000);
    own.freeze_id = "velero:nightly.1".into();
    let f = c.freeze_volumes(ctx(), &own).unwrap();
    assert_eq!(f.freeze_id, "velero:nightly.1");
    let again = c.freeze_volumes(ctx(), &own).unwrap();
    assert_eq!(
        (again.freeze_id, again.thaw_at_unix_ms),
        (f.freeze_id.clone(), f.thaw_at_unix_ms)
    );
    // An operator forces "b" (and names a volume that is not there).
    let r = c.thaw_volumes(ctx(), &force_req(&["b", "gone"]));
    assert_eq!(code(r.clone()), "NOT_FOUND");
    assert!(message(r).contains("volume gone is not published here"));
    write_in(Path::new(&p2), "f")
        .recv_timeout(Duration::from_secs(10))
        .expect("b thawed");
    assert!(blocks(&p1, "f").is_some(), "a stays frozen");
    let r = c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id));
    assert_eq!(code(r.clone()), "ABORTED");
    assert!(message(r).contains("volume b thawed by a forced thaw"));
    write_in(Path::new(&p1), "g")
        .recv_timeout(Duration::from_secs(10))
        .expect("a thawed");
    assert_eq!(code(c.freeze_volumes(ctx(), &own)), "ALREADY_EXISTS");
    assert!(a.log().contains("forced thaw"));
}

/// A freeze whose volume was unpublished (its pod deleted): its thaw ends
/// the rest and answers ABORTED naming that volume.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_thaw_thaws_what_it_can_when_a_volume_is_gone() {
    needs::loop_devices_and_mkfs();
    let (d1, d2) = (
        LoopDisk::new(64, Some("ext4")),
        LoopDisk::new(64, Some("ext4")),
    );
    let a = Agent::start();
    let c = a.client();
    publish(&c, "a", &d1, "ext4");
    let p2 = publish(&c, "b", &d2, "ext4");
    let f = c
        .freeze_volumes(ctx(), &freeze_req(&["a", "b"], 60_000))
        .unwrap();
    c.unpublish_volume(ctx(), &unpublish_req("a")).unwrap();
    let held = blocks(&p2, "x").expect("b is still frozen");
    let r = c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id));
    assert_eq!(code(r.clone()), "ABORTED");
    assert!(message(r).contains("volume a thawed when the volume was unpublished"));
    held.recv_timeout(Duration::from_secs(10))
        .expect("b thawed all the same");
}

#[test]
#[ignore = "needs root: make test runs it"]
fn unpublish_and_shutdown_thaw_first() {
    needs::loop_devices_and_mkfs();
    let (d1, d2) = (
        LoopDisk::new(64, Some("ext4")),
        LoopDisk::new(320, Some("xfs")),
    );
    let a = Agent::start();
    let c = a.client();
    let p1 = publish(&c, "a", &d1, "ext4");
    publish(&c, "b", &d2, "xfs");
    c.freeze_volumes(ctx(), &freeze_req(&["a", "b"], 0))
        .unwrap();
    let blocked = write_in(Path::new(&p1), "f");
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("a"))
            .unwrap()
            .was_published
    );
    // The blocked writer was let go with the thaw (its file may live on
    // the unmounted filesystem: the write itself finished).
    blocked
        .recv_timeout(Duration::from_secs(10))
        .expect("unpublish thawed the writer");
    assert!(mounts_of(&d1.path()).is_empty());
    let r = c.shutdown(ctx(), &pb::ShutdownRequest::new()).unwrap();
    assert_eq!(r.volumes_unmounted, 1);
    assert!(mounts_of(&d2.path()).is_empty());
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_kill_9_while_frozen_is_thawed_by_the_next_agent() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let path = publish(&c, "v", &disk, "ext4");
    let f = c
        .freeze_volumes(ctx(), &freeze_req(&["v"], 600_000))
        .unwrap();
    assert!(record(&a.root, &f.freeze_id).contains("pending"));
    let dir = a.kill9();
    let blocked = write_in(Path::new(&path), "f");
    assert!(blocked.recv_timeout(Duration::from_millis(500)).is_err());
    let b = Agent::start_in(dir);
    blocked
        .recv_timeout(Duration::from_secs(10))
        .expect("the restarted agent thawed the volume");
    assert!(
        b.log()
            .contains("thawed a volume a previous run left frozen"),
        "{}",
        b.log()
    );
    let c = b.client();
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!((l.volumes.len(), l.volumes[0].freeze_id.as_str()), (1, ""));
    assert!(record(&b.root, &f.freeze_id).contains("ended\trestart"));
    // The late thaw hears of the restart; a new freeze gets a new id.
    let r = c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id));
    assert_eq!(code(r.clone()), "ABORTED");
    assert!(message(r).contains("after the agent that froze it died"));
    let g = c.freeze_volumes(ctx(), &freeze_req(&["v"], 0)).unwrap();
    assert_ne!(g.freeze_id, f.freeze_id);
    c.unpublish_volume(ctx(), &unpublish_req("v")).unwrap();
}

#[test]
#[ignore = "needs root: make test runs it"]
fn trim_gives_deleted_blocks_back_to_the_disk() {
    needs::loop_devices_and_mkfs();
    for fs in ["ext4", "xfs"] {
        let disk = LoopDisk::new(320, Some(fs));
        let a = Agent::start();
        let c = a.client();
        let path = publish(&c, "v", &disk, fs);
        c.trim_volume(ctx(), &trim_req("v")).unwrap();
        let file = Path::new(&path).join("big");
        std::fs::write(&file, vec![0x5a; 64 << 20]).unwrap();
        run("sync", &[]);
        let before = allocated(&disk.image);
        std::fs::remove_file(&file).unwrap();
        run("sync", &[]);
        // xfs frees a deleted file's blocks in the background (inodegc),
        // and skips extents its log has not yet committed free: a trim
        // right after the delete may find them still busy, as fstrim would.
        let mut after = before;
        for _ in 0..50 {
            let t = c.trim_volume(ctx(), &trim_req("v")).unwrap();
            assert!(t.covered_bytes > 200 << 20);
            after = allocated(&disk.image);
            if before - after >= 60 << 20 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(
            before - after >= 60 << 20,
            "{fs}: the image kept its blocks ({before} -> {after})"
        );
        // A block volume and an unknown id are refused.
        assert_eq!(code(c.trim_volume(ctx(), &trim_req("nope"))), "NOT_FOUND");
        c.unpublish_volume(ctx(), &unpublish_req("v")).unwrap();
    }
}

/// Bytes the file holds on its filesystem.

#[test]
#[ignore = "needs root: make test runs it"]
fn trim_stops_at_the_callers_deadline_with_what_it_did() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    publish(&c, "v", &disk, "ext4");
    // A deadline gone by the time the trim looks at it, sent by hand (a
    // ttrpc client would stop waiting before the answer comes).
    let mut raw = support::raw::Raw::connect(&a.sock);
    raw.send(&support::raw::request_within(
        1,
        "TrimVolume",
        &trim_req("v"),
        Duration::from_nanos(1),
    ));
    let (code, message) = raw.status(1);
    assert_eq!(code, "DEADLINE_EXCEEDED", "{message}");
    assert!(
        message.contains("while trimming volume v: stopped after 0 of"),
        "{message}"
    );
    assert!(a.log().contains("trim stopped"));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn health_speaks_csi_for_healthy_broken_failed_and_unknown_volumes() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let path = publish(&c, "v", &disk, "ext4");
    assert!(c
        .get_volume_health(ctx(), &health_req("v"))
        .unwrap()
        .health
        .is_empty());
    // Unmounted behind the agent's back: INACCESSIBLE.
    run("umount", &[&path]);
    let h = c.get_volume_health(ctx(), &health_req("v")).unwrap().health;
    assert!(!h.is_empty());
    assert_eq!(
        h[0].status.enum_value().unwrap(),
        pb::volume_health::Status::INACCESSIBLE
    );
    assert_eq!(h[0].reason, "Unmounted");
    assert!(
        h[0].message.contains("no longer a mount point"),
        "{}",
        h[0].message
    );
    c.unpublish_volume(ctx(), &unpublish_req("v")).unwrap();
    // A publish that failed: INACCESSIBLE with its failure; then forgotten
    // by a publish that works.
    let r = c.publish_volume(ctx(), &publish_req("w", &disk.path(), "xfs"));
    let failure = message(r);
    let h = c.get_volume_health(ctx(), &health_req("w")).unwrap().health;
    assert_eq!((h.len(), h[0].reason.as_str()), (1, "PublishFailed"));
    assert_eq!(h[0].message, failure);
    publish(&c, "w", &disk, "ext4");
    assert!(c
        .get_volume_health(ctx(), &health_req("w"))
        .unwrap()
        .health
        .is_empty());
    // An id never seen: NOT_FOUND; a malformed one: INVALID_ARGUMENT.
    assert_eq!(
        code(c.get_volume_health(ctx(), &health_req("never"))),
        "NOT_FOUND"
    );
    assert_eq!(
        code(c.get_volume_health(ctx(), &health_req("../x"))),
        "INVALID_ARGUMENT"
    );
}

#[test]
fn capabilities_advertise_freeze_trim_and_health() {
    let a = Agent::start();
    let caps = a
        .client()
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap()
        .capabilities;
    for want in [
        pb::Capability::CAPABILITY_FREEZE,
        pb::Capability::CAPABILITY_TRIM,
        pb::Capability::CAPABILITY_VOLUME_HEALTH,
    ] {
        assert!(caps.contains(&want.into()), "{want:?}");
    }
}

/// An embedder's table dropped without `shutdown` while a volume is frozen
/// ends its freeze and its timer before the root is let go, whichever
/// comes first: the drop before the old freeze's timeout, or the timeout
/// before the drop. A table opened next on the root keeps its own freeze
/// past the old timeout, and its thaw is OK; the old id hears how it ended.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_dropped_table_leaves_no_timer_to_thaw_the_next_tables_freeze() {
    use crust_agent::embed::{pb as epb, Table};
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let root = tempfile::tempdir().unwrap();
    let freeze = |t: &Table, ms: u32| {
        let mut r = epb::FreezeVolumesRequest::new();
        r.volume_ids = vec!["v".into()];
        r.timeout_ms = ms;
        t.freeze(&r, None).unwrap().freeze_id
    };
    let thaw = |t: &Table, id: &str| {
        let mut r = epb::ThawVolumesRequest::new();
        r.freeze_id = id.into();
        t.thaw(&r)
    };
    let mut t1 = Table::open(root.path()).unwrap();
    let mut p = epb::PublishVolumeRequest::new();
    p.volume_id = "v".into();
    p.set_device_path(disk.path());
    p.fs_type = "ext4".into();
    let path = t1.publish(&p, None).unwrap().guest_path;
    for timer_first in [false, true] {
        let old = freeze(&t1, 1_000);
        if timer_first {
            write_in(Path::new(&path), "old")
                .recv_timeout(Duration::from_secs(10))
                .expect("the old freeze ends at its timeout");
        }
        drop(t1);
        write_in(Path::new(&path), "free")
            .recv_timeout(Duration::from_secs(10))
            .expect("nothing is left frozen by a dropped table");
        let t2 = Table::open(root.path()).unwrap();
        let new = freeze(&t2, 60_000);
        assert_ne!(old, new, "ids never repeat across tables");
        std::thread::sleep(Duration::from_millis(1_500));
        let held = blocks(&path, "during").expect("the old table's timer thawed the new freeze");
        assert_eq!(thaw(&t2, &new).unwrap().thawed, vec!["v".to_string()]);
        held.recv_timeout(Duration::from_secs(10)).expect("thawed");
        let e = thaw(&t2, &old).unwrap_err();
        assert_eq!(e.code.name(), "ABORTED", "{e}");
        let said = if timer_first {
            "timeout passed"
        } else {
            "when the agent stopped"
        };
        assert!(e.message.contains(said), "{e}");
        t1 = t2;
    }
    t1.shutdown();
}

/// "OK while it held every one of its volumes up to now". Something else
/// in the guest thaws the agent's frozen filesystem (`fsfreeze -u`, which
/// any root process may run; sysrq's emergency thaw), a write goes
/// through, and the agent's FITHAW says EINVAL (not frozen): the thaw by
/// the freeze's id answers ABORTED, saying the volume was found thawed by
/// something else, so the backup does not keep a torn snapshot.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_freeze_thawed_behind_the_agents_back_is_reported_as_lost() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(320, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let path = publish(&c, "v", &disk, "ext4");
    let f = c
        .freeze_volumes(ctx(), &freeze_req(&["v"], 60_000))
        .unwrap();
    let out = std::process::Command::new("fsfreeze")
        .args(["-u", &path])
        .output()
        .expect("fsfreeze");
    assert!(out.status.success(), "{out:?}");
    write_in(Path::new(&path), "torn")
        .recv_timeout(Duration::from_secs(10))
        .expect("the write goes through: the filesystem is thawed");
    match c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id)) {
        Ok(t) => panic!(
            "told OK (thawed {:?}) though a write went through before this thaw",
            t.thawed
        ),
        r => {
            assert_eq!(code(r.clone()), "ABORTED");
            assert!(message(r).contains("found thawed by something other than the agent"));
        }
    }
}

/// "A filesystem frozen by something else in the guest is refused, never
/// thawed by the agent." A freeze's end that cannot be recorded (a full
/// state filesystem) must not leave a record saying "pending": after a
/// kill -9, the next agent would thaw whatever freeze holds that volume
/// then, another backup tool's `fsfreeze -f`, whose snapshot would be
/// torn. The record of a freeze with nothing left frozen is removed
/// instead (an unlink needs no space).
#[test]
#[ignore = "needs root: make test runs it"]
fn a_restart_never_thaws_another_tools_freeze_after_an_unrecorded_end() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(320, Some("ext4"));
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_path_buf();
    let state = base.join("root/state");
    std::fs::create_dir_all(&state).unwrap();
    let tmpfs = ["-t", "tmpfs", "-o", "size=256k,mode=700", "crust-state"];
    let mounted = std::process::Command::new("mount")
        .args(tmpfs)
        .arg(&state)
        .status()
        .unwrap();
    assert!(mounted.success());
    let a = Agent::start_in(dir);
    let c = a.client();
    let path = publish(&c, "v", &disk, "ext4");
    let mut r = freeze_req(&["v"], 300_000);
    r.freeze_id = "snap-1".into();
    c.freeze_volumes(ctx(), &r).unwrap();
    {
        use std::io::Write;
        let mut f = std::fs::File::create_new(state.join("filler")).unwrap();
        while f.write_all(&[0u8; 4096]).is_ok() {}
    }
    // It held: OK, though its end could not be recorded.
    c.thaw_volumes(ctx(), &thaw_req("snap-1")).unwrap();
    drop(c);
    let dir = a.kill9();
    let fsfreeze = |how: &str| {
        std::process::Command::new("fsfreeze")
            .args([how, &path])
            .status()
            .unwrap()
            .success()
    };
    assert!(fsfreeze("-f"), "another tool's freeze");
    std::fs::remove_file(state.join("filler")).unwrap();
    let a = Agent::start_in(dir);
    let held = blocks(&path, "during-the-other-tools-snapshot");
    let still_frozen = fsfreeze("-u");
    if let Some(w) = held {
        w.recv_timeout(Duration::from_secs(10)).unwrap();
    }
    drop(a);
    let _ = std::process::Command::new("umount").arg(&state).status();
    let _ = std::fs::remove_dir_all(&base);
    assert!(
        still_frozen,
        "the restarted agent thawed a freeze it never made (another tool's)"
    );
}

/// "OK while it held every one of its volumes up to now", on a real
/// kernel. A forced thaw of a freeze of 24 volumes thaws them one FITHAW
/// after another and records them after the last: v0's writer gets
/// through at once, and the freeze's own thaw, sent after that write
/// finished, must hear ABORTED (its snapshot may hold the write), never OK.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_thaw_sent_after_a_forced_thaw_let_a_write_through_hears_aborted() {
    needs::loop_devices_and_mkfs();
    const N: usize = 24;
    let disks: Vec<LoopDisk> = (0..N).map(|_| LoopDisk::new(16, Some("ext4"))).collect();
    let a = Agent::start();
    let c = a.client();
    let ids: Vec<String> = (0..N).map(|i| format!("v{i}")).collect();
    let mut paths = Vec::new();
    for (id, d) in ids.iter().zip(&disks) {
        paths.push(publish(&c, id, d, "ext4"));
    }
    let names: Vec<&str> = ids.iter().map(String::as_str).collect();
    for round in 0..3 {
        let f = c
            .freeze_volumes(ctx(), &freeze_req(&names, 60_000))
            .unwrap();
        let written = write_in(Path::new(&paths[0]), &format!("w{round}"));
        assert!(written.recv_timeout(Duration::from_millis(200)).is_err());
        let (c2, all) = (a.client(), ids.clone());
        let forced = std::thread::spawn(move || {
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            c2.thaw_volumes(ctx(), &force_req(&refs))
        });
        written
            .recv_timeout(Duration::from_secs(10))
            .expect("the forced thaw lets v0's write through");
        let r = c.thaw_volumes(ctx(), &thaw_req(&f.freeze_id));
        forced.join().unwrap().unwrap();
        match r {
            Ok(t) => panic!(
                "round {round}: told OK (thawed {:?}) though a write went through v0 before this thaw was sent",
                t.thawed
            ),
            r => assert_eq!(code(r), "ABORTED"),
        }
    }
}

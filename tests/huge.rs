//! Huge volumes (semantics.md §4.1): a publish's fsGroup walk belongs to the
//! volume, not to the call. Against the real agent on loop ext4, with trees
//! just big enough for a walk to outlive a deadline of a few milliseconds:
//! the deadline answer, the walk going on, the join, other parameters,
//! unpublish mid-walk, a crash mid-walk, and memory bounded through a huge
//! directory and a deep tree.

mod support;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crust_protocols::protobuf::Message;
use support::raw::{request_within, Raw};
use support::*;

const GID: u32 = 4321;

/// A loop ext4 of `files` empty files in directories of 1,000 under
/// `tree/` (plus the directories and the root: `files + files/1000 + 2`
/// entries), made on the host.
fn tree_disk(files: usize) -> (LoopDisk, u64) {
    let inodes = (files + files / 1000 + 1000).to_string();
    let disk = LoopDisk::with_mkfs(512, Some("ext4"), &["-N", &inodes]);
    let m = disk.scratch("fill");
    run("mount", &[&disk.path(), m.to_str().unwrap()]);
    for i in 0..files {
        let dir = m.join(format!("tree/d{}", i / 1000));
        if i % 1000 == 0 {
            std::fs::create_dir_all(&dir).unwrap();
        }
        std::fs::File::create(dir.join(format!("f{i}"))).unwrap();
    }
    run("umount", &[m.to_str().unwrap()]);
    // lost+found, tree/, its directories and files, and the root.
    let entries = 1 + 1 + files.div_ceil(1000) as u64 + files as u64 + 1;
    (disk, entries)
}

/// Entries beneath `dir` (itself included) whose group is `gid`.
fn with_gid(dir: &Path, gid: u32) -> u64 {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if std::fs::symlink_metadata(&d).is_ok_and(|m| m.gid() == gid) {
            n += 1;
        }
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(p),
                _ => {
                    if e.metadata().is_ok_and(|m| m.gid() == gid) {
                        n += 1;
                    }
                }
            }
        }
    }
    n
}

fn walk_req(id: &str, disk: &LoopDisk, gid: u32) -> pb::PublishVolumeRequest {
    let mut req = publish_req(id, &disk.path(), "ext4");
    req.fs_group = fs_group(gid, pb::FsGroupChangePolicy::ALWAYS);
    req
}

/// A publish sent as raw frames with the deadline `timeout`: its answer's
/// code and message.
fn publish_with_deadline(
    a: &Agent,
    req: &pb::PublishVolumeRequest,
    timeout: Duration,
) -> (String, String) {
    let mut raw = Raw::connect(&a.sock);
    raw.send(&request_within(1, "PublishVolume", req, timeout));
    raw.status(1)
}

fn listed(a: &Agent, id: &str) -> Option<pb::VolumeInfo> {
    a.client()
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap()
        .volumes
        .into_iter()
        .find(|v| v.volume_id == id)
}

fn publishing(v: &pb::VolumeInfo) -> bool {
    v.state.enum_value() == Ok(pb::VolumeState::VOLUME_STATE_PUBLISHING)
}

/// Waits (up to a minute) until volume `id` is listed ready.
fn until_ready(a: &Agent, id: &str) -> pb::VolumeInfo {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let v = listed(a, id).unwrap_or_else(|| panic!("{id} is not listed; log:\n{}", a.log()));
        if !publishing(&v) {
            return v;
        }
        assert!(
            Instant::now() < end,
            "{id} still publishing after a minute: {v:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn applied_lines(a: &Agent) -> usize {
    a.log().matches("fsGroup applied").count()
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_walk_outlives_its_callers_deadline_and_a_retry_joins_it() {
    needs::loop_devices_and_mkfs();
    let (disk, entries) = tree_disk(100_000);
    let a = Agent::start();
    let c = a.client();
    let req = walk_req("huge", &disk, GID);

    // The deadline passes mid-walk: DEADLINE_EXCEEDED, saying the walk goes on.
    let (code, msg) = publish_with_deadline(&a, &req, Duration::from_millis(5));
    assert_eq!(code, "DEADLINE_EXCEEDED", "{msg}");
    assert!(
        msg.contains("the walk continues") && msg.contains("entries so far"),
        "{msg}"
    );
    // The same publish again, at once: it joins the walk.
    let joiner = {
        let (sock, req) = (a.sock.clone(), req.clone());
        std::thread::spawn(move || {
            let mut raw = Raw::connect(&sock);
            raw.s
                .set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            raw.send(&request_within(
                1,
                "PublishVolume",
                &req,
                Duration::from_secs(60),
            ));
            let (_, _, r) = raw.answer();
            r
        })
    };
    // While it walks: stats is refused, saying why; the list shows it
    // publishing, with its progress; other parameters are refused, naming
    // what differs.
    let stats = c.get_volume_stats(ctx(), &stats_req("huge"));
    let stats = said(&stats);
    assert!(
        stats.starts_with("FAILED_PRECONDITION") && stats.contains("still applying fsGroup"),
        "{stats}"
    );
    let other = c.publish_volume(ctx(), &walk_req("huge", &disk, GID + 1));
    let other = said(&other);
    assert!(
        other.starts_with("ALREADY_EXISTS") && other.contains("fs_group"),
        "{other}"
    );
    let mut progress = Vec::new();
    while let Some(v) = listed(&a, "huge").filter(publishing) {
        progress.push(v.ownership_done);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!progress.is_empty(), "never listed as publishing");
    assert!(
        progress.windows(2).all(|w| w[0] <= w[1]) && progress.iter().all(|&n| n <= entries),
        "{progress:?}"
    );

    // The join answers OK with the walk's report when it ends: the whole
    // tree visited by one walk (one "fsGroup applied" in the log).
    let joined = joiner.join().unwrap();
    assert_eq!(joined.status.code.value(), 0, "{:?}", joined.status);
    let joined = pb::PublishVolumeResponse::parse_from_bytes(&joined.payload).unwrap();
    let report = joined.ownership.as_ref().expect("the walk's report");
    assert_eq!(
        (report.visited, report.changed),
        (entries, entries),
        "{report:?}"
    );
    assert!(!joined.already_published);
    assert_eq!(
        applied_lines(&a),
        1,
        "the join restarted the walk:\n{}",
        a.log()
    );
    let gp = a.root.join("volumes/huge");
    assert_eq!(with_gid(&gp, GID), entries);
    let v = listed(&a, "huge").unwrap();
    assert!(!publishing(&v) && v.ownership_done == 0, "{v:?}");
    assert!(c.get_volume_stats(ctx(), &stats_req("huge")).is_ok());
    // Once done, a repeat is the plain idempotent answer.
    let again = c.publish_volume(ctx(), &req).unwrap();
    assert!(again.already_published && again.ownership.is_none());
    eprintln!(
        "progress seen while publishing: {progress:?}\n{}",
        a.log()
            .lines()
            .filter(|l| l.contains("fsGroup applied"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_caller_that_goes_away_leaves_the_walk_running() {
    needs::loop_devices_and_mkfs();
    let (disk, entries) = tree_disk(60_000);
    let a = Agent::start();
    let req = walk_req("gone", &disk, GID);
    {
        let mut raw = Raw::connect(&a.sock);
        raw.send(&request_within(
            1,
            "PublishVolume",
            &req,
            Duration::from_secs(60),
        ));
        // Gone once the walk has started.
        let end = Instant::now() + Duration::from_secs(30);
        while !listed(&a, "gone").is_some_and(|v| publishing(&v)) {
            assert!(Instant::now() < end, "never publishing:\n{}", a.log());
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    until_ready(&a, "gone");
    assert_eq!(with_gid(&a.root.join("volumes/gone"), GID), entries);
    assert_eq!(applied_lines(&a), 1, "{}", a.log());
    let again = a.client().publish_volume(ctx(), &req).unwrap();
    assert!(again.already_published, "{again:?}");
}

#[test]
#[ignore = "needs root: make test runs it"]
fn unpublish_mid_walk_stops_the_walk_and_takes_the_volume_down() {
    needs::loop_devices_and_mkfs();
    let (disk, entries) = tree_disk(100_000);
    let a = Agent::start();
    let c = a.client();
    let req = walk_req("stop", &disk, GID);
    let (code, msg) = publish_with_deadline(&a, &req, Duration::from_millis(5));
    assert_eq!(code, "DEADLINE_EXCEEDED", "{msg}");
    let start = Instant::now();
    let r = c.unpublish_volume(ctx(), &unpublish_req("stop")).unwrap();
    let took = start.elapsed();
    assert!(r.was_published);
    eprintln!("unpublish mid-walk took {took:?}");
    // Down: not mounted, not listed, and the walk stopped short (it never
    // said it was applied; the disk's tree is partly changed).
    assert!(mounts_of(&disk.path()).is_empty());
    assert!(listed(&a, "stop").is_none());
    assert_eq!(applied_lines(&a), 0, "{}", a.log());
    let m = disk.scratch("check");
    run("mount", &[&disk.path(), m.to_str().unwrap()]);
    let changed = with_gid(&m, GID);
    run("umount", &[m.to_str().unwrap()]);
    assert!(
        changed < entries,
        "the walk was not stopped: {changed} of {entries}"
    );
    // Published again, it walks from the top and finishes.
    let done = c.publish_volume(ctx(), &req).unwrap();
    assert_eq!(done.ownership.as_ref().unwrap().visited, entries);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_crash_mid_walk_is_finished_by_the_next_publish() {
    needs::loop_devices_and_mkfs();
    let (disk, entries) = tree_disk(60_000);
    let a = Agent::start();
    let req = walk_req("crash", &disk, GID);
    let (code, msg) = publish_with_deadline(&a, &req, Duration::from_millis(5));
    assert_eq!(code, "DEADLINE_EXCEEDED", "{msg}");
    let dir = a.kill9();
    let a = Agent::start_in(dir);
    // Recovery took it back, incomplete; the same publish finishes it.
    let done = a.client().publish_volume(ctx(), &req).unwrap();
    assert!(!done.already_published);
    assert_eq!(done.ownership.as_ref().unwrap().visited, entries);
    assert_eq!(with_gid(&a.root.join("volumes/crash"), GID), entries);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_walk_whose_end_cannot_be_recorded_takes_the_volume_down() {
    needs::loop_devices_and_mkfs();
    let (disk, entries) = tree_disk(60_000);
    // The state directory on a filesystem of its own, filled mid-walk.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("root/state");
    std::fs::create_dir_all(&state).unwrap();
    run(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            "size=64k,mode=700",
            "crust-state",
            state.to_str().unwrap(),
        ],
    );
    let a = Agent::start_in(dir);
    let req = walk_req("full", &disk, GID);
    let (code, msg) = publish_with_deadline(&a, &req, Duration::from_millis(5));
    assert_eq!(code, "DEADLINE_EXCEEDED", "{msg}");
    let filler = state.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        while f.write_all(&[0u8; 4096]).is_ok() {}
    }
    // The same publish joins the walk and hears how it ended: the volume
    // could not be recorded complete, so it was taken down.
    let joined = a.client().publish_volume(ctx(), &req);
    let said = said(&joined);
    assert!(
        said.starts_with("RESOURCE_EXHAUSTED") && said.contains("no space left"),
        "{said}"
    );
    assert!(listed(&a, "full").is_none());
    assert!(mounts_of(&disk.path()).is_empty());
    assert!(
        a.log()
            .contains("publish failed after mounting; unpublishing the volume"),
        "{}",
        a.log()
    );
    // Space again: the same publish walks the tree again and is complete.
    std::fs::remove_file(&filler).unwrap();
    let done = a.client().publish_volume(ctx(), &req).unwrap();
    assert_eq!(done.ownership.as_ref().unwrap().visited, entries);
    a.client()
        .unpublish_volume(ctx(), &unpublish_req("full"))
        .unwrap();
    let dir = a.kill9();
    run("umount", &[state.to_str().unwrap()]);
    drop(dir);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn memory_stays_bounded_through_a_huge_directory_and_a_deep_tree() {
    needs::loop_devices_and_mkfs();
    const FILES: usize = 200_000;
    const DEPTH: usize = 10_000;
    let disk = LoopDisk::with_mkfs(1024, Some("ext4"), &["-N", "260000"]);
    let m = disk.scratch("fill");
    run("mount", &[&disk.path(), m.to_str().unwrap()]);
    let big = m.join("big");
    std::fs::create_dir(&big).unwrap();
    for i in 0..FILES {
        std::fs::File::create(big.join(format!("file-with-a-longish-name-{i:08}"))).unwrap();
    }
    // A chain DEPTH levels deep, made from directory fds (its path is far
    // past PATH_MAX).
    let mut at = rustix::fs::open(
        &m,
        rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    for _ in 0..DEPTH {
        rustix::fs::mkdirat(&at, "d", rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
        at = rustix::fs::openat(
            &at,
            "d",
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
    }
    drop(at);
    run("umount", &[m.to_str().unwrap()]);
    let entries = 1 + 1 + 1 + FILES as u64 + DEPTH as u64; // root, lost+found, big/

    let a = Agent::start();
    let mut req = publish_req("mem", &disk.path(), "ext4");
    req.fs_group = fs_group(GID, pb::FsGroupChangePolicy::ALWAYS);
    let r = a.client().publish_volume(ctx(), &req).unwrap();
    assert_eq!(r.ownership.as_ref().unwrap().visited, entries);
    let peak = a.peak_rss_kib();
    eprintln!("peak RSS through {FILES} files in one directory and {DEPTH} levels: {peak} KiB");
    assert!(peak < 32 << 10, "peak RSS {peak} KiB (bound 32 MiB)");
}

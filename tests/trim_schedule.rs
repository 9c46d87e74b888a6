//! Trim on a schedule through the real agent, on loop devices over sparse
//! images: a deleted file's blocks go back to the image without any
//! TrimVolume call, and nothing is trimmed while the volume is frozen.
//! The interval is the shortest the agent takes (10 s), so each test waits
//! some tens of seconds.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use crust_protocols::crust_ttrpc::AgentClient;
use support::*;

const EVERY_S: u32 = crust_agent::validate::MIN_TRIM_INTERVAL_S;

/// Publishes `disk` as volume `v`, trimmed every `EVERY_S` seconds.
fn publish_scheduled(c: &AgentClient, disk: &LoopDisk, fs: &str) -> String {
    let mut r = publish_req("v", &disk.path(), fs);
    r.trim_interval_s = EVERY_S;
    c.publish_volume(ctx(), &r).unwrap().guest_path
}

/// Volume `v`'s trim schedule, as ListVolumes shows it.
fn schedule(c: &AgentClient) -> pb::TrimSchedule {
    volumes(c)[0].trim.clone().unwrap()
}

/// Writes 64 MiB into `dir` and deletes it again, each flushed: the
/// image's allocated bytes with the file still there.
fn write_and_delete(dir: &str, disk: &LoopDisk) -> u64 {
    let file = Path::new(dir).join("big");
    std::fs::write(&file, vec![0x5a; 64 << 20]).unwrap();
    run("sync", &[]);
    let before = allocated(&disk.image);
    std::fs::remove_file(&file).unwrap();
    run("sync", &[]);
    before
}

/// Waits up to `within` for a trim to end after the one that ended at
/// `last` (0: none yet), and gives the schedule that shows it. The blocks
/// go back while FITRIM runs, before the agent records the trim, so a
/// caller that saw them go waits for this too.
fn trim_recorded_after(c: &AgentClient, last: i64, within: Duration) -> pb::TrimSchedule {
    let t0 = Instant::now();
    loop {
        let s = schedule(c);
        if s.last_unix_ms != last {
            return s;
        }
        assert!(t0.elapsed() < within, "no trim ended after {last}: {s:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits up to `within` for the image to hold `bytes` fewer than `before`.
fn given_back(disk: &LoopDisk, before: u64, bytes: u64, within: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if before.saturating_sub(allocated(&disk.image)) >= bytes {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_scheduled_trim_gives_a_deleted_files_blocks_back_without_a_call() {
    needs::loop_devices_and_mkfs();
    for fs in ["ext4", "xfs"] {
        let disk = LoopDisk::new(320, Some(fs));
        let a = Agent::start();
        let c = a.client();
        let path = publish_scheduled(&c, &disk, fs);
        let s = schedule(&c);
        assert_eq!((s.interval_s, s.last_unix_ms), (EVERY_S, 0));
        let before = write_and_delete(&path, &disk);
        // The first trim comes within one interval, the next one about an
        // interval later; xfs may hold a freed extent busy until its log
        // commits, as for fstrim, so allow a few.
        assert!(
            given_back(
                &disk,
                before,
                60 << 20,
                Duration::from_secs(5 * u64::from(EVERY_S))
            ),
            "{fs}: the image kept its blocks ({before} -> {})",
            allocated(&disk.image)
        );
        let s = trim_recorded_after(&c, 0, Duration::from_secs(u64::from(EVERY_S)));
        assert!(s.last_error.is_empty(), "{s:?}");
        assert!(s.next_unix_ms > s.last_unix_ms, "{s:?}");
        assert!(a.log().contains("scheduled trim done"));
        assert!(!a.log().contains("TrimVolume"), "no call trimmed it");
        c.unpublish_volume(ctx(), &unpublish_req("v")).unwrap();
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn no_scheduled_trim_while_the_volume_is_frozen() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(320, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    let path = publish_scheduled(&c, &disk, "ext4");
    let before = write_and_delete(&path, &disk);
    let mut f = pb::FreezeVolumesRequest::new();
    f.volume_ids = vec!["v".into()];
    f.timeout_ms = 60_000;
    let frozen = c.freeze_volumes(ctx(), &f).unwrap();
    let (held, last) = (allocated(&disk.image), schedule(&c).last_unix_ms);
    // Two and a half intervals frozen: every trim that came due waited.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(2500 * u64::from(EVERY_S)) {
        assert_eq!(allocated(&disk.image), held, "trimmed while frozen");
        assert_eq!(schedule(&c).last_unix_ms, last, "a trim ended while frozen");
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut t = pb::ThawVolumesRequest::new();
    t.freeze_id = frozen.freeze_id;
    c.thaw_volumes(ctx(), &t).unwrap();
    // Thawed: the trim that waited comes (within its retry), and gives the
    // blocks back unless a trim between the delete and the freeze had.
    trim_recorded_after(&c, last, Duration::from_secs(3 * u64::from(EVERY_S)));
    assert!(given_back(&disk, before, 60 << 20, Duration::from_secs(1)));
    c.unpublish_volume(ctx(), &unpublish_req("v")).unwrap();
}

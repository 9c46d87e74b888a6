//! Trims on a schedule, through the table on the fake kernel, the tests
//! saying what time it is (`run_due_trims`): due times, what a trim never
//! runs under (a freeze, an unfinished publish, another call), how it
//! yields to a call and goes on, one trim at a time with a caller's
//! TrimVolume, a failure shown as health, and a restart resuming it; a
//! volume unpublished and published again under its id mid-pass, which
//! gets nothing of the old volume's trim.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::io::Errno;

use super::testkit::{bind, fake_table, reopen, request};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::model::{Device, FsType};
use crate::stats::problem::Health;
use crate::validate::STATE_DIR;
use crate::volumes::fake::{Call, Fake};
use crate::volumes::freeze::Thaw;
use crate::volumes::lease::DEFAULT_TIMEOUT;
use crate::volumes::request::PublishRequest;
use crate::volumes::table::Volumes;

type Later<T> = Arc<Mutex<Option<std::thread::JoinHandle<T>>>>;
type Hook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// The fake's disks are 1 GiB: a scheduled trim covers them in four ranges.
const RANGE: u64 = 256 << 20;

fn scheduled(id: &str, d: &Device, every: u32) -> PublishRequest {
    let mut r = request(id, d, false, false);
    r.spec.trim_interval_s = every;
    r
}

/// A table on the fake with volumes `ids` (on disks `fk<id>`) trimmed every minute.
fn with_volumes(dir: &std::path::Path, ids: &[&str]) -> (Arc<Volumes<Fake>>, Fake) {
    let (v, fake) = fake_table(dir);
    for id in ids {
        let d = fake.disk(dir, &format!("fk{id}"), Some(FsType::Ext4));
        v.publish(&scheduled(id, &d, 60), &Cancel::never()).unwrap();
    }
    (v, fake)
}

fn trims(journal: &[String]) -> Vec<String> {
    let trim = |l: &&String| l.starts_with("trim ");
    journal.iter().filter(trim).cloned().collect()
}

fn whole(id: &str) -> Vec<String> {
    ranges(id, 0..4)
}

fn ranges(id: &str, which: std::ops::Range<u64>) -> Vec<String> {
    which
        .map(|i| format!("trim volumes/{id} {}+{RANGE}", i * RANGE))
        .collect()
}

/// Right before the `nth` FITRIM from now on, `call` is made on a thread
/// of its own, and waits for volume `id`: the trim yields after that range.
fn call_during_trim<T: Send + 'static>(
    v: &Arc<Volumes<Fake>>,
    fake: &Fake,
    (nth, id): (u32, &'static str),
    call: impl FnOnce(&Volumes<Fake>) -> T + Send + 'static,
) -> Later<T> {
    let (table, later) = (v.clone(), Later::default());
    let l = later.clone();
    fake.before(Call::Trim, nth, move || {
        let t = table.clone();
        *l.lock().unwrap() = Some(std::thread::spawn(move || call(&t)));
        let t0 = Instant::now();
        while !table.waiting(id).0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "the call queues");
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    later
}

fn joined<T>(later: &Later<T>) -> T {
    later.lock().unwrap().take().unwrap().join().unwrap()
}

/// Nothing is trimmed before its time; at it, the whole filesystem in
/// ranges, and ListVolumes shows the last trim and the next one, an
/// interval ± 10% later.
#[test]
fn a_scheduled_trim_runs_at_its_time_and_is_listed() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let (v, fake) = with_volumes(dir.path(), &["a"]);
    let root = v.root().to_path_buf();
    let due = v.next_trim_due().unwrap();
    assert!(due >= t0 && due < Instant::now() + Duration::from_secs(60));
    let listed = v.list()[0].trim.clone().unwrap();
    assert_eq!((listed.interval_s, listed.last_unix_ms), (60, 0));
    fake.journal(&root);
    if let Some(before) = due.checked_sub(Duration::from_millis(1)) {
        v.run_due_trims(before);
    }
    assert!(fake.journal(&root).is_empty(), "not before its time");
    v.run_due_trims(due);
    assert_eq!(fake.journal(&root), whole("a"));
    let t = v.list()[0].trim.clone().unwrap();
    assert_eq!((t.last_bytes, t.last_error.clone()), (1 << 29, None));
    assert!(t.last_unix_ms > 0);
    let next = v.next_trim_due().unwrap() - due;
    assert!(
        next >= Duration::from_secs(54) && next <= Duration::from_secs(67),
        "{next:?}"
    );
    assert!(t.next_unix_ms - t.last_unix_ms >= 53_000, "{t:?}");
}

/// A frozen volume, one whose publish has not finished and one under
/// another call are not trimmed; the trim comes a little later.
#[test]
fn no_scheduled_trim_while_frozen_unfinished_or_under_a_call() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a"]);
    let root = v.root().to_path_buf();
    let f = v
        .freeze(&["a".into()], DEFAULT_TIMEOUT, None, &Cancel::never())
        .unwrap();
    let due = v.next_trim_due().unwrap() + Duration::from_secs(1);
    fake.journal(&root);
    v.run_due_trims(due);
    assert!(fake.journal(&root).is_empty(), "never while frozen");
    assert!(v.next_trim_due().unwrap() > due, "tried again later");
    v.thaw(&Thaw::Freeze(f.freeze_id)).unwrap();
    // Under a bind (any call holding the volume: an expand, an unpublish).
    let (table, at) = (v.clone(), due + Duration::from_secs(60));
    fake.before(Call::Bind, 1, move || table.run_due_trims(at));
    bind(&v, "a", "pods/p/data").unwrap();
    assert!(trims(&fake.journal(&root)).is_empty(), "never under a call");
    v.run_due_trims(at + Duration::from_secs(60));
    assert_eq!(fake.journal(&root), whole("a"));
    // A restart that finds the publish unfinished (its fsGroup walk cut
    // short) trims nothing until the walk is done.
    let record = root.join(STATE_DIR).join("a.vol");
    let text = std::fs::read_to_string(&record).unwrap();
    std::fs::write(&record, text.replace("complete=true", "complete=false")).unwrap();
    v.close_freezes();
    drop(v);
    let v = reopen(dir.path(), &fake);
    assert!(v.next_trim_due().is_some(), "scheduled all the same");
    v.run_due_trims(Instant::now() + Duration::from_secs(3600));
    assert!(
        trims(&fake.journal(&root)).is_empty(),
        "not while unfinished"
    );
}

/// A call that comes while a scheduled trim runs waits for one range at
/// most: the trim stops between two ranges and goes on later from where
/// it stopped.
#[test]
fn a_scheduled_trim_yields_to_a_call_and_goes_on_later() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a"]);
    let root = v.root().to_path_buf();
    let due = v.next_trim_due().unwrap();
    let caller = call_during_trim(&v, &fake, (1, "a"), |t| bind(t, "a", "pods/p/x"));
    fake.journal(&root);
    v.run_due_trims(due);
    joined(&caller).unwrap();
    let j = fake.journal(&root);
    assert_eq!(j[0], whole("a")[0]);
    assert!(j[1].starts_with("bind volumes/a"), "{j:?}");
    assert_eq!(j.len(), 2, "the trim stopped after one range: {j:?}");
    let later = v.next_trim_due().unwrap();
    assert!(later - due <= Duration::from_secs(2), "it goes on soon");
    v.run_due_trims(later);
    assert_eq!(fake.journal(&root), whole("a")[1..]);
    let t = v.list()[0].trim.clone().unwrap();
    assert_eq!(t.last_bytes, 1 << 29, "the parts add up");
}

/// One trim at a time in the agent: a caller's TrimVolume of another
/// volume waits for the scheduled trim's range, which then yields to it.
#[test]
fn a_callers_trim_never_runs_beside_a_scheduled_one() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a"]);
    let b = fake.disk(dir.path(), "fkb", Some(FsType::Ext4));
    v.publish(&request("b", &b, false, false), &Cancel::never())
        .unwrap();
    let root = v.root().to_path_buf();
    let due = v.next_trim_due().unwrap();
    let (table, probe) = (v.clone(), fake.clone());
    let caller = Arc::new(std::sync::Mutex::new(None));
    let c = caller.clone();
    let r = root.clone();
    fake.before(Call::Trim, 1, move || {
        let t = table.clone();
        *c.lock().unwrap() = Some(std::thread::spawn(move || t.trim("b", 0, &Cancel::never())));
        let t0 = Instant::now();
        while !table.waiting("b").1 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the caller waits for its turn"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let j = probe.journal(&r);
        assert!(trims(&j).is_empty(), "b is not trimmed meanwhile: {j:?}");
    });
    fake.journal(&root);
    v.run_due_trims(due);
    let out = caller
        .lock()
        .unwrap()
        .take()
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
    assert_eq!(out.covered_bytes, 1 << 30);
    assert_eq!(
        fake.journal(&root),
        [whole("a")[0].clone(), "trim volumes/b 0+1073741824".into()]
    );
    v.run_due_trims(v.next_trim_due().unwrap());
    assert_eq!(fake.journal(&root), whole("a")[1..]);
}

/// A scheduled trim that fails is logged and makes the volume DEGRADED
/// (`TrimFailed`, with the error) until a later one goes through; the
/// volume keeps working meanwhile.
#[test]
fn a_failed_scheduled_trim_is_degraded_until_one_goes_through() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a"]);
    fake.fail(Call::Trim, 2, Errno::IO);
    let due = v.next_trim_due().unwrap();
    v.run_due_trims(due);
    let failed = |v: &Volumes<Fake>| {
        let said = v.health("a", &Cancel::never()).unwrap();
        said.into_iter().find(|s| s.reason == "TrimFailed")
    };
    let s = failed(&v).expect("TrimFailed");
    assert_eq!(s.status, Health::Degraded);
    assert!(s.message.contains("FITRIM"), "{}", s.message);
    let t = v.list()[0].trim.clone().unwrap();
    assert!(t.last_error.unwrap().contains("FITRIM"));
    bind(&v, "a", "pods/p/x").unwrap();
    let next = v.next_trim_due().unwrap();
    assert!(
        next - due >= Duration::from_secs(50),
        "the next at its time"
    );
    v.run_due_trims(next);
    assert!(failed(&v).is_none());
    assert!(v.list()[0].trim.clone().unwrap().last_error.is_none());
}

/// A fault inside one volume's scheduled trim fails that trim (TrimFailed),
/// not the runner: the other volume is still trimmed, calls still work, and
/// the next trim of the first goes through.
#[test]
fn a_fault_in_a_scheduled_trim_fails_that_trim_and_the_runner_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a", "b"]);
    fake.before(Call::Trim, 1, || {
        panic!("a fault planted in the first FITRIM")
    });
    let due = v.next_trim_due().unwrap() + Duration::from_secs(60);
    v.run_due_trims(due);
    let failed: Vec<String> = ["a", "b"]
        .into_iter()
        .filter(|id| {
            let said = v.health(id, &Cancel::never()).unwrap();
            said.iter()
                .any(|s| s.reason == "TrimFailed" && s.message.contains("internal fault"))
        })
        .map(str::to_string)
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    let other = if failed[0] == "a" { "b" } else { "a" };
    let journal = fake.journal(v.root());
    let done = trims(&journal);
    assert_eq!(
        done.iter().filter(|l| l.contains(other)).count(),
        4,
        "{done:?}"
    );
    bind(&v, &failed[0], "pods/p/x").unwrap();
    let next = v.next_trim_due().unwrap() + Duration::from_secs(60);
    v.run_due_trims(next);
    let said = v.health(&failed[0], &Cancel::never()).unwrap();
    assert!(said.iter().all(|s| s.reason != "TrimFailed"), "{said:?}");
    // The fault let go of the volume's slot while unwinding: unpublished,
    // the volume leaves no slot behind (a forced thaw says it is not
    // published).
    assert!(v.unpublish(&failed[0], &Cancel::never()).unwrap());
    let e = v.thaw(&Thaw::Force(failed.clone())).unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
}

/// The interval is recorded: a restart resumes the schedule, first due
/// within an interval. Unpublish ends it: no entry is left.
#[test]
fn a_restart_resumes_the_schedule_and_unpublish_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a", "b"]);
    let root = v.root().to_path_buf();
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(record.contains("\ntrim_interval_s=60\n"), "{record}");
    v.close_freezes();
    drop(v);
    let t0 = Instant::now();
    let v = reopen(dir.path(), &fake);
    let due = v.next_trim_due().unwrap();
    assert!(due >= t0 && due <= Instant::now() + Duration::from_secs(60));
    assert!(v
        .list()
        .iter()
        .all(|i| i.trim.as_ref().unwrap().interval_s == 60));
    fake.journal(&root);
    v.run_due_trims(Instant::now() + Duration::from_secs(60));
    assert_eq!(trims(&fake.journal(&root)).len(), 8, "both, whole");
    for id in ["a", "b"] {
        assert!(v.unpublish(id, &Cancel::never()).unwrap());
    }
    assert_eq!(v.next_trim_due(), None, "no entry left");
}

/// What TrimVolume would refuse is refused a schedule, and nothing is
/// published; a republish with another interval is ALREADY_EXISTS.
#[test]
fn impossible_schedules_are_refused_and_the_interval_is_part_of_the_volume() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    let blk = fake.disk(dir.path(), "fkb", None);
    for (mut r, what) in [
        (request("ro", &d, false, true), "read-only"),
        (request("blk", &blk, true, false), "block volume"),
    ] {
        r.spec.trim_interval_s = 60;
        let e = v.publish(&r, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains(what), "{e}");
    }
    assert!(v.list().is_empty() && fake.mounts().is_empty());
    v.publish(&scheduled("a", &d, 60), &Cancel::never())
        .unwrap();
    let again = v
        .publish(&scheduled("a", &d, 60), &Cancel::never())
        .unwrap();
    assert!(again.already_published);
    for other in [0, 120] {
        let e = v
            .publish(&scheduled("a", &d, other), &Cancel::never())
            .unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{e}");
        assert!(
            e.to_string()
                .contains(&format!("trim_interval_s 60 vs {other}")),
            "{e}"
        );
    }
    assert_eq!(v.list()[0].trim.as_ref().unwrap().interval_s, 60);
}

/// With its runner thread (the agent's table), a shutdown stops the
/// schedule at once and takes the volumes down.
#[test]
fn shutdown_stops_the_runner_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::default();
    let sysfs = crate::sys::sysfs::Sysfs {
        sys_block: dir.path().join("sys/block"),
        dev_dir: dir.path().join("dev"),
        dev_block: dir.path().join("sys/dev/block"),
    };
    let v = Volumes::open_on(
        fake.clone(),
        &dir.path().join("root"),
        sysfs,
        crate::logging::discard(),
    )
    .unwrap();
    let d = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    v.publish(&scheduled("a", &d, 3600), &Cancel::never())
        .unwrap();
    let t0 = Instant::now();
    assert_eq!(v.shutdown(), 1);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(fake.mounts().is_empty());
}

/// A trim that yielded goes on over the filesystem as it is when it goes
/// on: to the end of a grown one (an ExpandVolume meanwhile), never past
/// the end of a smaller one.
#[test]
fn a_resumed_trim_covers_the_filesystem_as_it_is_then() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a"]);
    let root = v.root().to_path_buf();
    for (bytes, rest) in [(1536 << 20, ranges("a", 2..6)), (300 << 20, vec![])] {
        let caller = call_during_trim(&v, &fake, (2, "a"), |t| {
            t.stats("a", &Cancel::never()).map(|_| ())
        });
        fake.journal(&root);
        v.run_due_trims(v.next_trim_due().unwrap() + Duration::from_secs(60));
        joined(&caller).unwrap();
        assert_eq!(fake.journal(&root), ranges("a", 0..2), "yielded");
        fake.resize("fka", bytes);
        v.run_due_trims(v.next_trim_due().unwrap());
        let covered = RANGE * (2 + rest.len() as u64);
        assert_eq!(fake.journal(&root), rest);
        let t = v.list()[0].trim.clone().unwrap();
        // The fake's FITRIM gives back half of each range.
        assert_eq!((t.last_bytes, t.last_error), (covered / 2, None));
        fake.resize("fka", 1 << 30);
    }
}

/// A trim that yielded to a freeze waits out that freeze, its thaw by the
/// timer and another freeze, then goes on where it stopped.
#[test]
fn a_yielded_trim_waits_out_freezes_and_goes_on_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = with_volumes(dir.path(), &["a"]);
    let root = v.root().to_path_buf();
    let short = Duration::from_millis(200);
    let caller = call_during_trim(&v, &fake, (2, "a"), move |t| {
        t.freeze(&["a".into()], short, Some("f1"), &Cancel::never())
    });
    fake.journal(&root);
    let mut now = v.next_trim_due().unwrap();
    v.run_due_trims(now);
    joined(&caller).unwrap();
    assert_eq!(trims(&fake.journal(&root)), ranges("a", 0..2));
    let mut step = |v: &Volumes<Fake>| {
        now = v.next_trim_due().unwrap().max(now);
        v.run_due_trims(now);
        trims(&fake.journal(&root))
    };
    assert!(step(&v).is_empty(), "frozen");
    let t0 = Instant::now();
    while fake.frozen(&root.join("volumes/a")) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "thawed by its timer"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let f = v
        .freeze(&["a".into()], DEFAULT_TIMEOUT, Some("f2"), &Cancel::never())
        .unwrap();
    assert!(step(&v).is_empty(), "frozen again");
    v.thaw(&Thaw::Freeze(f.freeze_id)).unwrap();
    assert_eq!(step(&v), ranges("a", 2..4));
    assert_eq!(v.list()[0].trim.clone().unwrap().last_bytes, 1 << 29);
}

/// A pass over the trims due that meets a volume unpublished and published
/// again meanwhile (without a schedule, or with another interval) leaves
/// it alone: its old entry's turn is not the new volume's.
#[test]
fn a_trim_pass_leaves_alone_a_volume_published_again_meanwhile() {
    for every in [0, 3600] {
        let dir = tempfile::tempdir().unwrap();
        let (v, fake) = with_volumes(dir.path(), &["a", "b"]);
        let root = v.root().to_path_buf();
        fake.journal(&root);
        let other = Arc::new(Mutex::new(String::new()));
        let (t, probe, r) = (v.clone(), fake.clone(), root.clone());
        let (o, d) = (other.clone(), dir.path().to_path_buf());
        // Right before the second range of whichever comes first, the
        // other is published again on another disk.
        fake.before(Call::Trim, 2, move || {
            let first = probe.journal(&r)[0].clone();
            let id = if first.contains("volumes/a ") {
                "b"
            } else {
                "a"
            };
            assert!(t.unpublish(id, &Cancel::never()).unwrap());
            let disk = probe.disk(&d, &format!("fk{id}2"), Some(FsType::Ext4));
            t.publish(&scheduled(id, &disk, every), &Cancel::never())
                .unwrap();
            id.clone_into(&mut o.lock().unwrap());
        });
        let now = Instant::now() + Duration::from_secs(61);
        v.run_due_trims(now);
        let id = other.lock().unwrap().clone();
        let j = fake.journal(&root);
        assert!(
            j.iter()
                .all(|l| !l.starts_with(&format!("trim volumes/{id} "))),
            "{every}: {j:?}"
        );
        let listed = v.list().into_iter().find(|i| i.volume_id == id).unwrap();
        assert_eq!(
            listed.trim.map(|t| (t.interval_s, t.last_unix_ms)),
            (every > 0).then_some((every, 0))
        );
    }
}

/// Logs nothing, and runs a hook when a message starting with `msg` is logged.
struct OnMessage {
    msg: &'static str,
    hook: Hook,
}

impl slog::Drain for OnMessage {
    type Ok = ();
    type Err = slog::Never;
    fn log(&self, r: &slog::Record<'_>, _: &slog::OwnedKVList) -> Result<(), slog::Never> {
        if r.msg().to_string().starts_with(self.msg) {
            let hook = self.hook.lock().unwrap().take();
            if let Some(f) = hook {
                f();
            }
        }
        Ok(())
    }
}

/// A trim that failed, its volume unpublished and published again under
/// its id between its end and its record: the failure is the old volume's,
/// and the new one is neither DEGRADED nor given the old one's times.
#[test]
fn a_trims_end_never_lands_on_the_volume_published_again_under_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let hook = Hook::default();
    let (fake, sysfs) = (
        Fake::default(),
        crate::sys::sysfs::Sysfs {
            sys_block: dir.path().join("sys/block"),
            dev_dir: dir.path().join("dev"),
            dev_block: dir.path().join("sys/dev/block"),
        },
    );
    let log = slog::Logger::root(
        OnMessage {
            msg: "scheduled trim failed",
            hook: hook.clone(),
        },
        slog::o!(),
    );
    let v = Volumes::open_manual(fake.clone(), &dir.path().join("root"), sysfs, log).unwrap();
    let a = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    let b = fake.disk(dir.path(), "fkb", Some(FsType::Ext4));
    v.publish(&scheduled("a", &a, 60), &Cancel::never())
        .unwrap();
    fake.fail(Call::Trim, 2, Errno::IO);
    let t = v.clone();
    *hook.lock().unwrap() = Some(Box::new(move || {
        assert!(t.unpublish("a", &Cancel::never()).unwrap());
        t.publish(&scheduled("a", &b, 3600), &Cancel::never())
            .unwrap();
    }));
    v.run_due_trims(v.next_trim_due().unwrap());
    assert!(hook.lock().unwrap().is_none(), "published again in between");
    let said = v.health("a", &Cancel::never()).unwrap();
    assert!(said.iter().all(|s| s.reason != "TrimFailed"), "{said:?}");
    let t = v.list()[0].trim.clone().unwrap();
    assert_eq!(
        (t.interval_s, t.last_unix_ms, t.last_error),
        (3600, 0, None)
    );
}

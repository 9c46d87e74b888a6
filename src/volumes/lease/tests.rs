//! The leases' logic against a fake kernel: filesystems that freeze and
//! thaw in memory, with errno injection, and the real ledger in a temp
//! directory. No root, no loop device: milliseconds.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::sync::LockExt;
use rustix::io::Errno;

use super::*;
use crate::code::Code;
use crate::sys::beneath::Root;
use crate::sys::error::SysError;
use crate::validate::FREEZES_DIR;

/// Filesystems by volume id: frozen or not; volumes whose FIFREEZE or
/// FITHAW fails (EIO) while named here.
#[derive(Clone, Default)]
struct Kernel {
    frozen: Arc<Mutex<HashMap<String, bool>>>,
    fail_freeze: Arc<Mutex<HashSet<String>>>,
    fail_thaw: Arc<Mutex<HashSet<String>>>,
    /// Volumes whose FITHAW thaws the filesystem, says so on the sender,
    /// then returns only when the receiver hears: a thaw caught between
    /// the kernel and its record.
    stall_thaw: Arc<Mutex<HashMap<String, Stall>>>,
}

/// A stalled FITHAW's two ends: it says it thawed, then waits to return.
type Stall = (mpsc::Sender<()>, mpsc::Receiver<()>);

struct FakeHold {
    vol: String,
    k: Kernel,
}

impl Thaw for FakeHold {
    fn thaw(&self) -> Result<bool, quiesce::Error> {
        if self.k.fail_thaw.locked().contains(&self.vol) {
            return Err(SysError::new("FITHAW", &self.vol, Errno::IO).into());
        }
        let was = std::mem::replace(
            self.k.frozen.locked().entry(self.vol.clone()).or_default(),
            false,
        );
        if let Some((said, go)) = self.k.stall_thaw.locked().remove(&self.vol) {
            let _ = said.send(());
            let _ = go.recv();
        }
        Ok(was)
    }
}

impl Kernel {
    fn freeze(&self, vol: &str) -> crate::error::Result<FakeHold> {
        if self.fail_freeze.locked().contains(vol) {
            return Err(SysError::new("FIFREEZE", vol, Errno::IO).into());
        }
        let mut g = self.frozen.locked();
        let f = g.entry(vol.to_string()).or_default();
        if *f {
            return Err(quiesce::Error::FrozenElsewhere { path: vol.into() }.into());
        }
        *f = true;
        Ok(FakeHold {
            vol: vol.into(),
            k: self.clone(),
        })
    }

    fn is_frozen(&self, vol: &str) -> bool {
        self.frozen.locked().get(vol).copied().unwrap_or(false)
    }
}

type Leases = Arc<Freezer<FakeHold>>;

/// A freezer on `root`, whose restart thaws through `k`.
fn open(root: &Path, k: &Kernel) -> Leases {
    let ledger = Ledger::open(&Root::open(root).unwrap()).unwrap();
    let k = k.clone();
    Freezer::open(ledger, crate::logging::discard(), move |vol| {
        Ok(std::mem::replace(
            k.frozen.locked().entry(vol.to_string()).or_default(),
            false,
        ))
    })
}

fn vols(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A whole freeze call, as the table makes it.
fn freeze(
    f: &Leases,
    k: &Kernel,
    asked: Option<&str>,
    v: &[&str],
    timeout: Duration,
) -> crate::error::Result<Frozen> {
    f.freeze(
        asked,
        &vols(v),
        timeout,
        |id, vol| f.freeze_part(id, vol, || k.freeze(vol)),
        || Ok(()),
    )
}

const LONG: Duration = Duration::from_secs(60);

/// Waits (at most 10 s) until `cond` holds.
fn until(what: &str, cond: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < end, "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn code(r: crate::error::Result<impl std::fmt::Debug>) -> (Code, String) {
    let e = r.unwrap_err();
    (e.code(), e.to_string())
}

/// Backup A's freeze ends at its timeout; backup B freezes the volume;
/// A's late thaw answers ABORTED and leaves B's freeze in force; B's thaw
/// is OK.
#[test]
fn a_late_thaw_hears_its_freeze_ended_and_ends_no_newer_freeze() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let a = freeze(&f, &k, None, &["v1"], Duration::from_millis(30)).unwrap();
    until("A's timer thaws v1", || !k.is_frozen("v1"));
    let b = freeze(&f, &k, None, &["v1"], LONG).unwrap();
    assert_ne!(a.freeze_id, b.freeze_id);
    let (c, msg) = code(f.thaw(&a.freeze_id));
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(
        msg.contains("volume v1 thawed by the agent when its timeout passed"),
        "{msg}"
    );
    assert!(k.is_frozen("v1"), "A's late thaw ended B's freeze");
    assert_eq!(f.holding("v1").unwrap().freeze, b.freeze_id);
    assert_eq!(f.thaw(&b.freeze_id).unwrap(), vols(&["v1"]));
    assert!(!k.is_frozen("v1"));
    assert_eq!(
        f.thaw(&b.freeze_id).unwrap(),
        Vec::<String>::new(),
        "a repeated thaw is OK"
    );
    let (c, _) = code(f.thaw(&a.freeze_id));
    assert_eq!(c, Code::Aborted, "said every time");
}

/// The second volume's freeze fails: the first is thawed, nothing is held,
/// and the call answers the failure.
#[test]
fn the_second_freeze_fails_and_the_first_is_thawed() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    k.fail_freeze.locked().insert("v2".into());
    let (c, msg) = code(freeze(&f, &k, Some("snap-1"), &["v1", "v2", "v3"], LONG));
    assert_eq!(c, Code::Internal, "{msg}");
    assert!(!k.is_frozen("v1") && !k.is_frozen("v3"));
    assert!(f.holding("v1").is_none() && f.holding("v2").is_none());
    // It froze v1, so its id is spent and its end recorded.
    let (c, msg) = code(f.thaw("snap-1"));
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(msg.contains("when its own freeze call failed"), "{msg}");
    let (c, msg) = code(freeze(&f, &k, Some("snap-1"), &["v1"], LONG));
    assert_eq!(c, Code::AlreadyExists, "{msg}");
    // A call that froze nothing leaves no trace: its id can be used again.
    k.fail_freeze.locked().insert("v1".into());
    assert!(freeze(&f, &k, Some("snap-2"), &["v1"], LONG).is_err());
    assert_eq!(code(f.thaw("snap-2")).0, Code::NotFound);
    k.fail_freeze.locked().clear();
    freeze(&f, &k, Some("snap-2"), &["v1"], LONG).unwrap();
}

/// An undo whose thaw fails leaves the volume held, retried by the timer
/// until the thaw works, and never lost.
#[test]
fn an_undo_that_cannot_thaw_is_retried_until_it_can() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    k.fail_freeze.locked().insert("v2".into());
    k.fail_thaw.locked().insert("v1".into());
    assert!(freeze(&f, &k, None, &["v1", "v2"], LONG).is_err());
    assert!(k.is_frozen("v1"), "FITHAW failed");
    assert!(f.holding("v1").is_some(), "still held, for the timer");
    k.fail_thaw.locked().clear();
    until("the timer's retry thaws v1", || !k.is_frozen("v1"));
    until("v1 is free", || f.holding("v1").is_none());
}

/// The same caller id: the same freeze answered again while it holds;
/// other volumes, or an ended freeze, refused; a call still freezing,
/// UNAVAILABLE.
#[test]
fn a_callers_id_answers_a_retry_and_is_never_reused() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let first = freeze(&f, &k, Some("velero:1"), &["v1", "v2"], LONG).unwrap();
    let again = freeze(&f, &k, Some("velero:1"), &["v2", "v1"], LONG).unwrap();
    assert_eq!(first, again);
    let (c, msg) = code(freeze(&f, &k, Some("velero:1"), &["v1"], LONG));
    assert_eq!(c, Code::AlreadyExists, "{msg}");
    assert!(msg.contains("it holds v1, v2"), "{msg}");
    f.thaw("velero:1").unwrap();
    let (c, msg) = code(freeze(&f, &k, Some("velero:1"), &["v1", "v2"], LONG));
    assert_eq!(c, Code::AlreadyExists, "{msg}");
    assert!(msg.contains("thawed by its id"), "{msg}");
    // A second call while the first is still in FIFREEZE.
    let (entered, wait) = (mpsc::channel(), mpsc::channel::<()>());
    let (f2, k2) = (f.clone(), k.clone());
    let t = std::thread::spawn(move || {
        f2.freeze(
            Some("slow"),
            &vols(&["v3"]),
            LONG,
            |id, vol| {
                f2.freeze_part(id, vol, || {
                    entered.0.send(()).unwrap();
                    wait.1.recv().unwrap();
                    k2.freeze(vol)
                })
            },
            || Ok(()),
        )
    });
    entered.1.recv().unwrap();
    assert_eq!(
        code(freeze(&f, &k, Some("slow"), &["v3"], LONG)).0,
        Code::Unavailable
    );
    wait.0.send(()).unwrap();
    t.join().unwrap().unwrap();
    assert_eq!(
        freeze(&f, &k, Some("slow"), &["v3"], LONG)
            .unwrap()
            .freeze_id,
        "slow"
    );
}

/// A thaw by id that comes while FIFREEZE runs is not lost: the volume is
/// thawed as soon as FIFREEZE returns, the freeze call answers ABORTED,
/// and the volumes after it are never frozen.
#[test]
fn a_thaw_during_fifreeze_ends_the_freeze_as_soon_as_it_returns() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let (entered, wait) = (mpsc::channel(), mpsc::channel::<()>());
    let (f2, k2) = (f.clone(), k.clone());
    let t = std::thread::spawn(move || {
        f2.freeze(
            Some("mine"),
            &vols(&["v1", "v2"]),
            LONG,
            |id, vol| {
                f2.freeze_part(id, vol, || {
                    if vol == "v1" {
                        entered.0.send(()).unwrap();
                        wait.1.recv().unwrap();
                    }
                    k2.freeze(vol)
                })
            },
            || Ok(()),
        )
    });
    entered.1.recv().unwrap();
    assert_eq!(f.thaw("mine").unwrap(), vols(&["v1"]));
    wait.0.send(()).unwrap();
    let (c, msg) = code(t.join().unwrap());
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(!k.is_frozen("v1") && !k.is_frozen("v2"));
    assert!(f.holding("v1").is_none() && f.holding("v2").is_none());
    assert!(f.thaw("mine").is_ok(), "its own thaw ended it: OK again");
}

/// A forced thaw ends whatever holds the volume, and the freeze it ended
/// hears so at its own thaw; an unpublish ends only its volume's part.
#[test]
fn forced_thaws_and_unpublishes_are_recorded_against_the_freeze() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let a = freeze(&f, &k, None, &["v1", "v2"], LONG).unwrap();
    assert_eq!(
        f.end_volumes(&vols(&["v2", "v9"]), How::Forced),
        vols(&["v2"])
    );
    assert!(k.is_frozen("v1") && !k.is_frozen("v2"));
    let (c, msg) = code(f.thaw(&a.freeze_id));
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(msg.contains("volume v2 thawed by a forced thaw"), "{msg}");
    assert!(!k.is_frozen("v1"), "the rest is thawed all the same");
    let b = freeze(&f, &k, None, &["v1", "v2"], LONG).unwrap();
    f.end_volumes(&vols(&["v1"]), How::Unpublished);
    let (c, msg) = code(f.thaw(&b.freeze_id));
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(
        msg.contains("volume v1 thawed when the volume was unpublished"),
        "{msg}"
    );
    assert!(!msg.contains("v2 thawed"), "{msg}");
}

/// A restarted agent thaws what a dead one left frozen, records it, and a
/// late thaw hears of the restart; ids never repeat across the two; an id
/// never issued is NOT_FOUND.
#[test]
fn a_restart_ends_what_a_dead_agent_left_and_remembers_it() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let a = freeze(&f, &k, None, &["v1"], LONG).unwrap();
    let done = freeze(&f, &k, None, &["v2"], LONG).unwrap();
    f.thaw(&done.freeze_id).unwrap();
    // The agent dies: nothing thaws, its memory is gone.
    std::mem::forget(f);
    assert!(k.is_frozen("v1"));
    let g = open(d.path(), &k);
    assert!(!k.is_frozen("v1"), "the next start thaws it");
    let (c, msg) = code(g.thaw(&a.freeze_id));
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(msg.contains("after the agent that froze it died"), "{msg}");
    assert!(
        g.thaw(&done.freeze_id).is_ok(),
        "an ended freeze's own thaw stays OK"
    );
    let b = freeze(&g, &k, None, &["v1"], LONG).unwrap();
    assert_ne!(a.freeze_id, b.freeze_id);
    assert_eq!(code(g.thaw("freeze-never")).0, Code::NotFound);
}

/// Thawing one freeze leaves the record of a freeze made right after it
/// alone: each record is the freeze's own, never the volume's.
#[test]
fn a_thaw_never_touches_the_record_of_a_later_freeze() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let a = freeze(&f, &k, None, &["v1"], LONG).unwrap();
    f.thaw(&a.freeze_id).unwrap();
    let b = freeze(&f, &k, None, &["v1"], LONG).unwrap();
    let dir = d.path().join(FREEZES_DIR);
    let text = std::fs::read_to_string(dir.join(format!("{}.freeze", b.freeze_id))).unwrap();
    assert!(text.contains("volume=v1\tpending"), "{text}");
    let text = std::fs::read_to_string(dir.join(format!("{}.freeze", a.freeze_id))).unwrap();
    assert!(text.contains("volume=v1\tended\tthawed\t"), "{text}");
}

/// The ended freezes kept are bounded: the oldest go, on disk and in
/// memory, and their thaw is NOT_FOUND.
#[test]
fn ended_freezes_are_kept_to_a_bound() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let mut ids = Vec::new();
    for _ in 0..ENDED_KEPT + 5 {
        let a = freeze(&f, &k, None, &["v1"], LONG).unwrap();
        f.thaw(&a.freeze_id).unwrap();
        ids.push(a.freeze_id);
    }
    let files = std::fs::read_dir(d.path().join(FREEZES_DIR))
        .unwrap()
        .count();
    assert_eq!(files, ENDED_KEPT);
    assert_eq!(code(f.thaw(&ids[0])).0, Code::NotFound);
    assert!(f.thaw(&ids[ENDED_KEPT + 4]).is_ok());
    drop(f);
    let g = open(d.path(), &k);
    assert_eq!(code(g.thaw(&ids[4])).0, Code::NotFound);
    assert!(
        g.thaw(&ids[5]).is_ok(),
        "the newest are kept across a restart"
    );
}

/// Closing ends every freeze and stops the timer for good: a freeze a
/// later freezer makes on the same root outlives the first one's timeouts.
#[test]
fn a_closed_freezer_leaves_no_timer_to_end_a_later_freeze() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let a = freeze(&f, &k, None, &["v1"], Duration::from_millis(200)).unwrap();
    assert_eq!(f.end_all(How::Stopped), 1);
    f.close();
    assert!(!k.is_frozen("v1"));
    assert_eq!(
        code(freeze(&f, &k, None, &["v2"], LONG)).0,
        Code::FailedPrecondition
    );
    let g = open(d.path(), &k);
    let b = freeze(&g, &k, None, &["v1"], LONG).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        k.is_frozen("v1"),
        "the closed freezer's timer ended the new freeze"
    );
    assert!(g.thaw(&b.freeze_id).is_ok());
    let (c, msg) = code(g.thaw(&a.freeze_id));
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(msg.contains("when the agent stopped"), "{msg}");
}

/// Another freeze's volume is refused by name; a freeze already ended by
/// its timer while its call ran answers ABORTED and holds nothing.
#[test]
fn a_held_volume_is_refused_by_name_and_a_timeout_during_the_call_aborts_it() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let a = freeze(&f, &k, None, &["v1"], LONG).unwrap();
    let (c, msg) = code(freeze(&f, &k, None, &["v2", "v1"], LONG));
    assert_eq!(c, Code::FailedPrecondition, "{msg}");
    assert!(msg.contains(&a.freeze_id), "{msg}");
    assert!(!k.is_frozen("v2"), "all or none");
    let r = f.freeze(
        None,
        &vols(&["v3", "v4"]),
        Duration::from_millis(20),
        |id, vol| {
            if vol == "v4" {
                until("v3's timeout ends it", || !k.is_frozen("v3"));
            }
            f.freeze_part(id, vol, || k.freeze(vol))
        },
        || Ok(()),
    );
    let (c, msg) = code(r);
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(!k.is_frozen("v3") && !k.is_frozen("v4"));
    assert!(f.holding("v4").is_none());
}

// Attacks on the leases: each case names the promise of semantics.md §10 it
// holds the leases to.

/// Stalls volume `vol`'s next FITHAW once the kernel has thawed it:
/// answers (the filesystem is thawed now, let the FITHAW return).
fn stall(k: &Kernel, vol: &str) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (said, thawed) = mpsc::channel();
    let (go, wait) = mpsc::channel();
    k.stall_thaw.locked().insert(vol.into(), (said, wait));
    (thawed, go)
}

/// "OK while it held every one of its volumes up to now": the timer, or a
/// forced thaw, has thawed v1 in the kernel (writes go through it from
/// then on) and not yet recorded it. A thaw by the freeze's id that comes
/// in that window hears ABORTED: a backup whose snapshot ended just as its
/// timeout passed is never told it is consistent.
#[test]
fn a_thaw_by_id_while_another_end_runs_fithaw_answers_aborted() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    // Its timer.
    let (thawed, go) = stall(&k, "v1");
    let a = freeze(&f, &k, None, &["v1"], Duration::from_millis(50)).unwrap();
    thawed.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(
        !k.is_frozen("v1"),
        "the timer's FITHAW is done: writes go through"
    );
    let r = f.thaw(&a.freeze_id);
    go.send(()).unwrap();
    if let Ok(t) = r {
        panic!("told OK (thawed {t:?}) after its timeout had thawed v1");
    }
    // A forced thaw of two volumes: v1 thawed, v2 not yet, nothing recorded.
    let b = freeze(&f, &k, None, &["v1", "v2"], LONG).unwrap();
    let (thawed, go) = stall(&k, "v1");
    let f2 = f.clone();
    let forced = std::thread::spawn(move || f2.end_volumes(&vols(&["v1", "v2"]), How::Forced));
    thawed.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(
        !k.is_frozen("v1"),
        "the forced FITHAW is done: writes go through"
    );
    let r = f.thaw(&b.freeze_id);
    go.send(()).unwrap();
    forced.join().unwrap();
    if let Ok(t) = r {
        panic!("told OK (thawed {t:?}) after a forced thaw had thawed v1");
    }
}

/// "OK while it held every one of its volumes": FITHAW through the freeze's
/// own hold says the filesystem was not frozen any more (EINVAL: something
/// else in the guest thawed it, `fsfreeze -u`, sysrq's emergency thaw), so
/// writes went through before this thaw: ABORTED, naming that volume.
#[test]
fn a_thaw_that_finds_its_filesystem_thawed_by_another_answers_aborted() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let a = freeze(&f, &k, None, &["v1", "v2"], LONG).unwrap();
    // Someone else's FITHAW on v1.
    k.frozen.locked().insert("v1".into(), false);
    match f.thaw(&a.freeze_id) {
        Ok(t) => panic!("told OK (thawed {t:?}) though v1 was found thawed by someone else"),
        Err(e) => {
            assert_eq!(e.code(), Code::Aborted, "{e}");
            assert!(
                e.to_string()
                    .contains("volume v1 found thawed by something other"),
                "{e}"
            );
            assert!(!e.to_string().contains("volume v2"), "{e}");
        }
    }
}

/// A call with a caller's id that froze nothing forgets its lease and its
/// record; the next call with that id, made right then, writes its own
/// record, which must stay: a volume frozen with no record would never be
/// thawed by the next agent after a kill -9. The removal is rendered under
/// the record lock from the map as it is then. The gap it closes is a
/// preemption of the first call's thread, so this tries many times with
/// the second call ready to begin the moment the first lets go.
#[test]
fn a_failed_call_never_removes_the_record_of_the_next_call_with_its_id() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    for round in 0..5_000 {
        let id = format!("x{round}");
        let (entered, wait) = (mpsc::channel(), mpsc::channel::<()>());
        let (f1, id1) = (f.clone(), id.clone());
        let first = std::thread::spawn(move || {
            f1.freeze(
                Some(&id1),
                &vols(&["v1"]),
                LONG,
                |_, vol| {
                    entered.0.send(()).unwrap();
                    wait.1.recv().unwrap();
                    Err(SysError::new("open", vol, Errno::NOENT).into())
                },
                || Ok(()),
            )
        });
        entered.1.recv().unwrap();
        let (f2, k2, id2) = (f.clone(), k.clone(), id.clone());
        let second = std::thread::spawn(move || loop {
            match freeze(&f2, &k2, Some(&id2), &["v2"], LONG) {
                // Yield, not spin: on two cores a spinning second call would
                // take the CPU the first needs to fail and let go.
                Err(e) if e.code() == Code::Unavailable => std::thread::yield_now(),
                other => return other,
            }
        });
        wait.0.send(()).unwrap();
        assert!(first.join().unwrap().is_err());
        second.join().unwrap().unwrap();
        let rec = d.path().join(FREEZES_DIR).join(format!("{id}.freeze"));
        assert!(
            rec.exists(),
            "round {round}: v2 is frozen by {id} and {id} has no record: a kill -9 now leaves it frozen for good"
        );
        f.thaw(&id).unwrap();
    }
}

/// A crash in the middle of a freeze call leaves its record with the
/// volumes it had not reached yet "waiting": the next start thaws only
/// what the dead agent may have frozen, and leaves another tool's freeze
/// of a volume it never reached alone. Both parts end by the restart.
#[test]
fn a_restart_thaws_only_what_the_dead_call_had_reached() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let dir = d.path().join(FREEZES_DIR);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("cut.freeze"),
        "version=1\nfreeze=cut\ntimeout_ms=60000\nthaw_at_unix_ms=1\nvolume=v1\tpending\nvolume=v2\twaiting\n",
    )
    .unwrap();
    k.frozen.locked().insert("v1".into(), true);
    k.frozen.locked().insert("v2".into(), true);
    let f = open(d.path(), &k);
    assert!(!k.is_frozen("v1"), "what the dead call froze is thawed");
    assert!(
        k.is_frozen("v2"),
        "a freeze the dead call never made is left alone"
    );
    let (c, msg) = code(f.thaw("cut"));
    assert_eq!(c, Code::Aborted, "{msg}");
    assert!(
        msg.contains("volume v1 thawed by the agent's next start"),
        "{msg}"
    );
    let text = std::fs::read_to_string(dir.join("cut.freeze")).unwrap();
    assert!(
        !text.contains("pending") && !text.contains("waiting"),
        "{text}"
    );
}

/// The agent stops while a freeze call is under way, before it has frozen
/// anything: the call ends thawed and refused, not holding a filesystem
/// that no timer would thaw once the agent has gone.
#[test]
fn a_freeze_under_way_when_the_agent_stops_is_undone() {
    let d = tempfile::tempdir().unwrap();
    let k = Kernel::default();
    let f = open(d.path(), &k);
    let r = f.freeze(
        None,
        &vols(&["v1", "v2"]),
        LONG,
        |id, vol| {
            if vol == "v1" {
                f.stop();
            }
            f.freeze_part(id, vol, || k.freeze(vol))
        },
        || Ok(()),
    );
    let (c, msg) = code(r);
    assert_eq!(c, Code::FailedPrecondition, "{msg}");
    assert!(msg.contains("shutting down"), "{msg}");
    assert!(!k.is_frozen("v1") && !k.is_frozen("v2"), "left frozen");
}

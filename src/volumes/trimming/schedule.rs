//! The schedule room: one entry per published volume with a trim interval,
//! when its next trim is due, how far a trim that yielded got, and how the
//! last one went. The runner (run.rs) asks it what is due and tells it what
//! happened; ListVolumes and GetVolumeHealth read it. Time is given, never
//! read here, so the tests run a day of trims in milliseconds.
//!
//! Due times are spread: a volume's first trim comes at a random point
//! within its interval, and each next one an interval ± 10% after the last,
//! so a hundred volumes published at once never trim at once.
//!
//! What the runner tells of a trim goes to the entry the trim was due
//! of (`Due`): an unpublish and a publish of the same id meanwhile make
//! another entry, which keeps its own progress, times and errors.
//!
//! The one runner thread sleeps here until the next trim is due, and is
//! woken when an entry comes or goes and when the table closes; it ends
//! when no entry is left (the next entry starts another). Its mutex is a
//! leaf (table.rs's lock order).

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crust_protocols::sync::{CondvarExt, LockExt};

use super::super::request::TrimInfo;
use super::super::trim::Progress;

/// How soon a trim that found its volume busy (frozen, still publishing,
/// another operation on it) is tried again.
pub(crate) const BUSY_RETRY: Duration = Duration::from_secs(5);
/// How soon a trim that yielded to a call (or found another trim running)
/// goes on.
pub(crate) const YIELD_RETRY: Duration = Duration::from_secs(1);

/// Whether the runner thread runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runner {
    /// No thread: the next entry starts one.
    Idle,
    Running,
    /// The table's tests run the trims themselves (`run_due`): never a thread.
    Manual,
    /// The table closed: never a thread again.
    Closed,
}

/// How the last trim of a volume went.
#[derive(Clone, Debug)]
struct Last {
    at_unix_ms: i64,
    bytes: u64,
    spent: Duration,
}

/// A trim due, as `due` hands it out: what the runner tells of it
/// changes only the entry it was due of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Due {
    pub(crate) id: String,
    /// The entry's number (`Entry::made`).
    made: u64,
}

/// One volume's schedule.
#[derive(Clone, Debug)]
struct Entry {
    /// Which entry of its id this is: each new entry has the next number.
    made: u64,
    every: Duration,
    due: Instant,
    /// A trim that yielded part way: where it goes on from.
    part: Option<Progress>,
    last: Option<Last>,
    /// Why the last trim failed, until one goes through.
    error: Option<String>,
}

struct Inner {
    entries: BTreeMap<String, Entry>,
    /// The number of the last entry made.
    made: u64,
    runner: Runner,
    /// xorshift64 state, for the jitter.
    rng: u64,
}

/// The schedule (the module doc).
pub(crate) struct Schedule {
    inner: Mutex<Inner>,
    /// Wakes the runner when an entry comes or goes, or the table closes.
    wake: Condvar,
    /// The runner thread, joined when the table closes.
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A seed for the jitter from the kernel's random source (the clock's
/// bits if it fails: the spread needs no secret).
fn seed() -> u64 {
    let mut b = [0u8; 8];
    let s = match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
        Ok(8) => u64::from_ne_bytes(b),
        _ => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| u64::from(d.subsec_nanos()) ^ d.as_secs()),
    };
    s | 1
}

/// Milliseconds since the epoch at `at`, given that `now` is `now_ms`.
fn unix_ms_at(at: Instant, now: Instant, now_ms: i64) -> i64 {
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    match at.checked_duration_since(now) {
        Some(later) => now_ms.saturating_add(ms(later)),
        None => now_ms.saturating_sub(ms(now.saturating_duration_since(at))),
    }
}

impl Inner {
    fn random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    /// A random point in `[0, every)`.
    fn within(&mut self, every: Duration) -> Duration {
        let ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1);
        Duration::from_millis(self.random() % ms)
    }

    /// Volume `due.id`'s entry, if it is still the one `due` was of.
    fn of(&mut self, due: &Due) -> Option<&mut Entry> {
        self.entries.get_mut(&due.id).filter(|e| e.made == due.made)
    }

    /// `every` ± 10%.
    fn about(&mut self, every: Duration) -> Duration {
        let ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
        let spread = ms / 10;
        let off = self.random() % (2 * spread + 1);
        Duration::from_millis(ms - spread + off)
    }
}

impl Schedule {
    /// An empty schedule; `manual`: its trims are run by the caller, never
    /// by a thread (the table's tests).
    pub(crate) fn new(manual: bool) -> Schedule {
        Schedule {
            inner: Mutex::new(Inner {
                entries: BTreeMap::new(),
                made: 0,
                runner: if manual { Runner::Manual } else { Runner::Idle },
                rng: seed(),
            }),
            wake: Condvar::new(),
            thread: Mutex::new(None),
        }
    }

    /// Volume `id` as its slot holds it now: trimmed every `every` seconds
    /// (0, or gone: no entry). An entry kept with the same interval keeps
    /// its times; a new one is first due at a random point within its
    /// interval from `now`. True when a runner thread is to be started.
    pub(crate) fn show(&self, id: &str, every_s: u32, now: Instant) -> bool {
        let mut g = self.inner.locked();
        if every_s == 0 {
            if g.entries.remove(id).is_some() {
                self.wake.notify_all();
            }
            return false;
        }
        let every = Duration::from_secs(every_s.into());
        if g.entries.get(id).is_some_and(|e| e.every == every) {
            return false;
        }
        let due = now + g.within(every);
        g.made += 1;
        let entry = Entry {
            made: g.made,
            every,
            due,
            part: None,
            last: None,
            error: None,
        };
        g.entries.insert(id.to_string(), entry);
        self.wake.notify_all();
        if g.runner == Runner::Idle {
            g.runner = Runner::Running;
            return true;
        }
        false
    }

    /// The runner thread could not be started: the next entry tries again.
    pub(crate) fn not_started(&self) {
        let mut g = self.inner.locked();
        if g.runner == Runner::Running {
            g.runner = Runner::Idle;
        }
    }

    /// Keeps the runner thread, to be joined when the table closes.
    pub(crate) fn started(&self, h: JoinHandle<()>) {
        if let Some(old) = self.thread.locked().replace(h) {
            // It had ended (the runner was idle): joined at once.
            let _ = old.join();
        }
    }

    /// The trims due at `now`, the earliest first.
    pub(crate) fn due(&self, now: Instant) -> Vec<Due> {
        let g = self.inner.locked();
        let mut due: Vec<(Instant, Due)> = g
            .entries
            .iter()
            .filter(|(_, e)| e.due <= now)
            .map(|(id, e)| {
                let id = id.clone();
                (e.due, Due { id, made: e.made })
            })
            .collect();
        due.sort_by_key(|(at, _)| *at);
        due.into_iter().map(|(_, d)| d).collect()
    }

    /// When the next trim is due, if any entry is left.
    #[cfg(test)]
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.inner.locked().entries.values().map(|e| e.due).min()
    }

    /// The runner's wait: until a trim is due (answering the time it
    /// woke), or None once no entry is left (the runner ends) or the table
    /// closed.
    pub(crate) fn wait_due(&self) -> Option<Instant> {
        let mut g = self.inner.locked();
        loop {
            if g.runner != Runner::Running {
                return None;
            }
            let now = Instant::now();
            let Some(next) = g.entries.values().map(|e| e.due).min() else {
                g.runner = Runner::Idle;
                return None;
            };
            if next <= now {
                return Some(now);
            }
            g = self.wake.waited_for(g, next - now);
        }
    }

    /// Ends the runner for good and joins it (unless called on it).
    pub(crate) fn close(&self) {
        self.inner.locked().runner = Runner::Closed;
        self.wake.notify_all();
        let handle = self.thread.locked().take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    /// Where the trim `due` goes on from: a trim that yielded, or the
    /// start. None when its entry is gone or another (the volume was
    /// unpublished since `due` was handed out): nothing is to be trimmed.
    pub(crate) fn resume(&self, due: &Due) -> Option<Progress> {
        let mut g = self.inner.locked();
        g.of(due).map(|e| e.part.take().unwrap_or_default())
    }

    /// The trim `due` could not run at `now`: tried again `after`.
    pub(crate) fn later(&self, due: &Due, now: Instant, after: Duration) {
        if let Some(e) = self.inner.locked().of(due) {
            e.due = now + after;
        }
    }

    /// The trim `due` yielded at `now` having done `p`: it goes on soon.
    pub(crate) fn yielded(&self, due: &Due, now: Instant, p: Progress) {
        if let Some(e) = self.inner.locked().of(due) {
            e.part = Some(p);
            e.due = now + YIELD_RETRY;
        }
    }

    /// The trim `due` ended at `now` (`now_ms` since the epoch): done
    /// (`p`), or failed (`Err`, why). The next is due an interval ± 10% on.
    pub(crate) fn ended(&self, due: &Due, now: Instant, now_ms: i64, r: Result<Progress, String>) {
        let mut g = self.inner.locked();
        let Some(every) = g.of(due).map(|e| e.every) else {
            return;
        };
        let next = now + g.about(every);
        let Some(e) = g.of(due) else {
            return;
        };
        e.due = next;
        e.part = None;
        match r {
            Ok(p) => {
                e.last = Some(Last {
                    at_unix_ms: now_ms,
                    bytes: p.trimmed,
                    spent: p.spent,
                });
                e.error = None;
            }
            Err(why) => e.error = Some(why),
        }
    }

    /// Why volume `id`'s last trim failed, until one goes through.
    pub(crate) fn error(&self, id: &str) -> Option<String> {
        self.inner.locked().entries.get(id)?.error.clone()
    }

    /// What ListVolumes says of volume `id`'s schedule, at `now` (`now_ms`
    /// since the epoch).
    pub(crate) fn info(&self, id: &str, now: Instant, now_ms: i64) -> Option<TrimInfo> {
        let g = self.inner.locked();
        let e = g.entries.get(id)?;
        let last = e.last.clone();
        Some(TrimInfo {
            interval_s: u32::try_from(e.every.as_secs()).unwrap_or(u32::MAX),
            last_unix_ms: last.as_ref().map_or(0, |l| l.at_unix_ms),
            last_bytes: last.as_ref().map_or(0, |l| l.bytes),
            last_duration: last.map_or(Duration::ZERO, |l| l.spent),
            next_unix_ms: unix_ms_at(e.due, now, now_ms),
            last_error: e.error.clone(),
        })
    }

    /// How many entries there are (a bound tests check).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.locked().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Volume `id`'s trim, as `due` would hand it out.
    fn of(s: &Schedule, id: &str) -> Due {
        let made = s.inner.locked().entries[id].made;
        Due {
            id: id.into(),
            made,
        }
    }

    /// A hundred volumes shown at once are first due all over their
    /// interval, and each next trim an interval ± 10% after the last.
    #[test]
    fn due_times_are_spread_over_the_interval() {
        let s = Schedule::new(true);
        let t0 = Instant::now();
        for i in 0..100 {
            assert!(!s.show(&format!("v{i}"), 100, t0), "manual: no thread");
        }
        assert_eq!(s.len(), 100);
        let firsts: Vec<Duration> = s
            .due(t0 + Duration::from_secs(100))
            .iter()
            .map(|d| s.inner.locked().entries[&d.id].due - t0)
            .collect();
        assert_eq!(firsts.len(), 100, "all due within one interval");
        let mut quarters = [0; 4];
        for f in &firsts {
            quarters[usize::try_from(f.as_secs() / 25).unwrap()] += 1;
        }
        assert!(quarters.iter().all(|&n| n >= 5), "spread: {quarters:?}");
        assert!(s.due(t0).len() < 5, "not all at once");
        let later = t0 + Duration::from_secs(500);
        let mut gaps = Vec::new();
        for i in 0..100 {
            let id = format!("v{i}");
            s.ended(&of(&s, &id), later, 0, Ok(Progress::default()));
            gaps.push(s.inner.locked().entries[&id].due - later);
        }
        assert!(
            gaps.iter()
                .all(|g| *g >= Duration::from_secs(90) && *g <= Duration::from_secs(110)),
            "{gaps:?}"
        );
        let (lo, hi) = (gaps.iter().min().unwrap(), gaps.iter().max().unwrap());
        assert!(
            *hi - *lo >= Duration::from_secs(10),
            "jittered: {lo:?}..{hi:?}"
        );
    }

    /// The same interval again keeps an entry's times; another one starts
    /// it over; 0 removes it. A failure shows until a trim goes through.
    #[test]
    fn entries_follow_their_volume_and_failures_show_until_a_success() {
        let s = Schedule::new(true);
        let t0 = Instant::now();
        s.show("a", 60, t0);
        let due = s.next_due().unwrap();
        s.show("a", 60, t0 + Duration::from_secs(30));
        assert_eq!(s.next_due(), Some(due));
        s.ended(&of(&s, "a"), t0, 1000, Err("FITRIM failed".into()));
        assert_eq!(s.error("a").as_deref(), Some("FITRIM failed"));
        let i = s.info("a", t0, 1000).unwrap();
        assert_eq!((i.interval_s, i.last_unix_ms), (60, 0));
        let p = Progress {
            done: 8,
            trimmed: 4096,
            spent: Duration::from_millis(3),
        };
        s.ended(&of(&s, "a"), t0, 2000, Ok(p));
        let i = s.info("a", t0, 2000).unwrap();
        assert_eq!(
            (i.last_unix_ms, i.last_bytes, i.last_error.clone()),
            (2000, 4096, None)
        );
        assert!(
            i.next_unix_ms >= 2000 + 54_000 && i.next_unix_ms <= 2000 + 66_000,
            "{i:?}"
        );
        s.show("a", 0, t0);
        assert_eq!((s.len(), s.error("a")), (0, None));
    }

    /// What the runner tells of a trim handed out before its volume was
    /// unpublished and published again (with a schedule or without) lands
    /// nowhere: the new entry keeps its own times, and nothing is resumed.
    #[test]
    fn a_trim_of_an_entry_since_replaced_changes_nothing() {
        let s = Schedule::new(true);
        let t0 = Instant::now();
        s.show("a", 60, t0);
        let old = s.due(t0 + Duration::from_secs(60)).remove(0);
        let p = Progress {
            done: 1 << 28,
            trimmed: 4096,
            spent: Duration::from_millis(1),
        };
        s.yielded(&old, t0, p);
        assert_eq!(s.resume(&old), Some(p), "its own entry goes on");
        s.show("a", 0, t0);
        assert_eq!(s.resume(&old), None, "gone: nothing to trim");
        for every in [60, 3600] {
            s.show("a", every, t0);
            let due = s.next_due();
            s.yielded(&old, t0, p);
            s.later(&old, t0, BUSY_RETRY);
            s.ended(&old, t0, 1000, Err("FITRIM failed".into()));
            assert_eq!(s.resume(&old), None, "another entry: nothing to trim");
            let i = s.info("a", t0, 1000).unwrap();
            assert_eq!((i.last_unix_ms, i.last_error), (0, None));
            assert_eq!(s.next_due(), due, "its own first time");
            assert_eq!(s.resume(&of(&s, "a")), Some(Progress::default()));
            s.show("a", 0, t0);
        }
    }

    /// The runner sleeps until a trim is due, is woken by a new entry and
    /// by close, and ends when no entry is left.
    #[test]
    fn the_runner_sleeps_until_due_and_wakes_on_change_and_close() {
        let s = Arc::new(Schedule::new(false));
        assert!(
            s.show("a", 3600, Instant::now()),
            "the first entry starts the runner"
        );
        assert!(!s.show("b", 3600, Instant::now()), "one runner");
        // Due now: the runner is woken and answers at once.
        s.inner.locked().entries.get_mut("a").unwrap().due = Instant::now();
        assert!(s.wait_due().is_some());
        s.later(&of(&s, "a"), Instant::now(), Duration::from_secs(3600));
        s.inner.locked().entries.get_mut("b").unwrap().due =
            Instant::now() + Duration::from_secs(3600);
        let r = s.clone();
        let t0 = Instant::now();
        let runner = std::thread::spawn(move || r.wait_due());
        std::thread::sleep(Duration::from_millis(50));
        s.close();
        assert_eq!(runner.join().unwrap(), None);
        assert!(t0.elapsed() < Duration::from_secs(2), "close wakes it");
        // No entry left: the runner ends, and the next entry starts one.
        let s = Schedule::new(false);
        assert!(s.show("a", 60, Instant::now()));
        s.show("a", 0, Instant::now());
        assert_eq!(s.wait_due(), None);
        assert!(s.show("a", 60, Instant::now()));
    }
}

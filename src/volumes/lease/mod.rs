//! A freeze is a lease (semantics.md §10). It has an id that nothing else
//! reuses (a random part, or the caller's own new id), and only that id,
//! its own timer, an unpublish of one of its volumes, the agent stopping
//! or restarting, or a forced thaw ends it. Each end is recorded against
//! the id, so a late thaw hears how its freeze ended (ABORTED) and never
//! ends another caller's freeze. Only a forced thaw acts on "whatever
//! holds this volume", and it says so in the record.
//!
//! This room owns every lease, live and recently ended, which lease holds
//! which volume, the records (`ledger`) and the one timer thread. It thaws
//! through the frozen filesystems it holds open ([`Thaw`]), never by path
//! and never while its mutex is held; that trait is all it asks of the
//! kernel, so its logic is tested without root (`tests.rs`).
//!
//! Locks: `write` (one record rendered and written at a time, so the
//! newest state is the one on disk), then `inner`, a leaf held for one
//! lookup or update. Callers may hold a volume's slot; nothing here waits
//! for one.

mod end;
pub(crate) mod error;
mod ledger;
mod record;
#[cfg(test)]
mod tests;
mod timer;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crust_protocols::freeze::{new_id, ENDED_KEPT};
use crust_protocols::sync::LockExt;
use slog::{warn, Logger};

pub(crate) use end::{End, How};
pub use error::Error;
pub(crate) use ledger::Ledger;
use record::{Record, Said};

use crate::quiesce;

/// A freeze's timeout when the caller names none.
pub const DEFAULT_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::DEFAULT_TIMEOUT_MS as u64);
/// The longest freeze: a pod's writes wait for all of it.
pub const MAX_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::MAX_TIMEOUT_MS as u64);
/// How soon a thaw that failed is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Milliseconds since the epoch, now.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A frozen filesystem, held to be thawed: FITHAW on its root. False when
/// it was not frozen any more. The kernel the table runs on makes them
/// (`volumes::kernel`).
pub trait Thaw: Send + 'static {
    fn thaw(&self) -> Result<bool, quiesce::Error>;
}

/// One volume of a lease.
enum Part<H> {
    /// Not reached yet by its freeze call.
    Waiting,
    /// FIFREEZE in flight; `end`: how it ends as soon as it returns, when
    /// something ended it meanwhile.
    Freezing {
        end: Option<How>,
    },
    /// Frozen; `retry`: a thaw that failed, tried again then.
    Held {
        hold: H,
        retry: Option<(Instant, How)>,
    },
    /// FITHAW in flight: how it ends, and since when. Writes may go
    /// through already, so a thaw by its id that finds it so must not
    /// answer that the freeze held.
    Ending(End),
    Ended(End),
    /// Never frozen: its freeze call stopped before it.
    Skipped,
}

impl<H> Part<H> {
    /// A part whose FITHAW begins now, to end it `how`.
    fn ending(how: How) -> Part<H> {
        Part::Ending(End {
            how,
            at_unix_ms: unix_ms(),
        })
    }

    fn said(&self) -> Said {
        match self {
            Part::Ended(e) => Said::Ended(*e),
            Part::Skipped => Said::Skipped,
            Part::Waiting => Said::Waiting,
            Part::Freezing { .. } | Part::Held { .. } | Part::Ending(_) => Said::Pending,
        }
    }

    fn is_over(&self) -> bool {
        matches!(self, Part::Ended(_) | Part::Skipped)
    }
}

/// A freeze.
struct Lease<H> {
    /// Its volumes, in the order its call named them.
    parts: Vec<(String, Part<H>)>,
    timeout: Duration,
    deadline: Instant,
    thaw_at_unix_ms: u64,
    /// Its freeze call still runs.
    making: bool,
    /// What ended it while its call ran (a thaw by its id, the agent
    /// stopping): the call stops at its next volume.
    stopped: Option<How>,
    /// Counted among the ended leases the ledger keeps.
    settled: bool,
    /// Its record on disk is behind: the timer writes it again.
    unsaved: bool,
}

impl<H> Lease<H> {
    fn new(ids: &[String], timeout: Duration) -> Lease<H> {
        Lease {
            parts: ids.iter().map(|v| (v.clone(), Part::Waiting)).collect(),
            timeout,
            deadline: Instant::now() + timeout,
            thaw_at_unix_ms: unix_ms().saturating_add(millis(timeout)),
            making: true,
            stopped: None,
            settled: false,
            unsaved: false,
        }
    }

    fn part(&mut self, vol: &str) -> Option<&mut Part<H>> {
        self.parts
            .iter_mut()
            .find(|(v, _)| v == vol)
            .map(|(_, p)| p)
    }

    fn is_over(&self) -> bool {
        !self.making && self.parts.iter().all(|(_, p)| p.is_over())
    }

    fn frozen(&self, id: &str) -> Frozen {
        Frozen {
            freeze_id: id.to_string(),
            thaw_at_unix_ms: self.thaw_at_unix_ms,
            timeout: self.timeout,
        }
    }

    /// The parts that ended, or are being ended, some way other than by
    /// its id, as sentences.
    fn broken(&self, now: u64) -> Vec<String> {
        self.parts
            .iter()
            .filter_map(|(v, p)| match p {
                Part::Ended(e) | Part::Ending(e) if e.how != How::Thawed => Some(e.said(v, now)),
                _ => None,
            })
            .collect()
    }

    fn record(&self, id: &str) -> Record {
        Record {
            freeze: id.to_string(),
            timeout_ms: millis(self.timeout),
            thaw_at_unix_ms: self.thaw_at_unix_ms,
            parts: self
                .parts
                .iter()
                .map(|(v, p)| (v.clone(), p.said()))
                .collect(),
        }
    }

    /// A lease as a record left it: ended, nothing held.
    fn from_record(r: &Record) -> Lease<H> {
        let parts = r
            .parts
            .iter()
            .map(|(v, s)| {
                let p = match s {
                    Said::Ended(e) => Part::Ended(*e),
                    Said::Skipped | Said::Pending | Said::Waiting => Part::Skipped,
                };
                (v.clone(), p)
            })
            .collect();
        Lease {
            parts,
            timeout: Duration::from_millis(r.timeout_ms),
            deadline: Instant::now(),
            thaw_at_unix_ms: r.thaw_at_unix_ms,
            making: false,
            stopped: None,
            settled: true,
            unsaved: false,
        }
    }

    /// A second call with the caller's id `id`: the same freeze answered
    /// again while it holds, else refused.
    fn again(&self, id: &str, ids: &[String], timeout: Duration) -> Result<Frozen, Error> {
        if self.making {
            return Err(Error::BeingMade { freeze: id.into() });
        }
        let same = self.timeout == timeout
            && self.parts.len() == ids.len()
            && ids.iter().all(|v| self.parts.iter().any(|(p, _)| p == v));
        let holds = self
            .parts
            .iter()
            .all(|(_, p)| matches!(p, Part::Held { .. }));
        if same && holds {
            return Ok(self.frozen(id));
        }
        let broken = self.broken(unix_ms());
        let why = if !holds && !broken.is_empty() {
            format!("that freeze ended: {}", broken.join("; "))
        } else if !holds {
            "that freeze was thawed by its id".into()
        } else {
            let vols: Vec<&str> = self.parts.iter().map(|(v, _)| v.as_str()).collect();
            format!(
                "it holds {} with a timeout of {} ms, not what this call names",
                vols.join(", "),
                millis(self.timeout)
            )
        };
        Err(Error::Taken {
            freeze: id.into(),
            why,
        })
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What a freeze answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frozen {
    pub freeze_id: String,
    /// When it ends by itself, in milliseconds since the epoch.
    pub thaw_at_unix_ms: u64,
    pub timeout: Duration,
}

/// What holds a volume frozen, as ListVolumes and refusals say it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Holding {
    pub(crate) freeze: String,
    /// Until it ends by itself.
    pub(crate) left: Duration,
}

/// How a freeze call begins.
enum Begun {
    /// A new lease, recorded: freeze its volumes, then `complete` it.
    New(String),
    /// The caller's id names a freeze that holds these volumes already.
    Again(Frozen),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
enum TimerState {
    #[default]
    Idle,
    Running,
    /// The table closed: no timer, no new freeze.
    Closed,
}

struct Inner<H> {
    leases: HashMap<String, Lease<H>>,
    /// Which lease holds each volume (freezing, frozen or thawing).
    holders: HashMap<String, String>,
    /// The leases that are over, oldest first: the last ENDED_KEPT stay.
    over: VecDeque<String>,
    timer: TimerState,
    /// When the timer last wrote the records an end could not.
    saved_try: Option<Instant>,
}

/// A part taken out to be thawed.
struct Taken<H> {
    vol: String,
    hold: H,
    how: How,
}

/// The leases (the module doc).
pub(crate) struct Freezer<H: Thaw> {
    inner: Mutex<Inner<H>>,
    /// Wakes the timer when a lease changes, or the table closes.
    wake: Condvar,
    ledger: Ledger,
    /// Taken to render and write one record (the module doc's lock order).
    write: Mutex<()>,
    log: Logger,
    /// The timer thread, joined when the table closes.
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Itself, for the timer thread to hold.
    me: std::sync::Weak<Freezer<H>>,
}

/// 64 bits from the kernel's random source (a clock's bits if it fails, so
/// ids still differ from any earlier run's).
fn entropy() -> u64 {
    let mut b = [0u8; 8];
    match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
        Ok(8) => u64::from_ne_bytes(b),
        _ => SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
            u64::from(d.subsec_nanos()) ^ d.as_secs().rotate_left(32)
        }),
    }
}

impl<H: Thaw> Freezer<H> {
    /// The leases of the root the ledger is on. Each record that says a
    /// volume may be frozen (its agent died) has it thawed by `thaw_left`
    /// (true: it was frozen) and recorded as ended by a restart; ended
    /// leases are kept for late thaws.
    pub(crate) fn open(
        ledger: Ledger,
        log: Logger,
        thaw_left: impl Fn(&str) -> crate::error::Result<bool>,
    ) -> Arc<Freezer<H>> {
        let mut records = ledger.load(&log);
        for r in &mut records {
            let mut changed = false;
            for (vol, said) in &mut r.parts {
                match *said {
                    Said::Pending => {}
                    // Never frozen by the dead agent: its filesystem is
                    // left alone (something else may hold it frozen), and
                    // the freeze is over, by the restart.
                    Said::Waiting => {
                        *said = Said::Ended(End {
                            how: How::Restart,
                            at_unix_ms: unix_ms(),
                        });
                        changed = true;
                        continue;
                    }
                    Said::Skipped | Said::Ended(_) => continue,
                }
                match thaw_left(vol) {
                    Ok(true) => {
                        warn!(log, "thawed a volume a previous run left frozen"; "volume" => &*vol, "freeze" => &r.freeze)
                    }
                    Ok(false) => {}
                    Err(e) => {
                        warn!(log, "could not thaw a volume a previous run left frozen"; "volume" => &*vol, "freeze" => &r.freeze, "error" => %e)
                    }
                }
                *said = Said::Ended(End {
                    how: How::Restart,
                    at_unix_ms: unix_ms(),
                });
                changed = true;
            }
            if changed {
                if let Err(e) = ledger.write(r) {
                    warn!(log, "could not record a freeze a restart ended"; "freeze" => &r.freeze, "error" => %e);
                }
            }
        }
        records.sort_by_key(|r| (r.ended_at(), r.freeze.clone()));
        let mut inner = Inner {
            leases: HashMap::new(),
            holders: HashMap::new(),
            over: VecDeque::new(),
            timer: TimerState::Idle,
            saved_try: None,
        };
        for r in &records {
            inner.leases.insert(r.freeze.clone(), Lease::from_record(r));
            inner.over.push_back(r.freeze.clone());
        }
        for id in evict(&mut inner) {
            let _ = ledger.remove(&id);
        }
        Arc::new_cyclic(|me| Freezer {
            inner: Mutex::new(inner),
            wake: Condvar::new(),
            ledger,
            write: Mutex::new(()),
            log,
            thread: Mutex::new(None),
            me: me.clone(),
        })
    }

    /// Freezes `ids` (validated, distinct) for `timeout`, all or none: a
    /// lease named `asked` (or a new id) is recorded, then `each(id, vol)`
    /// freezes each volume in turn (through [`Freezer::freeze_part`]), and
    /// `wanted` says whether the caller still waits for the answer. Anything
    /// that fails, or ends the lease meanwhile, undoes what it froze. A
    /// retry with the caller's id of a freeze that holds answers it again.
    pub(crate) fn freeze(
        &self,
        asked: Option<&str>,
        ids: &[String],
        timeout: Duration,
        mut each: impl FnMut(&str, &str) -> crate::error::Result<()>,
        wanted: impl FnOnce() -> crate::error::Result<()>,
    ) -> crate::error::Result<Frozen> {
        let id = match self.begin(asked, ids, timeout)? {
            Begun::Again(frozen) => return Ok(frozen),
            Begun::New(id) => id,
        };
        let done = ids
            .iter()
            .try_for_each(|vol| each(&id, vol))
            .and_then(|()| wanted());
        if let Err(e) = done {
            self.abandon(&id);
            return Err(e);
        }
        self.complete(&id)
    }

    /// Starts a freeze of `ids` (validated, distinct) for `timeout`, named
    /// `asked` or a new id, and records it before anything is frozen.
    fn begin(
        &self,
        asked: Option<&str>,
        ids: &[String],
        timeout: Duration,
    ) -> crate::error::Result<Begun> {
        let id = {
            let mut g = self.inner.locked();
            if g.timer == TimerState::Closed {
                return Err(crate::volumes::error::Error::ShuttingDown.into());
            }
            let id = match asked {
                Some(a) => {
                    if let Some(l) = g.leases.get(a) {
                        return Ok(Begun::Again(l.again(a, ids, timeout)?));
                    }
                    a.to_string()
                }
                None => loop {
                    let id = new_id("freeze", unix_ms(), entropy());
                    if !g.leases.contains_key(&id) {
                        break id;
                    }
                },
            };
            g.leases.insert(id.clone(), Lease::new(ids, timeout));
            id
        };
        if let Err(e) = self.record(&id) {
            self.inner.locked().leases.remove(&id);
            let _ = self.record(&id);
            return Err(e);
        }
        Ok(Begun::New(id))
    }

    /// Freezes volume `vol` of lease `id` with `freeze` (FIFREEZE, under
    /// the volume's lock): refused when another lease holds the volume or
    /// something ended this one meanwhile. A thaw that comes while FIFREEZE
    /// runs is not lost: the volume is thawed as soon as it returns.
    pub(crate) fn freeze_part(
        &self,
        id: &str,
        vol: &str,
        freeze: impl FnOnce() -> crate::error::Result<H>,
    ) -> crate::error::Result<()> {
        self.claim(id, vol)?;
        // On disk before FIFREEZE: a restart thaws what this record says
        // may be frozen, and only that.
        if let Err(e) = self.record(id) {
            let mut g = self.inner.locked();
            if let Some(part) = g.leases.get_mut(id).and_then(|l| l.part(vol)) {
                *part = Part::Skipped;
            }
            g.holders.remove(vol);
            return Err(e);
        }
        let frozen = freeze();
        let mut g = self.inner.locked();
        let Inner {
            leases, holders, ..
        } = &mut *g;
        let Some(part) = leases.get_mut(id).and_then(|l| l.part(vol)) else {
            return Err(self.unknown(id).into());
        };
        let end = match part {
            Part::Freezing { end } => *end,
            _ => None,
        };
        match (frozen, end) {
            (Err(e), _) => {
                *part = Part::Skipped;
                holders.remove(vol);
                Err(e)
            }
            (Ok(hold), None) => {
                *part = Part::Held { hold, retry: None };
                drop(g);
                // A timer asleep until a later deadline must see this one.
                self.wake.notify_all();
                self.start_timer();
                Ok(())
            }
            (Ok(hold), Some(how)) => {
                *part = Part::ending(how);
                drop(g);
                let vol = vol.to_string();
                self.end(id, vec![Taken { vol, hold, how }]);
                Err(self.broken(id).into())
            }
        }
    }

    /// Marks `vol` as being frozen by lease `id`.
    fn claim(&self, id: &str, vol: &str) -> Result<(), Error> {
        let mut g = self.inner.locked();
        if let Some(other) = g.holders.get(vol) {
            let left = g.leases.get(other).map_or(Duration::ZERO, |l| {
                l.deadline.saturating_duration_since(Instant::now())
            });
            return Err(Error::Frozen {
                id: vol.into(),
                freeze: other.clone(),
                seconds_left: left.as_secs(),
            });
        }
        let lease = g.leases.get_mut(id).ok_or_else(|| self.unknown(id))?;
        if lease.stopped.is_some() {
            return Err(self.broken_locked(id, lease));
        }
        let part = lease.part(vol).ok_or_else(|| self.unknown(id))?;
        *part = Part::Freezing { end: None };
        g.holders.insert(vol.to_string(), id.to_string());
        Ok(())
    }

    /// Ends lease `id`'s call: every volume frozen and still held answers
    /// the freeze; anything that ended meanwhile undoes the rest (ABORTED).
    fn complete(&self, id: &str) -> crate::error::Result<Frozen> {
        {
            let mut g = self.inner.locked();
            if g.timer == TimerState::Closed {
                drop(g);
                self.abandon(id);
                return Err(crate::volumes::error::Error::ShuttingDown.into());
            }
            let lease = g.leases.get_mut(id).ok_or_else(|| self.unknown(id))?;
            let holds = lease
                .parts
                .iter()
                .all(|(_, p)| matches!(p, Part::Held { .. }));
            if holds && lease.stopped.is_none() {
                lease.making = false;
                return Ok(lease.frozen(id));
            }
        }
        let e = self.broken(id);
        self.abandon(id);
        Err(e.into())
    }

    /// Undoes lease `id` whose call failed: what it froze is thawed and
    /// recorded as undone. A lease that froze nothing, and that nothing
    /// ended, is forgotten with its record: its id may be used again.
    fn abandon(&self, id: &str) {
        let taken = {
            let mut g = self.inner.locked();
            let Some(lease) = g.leases.get_mut(id) else {
                return;
            };
            lease.making = false;
            let mut taken = Vec::new();
            for (vol, part) in &mut lease.parts {
                match std::mem::replace(part, Part::Skipped) {
                    Part::Held { hold, .. } => {
                        *part = Part::ending(How::Undone);
                        taken.push(Taken {
                            vol: vol.clone(),
                            hold,
                            how: How::Undone,
                        });
                    }
                    Part::Waiting => {}
                    other => *part = other,
                }
            }
            let untouched = taken.is_empty()
                && lease.stopped.is_none()
                && lease.parts.iter().all(|(_, p)| matches!(p, Part::Skipped));
            if untouched {
                g.leases.remove(id);
                drop(g);
                // Rendered under the record lock from the map as it is
                // then: a call with the same id may have begun meanwhile,
                // and its record must stay.
                let _ = self.record(id);
                return;
            }
            taken
        };
        self.end(id, taken);
    }

    /// Ends lease `id` by its id (ThawVolumes): answers the volumes this
    /// call thawed; ABORTED when a part of it ended some other way first.
    pub(crate) fn thaw(&self, id: &str) -> crate::error::Result<Vec<String>> {
        let taken = {
            let mut g = self.inner.locked();
            let lease = g.leases.get_mut(id).ok_or_else(|| self.unknown(id))?;
            if lease.making {
                lease.stopped.get_or_insert(How::Thawed);
            }
            let making = lease.making;
            let mut taken = Vec::new();
            let mut thawed = Vec::new();
            for (vol, part) in &mut lease.parts {
                if take_part(vol, part, How::Thawed, making, &mut taken) {
                    thawed.push(vol.clone());
                }
            }
            (taken, thawed)
        };
        let (taken, thawed) = taken;
        let failed = self.end(id, taken);
        if let Some(e) = failed {
            return Err(e.into());
        }
        let g = self.inner.locked();
        if let Some(lease) = g.leases.get(id) {
            if !lease.broken(unix_ms()).is_empty() {
                return Err(self.broken_locked(id, lease).into());
            }
        }
        Ok(thawed)
    }

    /// Ends whatever lease holds each of `vols` (a forced thaw, or `how`
    /// for an unpublish or the agent stopping); answers the volumes thawed.
    pub(crate) fn end_volumes(&self, vols: &[String], how: How) -> Vec<String> {
        let mut by_lease: HashMap<String, Vec<Taken<H>>> = HashMap::new();
        let mut thawed = Vec::new();
        {
            let mut g = self.inner.locked();
            let Inner {
                leases, holders, ..
            } = &mut *g;
            for vol in vols {
                let Some(id) = holders.get(vol) else { continue };
                let Some(lease) = leases.get_mut(id) else {
                    continue;
                };
                let Some(part) = lease.part(vol) else {
                    continue;
                };
                let mut taken = Vec::new();
                if take_part(vol, part, how, false, &mut taken) {
                    thawed.push(vol.clone());
                }
                by_lease.entry(id.clone()).or_default().extend(taken);
            }
        }
        for (id, taken) in by_lease {
            self.end(&id, taken);
        }
        thawed
    }

    /// The agent stops: no freeze begins or completes from here on (one
    /// under way is undone at its end), then every lease ends, its
    /// volumes thawed; answers how many. In that order, so that no freeze
    /// is left holding a filesystem after the last thaw.
    pub(crate) fn stop(&self) -> usize {
        self.close();
        self.end_all(How::Stopped)
    }

    /// Ends every lease (the agent stops); answers how many volumes were thawed.
    pub(crate) fn end_all(&self, how: How) -> usize {
        let vols: Vec<String> = self.inner.locked().holders.keys().cloned().collect();
        self.end_volumes(&vols, how).len()
    }

    /// What holds volume `vol` frozen, if anything.
    pub(crate) fn holding(&self, vol: &str) -> Option<Holding> {
        let g = self.inner.locked();
        let id = g.holders.get(vol)?;
        let left = g.leases.get(id).map_or(Duration::ZERO, |l| {
            l.deadline.saturating_duration_since(Instant::now())
        });
        Some(Holding {
            freeze: id.clone(),
            left,
        })
    }

    /// Thaws what was taken, then records how each part ended; a thaw that
    /// fails is put back for the timer to retry. Answers the failure, if any.
    fn end(&self, id: &str, taken: Vec<Taken<H>>) -> Option<Error> {
        let mut failed: Vec<(String, String)> = Vec::new();
        let mut done = Vec::new();
        for t in taken {
            let r = t.hold.thaw();
            done.push((t, r));
        }
        let mut retry = false;
        {
            let mut g = self.inner.locked();
            let at_unix_ms = unix_ms();
            let Inner {
                leases, holders, ..
            } = &mut *g;
            for (t, r) in done {
                let Some(part) = leases.get_mut(id).and_then(|l| l.part(&t.vol)) else {
                    continue;
                };
                match r {
                    Ok(was) => {
                        // Not frozen any more when its end came: something
                        // else thawed it, whatever this end meant to say.
                        let how = if was { t.how } else { How::Lost };
                        if !was {
                            warn!(self.log, "a frozen volume was found thawed by something other than the agent";
                                  "volume" => &t.vol, "freeze" => id);
                        }
                        *part = Part::Ended(End { how, at_unix_ms });
                        if holders.get(&t.vol).map(String::as_str) == Some(id) {
                            holders.remove(&t.vol);
                        }
                    }
                    Err(e) => {
                        warn!(self.log, "could not thaw; trying again in a second";
                              "volume" => &t.vol, "freeze" => id, "error" => %e);
                        failed.push((t.vol.clone(), e.to_string()));
                        *part = Part::Held {
                            hold: t.hold,
                            retry: Some((Instant::now() + RETRY, t.how)),
                        };
                        retry = true;
                    }
                }
            }
            let evicted = settle(&mut g, id);
            self.wake.notify_all();
            drop(g);
            for old in evicted {
                let _ = self.record(&old);
            }
        }
        if retry {
            self.start_timer();
        }
        self.save(id);
        let (_, error) = failed.first()?;
        let vols: Vec<&str> = failed.iter().map(|(v, _)| v.as_str()).collect();
        Some(Error::ThawFailed {
            freeze: id.into(),
            volumes: vols.join(", "),
            error: error.clone(),
        })
    }

    /// Writes lease `id`'s record after an end; one that cannot be written
    /// (a full state filesystem) is noted, and the timer writes it again
    /// every second until it can: a record left saying "pending" would
    /// have a restart thaw what may by then be another tool's freeze.
    ///
    /// Until then, a freeze with nothing left frozen has its record
    /// removed (an unlink needs no space): a restart then knows nothing of
    /// it (a late thaw of it hears NOT_FOUND) rather than thaw, by a record
    /// that says "pending", whatever freeze holds its volumes by then.
    fn save(&self, id: &str) {
        let saved = self.record(id);
        let mut g = self.inner.locked();
        let over = g.leases.get_mut(id).is_some_and(|l| {
            l.unsaved = saved.is_err();
            l.parts.iter().all(|(_, p)| p.is_over())
        });
        drop(g);
        if let Err(e) = saved {
            warn!(self.log, "could not record how a freeze ended; trying again every second"; "freeze" => id, "error" => %e);
            if over {
                let _w = self.write.locked();
                if let Err(e) = self.ledger.remove(id) {
                    warn!(self.log, "could not remove the record of an ended freeze either; a restart would thaw its volumes"; "freeze" => id, "error" => %e);
                }
            }
            self.wake.notify_all();
            self.start_timer();
        }
    }

    /// Writes every record an end could not write (the timer's call).
    pub(super) fn save_unsaved(&self) {
        let ids: Vec<String> = self
            .inner
            .locked()
            .leases
            .iter()
            .filter(|(_, l)| l.unsaved)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            if self.record(&id).is_ok() {
                if let Some(l) = self.inner.locked().leases.get_mut(&id) {
                    l.unsaved = false;
                }
            }
        }
    }

    /// Writes lease `id`'s record as it is now (removes it once forgotten).
    fn record(&self, id: &str) -> crate::error::Result<()> {
        let _w = self.write.locked();
        let r = self.inner.locked().leases.get(id).map(|l| l.record(id));
        match r {
            Some(r) => self.ledger.write(&r),
            None => self.ledger.remove(id),
        }
    }

    fn unknown(&self, id: &str) -> Error {
        Error::Unknown {
            freeze: id.into(),
            kept: ENDED_KEPT,
        }
    }

    /// The ABORTED answer for lease `id`.
    fn broken(&self, id: &str) -> Error {
        let g = self.inner.locked();
        match g.leases.get(id) {
            Some(l) => self.broken_locked(id, l),
            None => self.unknown(id),
        }
    }

    fn broken_locked(&self, id: &str, lease: &Lease<H>) -> Error {
        let mut ends = lease.broken(unix_ms());
        if let Some(how) = lease.stopped {
            ends.insert(
                0,
                format!("it was {} while its freeze call ran", how.said()),
            );
        }
        if ends.is_empty() {
            ends.push("a volume ended before its freeze call did".into());
        }
        Error::Broken {
            freeze: id.into(),
            ends: ends.join("; "),
        }
    }
}

/// Takes `part` (of volume `vol`) to be ended `how`: a held part into
/// `taken`; a part being frozen is marked to end when FIFREEZE returns;
/// a part not reached while the call runs (`making`) is skipped. True when
/// the volume is (or will be at once) thawed by this.
fn take_part<H>(
    vol: &str,
    part: &mut Part<H>,
    how: How,
    making: bool,
    taken: &mut Vec<Taken<H>>,
) -> bool {
    match std::mem::replace(part, Part::Skipped) {
        Part::Held { hold, .. } => {
            *part = Part::ending(how);
            taken.push(Taken {
                vol: vol.to_string(),
                hold,
                how,
            });
            true
        }
        Part::Freezing { end } => {
            *part = Part::Freezing {
                end: Some(end.unwrap_or(how)),
            };
            true
        }
        Part::Waiting if making => false,
        other => {
            *part = other;
            false
        }
    }
}

/// Counts lease `id` among the ended ones once it is over; answers the
/// oldest beyond the bound, forgotten here (their records are for the
/// caller to remove).
fn settle<H>(g: &mut Inner<H>, id: &str) -> Vec<String> {
    if let Some(l) = g.leases.get_mut(id) {
        if l.is_over() && !l.settled {
            l.settled = true;
            g.over.push_back(id.to_string());
        }
    }
    evict(g)
}

fn evict<H>(g: &mut Inner<H>) -> Vec<String> {
    let mut out = Vec::new();
    while g.over.len() > ENDED_KEPT {
        if let Some(old) = g.over.pop_front() {
            g.leases.remove(&old);
            out.push(old);
        }
    }
    out
}

/// The fuzz target's way in (`crate::fuzz::freeze_record`): a record that
/// decodes names ids a request could, and reads back the same.
#[cfg(feature = "fuzz")]
pub(crate) fn fuzz_record(data: &[u8]) {
    let name = data
        .split(|&b| b == b'\n')
        .find_map(|l| l.strip_prefix(b"freeze="))
        .and_then(|n| std::str::from_utf8(n).ok())
        .unwrap_or("f");
    if let Ok(r) = record::decode(data, name) {
        assert_eq!(crust_protocols::freeze::check_id(&r.freeze), Ok(()));
        for (vol, _) in &r.parts {
            assert!(crate::validate::volume_id(vol).is_ok(), "{vol:?}");
        }
        let text = record::encode(&r);
        assert_eq!(record::decode(text.as_bytes(), name).ok(), Some(r));
    }
}

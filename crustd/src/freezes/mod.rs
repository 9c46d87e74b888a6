//! The groups crustd freezes across sandboxes. A group is a lease, as a
//! guest agent's freeze is: its id (the caller's, or one crustd makes,
//! never repeated) is every guest's freeze id, and only that id, its
//! timeout, an unpublish of one of its volumes, a forced thaw or its
//! caller going away ends it. Each end is recorded against the id, so a
//! late thaw hears how its group ended (ABORTED) and never ends a newer
//! group on the same volumes.
//!
//! This table owns every group, live and recently ended (the last
//! `ENDED_KEPT`), its record on disk (`store`, so a restarted crustd knows
//! them all and re-arms the timer), and the host's timer: a group's
//! timeout runs in every guest and here, [`HOST_SLACK`] later, so a group
//! whose guest lost its timer, or whose freeze call failed with an outcome
//! unknown, is thawed by its id all the same. It calls no guest itself:
//! `volumes::thaw` does, with what this table answers.
//!
//! Locks: `writing` (one record written at a time per group, rendered from
//! the newest state just before, so the newest state is what lands on
//! disk), then `inner`, a leaf held for one lookup or update, never across
//! a file write or a call to a guest.

mod error;
mod group;
mod store;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crust_protocols::freeze::{check_id, new_id, ENDED_KEPT};
use crust_protocols::sync::{CondvarExt, LockExt};

pub use error::{FreezeError, Leftover, Placement, Unwritten};
pub use group::{
    cut, unix_ms, End, Group, How, Part, Plan, Volume, HOST_SLACK, MAX_DETAIL, MAX_GROUPS,
};
pub use store::{Store, Unread, Unused, DIR_NAME};

use crate::locks::{self, KeyedLocks};

/// What RuntimeFreezeVolumes answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frozen {
    /// The group's id: what thaws it.
    pub id: String,
    /// When it ends by itself.
    pub thaw_at_unix_ms: u64,
    /// This call made the group (not a retry answered from its record):
    /// if nobody takes the answer, nobody holds the id.
    pub made_now: bool,
}

/// How a freeze begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begun {
    /// A new group, recorded as being made: freeze its parts, then
    /// [`Freezes::made`]. `until`: the instant of `thaw_at_unix_ms`, by the
    /// monotonic clock, which each guest's timeout must end by.
    /// `start_timer`: the timer thread must be started.
    New {
        id: String,
        thaw_at_unix_ms: u64,
        until: Instant,
        start_timer: bool,
    },
    /// The caller's id names a group of these volumes that holds: its answer again.
    Again { id: String, thaw_at_unix_ms: u64 },
}

/// A group with what only this process knows of it.
struct Entry {
    group: Group,
    /// When the host's timer ends it (its record keeps the unix time).
    deadline: Instant,
    /// How many times the timer tried to end it.
    tries: u32,
}

#[derive(Default)]
struct Inner {
    groups: HashMap<String, Entry>,
    /// The groups that are over, oldest first: the last ENDED_KEPT stay.
    over: VecDeque<String>,
    /// The timer thread runs.
    timer: bool,
}

impl Inner {
    /// Groups not over (being made or holding a part).
    fn live(&self) -> usize {
        self.groups.values().filter(|e| !e.group.is_over()).count()
    }

    /// Notes group `id` over if it now is; answers the ended groups that
    /// no longer fit in the kept ones (to be removed from disk).
    fn settle(&mut self, id: &str, now: u64) -> Vec<String> {
        if let Some(e) = self.groups.get_mut(id) {
            if e.group.is_over() && e.group.ended_unix_ms.is_none() {
                e.group.ended_unix_ms = Some(now);
                self.over.push_back(id.to_string());
            }
        }
        let mut gone = Vec::new();
        while self.over.len() > ENDED_KEPT {
            if let Some(old) = self.over.pop_front() {
                self.groups.remove(&old);
                gone.push(old);
            }
        }
        gone
    }
}

/// The groups (the module doc).
pub struct Freezes {
    inner: Mutex<Inner>,
    /// Wakes the timer when a group changes.
    wake: Condvar,
    /// Where records go; none: kept in memory only (unit tests).
    store: Option<Store>,
    /// One record write at a time per group.
    writing: KeyedLocks<String>,
}

/// The instant at unix time `ms`, as seen now.
fn instant_at(ms: u64) -> Instant {
    locks::after(Duration::from_millis(ms.saturating_sub(unix_ms())))
}

/// 64 bits from the kernel's random source; the clock's bits if it fails,
/// so ids still differ from any earlier run's.
fn entropy() -> u64 {
    crate::files::random_u64().unwrap_or_else(|_| {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
            u64::from(d.subsec_nanos()) ^ d.as_secs().rotate_left(32)
        })
    })
}

/// An end now, as `how` says, with `detail`.
pub fn end_now(how: How, detail: &str) -> End {
    End::new(how, unix_ms(), detail)
}

impl Freezes {
    /// A table whose records go to `store` (none: in memory only).
    pub fn new(store: Option<Store>) -> Freezes {
        Freezes {
            inner: Mutex::default(),
            wake: Condvar::new(),
            store,
            writing: KeyedLocks::default(),
        }
    }

    /// The records' directory, for messages.
    pub fn dir(&self) -> Option<PathBuf> {
        self.store.as_ref().map(Store::dir)
    }

    /// Starts a freeze of `plan` for `timeout_ms`, named `asked` (the
    /// caller's id, checked) or a new id, and records it as being made
    /// before any guest is called. The caller's id of a group that holds
    /// these volumes answers it again; of any other group, ALREADY_EXISTS
    /// (UNAVAILABLE while its first call still runs).
    pub fn begin(
        &self,
        asked: Option<&str>,
        plan: &Plan,
        timeout_ms: u32,
    ) -> Result<Begun, FreezeError> {
        if let Some(a) = asked {
            check_id(a).map_err(FreezeError::BadId)?;
        }
        let (id, thaw_at_unix_ms, until) = {
            let mut g = self.inner.locked();
            if let Some(e) = asked.and_then(|a| g.groups.get(a)) {
                return again(&e.group, plan, timeout_ms);
            }
            if g.live() >= MAX_GROUPS {
                return Err(FreezeError::Full);
            }
            let id = match asked {
                Some(a) => a.to_string(),
                None => loop {
                    let id = new_id("group", unix_ms(), entropy());
                    if !g.groups.contains_key(&id) {
                        break id;
                    }
                },
            };
            // Read together, so that `until` is `thaw_at` on the other clock.
            let until = locks::after(Duration::from_millis(u64::from(timeout_ms)));
            let group = Group::new(&id, plan, timeout_ms, unix_ms());
            let thaw_at = group.thaw_at_unix_ms;
            let deadline = until.checked_add(HOST_SLACK).unwrap_or(until);
            let entry = Entry {
                group,
                deadline,
                tries: 0,
            };
            g.groups.insert(id.clone(), entry);
            (id, thaw_at, until)
        };
        if let Err(e) = self.persist(&id) {
            self.inner.locked().groups.remove(&id);
            return Err(e);
        }
        // Only once it is recorded: a group that never was needs no timer.
        let start_timer = !std::mem::replace(&mut self.inner.locked().timer, true);
        self.wake.notify_all();
        Ok(Begun::New {
            id,
            thaw_at_unix_ms,
            until,
            start_timer,
        })
    }

    /// Before the freeze of part `i` of group `id` is sent: marks it called,
    /// unless something ended the group meanwhile (then what did).
    pub fn calling(&self, id: &str, i: usize) -> Result<(), String> {
        self.unless_ended(id, |group| {
            if let Some(p) = group.parts.get_mut(i) {
                p.called = true;
            }
        })
    }

    /// Runs `f` on group `id` under the lock, unless its record is gone or
    /// something ended it (then what did).
    fn unless_ended<T>(&self, id: &str, f: impl FnOnce(&mut Group) -> T) -> Result<T, String> {
        let mut g = self.inner.locked();
        let e = g
            .groups
            .get_mut(id)
            .ok_or_else(|| "its record is gone".to_string())?;
        if let Some(why) = stop_reason(&e.group) {
            return Err(why);
        }
        Ok(f(&mut e.group))
    }

    /// Every part of group `id` answered its freeze: the group holds,
    /// unless something ended it meanwhile (then what did).
    pub fn made(&self, id: &str) -> Result<(), String> {
        self.unless_ended(id, |group| group.making = false)?;
        self.persist_logged(id);
        Ok(())
    }

    /// The freeze call of group `id` stops without the group holding
    /// (`end` says why, unless something ended it first): parts never
    /// called are skipped. Answers the group then.
    pub fn unmade(&self, id: &str, end: End) -> Option<Group> {
        self.update(id, |g| {
            g.closing.get_or_insert(end);
            g.making = false;
            g.skip_uncalled(unix_ms());
        })
    }

    /// Ends group `id` as a whole by `end` (its thaw, its timer, its
    /// caller leaving), unless something did first: answers the group
    /// then; NOT_FOUND for an id crustd does not know.
    pub fn close(&self, id: &str, end: End) -> Result<Group, FreezeError> {
        self.update(id, |g| {
            g.closing.get_or_insert(end);
        })
        .ok_or_else(|| FreezeError::Unknown { id: id.to_string() })
    }

    /// Records how parts of group `id` ended, by index; answers the group then.
    pub fn settle(&self, id: &str, ends: &[(usize, End)]) -> Option<Group> {
        self.update(id, |g| {
            for (i, end) in ends {
                if let Some(p) = g.parts.get_mut(*i) {
                    p.end(end);
                }
            }
        })
    }

    /// Ends volume `host_volume` of `sandbox` by `how` (an unpublish, a
    /// forced thaw) in every group where it may be frozen; answers them.
    pub fn end_volume(&self, sandbox: &str, host_volume: &str, how: How) -> Vec<String> {
        let ids: Vec<String> = {
            let g = self.inner.locked();
            g.groups
                .iter()
                .filter(|(_, e)| {
                    e.group.parts.iter().any(|p| {
                        p.sandbox == sandbox
                            && p.volumes
                                .iter()
                                .any(|v| v.host_volume == host_volume && v.end.is_none())
                    })
                })
                .map(|(id, _)| id.clone())
                .collect()
        };
        let end = end_now(how, "");
        for id in &ids {
            self.update(id, |g| {
                for p in g.parts.iter_mut().filter(|p| p.sandbox == sandbox) {
                    for v in p
                        .volumes
                        .iter_mut()
                        .filter(|v| v.host_volume == host_volume)
                    {
                        v.end.get_or_insert_with(|| end.clone());
                    }
                }
            });
        }
        ids
    }

    /// Forgets group `id` and its record: its freeze froze nothing in any
    /// guest, so its id may be used again.
    pub fn forget(&self, id: &str) {
        let _w = self.write_lock(id);
        self.inner.locked().groups.remove(id);
        if let Some(s) = &self.store {
            if let Err(e) = s.remove(id) {
                log_failure(id, &e);
            }
        }
        self.wake.notify_all();
    }

    /// Group `id` as it is now.
    pub fn get(&self, id: &str) -> Option<Group> {
        self.inner.locked().groups.get(id).map(|e| e.group.clone())
    }

    /// Changes group `id` by `f` under the lock, notes it over if it now
    /// is, writes its record; answers it then.
    fn update(&self, id: &str, f: impl FnOnce(&mut Group)) -> Option<Group> {
        let (group, changed, gone) = {
            let mut g = self.inner.locked();
            let e = g.groups.get_mut(id)?;
            let before = e.group.clone();
            f(&mut e.group);
            let changed = e.group != before;
            let gone = g.settle(id, unix_ms());
            (g.groups.get(id).map(|e| e.group.clone()), changed, gone)
        };
        if !changed {
            return group;
        }
        self.wake.notify_all();
        self.persist_logged(id);
        for old in gone {
            self.persist_logged(&old);
        }
        group
    }

    /// Waits for the next group not over whose deadline passed, re-arms it
    /// `retry` later and answers it with how many times the timer has now
    /// tried it; None once no group is live (the timer thread then ends).
    pub fn next_expired(&self, retry: Duration) -> Option<(String, u32)> {
        let mut g = self.inner.locked();
        loop {
            let next = g
                .groups
                .iter()
                .filter(|(_, e)| !e.group.is_over())
                .min_by_key(|(_, e)| e.deadline)
                .map(|(id, e)| (id.clone(), e.deadline));
            let Some((id, deadline)) = next else {
                g.timer = false;
                return None;
            };
            let now = Instant::now();
            if deadline <= now {
                let e = g.groups.get_mut(&id)?;
                e.deadline = locks::after(retry);
                e.tries += 1;
                return Some((id, e.tries));
            }
            g = self.wake.waited_for(g, deadline - now);
        }
    }

    /// At start: every record the store holds. Answers the groups whose
    /// freeze call died with the last crustd (to be ended at once),
    /// whether the timer must be started, and a sentence for each record
    /// not used.
    pub fn load(&self) -> (Vec<String>, bool, Vec<Unread>) {
        let Some(store) = &self.store else {
            return (Vec::new(), false, Vec::new());
        };
        let (mut groups, refused) = store.load();
        groups.sort_by_key(|g| (g.ended_unix_ms, g.id.clone()));
        let mut orphans = Vec::new();
        let mut gone = Vec::new();
        let start = {
            let mut g = self.inner.locked();
            for mut group in groups {
                if group.making {
                    for p in &mut group.parts {
                        p.called = true;
                    }
                    orphans.push(group.id.clone());
                }
                let id = group.id.clone();
                let deadline = instant_at(group.host_deadline_unix_ms());
                let over = group.is_over();
                g.groups.insert(
                    id.clone(),
                    Entry {
                        group,
                        deadline,
                        tries: 0,
                    },
                );
                if over {
                    g.over.push_back(id);
                }
            }
            gone.extend(g.settle("", unix_ms()));
            let live = g.live() > 0;
            live && !std::mem::replace(&mut g.timer, true)
        };
        for old in gone {
            self.persist_logged(&old);
        }
        (orphans, start, refused)
    }

    /// How many groups are live and how many ended are kept (bounds tests check).
    pub fn len(&self) -> (usize, usize) {
        let g = self.inner.locked();
        (g.live(), g.over.len())
    }

    /// Whether no group is kept.
    pub fn is_empty(&self) -> bool {
        self.inner.locked().groups.is_empty()
    }

    fn write_lock(&self, id: &str) -> Option<locks::Guard<'_, String>> {
        self.writing
            .lock_until(&id.to_string(), locks::after(Duration::from_secs(3600)))
    }

    /// Writes group `id`'s record as it is now (removes it when the group
    /// is no longer kept).
    fn persist(&self, id: &str) -> Result<(), FreezeError> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let _w = self.write_lock(id);
        let group = self.get(id);
        match group {
            Some(g) => store.write(&g),
            None => store.remove(id),
        }
    }

    /// As [`Freezes::persist`], a failure logged: the group stays in
    /// memory, and the next change writes it again.
    fn persist_logged(&self, id: &str) {
        if let Err(e) = self.persist(id) {
            log_failure(id, &e);
        }
    }
}

impl Default for Freezes {
    fn default() -> Freezes {
        Freezes::new(None)
    }
}

/// One JSON line on stderr: a record crustd could not write or remove.
fn log_failure(id: &str, e: &FreezeError) {
    let line = serde_json::json!({
        "msg": "a freeze record could not be written",
        "group": id,
        "error": e.to_string(),
    });
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{line}\n").as_bytes());
}

/// What ended a group being made, if anything did: its closing, or a
/// volume's end (an unpublish, a forced thaw).
fn stop_reason(g: &Group) -> Option<String> {
    if let Some(c) = &g.closing {
        return Some(format!("the group {}", c.how.said()));
    }
    let now = unix_ms();
    let broken = g.broken(now);
    (!broken.is_empty()).then(|| broken.join("; "))
}

/// A second freeze with the caller's id `g.id`: the same answer while the
/// group holds these volumes, else refused.
fn again(g: &Group, plan: &Plan, timeout_ms: u32) -> Result<Begun, FreezeError> {
    if g.making {
        return Err(FreezeError::BeingMade { id: g.id.clone() });
    }
    if g.same(plan, timeout_ms) && g.holds() {
        return Ok(Begun::Again {
            id: g.id.clone(),
            thaw_at_unix_ms: g.thaw_at_unix_ms,
        });
    }
    let why = if !g.holds() {
        let broken = g.broken(unix_ms());
        if broken.is_empty() {
            "that group was thawed by its id".to_string()
        } else {
            format!("that group ended: {}", broken.join("; "))
        }
    } else {
        format!(
            "it holds other volumes, or has a timeout of {} ms, not what this call names",
            g.timeout_ms
        )
    };
    Err(FreezeError::Taken {
        id: g.id.clone(),
        why,
    })
}

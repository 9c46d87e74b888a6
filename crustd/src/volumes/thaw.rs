//! RuntimeThawVolumes, and every other way a group ends: its freeze undone,
//! its caller gone before the answer, crustd's timer, a restart that finds
//! a group whose freeze call died. Each acts on the group's id in each
//! sandbox (ThawVolumes with freeze_id), never on "whatever holds this
//! volume", so it can end no other group; only a forced thaw, for an
//! operator, names volumes, and says so in every group it ends.
//!
//! A gone sandbox or an unpublished volume is reported, never a reason to
//! leave the rest frozen: each sandbox is thawed on its own, at once
//! ([`AT_ONCE`] at a time). What is not confirmed stays under crustd's
//! timer, which thaws it by the group's id.

use std::sync::Arc;
use std::time::Duration;

use crust_protocols::freeze::check_id;

use crate::deadline::Deadline;
use crate::devices::Key;
use crate::error::{Code, Error, Result};
use crate::freezes::{end_now, unix_ms, FreezeError, Group, How, HOST_SLACK};
use crate::registry;

use super::error::Error as Refused;
use super::snapshot::{add_to, check_refs, Part};
use super::{log_line, Crustd};

/// How many times an undo, or the end of a group nobody holds, tries a
/// sandbox it cannot reach (or whose freeze may still arrive).
const TRIES: u32 = 3;
/// The first wait between two tries; each next one is four times longer.
const BACKOFF: Duration = Duration::from_millis(250);
/// How many times crustd's timer tries a sandbox it cannot reach before it
/// leaves that part to its guest's own timer.
const TIMER_TRIES: u32 = 3;
/// Sandboxes thawed at once.
const AT_ONCE: usize = 16;

/// What one sandbox's thaw of a group by its id found.
enum PartThaw {
    /// OK: its part held up to now, and is thawed.
    Thawed,
    /// The agent's ABORTED: a part ended first (its message).
    Aborted(String),
    /// The agent's NOT_FOUND: it never issued the id (its message).
    NotFound(String),
    /// The sandbox is gone (why).
    Gone(String),
    /// Not reached, or not confirmed.
    Unreached(Error),
}

impl Crustd {
    /// RuntimeThawVolumes: a group by its id, or with force whatever holds
    /// the volumes named.
    pub fn thaw(
        &self,
        refs: &[Key],
        freeze_id: &str,
        force: bool,
        deadline: &Deadline,
    ) -> Result<()> {
        match (freeze_id.is_empty(), force, refs.is_empty()) {
            (false, false, true) => Ok(self.thaw_group(freeze_id, deadline)?),
            (true, true, _) => self.thaw_forced(refs, deadline),
            (false, true, _) => Err(FreezeError::ForceWithId.into()),
            (_, false, false) => Err(FreezeError::VolumesWithoutForce.into()),
            (true, false, true) => Err(FreezeError::NothingNamed.into()),
        }
    }

    /// Ends group `id` by its id in every sandbox it may still hold: OK
    /// while it held every volume up to now, ABORTED when a part ended
    /// first, NOT_FOUND for an id crustd does not know.
    fn thaw_group(&self, id: &str, deadline: &Deadline) -> std::result::Result<(), FreezeError> {
        check_id(id).map_err(FreezeError::BadId)?;
        let group = self.freezes.close(id, end_now(How::Thawed, ""))?;
        let found = self.thaw_parts(&group, &group.pending(), deadline, 1, None);
        let mut ends = Vec::new();
        let mut unreached = Vec::new();
        for (i, f) in found {
            let part = &group.parts[i];
            let end = match f {
                PartThaw::Thawed => end_now(How::Thawed, ""),
                // The guest's answer is for its part as a whole, and it
                // does not say which volumes held: each not already known
                // to have ended is recorded with the guest's words, so that
                // none is said to have kept the snapshot whole.
                PartThaw::Aborted(m) => end_now(How::Guest, &m),
                // Its freeze may not have reached it yet: the freeze
                // call, which sees the group closed, undoes it.
                PartThaw::NotFound(_) if group.making => continue,
                PartThaw::NotFound(m) => end_now(How::Unknown, &m),
                PartThaw::Gone(m) => end_now(How::Gone, &m),
                PartThaw::Unreached(e) => {
                    unreached.push(format!("sandbox {} ({})", part.sandbox, e));
                    continue;
                }
            };
            ends.push((i, end));
        }
        let group = self.freezes.settle(id, &ends).unwrap_or(group);
        verdict(&group, &unreached)
    }

    /// RuntimeThawVolumes with force: each sandbox's agent ends whatever
    /// freeze holds its volumes, and every group holding one is recorded
    /// as ended by a forced thaw. A volume not published is NOT_FOUND,
    /// after the others are thawed.
    fn thaw_forced(&self, refs: &[Key], deadline: &Deadline) -> Result<()> {
        check_refs(refs)?;
        let mut parts: Vec<Part> = Vec::new();
        let mut failed: Vec<Error> = Vec::new();
        for k in refs {
            match self.agent_id(&k.sandbox, &k.host_volume, true, deadline) {
                Ok((sb, id)) => add_to(&mut parts, sb, &k.host_volume, id),
                Err(e) => failed.push(e),
            }
        }
        for p in &parts {
            let r = self.agent(&p.sb, deadline).thaw_forced(&p.ids());
            // The agent's NOT_FOUND comes after it thawed the others.
            if r.as_ref()
                .map_or_else(|e| e.code() == Code::NotFound, |()| true)
            {
                for (host, _) in &p.volumes {
                    self.freezes.end_volume(p.sb.id(), host, How::Forced);
                }
            }
            if let Err(e) = r {
                failed.push(self.unless_dead(&p.sb, e));
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        Err(Error::Unthawed { failed })
    }

    /// The end of a group whose freeze was answered to nobody (its caller
    /// gave up or went away first): nobody holds its id, so it ends now.
    pub fn end_unclaimed(&self, id: &str) {
        let Ok(group) = self.freezes.close(id, end_now(How::CallerLeft, "")) else {
            return;
        };
        let (group, left) = self.end_pending(group, How::CallerLeft, None);
        log_line(serde_json::json!({
            "msg": "a group whose caller went away before the answer is ended",
            "group": id,
            "left_for_the_timer": left,
            "timer_at_unix_ms": group.host_deadline_unix_ms(),
        }));
    }

    /// Thaws `group` by its id in every sandbox it may still hold, with a
    /// budget of its own (the configured agent timeout, not a caller's),
    /// [`TRIES`] times with backoff, and records each confirmed end as
    /// `how`. A NOT_FOUND from part `unsettled` (a freeze that got no
    /// answer, which may still arrive) proves nothing. Answers the group
    /// then, and each sandbox left for crustd's timer with why; logs them.
    pub(super) fn end_pending(
        &self,
        group: Group,
        how: How,
        unsettled: Option<usize>,
    ) -> (Group, Vec<String>) {
        let own = Deadline::new(None);
        let found = self.thaw_parts(&group, &group.pending(), &own, TRIES, unsettled);
        let mut ends = Vec::new();
        let mut left = Vec::new();
        for (i, f) in found {
            let sandbox = &group.parts[i].sandbox;
            match f {
                PartThaw::Thawed => ends.push((i, end_now(how, ""))),
                PartThaw::Aborted(m) => ends.push((i, end_now(How::Guest, &m))),
                PartThaw::NotFound(_) if Some(i) == unsettled => left.push(format!(
                    "sandbox {sandbox} (its freeze got no answer, and its agent does not know the group: the freeze may still arrive)"
                )),
                PartThaw::NotFound(m) => ends.push((i, end_now(how, &m))),
                PartThaw::Gone(m) => ends.push((i, end_now(How::Gone, &m))),
                PartThaw::Unreached(e) => left.push(format!("sandbox {sandbox} ({e})")),
            }
        }
        let group = self.freezes.settle(&group.id, &ends).unwrap_or(group);
        if !left.is_empty() {
            log_line(serde_json::json!({
                "msg": "crustd could not confirm the thaw of a group; its timer thaws it by the group's id",
                "group": group.id,
                "how": how.said(),
                "left": left,
                "timer_at_unix_ms": group.host_deadline_unix_ms(),
            }));
        }
        (group, left)
    }

    /// Thaws `group` by its id in its parts `targets`, each sandbox at
    /// once, up to `tries` times for those not reached (and part
    /// `unsettled` while its agent does not know the id), waiting
    /// [`BACKOFF`], four times longer each time, between tries.
    fn thaw_parts(
        &self,
        group: &Group,
        targets: &[usize],
        deadline: &Deadline,
        tries: u32,
        unsettled: Option<usize>,
    ) -> Vec<(usize, PartThaw)> {
        let mut out = Vec::new();
        let mut todo = targets.to_vec();
        let mut wait = BACKOFF;
        for attempt in 1..=tries.max(1) {
            let last = attempt >= tries;
            let found = self.thaw_at_once(group, &todo, deadline);
            todo.clear();
            for (i, f) in found {
                let again = matches!(f, PartThaw::Unreached(_))
                    || (Some(i) == unsettled && matches!(f, PartThaw::NotFound(_)));
                if again && !last {
                    todo.push(i);
                } else {
                    out.push((i, f));
                }
            }
            if todo.is_empty() {
                break;
            }
            std::thread::sleep(wait);
            wait = wait.saturating_mul(4);
        }
        out
    }

    /// One try of [`Crustd::thaw_parts`]: [`AT_ONCE`] sandboxes at a time,
    /// each on a thread of its own (one that cannot be started runs here).
    fn thaw_at_once(
        &self,
        group: &Group,
        todo: &[usize],
        deadline: &Deadline,
    ) -> Vec<(usize, PartThaw)> {
        let mut out = Vec::new();
        for chunk in todo.chunks(AT_ONCE) {
            std::thread::scope(|s| {
                let mut started = Vec::new();
                for &i in chunk {
                    let sandbox = group.parts[i].sandbox.as_str();
                    let work = move || self.thaw_part(sandbox, &group.id, deadline);
                    match std::thread::Builder::new().spawn_scoped(s, work) {
                        Ok(h) => started.push((i, h)),
                        Err(_) => out.push((i, self.thaw_part(sandbox, &group.id, deadline))),
                    }
                }
                for (i, h) in started {
                    let f = h
                        .join()
                        .unwrap_or_else(|_| PartThaw::Unreached(Refused::ThawPanicked.into()));
                    out.push((i, f));
                }
            });
        }
        out
    }

    /// ThawVolumes of freeze `id` in `sandbox`, sorted by what it tells.
    fn thaw_part(&self, sandbox: &str, id: &str, deadline: &Deadline) -> PartThaw {
        let sb = match registry::home_with(&self.cfg.sandboxes, sandbox, self.cfg.kata.as_ref())
            .and_then(|home| home.vm())
        {
            Ok(sb) => sb,
            Err(e) if e.code() == Code::NotFound => return PartThaw::Gone(e.to_string()),
            Err(e) => return PartThaw::Unreached(e.into()),
        };
        match self.agent(&sb, deadline).thaw_id(id) {
            Ok(()) => PartThaw::Thawed,
            Err(e) if e.code() == Code::Aborted => PartThaw::Aborted(e.to_string()),
            Err(e) if e.code() == Code::NotFound => PartThaw::NotFound(e.to_string()),
            Err(e) if e.code() == Code::Unavailable => match sb.qmp.gone(self.cfg.qmp_timeout) {
                Some(why) => PartThaw::Gone(format!("its VM is gone ({why})")),
                None => PartThaw::Unreached(e.into()),
            },
            Err(e) => PartThaw::Unreached(e.into()),
        }
    }

    /// The host's timer (`freezes`): at each group's deadline, on a thread
    /// of its own, its id thawed in every sandbox it may still hold. Runs
    /// while any group is live.
    pub(super) fn start_freeze_timer(self: &Arc<Self>) {
        let me = Arc::clone(self);
        // A try ends (its budget is the agent timeout) before the next begins.
        let retry = self.cfg.agent_timeout + HOST_SLACK;
        let spawned = std::thread::Builder::new()
            .name("freeze-timer".into())
            .spawn(move || {
                while let Some((id, tries)) = me.freezes.next_expired(retry) {
                    let c = me.clone();
                    let one = std::thread::Builder::new()
                        .name("freeze-end".into())
                        .spawn(move || c.end_by_timer(&id, tries));
                    if let Err(e) = one {
                        log_line(serde_json::json!({
                            "msg": "crustd could not start a thread to end a group at its timeout; it tries again",
                            "error": e.to_string(),
                        }));
                    }
                }
            });
        if let Err(e) = spawned {
            log_line(serde_json::json!({
                "msg": "crustd could not start the freeze timer; freezes end by the guests' timers",
                "error": e.to_string(),
            }));
        }
    }

    /// Ends group `id` at its timeout ([`TIMER_TRIES`] tries of a sandbox
    /// it cannot reach), one log line per sandbox.
    fn end_by_timer(&self, id: &str, tries: u32) {
        let Ok(group) = self.freezes.close(id, end_now(How::Timer, "")) else {
            return;
        };
        let own = Deadline::new(None);
        let found = self.thaw_parts(&group, &group.pending(), &own, 1, None);
        let last = tries >= TIMER_TRIES;
        let mut ends = Vec::new();
        for (i, f) in found {
            let (end, said) = match f {
                PartThaw::Thawed => (Some(end_now(How::Timer, "")), "OK".to_string()),
                PartThaw::Aborted(m) => (Some(end_now(How::Guest, &m)), m),
                // Its freeze may not have reached it yet: the freeze call undoes it.
                PartThaw::NotFound(m) if group.making => (None, m),
                PartThaw::NotFound(m) => (Some(end_now(How::Timer, &m)), m),
                PartThaw::Gone(m) => (Some(end_now(How::Gone, &m)), m),
                PartThaw::Unreached(e) if last => (
                    Some(end_now(
                        How::Timer,
                        &format!("crustd could not reach its sandbox ({}); its guest's own timer ends it", e),
                    )),
                    e.to_string(),
                ),
                PartThaw::Unreached(e) => (None, format!("{e}; tried again later")),
            };
            let p = &group.parts[i];
            let volumes: Vec<&str> = p.volumes.iter().map(|v| v.host_volume.as_str()).collect();
            log_line(serde_json::json!({
                "event": "freeze ended by crustd's timer",
                "group": id,
                "sandbox": p.sandbox,
                "host_volumes": volumes,
                "thaw": said,
            }));
            if let Some(end) = end {
                ends.push((i, end));
            }
        }
        self.freezes.settle(id, &ends);
    }

    /// At start, before serving: the groups recorded by the crustd before.
    /// Each whose freeze call died with it is ended at once (nobody was
    /// answered its id), on a thread of its own; the timer is re-armed
    /// from each live group's recorded deadline. Answers a sentence for
    /// each record not used, for the log.
    pub fn recover_freezes(self: &Arc<Self>) -> Vec<crate::freezes::Unread> {
        let (orphans, start, refused) = self.freezes.load();
        for id in orphans {
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("freeze-restart".into())
                .spawn(move || {
                    if let Some(g) = me.freezes.unmade(&id, end_now(How::Restarted, "")) {
                        me.end_pending(g, How::Restarted, None);
                    }
                });
            if let Err(e) = spawned {
                log_line(serde_json::json!({
                    "msg": "crustd could not start a thread to end a group its last run was freezing; its timer ends it",
                    "error": e.to_string(),
                }));
            }
        }
        if start {
            self.start_freeze_timer();
        }
        refused
    }
}

/// A group's thaw, told: OK, ABORTED (a part ended first; naming also the
/// sandboxes not reached), or UNAVAILABLE (some not reached).
fn verdict(group: &Group, unreached: &[String]) -> std::result::Result<(), FreezeError> {
    let mut broken = group.broken(unix_ms());
    if !broken.is_empty() {
        if !unreached.is_empty() {
            broken.push(format!(
                "and crustd could not reach {} (its timer thaws what is left at unix time {} ms)",
                unreached.join(", "),
                group.host_deadline_unix_ms()
            ));
        }
        return Err(FreezeError::Broken {
            id: group.id.clone(),
            ends: broken.join("; "),
        });
    }
    if !unreached.is_empty() {
        return Err(FreezeError::Unreached {
            id: group.id.clone(),
            sandboxes: unreached.join(", "),
            timer_at_unix_ms: group.host_deadline_unix_ms(),
        });
    }
    Ok(())
}

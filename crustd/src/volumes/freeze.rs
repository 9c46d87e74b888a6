//! RuntimeFreezeVolumes: a group across sandboxes (a VolumeGroupSnapshot
//! can span pods), all or none, and a lease (`freezes`).
//!
//! The steps: the volumes' agent ids read (each under its lock, let go
//! before any guest is asked); the group recorded as being made, with its
//! deadline, so crustd's timer covers it whatever happens next; one
//! FreezeVolumes per sandbox, in the order the request names them, each
//! with the group's id and the time left until the group's end (so every
//! guest's own timer ends by the time the caller is told); the group
//! recorded as made. Before each sandbox, and before the answer, crustd
//! looks whether the group ended meanwhile (its thaw, its timer, an
//! unpublish, a forced thaw) and whether its caller still waits: if not, or
//! if a sandbox fails (or its turn comes too late to be asked), the freeze
//! is undone by the group's id in every sandbox it called, the failed one
//! included (`thaw`), and the answer says what could not be confirmed.

use std::time::Instant;

use crust_protocols::freeze::check_id;

use crate::agent::FreezeFailed;
use crate::deadline::Deadline;
use crate::devices::Key;
use crate::error::{Error, Result};
use crate::freezes::{end_now, Begun, FreezeError, Frozen, How, Leftover, Plan};

use super::snapshot::{check_refs, freeze_timeout, Part};
use super::Crustd;

/// Why a group's freeze stops short of holding.
enum Stop {
    /// Part `at`'s freeze failed.
    Failed { at: usize, failed: FreezeFailed },
    /// Something ended the group meanwhile (what did).
    Ended(String),
    /// Its caller went away.
    CallerLeft,
}

impl Crustd {
    /// RuntimeFreezeVolumes: answers the group's id and when it ends.
    pub fn freeze(
        self: &std::sync::Arc<Self>,
        refs: &[Key],
        timeout_ms: u32,
        freeze_id: &str,
        deadline: &Deadline,
    ) -> Result<Frozen> {
        check_refs(refs)?;
        let timeout = freeze_timeout(timeout_ms)?;
        let asked = (!freeze_id.is_empty()).then_some(freeze_id);
        if let Some(a) = asked {
            check_id(a).map_err(FreezeError::BadId)?;
        }
        let parts = self.parts(refs, deadline)?;
        let plan: Plan = parts
            .iter()
            .map(|p| (p.sb.id().to_string(), p.volumes.clone()))
            .collect();
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let (id, thaw_at, until) = match self.freezes.begin(asked, &plan, ms)? {
            Begun::Again {
                id,
                thaw_at_unix_ms,
            } => {
                return Ok(Frozen {
                    id,
                    thaw_at_unix_ms,
                    made_now: false,
                })
            }
            Begun::New {
                id,
                thaw_at_unix_ms,
                until,
                start_timer,
            } => {
                if start_timer {
                    self.start_freeze_timer();
                }
                (id, thaw_at_unix_ms, until)
            }
        };
        match self.freeze_parts(&id, &parts, until, deadline) {
            Ok(()) => Ok(Frozen {
                id,
                thaw_at_unix_ms: thaw_at,
                made_now: true,
            }),
            Err(stop) => Err(self.undo(&id, &parts, stop)),
        }
    }

    /// Each part's freeze in turn, under the group's id, each guest's
    /// timeout ending by `until`, the group's end (a guest called late gets
    /// only what is left; one left too little is not asked, and the group
    /// fails); the group made.
    fn freeze_parts(
        &self,
        id: &str,
        parts: &[Part],
        until: Instant,
        deadline: &Deadline,
    ) -> std::result::Result<(), Stop> {
        for (at, p) in parts.iter().enumerate() {
            if !deadline.attended() {
                return Err(Stop::CallerLeft);
            }
            self.freezes.calling(id, at).map_err(Stop::Ended)?;
            self.agent(&p.sb, deadline)
                .freeze(&p.ids(), until, id)
                .map_err(|failed| Stop::Failed { at, failed })?;
        }
        if !deadline.attended() {
            return Err(Stop::CallerLeft);
        }
        self.freezes.made(id).map_err(Stop::Ended)
    }

    /// Undoes group `id`'s freeze: its id thawed in every sandbox called,
    /// the failed one included (its outcome may be unknown); answers the
    /// error that says so, and what is left for crustd's timer.
    fn undo(&self, id: &str, parts: &[Part], stop: Stop) -> Error {
        let how = match stop {
            Stop::CallerLeft => How::CallerLeft,
            _ => How::Undone,
        };
        // Nothing of a part whose freeze the agent refused, or that was
        // never sent, is frozen: its NOT_FOUND is proof. Of one without
        // an answer it is not (the freeze may still arrive).
        let (unsettled, unsent) = match &stop {
            Stop::Failed { at, failed } if !failed.settled() => (Some(*at), None),
            Stop::Failed {
                at,
                failed: FreezeFailed::NotSent(_),
            } => (None, Some(*at)),
            _ => (None, None),
        };
        let Some(mut group) = self.freezes.unmade(id, end_now(how, "")) else {
            return FreezeError::Unknown { id: id.into() }.into();
        };
        if let Some(at) = unsent {
            group = self
                .freezes
                .settle(
                    id,
                    &[(at, end_now(How::Skipped, "its freeze was never sent"))],
                )
                .unwrap_or(group);
        }
        let (group, left) = self.end_pending(group, how, unsettled);
        let ours = group.closing.as_ref().map(|c| c.how) == Some(how);
        let untouched = ours
            && match &stop {
                Stop::Failed { at, failed } if failed.settled() => group
                    .parts
                    .iter()
                    .enumerate()
                    .all(|(i, p)| !p.called || i == *at),
                Stop::CallerLeft => group.parts.iter().all(|p| !p.called),
                _ => false,
            };
        if untouched {
            // No guest froze anything under this id: it may be used again.
            self.freezes.forget(id);
        }
        let left = Leftover {
            group: id.to_string(),
            sandboxes: left,
            timer_at_unix_ms: group.host_deadline_unix_ms(),
        };
        match stop {
            Stop::Failed { at, failed } => {
                let e = match parts.get(at) {
                    Some(p) => self.unless_dead(&p.sb, failed.error().clone()),
                    None => failed.error().clone().into(),
                };
                Error::FreezeRefused {
                    sandbox: parts.get(at).map_or("", |p| p.sb.id()).to_string(),
                    error: Box::new(e),
                    left,
                }
            }
            Stop::Ended(why) => FreezeError::Stopped {
                id: id.to_string(),
                why,
                left,
            }
            .into(),
            Stop::CallerLeft => FreezeError::CallerLeft {
                id: id.to_string(),
                left,
            }
            .into(),
        }
    }
}

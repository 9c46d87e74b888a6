//! A publish's undo list, as the agent keeps its own: each step that
//! changes something pushes, right after it, how to take it back. If the
//! publish fails, [`Rollback::fail`] undoes the steps last first and says
//! in the caller's error whether that failed too; a list dropped otherwise
//! (a panic on the way) undoes them all the same. An undo that fails stops
//! it there: the record stays `unplugging` with its claim, and the next
//! call finishes it. Once the volume is the guest's, `done` keeps
//! everything.

use crate::deadline::Deadline;
use crate::devices::Key;
use crate::error::{Error, Result};
use crate::hostdev::Names;
use crate::hotplug::Added;
use crate::registry::Sandbox;

use super::Crustd;

/// How to take back one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Undo {
    /// The claim this call made, before any record: released.
    Claim,
    /// The record and its claim (this call's, or an earlier attempt's that
    /// kubelet was never told of): the claim released by the device table's
    /// rule, then the record forgotten.
    Forget,
    /// The disk in QEMU, of a volume never reported published: the agent
    /// asked to unpublish (best effort), device_del, blockdev-del.
    TakeOut,
    /// Only what this call added in QEMU, of a volume kubelet was told is
    /// published (its disk had left QEMU behind crustd's back).
    Added(Added),
}

/// The undo list of one publish of volume `key` in `sb` (see the module doc).
#[must_use = "dropping a Rollback undoes its steps"]
pub(super) struct Rollback<'a> {
    c: &'a Crustd,
    sb: &'a Sandbox,
    key: &'a Key,
    names: &'a Names,
    deadline: &'a Deadline,
    steps: Vec<Undo>,
}

impl<'a> Rollback<'a> {
    pub(super) fn new(
        c: &'a Crustd,
        sb: &'a Sandbox,
        key: &'a Key,
        names: &'a Names,
        deadline: &'a Deadline,
    ) -> Rollback<'a> {
        Rollback {
            c,
            sb,
            key,
            names,
            deadline,
            steps: Vec::new(),
        }
    }

    /// A step went through; `undo` takes it back if a later one fails.
    pub(super) fn push(&mut self, undo: Undo) {
        self.steps.push(undo);
    }

    /// `undo` takes back what the last step's `before` took back, and more:
    /// it replaces it (a claim that became a record's goes with the record).
    pub(super) fn supersede(&mut self, before: Undo, undo: Undo) {
        if self.steps.last() == Some(&before) {
            self.steps.pop();
        }
        self.steps.push(undo);
    }

    /// The volume is the guest's now (published, or its publish goes on
    /// there): nothing is undone, whatever happens next.
    pub(super) fn done(&mut self) {
        self.steps.clear();
    }

    /// The publish failed with `err`: the steps undone, last first; `err`,
    /// with the undo's own failure when there was one.
    pub(super) fn fail(mut self, err: Error) -> Error {
        match self.undo_all() {
            Ok(()) => err,
            Err(undo) => Error::Undone {
                error: Box::new(err),
                undo: Box::new(undo),
            },
        }
    }

    /// Undoes the steps last first, stopping at the first that fails.
    fn undo_all(&mut self) -> Result<()> {
        while let Some(step) = self.steps.pop() {
            self.undo(step)?;
        }
        Ok(())
    }

    /// Takes back one step.
    fn undo(&self, step: Undo) -> Result<()> {
        let (c, sb, key, deadline) = (self.c, self.sb, self.key, self.deadline);
        match step {
            Undo::Claim => {
                Ok(c.devices
                    .release(key, "the publish that claimed it failed", deadline.at())?)
            }
            Undo::Forget => c.forget(
                &sb.home,
                key,
                "the publish that plugged it failed and its disk left the VM",
                None,
                deadline,
            ),
            Undo::TakeOut => c.undo_plug(sb, key, self.names, deadline),
            Undo::Added(a) => c.remove_added(sb, self.names, a, deadline),
        }
    }
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        if self.steps.is_empty() {
            return;
        }
        if let Err(e) = self.undo_all() {
            super::log_line(serde_json::json!({
                "msg": "undoing a publish that did not finish failed; RuntimeUnpublishVolume will finish it",
                "sandbox": self.key.sandbox,
                "host_volume": self.key.host_volume,
                "code": e.code().name(),
                "error": e.to_string(),
            }));
        }
    }
}

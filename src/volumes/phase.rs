//! How far a volume's publish got: its mount, its fsGroup walk and whether
//! it is complete, kept as one value that only the transitions below move
//! on, so no operation can hold a walk without a mount or call a volume
//! complete while its walk runs. Its record (state.rs) keeps it as
//! `mount_id=` and `complete=`, as every agent before wrote them.
//!
//! ```text
//! Recorded ──mounted──▶ Mounted ──walk──▶ Walking ──walked──▶ Published
//!     │                    ▲                 │
//!     └──mounted (no walk)─┼─────────────────┼───────────────▶ Published
//!                          └───walk_stopped──┘
//! ```

use std::sync::Arc;

use super::walking::job::WalkJob;
use crate::model::MountId;

/// A volume's place in its publish (the module doc).
#[derive(Clone, Debug)]
pub(crate) enum Phase {
    /// Recorded before anything is mounted: a publish between its first
    /// record and its mount check. Recovery finds such a record's mount by
    /// its disk alone.
    Recorded,
    /// Mounted (or bound) and checked, with the fsGroup walk its publish
    /// needs not done: not started yet, stopped by an unpublish that did
    /// not get through, or left by a run that stopped mid-walk. The same
    /// publish again starts a walk that finishes it.
    Mounted(MountId),
    /// Its fsGroup walk runs on a thread of its own, or ended with its
    /// outcome not yet taken under the volume's lock (walking/). Never
    /// recorded as such: a record says mounted and not complete.
    Walking(MountId, Arc<WalkJob>),
    /// Mounted and complete. The id is None only in a record written by
    /// an agent that kept none, until recovery finds the mount.
    Published(Option<MountId>),
}

impl Phase {
    /// The phase a record's `mount_id=` and `complete=` describe.
    pub(crate) fn from_record(mount: Option<MountId>, complete: bool) -> Phase {
        match (mount, complete) {
            (mount, true) => Phase::Published(mount),
            (Some(id), false) => Phase::Mounted(id),
            (None, false) => Phase::Recorded,
        }
    }

    /// The mount the agent made and checked, if it is known.
    pub(crate) fn mount_id(&self) -> Option<MountId> {
        match self {
            Phase::Recorded => None,
            Phase::Mounted(id) | Phase::Walking(id, _) => Some(*id),
            Phase::Published(id) => *id,
        }
    }

    /// Whether the publish is complete (a record's `complete=`).
    pub(crate) fn complete(&self) -> bool {
        matches!(self, Phase::Published(_))
    }

    /// The walk job, running or with its outcome not yet taken.
    pub(crate) fn job(&self) -> Option<&Arc<WalkJob>> {
        match self {
            Phase::Walking(_, job) => Some(job),
            _ => None,
        }
    }

    /// The walk job while its walk has no outcome yet.
    pub(crate) fn running(&self) -> Option<&Arc<WalkJob>> {
        self.job().filter(|j| !j.finished())
    }

    /// The mount was made and checked (`id`): complete at once, or
    /// Mounted until a walk finishes it (`walk`).
    pub(crate) fn mounted(&mut self, id: MountId, walk: bool) {
        debug_assert!(matches!(self, Phase::Recorded), "mounted twice: {self:?}");
        *self = if walk {
            Phase::Mounted(id)
        } else {
            Phase::Published(Some(id))
        };
    }

    /// A walk started on the mount; a job that ended without its outcome
    /// being taken is replaced. Only a mounted, incomplete volume walks.
    pub(crate) fn walk(&mut self, job: Arc<WalkJob>) {
        match self {
            Phase::Mounted(id) | Phase::Walking(id, _) => *self = Phase::Walking(*id, job),
            Phase::Recorded | Phase::Published(_) => {
                debug_assert!(false, "a walk on a volume {self:?}")
            }
        }
    }

    /// The walk went through and the publish is recorded complete.
    pub(crate) fn walked(&mut self) {
        if let Phase::Walking(id, _) = self {
            *self = Phase::Published(Some(*id));
        }
    }

    /// The walk was stopped and let go of the mount (an unpublish): the
    /// volume is mounted, not complete.
    pub(crate) fn walk_stopped(&mut self) {
        if let Phase::Walking(id, _) = self {
            *self = Phase::Mounted(*id);
        }
    }

    /// Recovery found the mount (`id`) where the record says: the id a
    /// record lacked or the kernel changed is the one now.
    pub(crate) fn found(&mut self, id: MountId) {
        *self = match self {
            Phase::Recorded | Phase::Mounted(_) | Phase::Walking(..) => Phase::Mounted(id),
            Phase::Published(_) => Phase::Published(Some(id)),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record's two fields and the phase say the same thing both ways.
    #[test]
    fn a_phase_reads_back_from_its_record() {
        let job = Arc::new(WalkJob::new());
        for (phase, mount, complete) in [
            (Phase::Recorded, None, false),
            (Phase::Mounted(MountId(5)), Some(MountId(5)), false),
            (Phase::Walking(MountId(6), job), Some(MountId(6)), false),
            (Phase::Published(Some(MountId(7))), Some(MountId(7)), true),
            (Phase::Published(None), None, true),
        ] {
            assert_eq!((phase.mount_id(), phase.complete()), (mount, complete));
            let back = Phase::from_record(mount, complete);
            assert_eq!((back.mount_id(), back.complete()), (mount, complete));
            assert!(back.job().is_none(), "a walk is never read from a record");
        }
    }

    #[test]
    fn a_walk_runs_between_the_mount_and_completion() {
        let mut p = Phase::Recorded;
        p.mounted(MountId(9), true);
        assert!(matches!(p, Phase::Mounted(MountId(9))));
        let job = Arc::new(WalkJob::new());
        p.walk(Arc::clone(&job));
        assert!(p.running().is_some() && !p.complete());
        // Stopped by an unpublish: mounted, incomplete, no job.
        p.walk_stopped();
        assert!(matches!(p, Phase::Mounted(MountId(9))) && p.job().is_none());
        p.walk(job);
        p.walked();
        assert!(matches!(p, Phase::Published(Some(MountId(9)))));
        // Nothing to walk: complete at once.
        let mut q = Phase::Recorded;
        q.mounted(MountId(3), false);
        assert!(q.complete());
        // Recovery's id replaces a recorded one, and keeps completeness.
        q.found(MountId(4));
        assert!(matches!(q, Phase::Published(Some(MountId(4)))));
        let mut r = Phase::Recorded;
        r.found(MountId(8));
        assert!(matches!(r, Phase::Mounted(MountId(8))));
    }
}

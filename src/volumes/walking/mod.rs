//! A publish's fsGroup walk belongs to the volume, not to the call that
//! started it (semantics.md §4.1). Once the filesystem is mounted and its
//! mount recorded, the walk runs on a thread of its own:
//!
//! - the caller waits for it within its own deadline; when the deadline
//!   passes or the caller goes away, the caller is answered
//!   DEADLINE_EXCEEDED or CANCELLED, saying how far the walk got, and the
//!   walk goes on;
//! - a publish of the same volume with the same parameters waits for the
//!   same walk (it joins it; nothing starts again from the top);
//! - Unpublish stops the walk, waits until it has let go of the mount, and
//!   takes the volume down; Shutdown does the same for every volume;
//! - when the walk ends, its thread takes the volume's lock and finishes the
//!   publish: the volume complete (recorded), or, if the walk failed, taken
//!   down as by Unpublish — the one undo a walk has, since what it changed
//!   stays changed (a chown cannot be undone safely).
//!
//! A job goes Walking → Ended (the walk returned and closed its fd on the
//! mount, so an unmount does not find it busy) → Finished (the outcome is
//! known: every waiter gets it).

//!
//! The room has two files: `job` (the job: its phases, its waiters, its
//! stop) and `lifecycle` (a walk started on a thread of the volume's, run,
//! then handed to the table to finish the publish under the volume's lock).

pub(crate) mod job;
pub(crate) mod lifecycle;

pub(crate) use job::{Outcome, WalkJob};
pub(crate) use lifecycle::start;

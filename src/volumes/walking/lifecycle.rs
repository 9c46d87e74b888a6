//! The walk's lifecycle on the table's side: started on a thread of the
//! volume's, run from the mount's own fd, finished under the volume's
//! lock (the room's doc is in `mod.rs`).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slog::{info, warn};

use super::job::{Outcome, WalkJob};
use crate::cancel::Cancel;
use crate::error::Result;
use crate::ownership::walk::{self, Report, Walk};
use crate::sys::beneath;
use crate::sys::error::SysError;
use crate::volumes::table::Volumes;
use crate::volumes::volume::Volume;

/// How often the walk's progress is taken (ListVolumes' `ownership_done`).
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// How often a long walk is logged, in milliseconds.
const LOG_EVERY_MS: u64 = 10_000;

impl Volumes {
    /// Starts the fsGroup walk of `vol` (mounted and recorded, not complete)
    /// on a thread of its own, holding `fd` (the mount's root) until it
    /// ends; the job is kept in the volume.
    pub(crate) fn start_walk(&self, vol: &mut Volume, fd: OwnedFd) -> Result<Arc<WalkJob>> {
        self.not_frozen(vol.id())?;
        let job = Arc::new(WalkJob::new());
        let (table, walking, j) = (self.shared(), vol.clone(), Arc::clone(&job));
        std::thread::Builder::new()
            .name("fsgroup-walk".into())
            .spawn(move || {
                // A bug in the walk must not leave its waiters, and an
                // Unpublish or Shutdown stopping it, waiting for ever.
                let run = std::panic::AssertUnwindSafe(|| table.run_walk(&walking, fd, &j));
                if std::panic::catch_unwind(run).is_err() {
                    j.ended();
                    j.finish(Outcome::Failed {
                        code: crate::code::Code::Internal,
                        message: format!(
                            "the agent hit an internal fault in the fsGroup walk of volume {}; unpublish it, then publish it again",
                            walking.id()
                        ),
                    });
                }
            })
            .map_err(|e| SysError::new("clone", "a thread for the fsGroup walk", e))?;
        vol.phase.walk(Arc::clone(&job));
        Ok(job)
    }

    /// The walk thread: walks, lets go of the mount, then finishes the
    /// publish under the volume's lock and tells every waiter.
    fn run_walk(&self, vol: &Volume, fd: OwnedFd, job: &Arc<WalkJob>) {
        let cancel = job.cancel(&self.stop_token());
        let walked = self.walk(vol, &fd, &cancel, Some(job));
        // Nothing of the walk's may hold the mount when it is taken down
        // (an fd on it, even O_PATH, makes umount fail with EBUSY).
        drop(fd);
        job.ended();
        let outcome = self.finish_walk(vol.id(), job, walked, &cancel);
        job.finish(outcome);
    }

    /// Takes the walk's outcome under the volume's lock: the volume
    /// complete (recorded, then listed ready), or, when the walk or the
    /// record failed, the volume taken down as by Unpublish. An Unpublish or
    /// a Shutdown that stopped the walk holds the lock and takes the volume
    /// down itself: `cancel` (fired by them) gives the lock up.
    fn finish_walk(
        &self,
        id: &str,
        job: &Arc<WalkJob>,
        walked: Result<Option<Report>>,
        cancel: &Cancel,
    ) -> Outcome {
        let failed = |e: &crate::error::Error| Outcome::Failed {
            code: e.code(),
            message: e.to_string(),
        };
        let Some(slot) = self.existing_slot(id) else {
            return walked.map_or_else(|e| failed(&e), Outcome::Done);
        };
        let mut guard = match slot.lock(id, cancel) {
            Ok(g) => g,
            Err(e) => return failed(&walked.err().unwrap_or(e)),
        };
        let ours = guard
            .as_ref()
            .and_then(|v| v.phase.job())
            .is_some_and(|j| Arc::ptr_eq(j, job));
        if !ours {
            return walked.map_or_else(|e| failed(&e), Outcome::Done);
        }
        let recorded = walked.and_then(|report| {
            let vol = guard.as_mut().expect("checked above");
            let mut done = vol.clone();
            done.phase.walked();
            self.store().save(&done)?;
            *vol = done;
            self.index().show(vol);
            Ok(report)
        });
        let outcome = match recorded {
            Ok(report) => Outcome::Done(report),
            Err(e) => {
                warn!(self.log(), "publish failed after mounting; unpublishing the volume";
                      "volume" => id, "error" => %e);
                if let Err(undo) = self.unpublish_locked(&mut guard, &Cancel::never()) {
                    warn!(self.log(), "could not take the volume down; the next unpublish or start does";
                          "volume" => id, "error" => %undo);
                }
                failed(&e)
            }
        };
        let gone = guard.is_none();
        drop(guard);
        drop(slot);
        if gone {
            self.forget_slot(id);
        }
        outcome
    }

    /// The fsGroup walk of a freshly mounted volume (if asked for and
    /// writable), from the mount's own fd; its progress is kept in `job`
    /// (ListVolumes) and logged every 10 s.
    pub(crate) fn walk(
        &self,
        vol: &Volume,
        fd: &OwnedFd,
        cancel: &Cancel,
        job: Option<&WalkJob>,
    ) -> Result<Option<Report>> {
        let Some(g) = vol.spec.fs_group.filter(|_| !vol.mounted_read_only()) else {
            return Ok(None);
        };
        // Milliseconds since the walk started at the last log line.
        let logged = AtomicU64::new(0);
        let progress = |p: &Report| {
            if let Some(job) = job {
                job.progress(p.visited);
            }
            let ms = u64::try_from(p.duration.as_millis()).unwrap_or(u64::MAX);
            if ms.saturating_sub(logged.load(Ordering::Relaxed)) < LOG_EVERY_MS {
                return;
            }
            logged.store(ms, Ordering::Relaxed);
            info!(self.log(), "fsGroup walk in progress"; "volume" => vol.id(),
                  "visited" => p.visited, "changed" => p.changed, "errors" => p.errors,
                  "elapsed_ms" => ms);
        };
        let r = walk::run(&Walk {
            open_at: &beneath::proc_path(fd.as_fd()),
            shown: &vol.guest_path,
            gid: g.gid,
            policy: g.policy,
            read_only: false,
            every: PROGRESS_EVERY,
            progress: &progress,
            cancel,
        })?;
        if let Some(job) = job {
            job.progress(r.visited);
        }
        info!(self.log(), "fsGroup applied"; "volume" => vol.id(), "gid" => g.gid,
              "skipped" => r.skipped, "visited" => r.visited, "changed" => r.changed,
              "errors" => r.errors,
              "duration_us" => u64::try_from(r.duration.as_micros()).unwrap_or(u64::MAX));
        Ok(Some(r))
    }
}

//! The walk's lifecycle: started on a thread of the volume's, run from the
//! mount's own fd, then finished by the table under the volume's lock
//! through the `finish` it was started with (the room's doc is in
//! `mod.rs`). Nothing here knows the table: the thread holds only the
//! volume's copy, the mount's fd and what the table handed it.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slog::{info, Logger};

use super::job::{Outcome, WalkJob};
use crate::cancel::{Cancel, Token};
use crate::error::Result;
use crate::ownership::mounts;
use crate::ownership::walk::{self, Report, Walk};
use crate::sys::beneath;
use crate::sys::error::SysError;
use crate::volumes::volume::Volume;

/// How often the walk's progress is taken (ListVolumes' `ownership_done`).
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// How often a long walk is logged, in milliseconds.
const LOG_EVERY_MS: u64 = 10_000;

/// What the table does once a walk returned and let go of the mount: takes
/// the volume's lock (giving up when the cancellation fires) and finishes
/// the publish with what the walk returned, answering the job's outcome.
pub(crate) trait Finish:
    FnOnce(&str, &Arc<WalkJob>, Result<Option<Report>>, &Cancel) -> Outcome + Send + 'static
{
}

impl<F> Finish for F where
    F: FnOnce(&str, &Arc<WalkJob>, Result<Option<Report>>, &Cancel) -> Outcome + Send + 'static
{
}

/// Starts the fsGroup walk of `vol` (mounted and recorded, not complete)
/// on a thread of its own, holding `fd` (the mount's root) until it ends;
/// the job is kept in the volume's phase. `shutdown` stops it too.
pub(crate) fn start(
    vol: &mut Volume,
    fd: OwnedFd,
    shutdown: Token,
    log: Logger,
    finish: impl Finish,
) -> Result<Arc<WalkJob>> {
    let job = Arc::new(WalkJob::new());
    let (walking, j) = (vol.clone(), Arc::clone(&job));
    std::thread::Builder::new()
        .name("fsgroup-walk".into())
        .spawn(move || {
            // A bug in the walk must not leave its waiters, and an
            // Unpublish or Shutdown stopping it, waiting for ever.
            let run =
                std::panic::AssertUnwindSafe(|| run(&walking, fd, &j, &shutdown, &log, finish));
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

/// The walk thread: walks, lets go of the mount, then has the table
/// finish the publish and tells every waiter.
fn run(
    vol: &Volume,
    fd: OwnedFd,
    job: &Arc<WalkJob>,
    shutdown: &Token,
    log: &Logger,
    finish: impl Finish,
) {
    let cancel = job.cancel(shutdown);
    let walked = walk(vol, &fd, &cancel, job, log);
    // Nothing of the walk's may hold the mount when it is taken down
    // (an fd on it, even O_PATH, makes umount fail with EBUSY).
    drop(fd);
    job.ended();
    let outcome = finish(vol.id(), job, walked, &cancel);
    job.finish(outcome);
}

/// The fsGroup walk of a freshly mounted volume (if asked for and
/// writable), from the mount's own fd; its progress is kept in `job`
/// (ListVolumes) and logged every 10 s.
fn walk(
    vol: &Volume,
    fd: &OwnedFd,
    cancel: &Cancel,
    job: &WalkJob,
    log: &Logger,
) -> Result<Option<Report>> {
    let Some(g) = vol.spec.fs_group.filter(|_| !vol.mounted_read_only()) else {
        return Ok(None);
    };
    // Milliseconds since the walk started at the last log line.
    let logged = AtomicU64::new(0);
    let progress = |p: &Report| {
        job.progress(p.visited);
        let ms = u64::try_from(p.duration.as_millis()).unwrap_or(u64::MAX);
        if ms.saturating_sub(logged.load(Ordering::Relaxed)) < LOG_EVERY_MS {
            return;
        }
        logged.store(ms, Ordering::Relaxed);
        info!(log, "fsGroup walk in progress"; "volume" => vol.id(),
              "visited" => p.visited, "changed" => p.changed, "errors" => p.errors,
              "mounts_skipped" => p.mounts_skipped, "elapsed_ms" => ms);
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
    job.progress(r.visited);
    info!(log, "fsGroup applied"; "volume" => vol.id(), "gid" => g.gid,
          "skipped" => r.skipped, "visited" => r.visited, "changed" => r.changed,
          "errors" => r.errors,
          "duration_us" => u64::try_from(r.duration.as_micros()).unwrap_or(u64::MAX),
          "mounts_skipped" => r.mounts_skipped,
          "skipped_mount_points" => mounts::listed(&r.skipped_mount_points, r.mounts_skipped));
    Ok(Some(r))
}

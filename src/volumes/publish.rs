//! Publishing a volume (semantics.md §1): idempotent for the same request,
//! refused for another; a new one as explicit steps with one undo list.
//!
//! A new filesystem volume, step by step, and what undoes each if a later
//! step fails (`Rollback`, last first):
//!
//! | step | undone by |
//! | --- | --- |
//! | find the disk, claim it (and its sectors) | the claim is released |
//! | check nothing else mounts it or shares its sectors | — |
//! | make the guest path, a directory of the agent's | removing what was made |
//! | probe: the disk holds the filesystem asked for | — |
//! | record the volume, incomplete | removing the record |
//! | mount the filesystem on the directory's fd | — (until checked, below) |
//! | check the mount is there, the disk's | if not: nothing is undone, recovery takes it down |
//! | record the mount's id | unmounting it by that id |
//! | — from here on the volume is published, and the call may go — | |
//! | walk fsGroup, on a thread of the volume's (walking.rs) | Unpublish (what a walk changed stays: a chown cannot be undone safely) |
//! | record the volume complete | Unpublish |
//!
//! The caller waits for the walk within its own deadline; when the deadline
//! passes or the caller goes, it is answered DEADLINE_EXCEEDED or CANCELLED
//! and the walk goes on; the same publish again waits for the same walk.
//!
//! A block volume takes the same steps (`block`): an empty file instead of
//! a directory, the device's read-only flag instead of the probe, its node
//! bound instead of a filesystem mounted, no walk.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slog::{info, warn};

use super::error::Error;
use super::request::{PublishRequest, Published, Source};
use super::rollback::{Rollback, Undo};
use super::table::Volumes;
use super::volume::{guest_rel, Volume};
use super::walking::{Outcome, WalkJob};
use crate::cancel::Cancel;
use crate::device;
use crate::error::Result;
use crate::model::{Device, Extent, VolumeMode};
use crate::mount::filesystem::mount_filesystem;
use crate::mount::unmount::Expect;
use crate::ownership::walk::{self, Report, Walk};
use crate::probe::judge;
use crate::sys::beneath::{self, Leaf};
use crate::sys::error::SysError;
use crate::sys::mountinfo::{self, shown};

/// What a publish answers once the volume's lock is let go: at once, or
/// when the volume's fsGroup walk ends (walking.rs), waited for without
/// holding the lock, so that a list, a stats or an unpublish is served
/// meanwhile.
enum Answer {
    Now(Published),
    Wait(Arc<WalkJob>, Published),
}

/// How often the walk's progress is taken (ListVolumes' `ownership_done`).
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// How often a long walk is logged, in milliseconds.
const LOG_EVERY_MS: u64 = 10_000;

impl Volumes {
    /// Publishes a volume (semantics.md §1): idempotent for the same
    /// request, refused for another. A publish whose fsGroup walk outlives
    /// the caller's deadline answers DEADLINE_EXCEEDED (CANCELLED when the
    /// caller went away) while the walk goes on; the same publish again
    /// waits for that walk (semantics.md §4.1).
    pub fn publish(&self, req: &PublishRequest, cancel: &Cancel) -> Result<Published> {
        self.accepting()?;
        let cancel = &self.stop_with(cancel);
        let result = {
            let slot = self.slot(&req.volume_id);
            let locked = slot.lock(&req.volume_id, cancel);
            locked.and_then(|mut guard| {
                // Checked again now that the slot exists: a Shutdown that
                // listed the slots before this one was made set the flag
                // first, so no publish can slip past it.
                self.accepting()?;
                self.publish_locked(&mut guard, req, cancel)
            })
        };
        match result {
            Ok(Answer::Now(out)) => Ok(out),
            Ok(Answer::Wait(job, mut out)) => match job.wait(&req.volume_id, cancel)? {
                Outcome::Done(report) => {
                    out.ownership = report;
                    Ok(out)
                }
                Outcome::Failed { code, message } => {
                    Err(Error::PublishFailed { code, message }.into())
                }
            },
            Err(e) => {
                // A publish that failed leaves no trace, not even an empty slot.
                self.forget_slot(&req.volume_id);
                Err(e)
            }
        }
    }

    fn publish_locked(
        &self,
        guard: &mut Option<Volume>,
        req: &PublishRequest,
        cancel: &Cancel,
    ) -> Result<Answer> {
        if let Some(vol) = guard.as_mut() {
            return self.publish_again(vol, req);
        }
        let device = match &req.source {
            Source::Serial(s) => device::find_by_serial(&self.sysfs, s, req.timeout, cancel)?,
            Source::Path(p) => device::from_path(&self.sysfs, p)?,
        };
        // Claimed for the whole publish: a concurrent publish of the same
        // disk, or of one sharing its sectors, is refused.
        let extent = self.sysfs.extent((device.major, device.minor));
        let claim = self.index.claim(&device, &req.volume_id, extent)?;
        self.check_not_mounted(&device, &extent)?;
        let vol = match req.mode {
            VolumeMode::Filesystem(_) => self.publish_filesystem(req, device)?,
            VolumeMode::Block => self.publish_block(req, device)?,
        };
        self.index.published(&vol, claim);
        let out = Published {
            guest_path: vol.guest_path.clone(),
            device: vol.device.path.clone(),
            already_published: false,
            // fsGroup on a read-only volume: left alone, and said so.
            ownership: (vol.fs_group.is_some() && vol.mounted_read_only()).then(|| Report {
                skipped: true,
                ..Default::default()
            }),
        };
        let answer = match &vol.walk {
            Some(job) => Answer::Wait(Arc::clone(job), out),
            None => Answer::Now(out),
        };
        *guard = Some(vol);
        Ok(answer)
    }

    /// The same request again: conflicts are refused, and the answer is
    /// given only while it is still true (the mount is checked). A volume
    /// whose fsGroup walk runs is waited for (the call joins the walk); one
    /// whose walk did not finish (taken back from a run that stopped
    /// mid-walk, or whose walk failed and could not be taken down) gets a
    /// walk that finishes it.
    fn publish_again(&self, vol: &mut Volume, req: &PublishRequest) -> Result<Answer> {
        if let Some(differs) = vol.differs_from(req) {
            return Err(Error::Conflict {
                id: req.volume_id.clone(),
                differs,
            }
            .into());
        }
        let fd = self.open_mount(vol)?;
        let out = Published {
            guest_path: vol.guest_path.clone(),
            device: vol.device.path.clone(),
            already_published: vol.complete,
            ownership: None,
        };
        if vol.complete {
            return Ok(Answer::Now(out));
        }
        if let Some(job) = vol.walk.as_ref().filter(|j| !j.finished()) {
            return Ok(Answer::Wait(Arc::clone(job), out));
        }
        let job = self.start_walk(vol, fd)?;
        self.index.show(vol);
        Ok(Answer::Wait(job, out))
    }

    /// A new filesystem volume on `device` (claimed by the caller): the
    /// steps of the module doc, each followed by its undo.
    fn publish_filesystem(&self, req: &PublishRequest, device: Device) -> Result<Volume> {
        let VolumeMode::Filesystem(fs) = req.mode else {
            unreachable!("publish_filesystem of a block request");
        };
        let rel = guest_rel(&req.volume_id);
        let guest_path = self.root.join(&rel);
        let mut undo = Rollback::new(self, "publish", &req.volume_id, &device);

        // The guest path: a directory of the agent's, not a mount point.
        let dir = self.guest_node(&rel, Leaf::Dir(0o750), "a plain directory", &mut undo)?;
        let here = beneath::mount_point(dir.as_fd())
            .map_err(|e| SysError::new("statx", guest_path.display(), e))?;
        if here.is_root {
            return Err(Error::GuestPathBusy {
                path: guest_path.display().to_string(),
            }
            .into());
        }

        // The disk holds the filesystem asked for, and a superblock the agent mounts.
        judge::check(&device.path, fs)?;

        // Recorded before anything is mounted: a crash from here on leaves a
        // record that recovery adopts or clears, never an unknown mount.
        let mut vol = Volume {
            id: req.volume_id.clone(),
            source: req.source.clone(),
            device: device.clone(),
            mode: req.mode,
            options: req.options.clone(),
            mount: req.mount.clone(),
            read_only: req.read_only,
            fs_group: req.fs_group,
            guest_path: guest_path.clone(),
            mount_id: None,
            complete: false,
            ro_set: false,
            walk: None,
            binds: Vec::new(),
        };
        self.store.save(&vol)?;
        undo.push(Undo::Record);

        // Mounted on the directory's fd, so no rename or symlink moves it.
        mount_filesystem(
            &device.path,
            dir.as_fd(),
            &guest_path,
            fs.name(),
            &req.mount,
        )?;
        drop(dir);

        // What is mounted at the guest path now must be the device just
        // mounted; if it is not, undoing could hit what is there instead.
        let (fd, id) = match self.mounted_here(&vol) {
            Ok(found) => found,
            Err(e) => {
                undo.leave_to_recovery();
                return Err(e);
            }
        };
        undo.push(Undo::Mount {
            rel: rel.clone(),
            expect: Expect::Mount(id, device.major, device.minor),
        });
        vol.mount_id = Some(id);
        vol.complete = vol.fs_group.is_none() || vol.mounted_read_only();
        self.store.save(&vol)?;
        undo.done();

        // fsGroup: from here on the publish belongs to the volume. Its walk
        // runs on a thread of its own, from the mount's own fd; the one undo
        // a failed walk has is Unpublish's (walking.rs).
        if !vol.complete {
            self.start_walk(&mut vol, fd)?;
        }
        Ok(vol)
    }

    /// Starts the fsGroup walk of `vol` (mounted and recorded, not complete)
    /// on a thread of its own, holding `fd` (the mount's root) until it
    /// ends; the job is kept in the volume.
    fn start_walk(&self, vol: &mut Volume, fd: OwnedFd) -> Result<Arc<WalkJob>> {
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
                            walking.id
                        ),
                    });
                }
            })
            .map_err(|e| SysError::new("clone", "a thread for the fsGroup walk", e))?;
        vol.walk = Some(Arc::clone(&job));
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
        let outcome = self.finish_walk(&vol.id, job, walked, &cancel);
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
            .and_then(|v| v.walk.as_ref())
            .is_some_and(|j| Arc::ptr_eq(j, job));
        if !ours {
            return walked.map_or_else(|e| failed(&e), Outcome::Done);
        }
        let recorded = walked.and_then(|report| {
            let vol = guard.as_mut().expect("checked above");
            let mut done = vol.clone();
            done.complete = true;
            done.walk = None;
            self.store.save(&done)?;
            *vol = done;
            self.index.show(vol);
            Ok(report)
        });
        let outcome = match recorded {
            Ok(report) => Outcome::Done(report),
            Err(e) => {
                warn!(self.log, "publish failed after mounting; unpublishing the volume";
                      "volume" => id, "error" => %e);
                if let Err(undo) = self.unpublish_locked(&mut guard, &Cancel::never()) {
                    warn!(self.log, "could not take the volume down; the next unpublish or start does";
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
        let Some(g) = vol.fs_group.filter(|_| !vol.mounted_read_only()) else {
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
            info!(self.log, "fsGroup walk in progress"; "volume" => &vol.id,
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
        info!(self.log, "fsGroup applied"; "volume" => &vol.id, "gid" => g.gid,
              "skipped" => r.skipped, "visited" => r.visited, "changed" => r.changed,
              "errors" => r.errors,
              "duration_us" => u64::try_from(r.duration.as_micros()).unwrap_or(u64::MAX));
        Ok(Some(r))
    }

    /// Refuses a device whose filesystem is mounted already, or one that
    /// shares sectors with a mounted device (a partition of it, the disk it
    /// is a partition of, an overlapping partition): mounted by someone
    /// else, since the agent's own volumes are refused by their claims.
    fn check_not_mounted(&self, device: &Device, extent: &Extent) -> Result<()> {
        let key = (device.major, device.minor);
        let mut extents: std::collections::HashMap<(u32, u32), Extent> =
            std::collections::HashMap::new();
        for m in mountinfo::read()? {
            let dev = (m.major, m.minor);
            if dev == key {
                return Err(Error::DeviceMounted {
                    device: shown(&device.path),
                    at: shown(&m.mount_point),
                }
                .into());
            }
            // Major 0: no block device behind it (tmpfs, proc, overlay…).
            if dev.0 == 0 {
                continue;
            }
            let other = *extents.entry(dev).or_insert_with(|| self.sysfs.extent(dev));
            if other.overlaps(extent) {
                return Err(Error::DeviceOverlapsMount {
                    device: shown(&device.path),
                    other_device: format!("{} ({}:{})", m.source, dev.0, dev.1),
                    how: extent.describe(&other),
                    at: shown(&m.mount_point),
                }
                .into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::code::Code;
    use crate::model::RecursiveReadOnly;
    use crate::volumes::request::BindRequest;
    use crate::volumes::testkit::{fake_partitions, publish_loop, table};
    use crate::volumes::volume::tests::sample;

    #[test]
    fn partitions_that_overlap_are_one_volume() {
        if !crate::testutil::root_or_skip("partitions_that_overlap_are_one_volume") {
            return;
        }
        let (a, b, c) = (
            crate::testutil::LoopDisk::new(32, Some("ext4")),
            crate::testutil::LoopDisk::new(32, None),
            crate::testutil::LoopDisk::new(32, None),
        );
        let dir = tempfile::tempdir().unwrap();
        // a: sectors 2048..67584; b overlaps its end; c lies after both.
        let sysfs = fake_partitions(
            dir.path(),
            &[(&a, 2048, 65536), (&b, 60000, 8192), (&c, 68216, 100)],
        );
        let v = Volumes::open(&dir.path().join("root"), sysfs, crate::logging::discard()).unwrap();
        let block = |id: &str, d: &crate::testutil::LoopDisk| PublishRequest {
            volume_id: id.into(),
            source: Source::Path(d.device.clone()),
            mode: VolumeMode::Block,
            options: Vec::new(),
            mount: crate::mount::options::parse_options(&[], false).unwrap(),
            read_only: false,
            fs_group: None,
            timeout: Duration::from_secs(1),
        };
        publish_loop(&v, "pa", &a);
        let e = v.publish(&block("pb", &b), &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("volume pa") && msg.contains("60000..68192"),
            "{msg}"
        );
        assert!(
            v.list().iter().all(|i| i.volume_id != "pb"),
            "a refused publish leaves nothing"
        );
        // One that does not overlap is its own volume.
        v.publish(&block("pc", &c), &Cancel::never()).unwrap();
        // The other order: b first, then a is refused.
        assert!(v.unpublish("pa", &Cancel::never()).unwrap());
        v.publish(&block("pb", &b), &Cancel::never()).unwrap();
        let e = v.publish(&block("pa", &a), &Cancel::never()).unwrap_err();
        assert!(e.to_string().contains("volume pb"), "{e}");
        for id in ["pb", "pc"] {
            assert!(v.unpublish(id, &Cancel::never()).unwrap());
        }
    }

    #[test]
    fn after_shutdown_nothing_new_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let v = table(dir.path());
        assert_eq!(v.shutdown(), 0);
        let s = sample();
        let req = PublishRequest {
            volume_id: "late".into(),
            source: s.source.clone(),
            mode: s.mode,
            options: s.options.clone(),
            mount: s.mount.clone(),
            read_only: false,
            fs_group: None,
            timeout: Duration::from_millis(1),
        };
        let e = v.publish(&req, &Cancel::never()).unwrap_err();
        assert!(
            matches!(e, crate::error::Error::Volume(Error::ShuttingDown)),
            "{e}"
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        let b = BindRequest {
            volume_id: "late".into(),
            subpath: PathBuf::new(),
            target: dir.path().join("t"),
            read_only: false,
            recursive_read_only: RecursiveReadOnly::Disabled,
        };
        assert!(matches!(
            v.bind(&b, &Cancel::never()),
            Err(crate::error::Error::Volume(Error::ShuttingDown))
        ));
    }
}

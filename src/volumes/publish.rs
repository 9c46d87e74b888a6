//! Publishing a volume (semantics.md §1): idempotent for the same request,
//! refused for another; a new one as explicit steps with one undo list.
//!
//! A new volume, step by step (`publish_new`), and what undoes each if a
//! later step fails (`Rollback`, last first). A filesystem and a block
//! volume (`block`) take the same steps; they differ only where the table
//! says:
//!
//! | step | filesystem | block | undone by |
//! | --- | --- | --- | --- |
//! | find the disk, claim it (and its sectors) | | | the claim is released |
//! | check nothing else mounts it or shares its sectors | | | — |
//! | make the guest path, a node of the agent's (`guest_node`) | a directory | an empty 0600 file | removing what was made |
//! | prepare | probe: the disk holds the filesystem asked for | open the device, read its read-only flag | — |
//! | record the volume, incomplete (`Volume::new`) | | | removing the record |
//! | attach | mount the filesystem on the directory's fd | set the device read-only if asked and not already (undone by clearing it), bind its node onto the file | — (until checked, below) |
//! | check the mount is the volume's own (`own_mount`) | | | if not: nothing is undone, recovery takes it down |
//! | record the mount's id | | | unmounting it by that id |
//! | — from here on the volume is published, and the call may go — | | | |
//! | walk fsGroup, on a thread of the volume's (`walking`) | if asked and writable | never | Unpublish (what a walk changed stays: a chown cannot be undone safely) |
//! | record the volume complete | | | Unpublish |
//!
//! The caller waits for the walk within its own deadline; when the deadline
//! passes or the caller goes, it is answered DEADLINE_EXCEEDED or CANCELLED
//! and the walk goes on; the same publish again waits for the same walk.
//! Nothing of a block volume's publish reads or writes the disk.

use std::os::fd::AsFd;
use std::sync::Arc;

use slog::info;

use super::block;
use super::error::Error;
use super::failures::Failure;
use super::request::{PublishRequest, Published, Source, Spec};
use super::rollback::{Rollback, Undo};
use super::table::Volumes;
use super::volume::{guest_rel, Volume};
use super::walking::{Outcome, WalkJob};
use crate::cancel::Cancel;
use crate::device;
use crate::error::Result;
use crate::model::{Device, Extent, FsType, VolumeMode};
use crate::mount::filesystem::mount_filesystem;
use crate::ownership::walk::Report;
use crate::probe::judge;
use crate::sys::mountinfo::{self, shown};

/// What a publish answers once the volume's lock is let go: at once, or
/// when the volume's fsGroup walk ends (walking.rs), waited for without
/// holding the lock, so that a list, a stats or an unpublish is served
/// meanwhile.
enum Answer {
    Now(Published),
    Wait(Arc<WalkJob>, Published),
}

/// What a publish's prepare step found, for its attach step: the
/// filesystem the disk holds, or a block volume's device opened.
enum Prepared {
    Filesystem(FsType),
    Block(block::Opened),
}

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
            let slot = self.slot(&req.spec.volume_id);
            let locked = slot.lock(&req.spec.volume_id, cancel);
            locked.and_then(|mut guard| {
                // Checked again now that the slot exists: a Shutdown that
                // listed the slots before this one was made set the flag
                // first, so no publish can slip past it.
                self.accepting()?;
                self.publish_locked(&mut guard, req, cancel)
            })
        };
        match &result {
            Ok(_) => self.failures().forget(&req.spec.volume_id),
            Err(e) => self.failures().note(
                &req.spec.volume_id,
                Failure {
                    code: e.code(),
                    message: e.to_string(),
                },
            ),
        }
        match result {
            Ok(Answer::Now(out)) => Ok(out),
            Ok(Answer::Wait(job, mut out)) => match job.wait(&req.spec.volume_id, cancel)? {
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
                self.forget_slot(&req.spec.volume_id);
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
        let device = match &req.spec.source {
            Source::Serial(s) => device::find_by_serial(self.sysfs(), s, req.timeout, cancel)?,
            Source::Path(p) => device::from_path(self.sysfs(), p)?,
        };
        // Claimed for the whole publish: a concurrent publish of the same
        // disk, or of one sharing its sectors, is refused.
        let extent = self.sysfs().extent((device.major, device.minor));
        let claim = self.index().claim(&device, &req.spec.volume_id, extent)?;
        self.check_not_mounted(&device, &extent)?;
        let vol = self.publish_new(&req.spec, device)?;
        self.index().published(&vol, claim);
        let out = Published {
            guest_path: vol.guest_path.clone(),
            device: vol.device.path.clone(),
            already_published: false,
            // fsGroup on a read-only volume: left alone, and said so.
            ownership: (vol.spec.fs_group.is_some() && vol.mounted_read_only()).then(|| Report {
                skipped: true,
                ..Default::default()
            }),
        };
        let answer = match vol.phase.job() {
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
        if let Some(differs) = vol.differs_from(&req.spec) {
            return Err(Error::Conflict {
                id: req.spec.volume_id.clone(),
                differs,
            }
            .into());
        }
        let fd = self.open_mount(vol)?;
        let out = Published {
            guest_path: vol.guest_path.clone(),
            device: vol.device.path.clone(),
            already_published: vol.phase.complete(),
            ownership: None,
        };
        if vol.phase.complete() {
            return Ok(Answer::Now(out));
        }
        if let Some(job) = vol.phase.running() {
            return Ok(Answer::Wait(Arc::clone(job), out));
        }
        let job = self.start_walk(vol, fd)?;
        self.index().show(vol);
        Ok(Answer::Wait(job, out))
    }

    /// A new volume on `device` (claimed by the caller): the steps of the
    /// module doc, each followed by its undo. A filesystem and a block
    /// volume differ only in their guest node, their prepare step and
    /// their attach step.
    fn publish_new(&self, spec: &Spec, device: Device) -> Result<Volume> {
        let rel = guest_rel(&spec.volume_id);
        let mut undo = Rollback::new(self, "publish", &spec.volume_id, &device);

        // The guest path: a node of the agent's, not a mount point.
        let node = self.guest_node(&rel, spec.mode, &mut undo)?;

        // What the disk must hold, or the device's read-only flag.
        let prepared = match spec.mode {
            VolumeMode::Filesystem(fs) => {
                judge::check(&device.path, fs)?;
                Prepared::Filesystem(fs)
            }
            VolumeMode::Block => {
                Prepared::Block(block::prepare(&device, spec.options.read_only_flag())?)
            }
        };

        // Recorded before anything is mounted or set: a crash from here on
        // leaves a record that recovery adopts or clears, never an unknown
        // mount (nor a flag nobody clears).
        let ro_set = matches!(prepared, Prepared::Block(ref b) if b.ro_set);
        let mut vol = Volume::new(
            spec.clone(),
            device.clone(),
            self.root_dir().join(&rel),
            ro_set,
        );
        self.store().save(&vol)?;
        undo.push(Undo::Record);

        // Mounted (or bound) through the node's fd, so no rename or
        // symlink moves it.
        match prepared {
            Prepared::Filesystem(fs) => {
                mount_filesystem(
                    &device.path,
                    node.as_fd(),
                    &vol.guest_path,
                    fs.name(),
                    spec.options.mount(),
                )?;
                drop(node);
            }
            Prepared::Block(b) => self.attach_block(b, &vol, node, &mut undo)?,
        }

        // What is mounted at the guest path now must be the device just
        // mounted; if it is not, undoing could hit what is there instead.
        let (fd, id) = match self.own_mount(&vol) {
            Ok(Some(found)) => found,
            other => {
                undo.leave_to_recovery();
                return Err(other.err().unwrap_or_else(|| {
                    crate::mount::error::Error::Moved {
                        path: vol.guest_path.display().to_string(),
                    }
                    .into()
                }));
            }
        };
        vol.phase.mounted(id, vol.needs_walk());
        undo.push(Undo::Mount {
            rel,
            expect: vol.mount_identity(),
        });
        self.store().save(&vol)?;
        undo.done();
        info!(self.log(), "volume published"; "volume" => vol.id(), "device" => %device.path.display(),
              "mode" => vol.mode().name(), "read_only" => vol.mounted_read_only(), "ro_set" => ro_set);

        // fsGroup: from here on the publish belongs to the volume. Its walk
        // runs on a thread of its own, from the mount's own fd; the one undo
        // a failed walk has is Unpublish's (walking.rs).
        if !vol.phase.complete() {
            self.start_walk(&mut vol, fd)?;
        }
        Ok(vol)
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
            let other = *extents
                .entry(dev)
                .or_insert_with(|| self.sysfs().extent(dev));
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
    use std::time::Duration;

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
            spec: Spec {
                volume_id: id.into(),
                source: Source::Path(d.device.clone()),
                mode: VolumeMode::Block,
                options: crate::volumes::request::Options::parse(Vec::new(), false).unwrap(),
                fs_group: None,
            },
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
        let mut spec = sample().spec;
        spec.volume_id = "late".into();
        spec.fs_group = None;
        let req = PublishRequest {
            spec,
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

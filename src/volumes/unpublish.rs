//! Unpublishing a volume (semantics.md §2): its binds (deepest last made
//! first), a flush, its mount, any mount of its disk left beneath the root
//! (moved or copied behind the agent's back), its directory and its record;
//! and Shutdown, which unpublishes everything. Nothing is written on the
//! way, so an unpublish needs no space in the state directory.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use slog::warn;

use super::error::Error;
use super::lease::How;
use super::table::Volumes;
use super::volume::Volume;
use crate::cancel::Cancel;
use crate::error::Result;
use crate::model::{MountId, VolumeMode};
use crate::mount::error::Error as MountError;
use crate::mount::filesystem::sync_filesystem;
use crate::mount::unmount::{listed, remove_node, unmount_tree, Expect};
use crate::sys::mountinfo::{self, shown, MountEntry};

impl Volumes {
    /// Unpublishes a volume: its binds, then its mount (flushed first), its
    /// directory and its record. False when it was not published.
    pub fn unpublish(&self, id: &str, cancel: &Cancel) -> Result<bool> {
        let Some(slot) = self.existing_slot(id) else {
            return Ok(false);
        };
        let result = {
            let locked = slot.lock(id, cancel);
            locked.and_then(|mut guard| self.unpublish_locked(&mut guard, cancel))
        };
        drop(slot);
        if result.is_ok() {
            self.forget_slot(id);
        }
        result
    }

    pub(crate) fn unpublish_locked(
        &self,
        guard: &mut Option<Volume>,
        cancel: &Cancel,
    ) -> Result<bool> {
        let Some(vol) = guard.as_mut() else {
            return Ok(false);
        };
        // A publish's fsGroup walk still running is stopped first, and
        // waited for until it let go of the mount (milliseconds: it looks
        // at its token between two entries).
        if let Some(job) = vol.phase.job() {
            job.stop_and_wait(vol.id(), cancel)?;
            vol.phase.walk_stopped();
        }
        // Thawed first: a frozen filesystem would hang its flush and unmount.
        self.freezer()
            .end_volumes(&[vol.id().to_string()], How::Unpublished);
        self.failures().forget(vol.id());
        // Nothing is written on the way: an unpublish needs no space in the
        // state directory. A record that still lists binds taken down (if
        // this stops half-way) lists only what recovery drops; the table in
        // memory follows every unmount, so ListVolumes stays true.
        while let Some(b) = vol.binds.last() {
            self.take_down(&b.rel, b.mount_identity(&vol.device))?;
            self.index().drop_bind(vol, vol.binds.len() - 1);
        }
        match vol.mode() {
            // Flushed while it is certainly the volume's own mount.
            VolumeMode::Filesystem(_) => {
                if let Ok(fd) = self.open_mount(vol) {
                    sync_filesystem(fd.as_fd(), &vol.guest_path)?;
                }
                self.take_down(&vol.rel(), vol.mount_identity())?;
            }
            VolumeMode::Block => self.unpublish_block(vol)?,
        }
        // Never OK while the disk is still mounted beneath the root.
        self.take_down_leftovers(vol)?;
        // Unlinking needs no space; where even that fails (a read-only or
        // failing state filesystem), every mount is down all the same, and
        // the record names a volume whose mount is gone, which recovery drops.
        if let Err(e) = self.store().remove(vol.id()) {
            warn!(self.log(), "could not remove the record of an unpublished volume; the next start drops it";
                  "volume" => vol.id(), "error" => %e);
        }
        self.index().forget(vol);
        *guard = None;
        Ok(true)
    }

    /// Takes down every mount of `vol`'s disk still beneath the root once
    /// the agent's own are down: its filesystem, or a bind of its node (a
    /// devtmpfs mount of the node's name, checked by its device number
    /// before it comes off). They are binds moved or copied behind the
    /// agent's back, which recovery would take down too; leaving one would
    /// let the host detach a disk that is still mounted. One that cannot be
    /// taken down is an error naming it.
    fn take_down_leftovers(&self, vol: &Volume) -> Result<()> {
        let (root_fd, root) = (self.root_dir().fd(), self.root_dir().path());
        let disk = (vol.device.major, vol.device.minor);
        let node = Path::new("/").join(&vol.device.name);
        let of_disk = |m: &MountEntry| match vol.mode() {
            VolumeMode::Filesystem(_) => (m.major, m.minor) == disk,
            VolumeMode::Block => m.fs_type == "devtmpfs" && m.root == node,
        };
        let beneath_root = |m: &MountEntry| {
            m.mount_point
                .strip_prefix(root)
                .ok()
                .filter(|r| !r.as_os_str().is_empty())
                .map(Path::to_path_buf)
        };
        let mut left: Vec<(PathBuf, MountId)> = mountinfo::read()?
            .iter()
            .filter(|m| of_disk(m))
            .filter_map(|m| beneath_root(m).map(|r| (r, m.mount_id)))
            .collect();
        left.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (rel, id) in &left {
            let expect = Expect::Mount(*id, disk.0, disk.1);
            match unmount_tree(root_fd, root, rel, expect) {
                Ok(true) => {
                    warn!(self.log(), "a mount of the volume's disk was left beneath the root (moved or copied behind the agent's back); taken down";
                          "volume" => vol.id(), "path" => shown(&root.join(rel)));
                }
                Ok(false) => {}
                Err(e) => {
                    return Err(Error::StillMounted {
                        id: vol.id().to_string(),
                        at: shown(&root.join(rel)),
                        why: e.to_string(),
                    }
                    .into())
                }
            }
        }
        if let Some(m) = mountinfo::read()?
            .iter()
            .find(|m| of_disk(m) && beneath_root(m).is_some())
        {
            return Err(Error::StillMounted {
                id: vol.id().to_string(),
                at: shown(&m.mount_point),
                why: "it came back or could not be reached beneath the root".into(),
            }
            .into());
        }
        Ok(())
    }

    /// Takes down the agent's mount `expect` made at `rel` and removes the
    /// node it was made on. A mount moved away from `rel` behind the agent's
    /// back (its parent renamed, say, whether or not something now sits at
    /// `rel`, under any name, UTF-8 or not) is still the agent's own: it is
    /// found by its id and taken down where it is now, if that is beneath the
    /// root; moved outside the root, it is an error naming where it is.
    pub(crate) fn take_down(&self, rel: &Path, expect: Expect) -> Result<bool> {
        let (root_fd, root) = (self.root_dir().fd(), self.root_dir().path());
        match unmount_tree(root_fd, root, rel, expect) {
            Ok(was) => {
                if was {
                    remove_node(root_fd, rel);
                }
                Ok(was)
            }
            Err(e @ (MountError::Moved { .. } | MountError::Unsafe { .. })) => {
                if !matches!(expect, Expect::Mount(..)) {
                    return Err(e.into());
                }
                let table = mountinfo::read()?;
                let Some(now) = listed(&table, expect) else {
                    return Ok(false);
                };
                match now.mount_point.strip_prefix(root) {
                    Ok(moved) if moved != rel && !moved.as_os_str().is_empty() => {
                        warn!(self.log(), "mount moved behind the agent's back; taken down where it is now";
                              "was" => shown(&root.join(rel)), "now" => shown(&now.mount_point));
                        Ok(unmount_tree(root_fd, root, moved, expect)?)
                    }
                    Ok(_) => Err(e.into()),
                    Err(_) => Err(Error::MovedOutside {
                        was: shown(&root.join(rel)),
                        now: shown(&now.mount_point),
                    }
                    .into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Stops work in flight, refuses new volumes and binds, and unpublishes
    /// every volume. Returns how many were unpublished.
    pub fn shutdown(&self) -> u32 {
        self.stop_accepting();
        // Recorded as the agent stopping, before each unpublish would say
        // its volume was unpublished.
        self.close_freezes();
        let mut ids = self.slot_ids();
        let mut n = 0;
        while let Some(id) = ids.pop() {
            match self.unpublish(&id, &Cancel::never()) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    warn!(self.log(), "could not unpublish at shutdown"; "volume" => &id, "error" => %e)
                }
            }
        }
        n
    }
}

//! Taking a volume's mounts down, by identity: one mount the agent made
//! (followed where it was moved beneath the root), a volume's own mount
//! with what a filesystem or a block volume needs before and after, and
//! any mount of its disk still beneath the root. Unpublish takes a volume
//! down through here, and so does the end of a walk that failed; nothing
//! here touches the table's records or maps.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use slog::{warn, Logger};

use super::block;
use super::error::Error;
use super::kernel::Kernel;
use super::mounts::Mounts;
use super::volume::Volume;
use crate::error::Result;
use crate::luks2::mapping::Owner;
use crate::model::{MountId, VolumeMode};
use crate::mount::error::Error as MountError;
use crate::mount::unmount::{listed, Expect};
use crate::sys::mountinfo::{shown, MountEntry};

/// The mounts beneath the root, and where taking them down is said.
pub(crate) struct Takedown<'a, K> {
    pub(crate) mounts: Mounts<'a, K>,
    pub(crate) log: &'a Logger,
}

// By hand: a derive would ask K itself to be Copy.
impl<K> Clone for Takedown<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Takedown<'_, K> {}

impl<K: Kernel> Takedown<'_, K> {
    /// Takes `vol`'s own mount down once its binds are gone: a filesystem
    /// flushed first (while it is certainly the volume's own mount); a
    /// block volume's bind, then its device flushed and its read-only flag
    /// cleared if the agent set it, then its file.
    pub(crate) fn volume(&self, vol: &Volume) -> Result<()> {
        match vol.mode() {
            VolumeMode::Filesystem(_) => {
                if let Ok(fd) = self.mounts.open_mount(vol) {
                    self.mounts
                        .kernel
                        .sync_filesystem(fd.as_fd(), &vol.guest_path)?;
                }
                self.take_down(&vol.rel(), vol.mount_identity())?;
            }
            VolumeMode::Block => {
                self.take_down(&vol.rel(), vol.mount_identity())?;
                block::release(vol, self.mounts.kernel, self.log)?;
                self.mounts
                    .kernel
                    .remove_node(self.mounts.root.fd(), &vol.rel());
            }
        }
        Ok(())
    }

    /// Removes the mapping `owner` (the agent) names volume `id`'s when no
    /// volume has it: left by a publish that failed while something held
    /// it. One still held is an error saying so. Another agent's mapping
    /// of the same id, or an untagged one, is never its to remove.
    pub(crate) fn leftover_mapping(&self, id: &str, owner: &Owner) -> Result<()> {
        let kernel = self.mounts.kernel;
        let name = owner.name_for(id);
        // No device-mapper, or no list: no mapping of the agent's either.
        let Ok(all) = kernel.agents_mappings() else {
            return Ok(());
        };
        if !all.contains(&name) {
            return Ok(());
        }
        match kernel.close_mapping(&name) {
            Ok(_) => {
                warn!(self.log, "a mapping left by a failed publish of the volume; removed"; "volume" => id, "mapping" => &name);
                Ok(())
            }
            Err(e) => Err(Error::MappingHeld {
                id: id.to_string(),
                mapping: name,
                why: e.to_string(),
            }
            .into()),
        }
    }

    /// Removes an encrypted volume's mapping once nothing of it is
    /// mounted: the disk is then ciphertext only, and its key forgotten.
    pub(crate) fn unmap(&self, vol: &Volume) -> Result<()> {
        let Some(enc) = &vol.encrypted else {
            return Ok(());
        };
        match self.mounts.kernel.close_mapping(&enc.mapping.name) {
            Ok(_) => Ok(()),
            Err(e) => Err(Error::MappingHeld {
                id: vol.id().to_string(),
                mapping: enc.mapping.name.clone(),
                why: e.to_string(),
            }
            .into()),
        }
    }

    /// Takes down every mount of `vol`'s disk still beneath the root once
    /// the agent's own are down: its filesystem, or a bind of its node (a
    /// devtmpfs mount of the node's name, checked by its device number
    /// before it comes off). They are binds moved or copied behind the
    /// agent's back, which recovery would take down too; leaving one would
    /// let the host detach a disk that is still mounted. One that cannot be
    /// taken down is an error naming it.
    pub(crate) fn leftovers(&self, vol: &Volume) -> Result<()> {
        let (root_fd, root) = (self.mounts.root.fd(), self.mounts.root.path());
        let kernel = self.mounts.kernel;
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
        let mut left: Vec<(PathBuf, MountId)> = kernel
            .mountinfo()?
            .iter()
            .filter(|m| of_disk(m))
            .filter_map(|m| beneath_root(m).map(|r| (r, m.mount_id)))
            .collect();
        left.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (rel, id) in &left {
            let expect = Expect::Mount(*id, disk.0, disk.1);
            match kernel.unmount_tree(root_fd, root, rel, expect) {
                Ok(true) => {
                    warn!(self.log, "a mount of the volume's disk was left beneath the root (moved or copied behind the agent's back); taken down";
                          "volume" => vol.id(), "path" => shown(&root.join(rel)));
                }
                Ok(false) => {}
                Err(e) => {
                    return Err(Error::StillMounted {
                        id: vol.id().to_string(),
                        at: root.join(rel),
                        why: e.to_string(),
                    }
                    .into())
                }
            }
        }
        if let Some(m) = kernel
            .mountinfo()?
            .iter()
            .find(|m| of_disk(m) && beneath_root(m).is_some())
        {
            return Err(Error::StillMounted {
                id: vol.id().to_string(),
                at: m.mount_point.clone(),
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
        let (root_fd, root) = (self.mounts.root.fd(), self.mounts.root.path());
        let kernel = self.mounts.kernel;
        match kernel.unmount_tree(root_fd, root, rel, expect) {
            Ok(was) => {
                if was {
                    kernel.remove_node(root_fd, rel);
                }
                Ok(was)
            }
            Err(e @ (MountError::Moved { .. } | MountError::Unsafe { .. })) => {
                if !matches!(expect, Expect::Mount(..)) {
                    return Err(e.into());
                }
                let table = kernel.mountinfo()?;
                let Some(now) = listed(&table, expect) else {
                    return Ok(false);
                };
                match now.mount_point.strip_prefix(root) {
                    Ok(moved) if moved != rel && !moved.as_os_str().is_empty() => {
                        warn!(self.log, "mount moved behind the agent's back; taken down where it is now";
                              "was" => shown(&root.join(rel)), "now" => shown(&now.mount_point));
                        Ok(kernel.unmount_tree(root_fd, root, moved, expect)?)
                    }
                    Ok(_) => Err(e.into()),
                    Err(_) => Err(Error::MovedOutside {
                        was: root.join(rel),
                        now: now.mount_point.clone(),
                    }
                    .into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }
}

//! The steps a publish shares between a filesystem and a block volume
//! (`publish`), and the one check of "is this our mount" that every
//! operation on a published volume makes.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::{FileType, OFlags};
use rustix::io::Errno;

use super::error::Error;
use super::rollback::{Rollback, Undo};
use super::table::Volumes;
use super::volume::Volume;
use crate::error::Result;
use crate::model::{MountId, VolumeMode};
use crate::sys::beneath::{self, Leaf};
use crate::sys::error::SysError;

impl Volumes {
    /// Makes the guest path `rel` beneath the root, pushing the removal of
    /// what it made: a directory of the agent's for a filesystem, an empty
    /// file for a block volume. Refuses a symlink, anything else the agent
    /// would not make there, and a mount point.
    pub(crate) fn guest_node(
        &self,
        rel: &Path,
        mode: VolumeMode,
        undo: &mut Rollback<'_>,
    ) -> Result<OwnedFd> {
        let (leaf, what) = match mode {
            VolumeMode::Filesystem(_) => (Leaf::Dir(0o750), "a plain directory"),
            VolumeMode::Block => (Leaf::File(0o600), "an empty file"),
        };
        let guest_path = self.root_dir().join(rel);
        let mut created = Vec::new();
        let made = beneath::make_path(self.root_dir().fd(), rel, 0o750, leaf, &mut created);
        undo.push(Undo::Nodes(created));
        let node = match made {
            Ok(fd) => fd,
            Err(Errno::LOOP | Errno::XDEV | Errno::NOTDIR | Errno::ISDIR) => {
                return Err(Error::GuestPathUnsafe {
                    path: guest_path.display().to_string(),
                    what,
                }
                .into())
            }
            Err(e) => {
                let call = if matches!(leaf, Leaf::Dir(_)) {
                    "mkdir"
                } else {
                    "open"
                };
                return Err(SysError::new(call, guest_path.display(), e).into());
            }
        };
        let here = beneath::mount_point(node.as_fd())
            .map_err(|e| SysError::new("statx", guest_path.display(), e))?;
        if here.is_root {
            return Err(Error::GuestPathBusy {
                path: guest_path.display().to_string(),
            }
            .into());
        }
        if mode == VolumeMode::Block {
            let empty = rustix::fs::fstat(&node).is_ok_and(|st| st.st_size == 0);
            if here.kind != FileType::RegularFile || !empty {
                return Err(Error::GuestPathUnsafe {
                    path: guest_path.display().to_string(),
                    what,
                }
                .into());
            }
        }
        Ok(node)
    }

    /// The mount at `vol`'s guest path, if it is the volume's own: resolved
    /// beneath the root with no symlinks, a mount root of the volume's disk
    /// (its filesystem, or a bind of its node), with the recorded mount id
    /// where one is recorded. An O_PATH fd of it and its id; None when
    /// nothing of the volume's is there.
    pub(crate) fn own_mount(&self, vol: &Volume) -> Result<Option<(OwnedFd, MountId)>> {
        let fd = match beneath::open_with(
            self.root_dir().fd(),
            &vol.rel(),
            OFlags::PATH | vol.guest_path_kind(),
            beneath::strict(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT | Errno::LOOP | Errno::XDEV | Errno::NOTDIR) => return Ok(None),
            Err(e) => return Err(SysError::new("openat2", vol.guest_path.display(), e).into()),
        };
        let mp = beneath::mount_point(fd.as_fd())
            .map_err(|e| SysError::new("statx", vol.guest_path.display(), e))?;
        Ok(vol.is_own_mount(&mp).then_some((fd, mp.mount_id)))
    }

    /// An fd of the volume's mount root, checked to be its own
    /// (`own_mount`); `MountGone` when it is not there.
    pub(crate) fn open_mount(&self, vol: &Volume) -> Result<OwnedFd> {
        match self.own_mount(vol)? {
            Some((fd, _)) => Ok(fd),
            None => Err(Error::MountGone {
                id: vol.id().to_string(),
                path: vol.guest_path.display().to_string(),
            }
            .into()),
        }
    }
}

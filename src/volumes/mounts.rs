//! The table's view of the mounts beneath its root: the guest node a
//! publish mounts on, and the one check of "is this our mount" that every
//! operation on a published volume makes, by identity (its disk, its
//! recorded mount id), never by a path's spelling.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::{FileType, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::error::Error;
use super::idmap;
use super::kernel::Kernel;
use super::volume::{Bind, Volume};
use crate::error::Result;
use crate::model::{MountId, VolumeMode};
use crate::mount;
use crate::sys::beneath::{self, Created, Leaf, Root};
use crate::sys::error::SysError;
use crate::sys::mountinfo;

/// What an openat2 failure on a path the agent resolves means.
pub(crate) fn unsafe_or_sys(e: Errno, call: &'static str, path: &Path) -> crate::error::Error {
    match e {
        Errno::LOOP | Errno::XDEV | Errno::NOTDIR => mount::error::Error::Unsafe {
            path: path.to_path_buf(),
        }
        .into(),
        _ => SysError::new(call, path.display(), e).into(),
    }
}

/// The agent's root, where every mount the table makes or checks is
/// resolved beneath, and the kernel that makes and shows them.
pub(crate) struct Mounts<'a, K> {
    pub(crate) root: &'a Root,
    pub(crate) kernel: &'a K,
}

// By hand: a derive would ask K itself to be Copy.
impl<K> Clone for Mounts<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Mounts<'_, K> {}

impl<K: Kernel> Mounts<'_, K> {
    /// Makes the guest path `rel` beneath the root: a directory of the
    /// agent's for a filesystem, an empty file for a block volume. Refuses
    /// a symlink, anything else the agent would not make there, and a
    /// mount point. The nodes it made come back either way, for the
    /// caller's undo list.
    pub(crate) fn guest_node(
        &self,
        rel: &Path,
        mode: VolumeMode,
    ) -> (Vec<Created>, Result<OwnedFd>) {
        let mut created = Vec::new();
        let node = self.make_guest_node(rel, mode, &mut created);
        (created, node)
    }

    fn make_guest_node(
        &self,
        rel: &Path,
        mode: VolumeMode,
        created: &mut Vec<Created>,
    ) -> Result<OwnedFd> {
        let (leaf, what) = match mode {
            VolumeMode::Filesystem(_) => (Leaf::Dir(0o750), "a plain directory"),
            VolumeMode::Block => (Leaf::File(0o600), "an empty file"),
        };
        let guest_path = self.root.join(rel);
        let node = match beneath::make_path(self.root.fd(), rel, 0o750, leaf, created) {
            Ok(fd) => fd,
            Err(Errno::LOOP | Errno::XDEV | Errno::NOTDIR | Errno::ISDIR) => {
                return Err(Error::GuestPathUnsafe {
                    path: guest_path.to_path_buf(),
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
        let here = self
            .kernel
            .mount_point(node.as_fd())
            .map_err(|e| SysError::new("statx", guest_path.display(), e))?;
        if here.is_root {
            return Err(Error::GuestPathBusy {
                path: guest_path.to_path_buf(),
            }
            .into());
        }
        if mode == VolumeMode::Block {
            let empty = rustix::fs::fstat(&node).is_ok_and(|st| st.st_size == 0);
            if here.kind != FileType::RegularFile || !empty {
                return Err(Error::GuestPathUnsafe {
                    path: guest_path.to_path_buf(),
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
            self.root.fd(),
            &vol.rel(),
            OFlags::PATH | vol.guest_path_kind(),
            beneath::strict(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT | Errno::LOOP | Errno::XDEV | Errno::NOTDIR) => return Ok(None),
            Err(e) => return Err(SysError::new("openat2", vol.guest_path.display(), e).into()),
        };
        let mp = self
            .kernel
            .mount_point(fd.as_fd())
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
                path: vol.guest_path.clone(),
            }
            .into()),
        }
    }

    /// Whether bind `b` of `vol` is still mounted, as the agent made it.
    pub(crate) fn bind_is_live(&self, vol: &Volume, b: &Bind) -> bool {
        let Ok((parent, name)) = beneath::open_parent(self.root.fd(), &b.rel) else {
            return false;
        };
        let Ok(mp) = self.kernel.mount_point_at(parent.as_fd(), &name) else {
            return false;
        };
        // A mount id freed is the next mount's: a bind made there behind
        // the agent's back may have it. An unreadable table tells nothing.
        vol.is_own_bind(b, &mp)
            && self
                .kernel
                .mountinfo()
                .map_or(true, |t| self.idmapped_as_recorded(&t, mp.mount_id, vol, b))
    }

    /// Whether mount `id` (of `table`) at bind `b`'s target is idmapped as
    /// `b` records (semantics.md §7): mountinfo says `idmapped` exactly
    /// when `b` has mappings, and then the owner the bind shows for its
    /// root is the mappings' of the owner on disk (seen through the
    /// volume's own mount). Where its root tells nothing (an owner the
    /// mappings leave out, the subpath naming another file now), the flag
    /// is the check.
    pub(crate) fn idmapped_as_recorded(
        &self,
        table: &[mountinfo::MountEntry],
        id: MountId,
        vol: &Volume,
        b: &Bind,
    ) -> bool {
        let idmapped = mountinfo::by_id(table, id).is_some_and(|e| e.idmapped());
        let Some(map) = b.idmap.as_ref().filter(|_| idmapped) else {
            return idmapped == b.idmap.is_some();
        };
        let how = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
        let stat = |fd: std::result::Result<OwnedFd, Errno>| {
            fd.and_then(|fd| self.kernel.stat(fd.as_fd())).ok()
        };
        let shown = stat(beneath::open_path(self.root.fd(), &b.rel));
        let on_disk = stat(
            beneath::open_path(self.root.fd(), &vol.rel())
                .and_then(|v| beneath::open_with(v.as_fd(), &b.subpath, OFlags::PATH, how)),
        );
        let (Some(shown), Some(disk)) = (shown, on_disk) else {
            return true;
        };
        if (shown.st_dev, shown.st_ino) != (disk.st_dev, disk.st_ino) {
            return true;
        }
        let agrees =
            |ranges, on_disk, seen| idmap::shown(ranges, on_disk).is_none_or(|i| i == seen);
        agrees(&map.uids, disk.st_uid, shown.st_uid) && agrees(&map.gids, disk.st_gid, shown.st_gid)
    }

    /// What mount `id` is, in words ("/dev/vdb (ext4)"), for a refusal.
    pub(crate) fn describe(&self, id: MountId) -> Result<Option<String>> {
        let table = self.kernel.mountinfo()?;
        Ok(mountinfo::by_id(&table, id).map(|m| format!("{} ({})", m.source, m.fs_type)))
    }
}

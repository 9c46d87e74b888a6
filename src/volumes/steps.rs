//! The steps a filesystem publish (`publish`) and a block publish
//! (`block`) share, so that both read the same: the guest path made (and
//! its undo pushed), and the new mount checked to be the one just made.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::OFlags;
use rustix::io::Errno;

use super::error::Error;
use super::rollback::{Rollback, Undo};
use super::table::{unsafe_or_sys, Volumes};
use super::volume::Volume;
use crate::error::Result;
use crate::model::MountId;
use crate::mount;
use crate::sys::beneath::{self, Leaf};
use crate::sys::error::SysError;

impl Volumes {
    /// Makes the guest path `rel` beneath the root (`leaf`: a directory, or
    /// an empty file), refusing a symlink or anything else the agent would
    /// not make there (`what`), and pushes the removal of what it made.
    pub(crate) fn guest_node(
        &self,
        rel: &Path,
        leaf: Leaf,
        what: &'static str,
        undo: &mut Rollback<'_>,
    ) -> Result<OwnedFd> {
        let guest_path = self.root.join(rel);
        let mut created = Vec::new();
        let made = beneath::make_path(self.root.fd(), rel, 0o750, leaf, &mut created);
        undo.push(Undo::Nodes(created));
        match made {
            Ok(fd) => Ok(fd),
            Err(Errno::LOOP | Errno::XDEV | Errno::NOTDIR | Errno::ISDIR) => {
                Err(Error::GuestPathUnsafe {
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
                Err(SysError::new(call, guest_path.display(), e).into())
            }
        }
    }

    /// The mount just made at `vol`'s guest path, checked to be a mount
    /// root of its disk (its filesystem, or a bind of its node): an O_PATH
    /// fd of it and its id. Anything else there is `Moved` (the path
    /// changed during the publish).
    pub(crate) fn mounted_here(&self, vol: &Volume) -> Result<(OwnedFd, MountId)> {
        let fd = beneath::open_with(
            self.root.fd(),
            &vol.rel(),
            OFlags::PATH | vol.guest_path_kind(),
            beneath::strict(),
        )
        .map_err(|e| unsafe_or_sys(e, "openat2", &vol.guest_path))?;
        let mp = beneath::mount_point(fd.as_fd())
            .map_err(|e| SysError::new("statx", vol.guest_path.display(), e))?;
        if !mp.is_root || !vol.of_disk(&mp) {
            return Err(mount::error::Error::Moved {
                path: vol.guest_path.display().to_string(),
            }
            .into());
        }
        Ok((fd, mp.mount_id))
    }
}

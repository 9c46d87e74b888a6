//! Binds of a published volume (semantics.md §6): the volume or a subpath
//! at a target beneath the root, the target reserved first so two binds
//! never share, nest in or cover each other; and Unmount of the agent's own
//! binds, recognised by mount id. A repeat of a live bind answers
//! `already_mounted`; a bind gone behind the agent's back is made again.
//! An idmapped bind is one more parameter of a bind: a repeat must ask the
//! same mappings.

use std::os::fd::AsFd;
use std::path::Path;

use rustix::io::Errno;
use slog::warn;

use super::block::check_bind;
use super::claims::Claims;
use super::error::Error;
use super::freeze::not_frozen;
use super::idmap;
use super::kernel::Kernel;
use super::lease::Freezer;
use super::mounts::unsafe_or_sys;
use super::request::{BindOutcome, BindRequest};
use super::rollback::{Rollback, Undo};
use super::state::Store;
use super::takedown::Takedown;
use super::targets::Targets;
use super::volume::{Bind, Volume};
use crate::error::Result;
use crate::model::VolumeMode;
use crate::mount;
use crate::mount::bind::BindSpec;
use crate::mount::unmount::Expect;
use crate::sys::beneath;
use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;

/// The parts a bind or an unmount works with: the mounts (made, checked,
/// taken down), the volume's record, the targets reserved, the devices
/// claimed (a target must not lie on a volume) and the freezes.
pub(crate) struct Binder<'a, K: Kernel> {
    pub(crate) takedown: Takedown<'a, K>,
    pub(crate) store: &'a Store,
    pub(crate) targets: &'a Targets,
    pub(crate) claims: &'a Claims,
    pub(crate) leases: &'a Freezer<K::Hold>,
}

impl<K: Kernel> Binder<'_, K> {
    /// Binds `vol` (or a subpath) at `target` (canonical, validated; `rel`
    /// beneath the root) (semantics.md §6). A repeat of a live bind answers
    /// `already_mounted`.
    pub(crate) fn bind(
        &self,
        vol: &mut Volume,
        req: &BindRequest,
        target: &Path,
        rel: &Path,
    ) -> Result<BindOutcome> {
        vol.not_publishing()?;
        not_frozen(self.leases, vol.id())?;
        if vol.mode() == VolumeMode::Block {
            check_bind(vol, req)?;
        }
        if let Some(i) = vol.binds.iter().position(|b| b.rel == rel) {
            let b = &vol.binds[i];
            if b.subpath != req.subpath
                || b.read_only != req.read_only
                || b.rro != req.recursive_read_only
                || b.idmap != req.idmap
            {
                let other = if b.idmap == req.idmap {
                    "other parameters"
                } else {
                    "other uid and gid mappings (or none)"
                };
                return Err(Error::TargetTaken {
                    target: target.to_path_buf(),
                    what: format!("a bind of volume {} with {other}", vol.id()),
                }
                .into());
            }
            if self.takedown.mounts.bind_is_live(vol, b) {
                return Ok(BindOutcome {
                    recursive_read_only_applied: b.rro_applied,
                    already_mounted: true,
                });
            }
            // Unmounted behind the agent's back: forget it and bind again.
            // The record is rewritten with the new bind below; if that
            // bind fails, a record still listing the old one lists a
            // bind that is gone, which the next start drops.
            warn!(self.takedown.log, "bind was gone; binding again"; "volume" => vol.id(), "target" => shown(target));
            self.targets.drop_bind(vol, i);
        }
        self.targets.room_for_one_more(vol)?;
        idmap::room_for(vol, req.idmap.as_ref())?;
        self.bind_new(vol, req, target, rel)
    }

    /// Refuses a target whose nearest existing node is already a mount, or
    /// lies on a volume's filesystem (a bind there would write into it).
    fn check_target(&self, rel: &Path, target: &Path) -> Result<()> {
        let root = self.takedown.mounts.root;
        let mut at = Some(rel);
        while let Some(p) = at {
            let found = if p.as_os_str().is_empty() {
                Ok(rustix::io::fcntl_dupfd_cloexec(root.fd(), 0)
                    .map_err(|e| SysError::new("dup", root.path().display(), e))?)
            } else {
                beneath::open_path(root.fd(), p)
            };
            match found {
                Ok(fd) => {
                    let mp = self
                        .takedown
                        .mounts
                        .kernel
                        .mount_point(fd.as_fd())
                        .map_err(|e| SysError::new("statx", root.join(p).display(), e))?;
                    if p == rel && mp.is_root {
                        let what = self.takedown.mounts.describe(mp.mount_id)?;
                        return Err(Error::TargetTaken {
                            target: target.to_path_buf(),
                            what: what.map_or_else(
                                || "a mount point".to_string(),
                                |m| format!("a mount of {m}"),
                            ),
                        }
                        .into());
                    }
                    if let Some(volume) = self.claims.holder_of(mp.dev) {
                        return Err(Error::TargetInVolume {
                            target: target.to_path_buf(),
                            volume,
                        }
                        .into());
                    }
                    return Ok(());
                }
                Err(Errno::NOENT) => at = p.parent(),
                Err(e) => return Err(unsafe_or_sys(e, "openat2", &root.join(p))),
            }
        }
        Ok(())
    }

    /// A new bind of `vol` at `target` (canonical; `rel` beneath the root),
    /// as the request asks: the target reserved and checked, the bind made,
    /// then recorded; a bind whose record cannot be written is taken down
    /// again (`Rollback`).
    fn bind_new(
        &self,
        vol: &mut Volume,
        req: &BindRequest,
        target: &Path,
        rel: &Path,
    ) -> Result<BindOutcome> {
        let mounts = self.takedown.mounts;
        let reservation = self
            .targets
            .reserve(rel, target, vol.id(), mounts.root.path())?;
        self.check_target(rel, target)?;
        let source = mounts.open_mount(vol)?;
        let out = mounts.kernel.bind(&BindSpec {
            source_root: source.as_fd(),
            source_path: &vol.guest_path,
            subpath: &req.subpath,
            target_base: mounts.root.fd(),
            target_rel: rel,
            target_path: target,
            read_only: req.read_only,
            recursive_read_only: req.recursive_read_only,
            idmap: req.idmap.as_ref(),
        })?;
        drop(source);
        let device = vol.device.clone();
        let mut undo = Rollback::new(
            mounts,
            self.store,
            self.takedown.log,
            "bind",
            &vol.spec.volume_id,
            &device,
        );
        undo.push(Undo::Nodes(out.created));
        undo.push(Undo::Mount {
            rel: rel.to_path_buf(),
            expect: Expect::Mount(out.mount_id, device.major, device.minor),
        });
        vol.binds.push(Bind {
            target: mounts.root.join(rel),
            rel: rel.to_path_buf(),
            subpath: req.subpath.clone(),
            read_only: req.read_only,
            rro: req.recursive_read_only,
            rro_applied: out.recursive_read_only_applied,
            mount_id: Some(out.mount_id),
            idmap: req.idmap.clone(),
        });
        if let Err(e) = self.store.save(vol) {
            vol.binds.pop();
            return Err(e);
        }
        undo.done();
        reservation.keep();
        Ok(BindOutcome {
            recursive_read_only_applied: out.recursive_read_only_applied,
            already_mounted: false,
        })
    }

    /// Takes down `vol`'s bind at `target` (canonical, validated; `rel`
    /// beneath the root): whether it was mounted; None when `vol` has no
    /// bind there (any more).
    pub(crate) fn unbind(
        &self,
        vol: &mut Volume,
        rel: &Path,
        target: &Path,
    ) -> Result<Option<bool>> {
        let Some(i) = vol.binds.iter().position(|b| b.rel == rel) else {
            return Ok(None);
        };
        let was = self
            .takedown
            .take_down(rel, vol.binds[i].mount_identity(&vol.device))?;
        self.targets.drop_bind(vol, i);
        // The bind is down, as asked, and the table says so. A record that
        // cannot be rewritten now (a full state filesystem) still lists it:
        // a bind that is gone, which the next write of this record or the
        // next start drops.
        if let Err(e) = self.store.save(vol) {
            warn!(self.takedown.log, "bind taken down, but its volume's record could not be rewritten; it is dropped from the record later";
                  "volume" => vol.id(), "target" => shown(target), "error" => %e);
        }
        Ok(Some(was))
    }

    /// An unmount of a target no bind of the agent's holds: says whether
    /// something is mounted there and touches nothing; a mount there is
    /// refused as not the agent's.
    pub(crate) fn not_ours(&self, rel: &Path, target: &Path) -> Result<bool> {
        let mounts = self.takedown.mounts;
        let (parent, name) = match beneath::open_parent(mounts.root.fd(), rel) {
            Ok(p) => p,
            Err(Errno::NOENT | Errno::NOTDIR) => return Ok(false),
            Err(e) => return Err(unsafe_or_sys(e, "openat2", target)),
        };
        match mounts.kernel.mount_point_at(parent.as_fd(), &name) {
            Ok(mp) if mp.is_root => {
                let what = mounts
                    .describe(mp.mount_id)?
                    .unwrap_or_else(|| format!("mount {}", mp.mount_id));
                Err(mount::error::Error::NotOurs {
                    path: target.to_path_buf(),
                    what,
                }
                .into())
            }
            Ok(_) | Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(SysError::new("statx", target.display(), e).into()),
        }
    }
}

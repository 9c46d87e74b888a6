//! Binds of a published volume (semantics.md §6): the volume or a subpath
//! at a target beneath the root, the target reserved first so two binds
//! never share, nest in or cover each other; and Unmount of the agent's own
//! binds, recognised by mount id. A repeat of a live bind answers
//! `already_mounted`; a bind gone behind the agent's back is made again.

use std::os::fd::AsFd;
use std::path::Path;

use rustix::io::Errno;
use slog::warn;

use super::block::check_bind;
use super::error::Error;
use super::request::{BindOutcome, BindRequest};
use super::rollback::{Rollback, Undo};
use super::table::{unsafe_or_sys, Volumes};
use super::volume::{Bind, Volume};
use crate::cancel::Cancel;
use crate::error::Result;
use crate::model::VolumeMode;
use crate::mount;
use crate::mount::bind::BindSpec;
use crate::mount::unmount::Expect;
use crate::sys::beneath;
use crate::sys::error::SysError;
use crate::sys::mountinfo::{self, shown};

impl Volumes {
    /// Whether bind `b` of `vol` is still mounted, as the agent made it.
    fn bind_is_live(&self, vol: &Volume, b: &Bind) -> bool {
        let Ok((parent, name)) = beneath::open_parent(self.root_dir().fd(), &b.rel) else {
            return false;
        };
        beneath::mount_point_at(parent.as_fd(), &name).is_ok_and(|mp| vol.is_own_bind(b, &mp))
    }

    /// Refuses a target whose nearest existing node is already a mount, or
    /// lies on a volume's filesystem (a bind there would write into it).
    fn check_target(&self, rel: &Path, target: &Path) -> Result<()> {
        let mut at = Some(rel);
        while let Some(p) = at {
            let found = if p.as_os_str().is_empty() {
                Ok(rustix::io::fcntl_dupfd_cloexec(self.root_dir().fd(), 0)
                    .map_err(|e| SysError::new("dup", self.root_dir().path().display(), e))?)
            } else {
                beneath::open_path(self.root_dir().fd(), p)
            };
            match found {
                Ok(fd) => {
                    let mp = beneath::mount_point(fd.as_fd()).map_err(|e| {
                        SysError::new("statx", self.root_dir().join(p).display(), e)
                    })?;
                    if p == rel && mp.is_root {
                        let table = mountinfo::read()?;
                        let what = mountinfo::by_id(&table, mp.mount_id)
                            .map(|m| format!("a mount of {} ({})", m.source, m.fs_type))
                            .unwrap_or_else(|| "a mount point".to_string());
                        return Err(Error::TargetTaken {
                            target: target.display().to_string(),
                            what,
                        }
                        .into());
                    }
                    if let Some(volume) = self.index().holder_of(mp.dev) {
                        return Err(Error::TargetInVolume {
                            target: target.display().to_string(),
                            volume,
                        }
                        .into());
                    }
                    return Ok(());
                }
                Err(Errno::NOENT) => at = p.parent(),
                Err(e) => return Err(unsafe_or_sys(e, "openat2", &self.root_dir().join(p))),
            }
        }
        Ok(())
    }

    /// Binds a volume (or a subpath) at a target beneath the root
    /// (semantics.md §6). A repeat of a live bind answers `already_mounted`.
    pub fn bind(&self, req: &BindRequest, cancel: &Cancel) -> Result<BindOutcome> {
        self.accepting()?;
        let cancel = &self.stop_with(cancel);
        let target = self.target_of(&req.target)?;
        let rel = self.rel_of(&target)?.to_path_buf();
        self.with_volume(&req.volume_id, cancel, |vol| {
            vol.not_publishing()?;
            self.not_frozen(&req.volume_id)?;
            if vol.mode() == VolumeMode::Block {
                check_bind(vol, req)?;
            }
            if let Some(i) = vol.binds.iter().position(|b| b.rel == rel) {
                let b = &vol.binds[i];
                if b.subpath != req.subpath
                    || b.read_only != req.read_only
                    || b.rro != req.recursive_read_only
                {
                    return Err(Error::TargetTaken {
                        target: target.display().to_string(),
                        what: format!("a bind of volume {} with other parameters", vol.id()),
                    }
                    .into());
                }
                if self.bind_is_live(vol, b) {
                    return Ok(BindOutcome {
                        recursive_read_only_applied: b.rro_applied,
                        already_mounted: true,
                    });
                }
                // Unmounted behind the agent's back: forget it and bind again.
                // The record is rewritten with the new bind below; if that
                // bind fails, a record still listing the old one lists a
                // bind that is gone, which the next start drops.
                warn!(self.log(), "bind was gone; binding again"; "volume" => vol.id(), "target" => shown(&target));
                self.index().drop_bind(vol, i);
            }
            let max = self.max_binds_cell().load(std::sync::atomic::Ordering::Relaxed);
            if vol.binds.len() >= max {
                return Err(Error::TooManyBinds {
                    id: vol.id().to_string(),
                    max,
                }
                .into());
            }
            self.bind_new(vol, req, &target, &rel)
        })
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
        let reservation = self
            .index()
            .reserve(rel, target, vol.id(), self.root_dir().path())?;
        self.check_target(rel, target)?;
        let source = self.open_mount(vol)?;
        let out = mount::bind::bind(&BindSpec {
            source_root: source.as_fd(),
            source_path: &vol.guest_path,
            subpath: &req.subpath,
            target_base: self.root_dir().fd(),
            target_rel: rel,
            target_path: target,
            read_only: req.read_only,
            recursive_read_only: req.recursive_read_only,
        })?;
        drop(source);
        let device = vol.device.clone();
        let mut undo = Rollback::new(self, "bind", &vol.spec.volume_id, &device);
        undo.push(Undo::Nodes(out.created));
        undo.push(Undo::Mount {
            rel: rel.to_path_buf(),
            expect: Expect::Mount(out.mount_id, device.major, device.minor),
        });
        vol.binds.push(Bind {
            target: self.root_dir().join(rel),
            rel: rel.to_path_buf(),
            subpath: req.subpath.clone(),
            read_only: req.read_only,
            rro: req.recursive_read_only,
            rro_applied: out.recursive_read_only_applied,
            mount_id: Some(out.mount_id),
        });
        if let Err(e) = self.store().save(vol) {
            vol.binds.pop();
            return Err(e);
        }
        undo.done();
        self.index().bound(vol, reservation);
        Ok(BindOutcome {
            recursive_read_only_applied: out.recursive_read_only_applied,
            already_mounted: false,
        })
    }

    /// Takes down a bind the agent made at `target` (canonical, validated).
    /// False when nothing is mounted there; a mount the agent did not make is
    /// refused and left alone.
    pub fn unmount(&self, target: &Path, cancel: &Cancel) -> Result<bool> {
        let target = self.target_of(target)?;
        let rel = self.rel_of(&target)?.to_path_buf();
        if let Some(id) = self.index().owner_of(&rel) {
            let r = self.with_volume(&id, cancel, |vol| {
                let Some(i) = vol.binds.iter().position(|b| b.rel == rel) else {
                    return Ok(None);
                };
                let was = self.take_down(&rel, vol.binds[i].mount_identity(&vol.device))?;
                self.index().drop_bind(vol, i);
                // The bind is down, as asked, and the table says so. A record
                // that cannot be rewritten now (a full state filesystem) still
                // lists it: a bind that is gone, which the next write of this
                // record or the next start drops.
                if let Err(e) = self.store().save(vol) {
                    warn!(self.log(), "bind taken down, but its volume's record could not be rewritten; it is dropped from the record later";
                          "volume" => vol.id(), "target" => shown(&target), "error" => %e);
                }
                Ok(Some(was))
            });
            match r {
                Ok(Some(was)) => return Ok(was),
                Ok(None) => {}
                Err(crate::error::Error::Volume(Error::NotPublished(_))) => {}
                Err(e) => return Err(e),
            }
        }
        // Not a bind of the agent's: say whether something is there, touch nothing.
        let (parent, name) = match beneath::open_parent(self.root_dir().fd(), &rel) {
            Ok(p) => p,
            Err(Errno::NOENT | Errno::NOTDIR) => return Ok(false),
            Err(e) => return Err(unsafe_or_sys(e, "openat2", &target)),
        };
        match beneath::mount_point_at(parent.as_fd(), &name) {
            Ok(mp) if mp.is_root => {
                let table = mountinfo::read()?;
                let what = mountinfo::by_id(&table, mp.mount_id)
                    .map(|m| format!("{} ({})", m.source, m.fs_type))
                    .unwrap_or_else(|| format!("mount {}", mp.mount_id));
                Err(mount::error::Error::NotOurs {
                    path: target.display().to_string(),
                    what,
                }
                .into())
            }
            Ok(_) | Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(SysError::new("statx", target.display(), e).into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::code::Code;
    use crate::model::RecursiveReadOnly;
    use crate::volumes::testkit::{publish_loop, table};

    /// A target is validated by the table, beneath its root, whatever spelling
    /// it comes in: outside the root, relative, or not UTF-8 (which no wire
    /// request can carry) is INVALID_ARGUMENT, and nothing is made.
    #[test]
    fn targets_outside_the_root_or_not_utf8_are_refused() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let v = table(dir.path());
        let not_utf8 = v.root().join(std::ffi::OsStr::from_bytes(b"pods/\xff"));
        for t in [
            PathBuf::from("/etc/x"),
            PathBuf::from("relative"),
            not_utf8.clone(),
        ] {
            let e = v.unmount(&t, &Cancel::never()).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{}: {e}", t.display());
            let b = BindRequest {
                volume_id: "v".into(),
                subpath: PathBuf::new(),
                target: t.clone(),
                read_only: false,
                recursive_read_only: RecursiveReadOnly::Disabled,
            };
            let e = v.bind(&b, &Cancel::never()).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{}: {e}", t.display());
        }
        assert!(!not_utf8.parent().unwrap().exists(), "nothing is made");
    }

    #[test]
    fn a_bind_whose_record_cannot_be_written_leaves_nothing() {
        if !crate::testutil::root_or_skip("a_bind_whose_record_cannot_be_written_leaves_nothing") {
            return;
        }
        let disk = crate::testutil::LoopDisk::new(32, Some("ext4"));
        let dir = tempfile::tempdir().unwrap();
        let v = table(dir.path());
        publish_loop(&v, "rec", &disk);
        // A directory where the record's temp file goes: the next save fails.
        let tmp = v.root().join("state/rec.vol.tmp");
        std::fs::create_dir(&tmp).unwrap();
        let target = v.root().join("pods/p/data");
        let req = BindRequest {
            volume_id: "rec".into(),
            subpath: PathBuf::new(),
            target: target.clone(),
            read_only: false,
            recursive_read_only: RecursiveReadOnly::Disabled,
        };
        assert!(v.bind(&req, &Cancel::never()).is_err());
        assert!(
            !v.root().join("pods").exists(),
            "the directories the bind created are gone"
        );
        let table = mountinfo::read().unwrap();
        assert!(mountinfo::mounts_under(&table, &v.root().join("pods")).is_empty());
        assert!(v.list()[0].bind_targets.is_empty());
        // The target is free again: once the record can be written, the bind works.
        std::fs::remove_dir(&tmp).unwrap();
        let out = v.bind(&req, &Cancel::never()).unwrap();
        assert!(!out.already_mounted);
        // Binds per volume are bounded (MAX_BINDS; 2 here).
        v.max_binds_cell()
            .store(2, std::sync::atomic::Ordering::Relaxed);
        let mut second = req.clone();
        second.target = v.root().join("pods/p/two");
        v.bind(&second, &Cancel::never()).unwrap();
        let mut third = req.clone();
        third.target = v.root().join("pods/p/three");
        let e = v.bind(&third, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        assert!(!third.target.exists(), "a refused bind creates nothing");
        assert!(v.unpublish("rec", &Cancel::never()).unwrap());
        assert!(!target.exists());
    }
}

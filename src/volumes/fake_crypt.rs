//! The fake kernel's device-mapper (`fake.rs`): a LUKS2 disk the test
//! makes up with its passphrase and the filesystem inside (or a blank disk
//! the agent formats), and mappings over such disks, each a made-up disk of
//! its own named `dm-<minor>`, as devtmpfs names a mapping's node.

use std::path::Path;

use crust_protocols::sync::LockExt;
use rustix::io::Errno;
use zeroize::Zeroizing;

use super::{Call, Fake, Luks, Mapped};
use crate::luks2;
use crate::luks2::format::Mac;
use crate::luks2::made::Found;
use crate::luks2::mapping::{Live, Mapping};
use crate::model::{Device, FsType};
use crate::sys::dm;
use crate::sys::error::SysError;

impl Fake {
    /// Makes up a disk `name` holding a LUKS2 volume that `passphrase`
    /// opens, with `inner` (None: blank) inside.
    pub(crate) fn luks_disk(
        &self,
        dir: &Path,
        name: &str,
        passphrase: &[u8],
        inner: Option<FsType>,
    ) -> Device {
        let d = self.disk(dir, name, None);
        self.state.locked().luks.push(Luks {
            disk: name.into(),
            passphrase: passphrase.to_vec(),
            inner,
            dir: dir.to_path_buf(),
            integrity: None,
            tampered: 0,
            unfinished: false,
            wiping: false,
        });
        d
    }

    /// Gives the LUKS2 disk `name` a segment with integrity `kind`.
    pub(crate) fn with_integrity(&self, name: &str, kind: &str) {
        let mut st = self.state.locked();
        let l = st
            .luks
            .iter_mut()
            .find(|l| l.disk == name)
            .expect("a LUKS2 disk");
        l.integrity = Some(kind.into());
    }

    /// The host changed `sectors` sectors of LUKS2 disk `name`: a mapping
    /// of it finds them tampered.
    pub(crate) fn tamper_disk(&self, name: &str, sectors: u64) {
        self.on_luks(name, |l| l.tampered = sectors);
    }

    /// Changes the made-up LUKS2 disk `disk` with `f`.
    fn on_luks(&self, disk: &str, f: impl FnOnce(&mut Luks)) {
        let mut st = self.state.locked();
        f(st.luks
            .iter_mut()
            .find(|l| l.disk == disk)
            .expect("a LUKS2 disk"));
    }

    /// The kernel refuses `sectors` more sectors of mapping `name` as tampered.
    pub(crate) fn tamper(&self, name: &str, sectors: u64) {
        let mut st = self.state.locked();
        let m = st
            .mapped
            .iter_mut()
            .find(|m| m.name == name)
            .expect("a mapping");
        m.tampered += sectors;
    }

    /// The host labels LUKS2 disk `disk` unfinished again.
    pub(crate) fn label_unfinished(&self, disk: &str) {
        self.on_luks(disk, |l| l.unfinished = true);
    }

    /// The names of the LUKS2 disks the agent made and did not finish.
    pub(crate) fn unfinished(&self) -> Vec<String> {
        let st = self.state.locked();
        st.luks
            .iter()
            .filter(|l| l.unfinished)
            .map(|l| l.disk.clone())
            .collect()
    }

    pub(super) fn format_if_blank_fake(
        &self,
        disk: &Device,
        passphrase: &Zeroizing<Vec<u8>>,
        integrity: Option<Mac>,
    ) -> std::result::Result<Found, luks2::error::Error> {
        let mut st = self.state.locked();
        if let Some(l) = st.luks.iter().find(|l| l.disk == disk.name) {
            if l.integrity.as_deref() != integrity.map(Mac::kind) {
                return Err(luks2::error::Error::IntegrityDiffers {
                    asked: integrity.map_or("none".into(), |m| m.kind().into()),
                    has: l.integrity.clone().unwrap_or_else(|| "none".into()),
                });
            }
            return Ok(if l.unfinished {
                Found::Unfinished
            } else {
                Found::Luks
            });
        }
        let Some(d) = st.disks.iter().find(|d| d.device.name == disk.name) else {
            return Err(SysError::new(
                "open",
                disk.path.display(),
                std::io::Error::from(Errno::NOENT),
            )
            .into());
        };
        if let Some(fs) = d.fs {
            return Err(crate::luks2::blank::NotBlank::Holds {
                what: fs.name(),
                at: 0,
                byte: 1024,
            }
            .into());
        }
        let dir = d.node.parent().unwrap().to_path_buf();
        st.luks.push(Luks {
            disk: disk.name.clone(),
            passphrase: passphrase.to_vec(),
            inner: None,
            dir,
            integrity: integrity.map(|m| m.kind().into()),
            tampered: 0,
            unfinished: true,
            wiping: integrity.is_some(),
        });
        drop(st);
        let with = integrity.map_or(String::new(), |m| format!(" with {}", m.flag()));
        self.note(format!("format {}{with}", disk.name));
        Ok(Found::Formatted)
    }

    /// The wipe of the LUKS2 disk under mapping `mapped`, if one is under
    /// way: done (or failed, as planted for [`Call::Wipe`]).
    pub(super) fn wipe_fake(
        &self,
        disk: &Device,
        mapped: &Device,
    ) -> crate::error::Result<Option<std::ops::Range<u64>>> {
        let st = self.state.locked();
        if !st.luks.iter().any(|l| l.disk == disk.name && l.wiping) {
            return Ok(None);
        }
        drop(st);
        let what = format!("wipe {}", mapped.name);
        self.call(Call::Wipe, &what).map_err(|e| {
            luks2::error::Error::from(SysError::new("write", mapped.path.display(), e))
        })?;
        self.on_luks(&disk.name, |l| l.wiping = false);
        self.note(what);
        let bytes = self
            .state
            .locked()
            .disk(&mapped.path)
            .map_or(0, |d| d.bytes);
        Ok(Some(0..bytes))
    }

    /// A read of a mapping whose wipe is not done fails, as the kernel's
    /// does for a sector with no tag.
    pub(super) fn unwiped_fake(&self, device: &Device) -> crate::error::Result<()> {
        let st = self.state.locked();
        let disk = st
            .mapped
            .iter()
            .find(|m| m.dev.path == device.path)
            .map(|m| &m.disk);
        if st.luks.iter().any(|l| Some(&l.disk) == disk && l.wiping) {
            let e = std::io::Error::from(Errno::IO);
            return Err(SysError::new("read", device.path.display(), e).into());
        }
        Ok(())
    }

    pub(super) fn finish_format_fake(&self, disk: &Device) {
        self.on_luks(&disk.name, |l| l.unfinished = false);
    }

    /// mkfs on a mapping: its disk, and what later mappings of its LUKS
    /// disk, hold `fs`.
    pub(super) fn make_filesystem_fake(&self, device: &Device, fs: FsType) {
        let mut st = self.state.locked();
        let disk = st
            .mapped
            .iter()
            .find(|m| m.dev.path == device.path)
            .map(|m| m.disk.clone());
        if let Some(d) = st.disks.iter_mut().find(|d| d.device.path == device.path) {
            d.fs = Some(fs);
        }
        if let Some(l) = st.luks.iter_mut().find(|l| Some(&l.disk) == disk.as_ref()) {
            l.inner = Some(fs);
        }
        drop(st);
        self.note(format!("mkfs.{} {}", fs.name(), device.name));
    }

    /// The names of the mappings now made.
    pub(crate) fn mappings(&self) -> Vec<String> {
        let st = self.state.locked();
        st.mapped.iter().map(|m| m.name.clone()).collect()
    }

    /// Renames mapping `from` to `to`: as an agent before owners named it.
    pub(crate) fn rename_mapping(&self, from: &str, to: &str) {
        let mut st = self.state.locked();
        let m = st.mapped.iter_mut().find(|m| m.name == from);
        m.expect("a mapping").name = to.into();
    }

    pub(super) fn open_mapping_fake(
        &self,
        disk: &Device,
        name: &str,
        allow_discards: bool,
        passphrase: &Zeroizing<Vec<u8>>,
    ) -> std::result::Result<Mapping, luks2::error::Error> {
        let (inner, dir, integrity, tampered) = {
            let st = self.state.locked();
            let Some(l) = st.luks.iter().find(|l| l.disk == disk.name) else {
                return Err(luks2::error::Error::NotLuks);
            };
            if l.passphrase != **passphrase {
                return Err(luks2::error::Error::WrongPassphrase);
            }
            if st.mapped.iter().any(|m| m.name == name) {
                return Err(dm::Error::Exists {
                    name: name.into(),
                    uuid: String::new(),
                }
                .into());
            }
            (l.inner, l.dir.clone(), l.integrity.clone(), l.tampered)
        };
        let minor = self.state.locked().disks.len();
        let dev = self.disk(&dir, &format!("dm-{minor}"), inner);
        self.note(format!("map {} as {name}", disk.name));
        let m = Mapping {
            name: name.into(),
            dm_uuid: format!("CRYPT-LUKS2-0123-{name}"),
            dev: (dev.major, dev.minor),
            luks_uuid: "0123".into(),
            cipher: "aes-xts-plain64".into(),
            key_bits: if integrity.is_some() { 768 } else { 512 },
            integrity,
            allow_discards,
            log_from: 0,
        };
        self.state.locked().mapped.push(Mapped {
            name: name.into(),
            disk: disk.name.clone(),
            dev,
            tampered,
        });
        Ok(m)
    }

    pub(super) fn close_mapping_fake(
        &self,
        name: &str,
    ) -> std::result::Result<bool, luks2::error::Error> {
        let mut st = self.state.locked();
        let Some(i) = st.mapped.iter().position(|m| m.name == name) else {
            return Ok(false);
        };
        let dev = (st.mapped[i].dev.major, st.mapped[i].dev.minor);
        if st
            .mounts
            .iter()
            .any(|m| m.dev == dev || m.rdev == Some(dev))
        {
            return Err(dm::Error::Busy(name.into()).into());
        }
        st.mapped.remove(i);
        drop(st);
        self.note(format!("unmap {name}"));
        Ok(true)
    }

    pub(super) fn mapping_live_fake(&self, m: &Mapping) -> Live {
        let st = self.state.locked();
        match st.mapped.iter().find(|x| x.name == m.name) {
            Some(x) => Live::Serving((x.dev.major, x.dev.minor)),
            None => Live::Missing,
        }
    }
}

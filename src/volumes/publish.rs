//! Publishing a volume (semantics.md §1): idempotent for the same request,
//! refused for another; a new one as explicit steps with one undo list.
//!
//! A new volume, step by step (`Publisher::new_volume`), and what undoes each if a
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
//! | walk fsGroup, on a thread of the volume's (`walking/`, started by the table) | if asked and writable | never | Unpublish (what a walk changed stays: a chown cannot be undone safely) |
//! | record the volume complete | | | Unpublish |
//!
//! The caller waits for the walk within its own deadline; when the deadline
//! passes or the caller goes, it is answered DEADLINE_EXCEEDED or CANCELLED
//! and the walk goes on; the same publish again waits for the same walk.
//! Nothing of a block volume's publish reads or writes the disk.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use slog::{info, warn, Logger};

use super::block;
use super::claims::Claims;
use super::error::Error;
use super::kernel::Kernel;
use super::mounts::Mounts;
use super::request::{PublishRequest, Published, Spec};
use super::rollback::{Rollback, Undo};
use super::state::Store;
use super::unlocks::Unlocks;
use super::volume::{guest_rel, Encrypted, Volume};
use super::walking::WalkJob;
use crate::cancel::Cancel;
use crate::error::Result;
use crate::keys;
use crate::luks2::made::Found;
use crate::luks2::mapping::Mapping;
use crate::model::{Device, Extent, FsType, VolumeMode};
use crate::ownership::walk::Report;
use crate::sys::sysfs::Sysfs;

/// What a publish answers once the volume's lock is let go, and the
/// volume's fsGroup walk (walking/) to wait for first, if one runs: it is
/// waited for without holding the lock, so that a list, a stats or an
/// unpublish is served meanwhile.
pub(crate) type Answer = (Option<Arc<WalkJob>>, Published);

/// What a publish's prepare step found, for its attach step: the
/// filesystem the disk holds, or a block volume's device opened.
enum Prepared<D> {
    Filesystem(FsType),
    Block(block::Opened<D>),
}

/// The parts a publish works with: where it mounts, the records, the
/// devices claimed, where disks are found.
pub(crate) struct Publisher<'a, K> {
    pub(crate) mounts: Mounts<'a, K>,
    pub(crate) store: &'a Store,
    pub(crate) claims: &'a Claims,
    pub(crate) sysfs: &'a Sysfs,
    /// Where encrypted volumes' keys are resolved from.
    pub(crate) keys: &'a keys::resolve::Config,
    /// One key derivation at a time.
    pub(crate) unlocks: &'a Unlocks,
    pub(crate) log: &'a Logger,
}

impl<K: Kernel> Publisher<'_, K> {
    /// Publishes `req` into volume slot `slot`, held by the caller: the same
    /// request again (`again`), or a new volume on a disk claimed for the
    /// whole publish, so that a concurrent publish of the same disk, or of
    /// one sharing its sectors, is refused. A walk to run is started with
    /// `walk` (the table's, since the walk's thread outlives the call) once
    /// the volume is in its slot, from the mount's own fd.
    pub(crate) fn run(
        &self,
        slot: &mut Option<Volume>,
        req: &PublishRequest,
        cancel: &Cancel,
        walk: impl FnOnce(&mut Volume, OwnedFd) -> Result<Arc<WalkJob>>,
    ) -> Result<Answer> {
        not_trimmable(&req.spec)?;
        if let Some(vol) = slot.as_mut() {
            return self.again(vol, req, walk);
        }
        let kernel = self.mounts.kernel;
        let device = kernel.find_disk(self.sysfs, &req.spec.source, req.timeout, cancel)?;
        let extent = self.sysfs.extent((device.major, device.minor));
        let claim = self.claims.claim(&device, &req.spec.volume_id, extent)?;
        self.check_not_mounted(&device, &extent)?;
        let encrypted = self.map(req, &device, cancel)?;
        let made = match &encrypted {
            Some(e) => self.new_volume(&req.spec, mapped_device(&e.mapping), encrypted.clone()),
            None => self.new_volume(&req.spec, device, None),
        };
        let (vol, fd) = match made {
            Ok(made) => made,
            Err(e) => {
                let Some(enc) = &encrypted else {
                    return Err(e);
                };
                let e = self.tampered(&req.spec.volume_id, &enc.mapping, e);
                self.unmap(&req.spec.volume_id, &enc.mapping.name);
                return Err(e);
            }
        };
        claim.keep();
        // The mapping is the volume's too: no other volume takes its node
        // (its disk's claim, held above, is entered again as it is).
        if vol.encrypted.is_some() {
            self.claims.adopt(&vol, extent);
        }
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
        let vol = slot.insert(vol);
        Ok(match fd {
            Some(fd) => (Some(walk(vol, fd)?), out),
            None => (None, out),
        })
    }

    /// The same request again: conflicts are refused, and the answer is
    /// given only while it is still true (the mount is checked). A volume
    /// whose fsGroup walk runs is waited for (the call joins the walk); one
    /// whose walk did not finish (taken back from a run that stopped
    /// mid-walk, or whose walk failed and could not be taken down) gets a
    /// walk that finishes it.
    fn again(
        &self,
        vol: &mut Volume,
        req: &PublishRequest,
        walk: impl FnOnce(&mut Volume, OwnedFd) -> Result<Arc<WalkJob>>,
    ) -> Result<Answer> {
        if let Some(differs) = vol.differs_from(&req.spec) {
            return Err(Error::Conflict {
                id: req.spec.volume_id.clone(),
                differs,
            }
            .into());
        }
        let fd = self.mounts.open_mount(vol)?;
        let out = Published {
            guest_path: vol.guest_path.clone(),
            device: vol.device.path.clone(),
            already_published: vol.phase.complete(),
            ownership: None,
        };
        if vol.phase.complete() {
            return Ok((None, out));
        }
        if let Some(job) = vol.phase.running() {
            return Ok((Some(Arc::clone(job)), out));
        }
        Ok((Some(walk(vol, fd)?), out))
    }

    /// An encrypted volume's mapping, opened over `disk` with its key
    /// (resolved here, in the guest, and zeroed once the mapping holds it);
    /// None for a volume in the clear.
    fn map(
        &self,
        req: &PublishRequest,
        disk: &Device,
        cancel: &Cancel,
    ) -> Result<Option<Encrypted>> {
        let Some(enc) = req.spec.encryption else {
            return Ok(None);
        };
        let Some(source) = &req.key else {
            return Err(Error::NoKey(req.spec.volume_id.clone()).into());
        };
        if enc.format_if_blank && req.spec.options.read_only() {
            return Err(Error::FormatReadOnly(req.spec.volume_id.clone()).into());
        }
        let key = keys::resolve::resolve(source, self.keys, cancel)?;
        let kernel = self.mounts.kernel;
        let id = &req.spec.volume_id;
        let name = self.store.owner().name_for(id);
        let found = match enc.format_if_blank {
            true => self.unlocks.one(cancel, || {
                kernel.format_if_blank(disk, &name, &key, enc.integrity)
            })??,
            false => Found::Luks,
        };
        let mapping = self.unlocks.one(cancel, || {
            kernel.open_mapping(disk, &name, enc.allow_discards, &key)
        })??;
        drop(key);
        info!(self.log, "encrypted volume opened"; "volume" => id, "disk" => %disk.path.display(),
              "mapping" => &mapping.name, "cipher" => &mapping.cipher, "made" => ?found);
        if found != Found::Luks {
            if let Err(e) = self.make_inside(req, disk, &mapping, found, cancel) {
                self.unmap(id, &name);
                return Err(e);
            }
        }
        Ok(Some(Encrypted {
            disk: disk.clone(),
            mapping,
        }))
    }

    /// The filesystem inside a volume the agent made (or began to make) on
    /// `disk`, on its new `mapping`; then the volume is marked finished.
    /// With integrity, every sector is wiped through the mapping first (or
    /// what a stopped publish left of the wipe: its header says how far it
    /// went). A volume found unfinished with no wipe under way whose
    /// mapping holds a filesystem is only marked finished: its label is the
    /// host's to write, and a label put back on a finished volume must not
    /// make it empty.
    fn make_inside(
        &self,
        req: &PublishRequest,
        disk: &Device,
        mapping: &Mapping,
        found: Found,
        cancel: &Cancel,
    ) -> Result<()> {
        let kernel = self.mounts.kernel;
        let device = mapped_device(mapping);
        let wiped = match mapping.integrity {
            Some(_) => {
                let started = std::time::Instant::now();
                let wiped = kernel.wipe_mapping(disk, &device, cancel)?;
                if let Some(bytes) = &wiped {
                    info!(self.log, "encrypted volume wiped through its integrity"; "volume" => &req.spec.volume_id,
                          "mapping" => &mapping.name, "from" => bytes.start, "to" => bytes.end,
                          "ms" => started.elapsed().as_millis());
                }
                wiped.is_some()
            }
            None => false,
        };
        if let VolumeMode::Filesystem(fs) = req.spec.mode {
            let holds = match found {
                Found::Unfinished if !wiped => kernel.identify(&device)?,
                Found::Unfinished | Found::Formatted | Found::Luks => None,
            };
            match holds {
                None => kernel.make_filesystem(&device, fs, cancel)?,
                Some(what) => {
                    warn!(self.log, "a volume labelled unfinished holds a filesystem: not made again, only marked finished";
                          "volume" => &req.spec.volume_id, "holds" => what);
                }
            }
        }
        kernel.finish_format(disk)?;
        info!(self.log, "encrypted volume made"; "volume" => &req.spec.volume_id,
              "mapping" => &mapping.name, "mode" => req.spec.mode.name());
        Ok(())
    }

    /// The failure `e` of a publish over `mapping`, said as DATA_LOSS when
    /// the mapping has integrity and the kernel refused sectors of it as
    /// tampered (the failure is then a read of one of them).
    fn tampered(&self, id: &str, mapping: &Mapping, e: crate::error::Error) -> crate::error::Error {
        let Some(integrity) = &mapping.integrity else {
            return e;
        };
        match self.mounts.kernel.mapping_tampered(mapping) {
            Ok(sectors) if sectors > 0 => Error::Tampered {
                id: id.to_string(),
                mapping: mapping.name.clone(),
                integrity: integrity.clone(),
                sectors,
                why: e.to_string(),
            }
            .into(),
            _ => e,
        }
    }

    /// Removes the mapping of a publish that failed after opening it; one
    /// still held (a mount left to recovery) stays, for recovery.
    /// Something holding it for a moment (an mkfs killed at the caller's
    /// deadline, still dying) is waited for a little; one that stays held
    /// is left, and Unpublish of the same id (or recovery) removes it.
    fn unmap(&self, id: &str, name: &str) {
        let mut tries = 0;
        loop {
            match self.mounts.kernel.close_mapping(name) {
                Ok(_) => return,
                Err(e) if tries >= UNMAP_TRIES => {
                    warn!(self.log, "could not remove the mapping of a failed publish; Unpublish of the volume, or recovery at the next start, removes it";
                          "volume" => id, "mapping" => name, "error" => %e);
                    return;
                }
                Err(_) => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        }
    }

    /// A new volume on `device` (claimed by the caller): the steps of the
    /// module doc, each followed by its undo. A filesystem and a block
    /// volume differ only in their guest node, their prepare step and
    /// their attach step. With the volume comes its mount's fd when its
    /// walk is still to run.
    fn new_volume(
        &self,
        spec: &Spec,
        device: Device,
        encrypted: Option<Encrypted>,
    ) -> Result<(Volume, Option<OwnedFd>)> {
        let rel = guest_rel(&spec.volume_id);
        let kernel = self.mounts.kernel;
        let mut undo = Rollback::new(
            self.mounts,
            self.store,
            self.log,
            "publish",
            &spec.volume_id,
            &device,
        );

        // The guest path: a node of the agent's, not a mount point.
        let (created, node) = self.mounts.guest_node(&rel, spec.mode);
        undo.push(Undo::Nodes(created));
        let node = node?;

        // What the disk must hold, or the device's read-only flag.
        let prepared = match spec.mode {
            VolumeMode::Filesystem(fs) => {
                kernel.check_filesystem(&device, fs)?;
                Prepared::Filesystem(fs)
            }
            VolumeMode::Block => Prepared::Block(block::prepare(
                &device,
                spec.options.read_only_flag(),
                kernel,
            )?),
        };

        // Recorded before anything is mounted or set: a crash from here on
        // leaves a record that recovery adopts or clears, never an unknown
        // mount (nor a flag nobody clears).
        let ro_set = matches!(prepared, Prepared::Block(ref b) if b.ro_set);
        let mut vol = Volume::new(
            spec.clone(),
            device.clone(),
            self.mounts.root.join(&rel),
            ro_set,
            encrypted,
        );
        self.store.save(&vol)?;
        undo.push(Undo::Record);

        // Mounted (or bound) through the node's fd, so no rename or
        // symlink moves it.
        match prepared {
            Prepared::Filesystem(fs) => {
                kernel.mount_filesystem(
                    &device.path,
                    node.as_fd(),
                    &vol.guest_path,
                    fs,
                    spec.options.mount(),
                )?;
                drop(node);
            }
            Prepared::Block(b) => block::attach(b, &vol, node, self.mounts, &mut undo)?,
        }

        // What is mounted at the guest path now must be the device just
        // mounted; if it is not, undoing could hit what is there instead.
        let (fd, id) = match self.mounts.own_mount(&vol) {
            Ok(Some(found)) => found,
            other => {
                undo.leave_to_recovery();
                return Err(other.err().unwrap_or_else(|| {
                    crate::mount::error::Error::Moved {
                        path: vol.guest_path.to_path_buf(),
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
        self.store.save(&vol)?;
        undo.done();
        info!(self.log, "volume published"; "volume" => vol.id(), "device" => %device.path.display(),
              "mode" => vol.mode().name(), "read_only" => vol.mounted_read_only(), "ro_set" => ro_set);

        // fsGroup: from here on the publish belongs to the volume. Its walk
        // runs on a thread of its own, from the mount's own fd; the one undo
        // a failed walk has is Unpublish's (walking/).
        let walk = (!vol.phase.complete()).then_some(fd);
        Ok((vol, walk))
    }

    /// Refuses a device whose filesystem is mounted already, or one that
    /// shares sectors with a mounted device (a partition of it, the disk it
    /// is a partition of, an overlapping partition): mounted by someone
    /// else, since the agent's own volumes are refused by their claims.
    fn check_not_mounted(&self, device: &Device, extent: &Extent) -> Result<()> {
        let key = (device.major, device.minor);
        let mut extents: std::collections::HashMap<(u32, u32), Extent> =
            std::collections::HashMap::new();
        for m in self.mounts.kernel.mountinfo()? {
            let dev = (m.major, m.minor);
            if dev == key {
                return Err(Error::DeviceMounted {
                    device: device.path.clone(),
                    at: m.mount_point.clone(),
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
                    device: device.path.clone(),
                    other_device: format!("{} ({}:{})", m.source, dev.0, dev.1),
                    how: extent.describe(&other),
                    at: m.mount_point.clone(),
                }
                .into());
            }
        }
        Ok(())
    }
}

/// Refuses a trim schedule on a volume TrimVolume would refuse: a block
/// volume, a read-only one, an encrypted one without allow_discards.
fn not_trimmable(spec: &Spec) -> Result<()> {
    if spec.trim_interval_s == 0 {
        return Ok(());
    }
    let why = if spec.mode == VolumeMode::Block {
        "it is a block volume, with no filesystem to trim"
    } else if spec.options.read_only() {
        "it is published read-only, and a read-only filesystem is not trimmed"
    } else if spec.encryption.is_some_and(|e| !e.allow_discards) {
        "it is encrypted without allow_discards, and a discard would tell the host which blocks are free"
    } else {
        return Ok(());
    };
    Err(Error::TrimNotPossible {
        id: spec.volume_id.clone(),
        why,
    }
    .into())
}

/// How many times (100 ms apart) a failed publish tries to remove its mapping.
const UNMAP_TRIES: u32 = 20;

/// The device a mapping is: /dev/dm-<minor>, as devtmpfs names it.
pub(crate) fn mapped_device(m: &Mapping) -> Device {
    let name = format!("dm-{}", m.dev.1);
    Device {
        path: std::path::Path::new("/dev").join(&name),
        name,
        major: m.dev.0,
        minor: m.dev.1,
        serial: None,
    }
}

/// The walk went through: the volume is recorded complete, then is so in
/// the table (a record that cannot be written leaves it as it was).
pub(crate) fn walked(vol: &mut Volume, store: &Store) -> Result<()> {
    let mut done = vol.clone();
    done.phase.walked();
    store.save(&done)?;
    *vol = done;
    Ok(())
}

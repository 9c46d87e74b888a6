//! Taking back a previous run's volumes: every record is checked against
//! what is mounted, by identity (the mount at `<root>/volumes/<id>` must be
//! the recorded disk, and the recorded mount where an id was kept); what is
//! still there is adopted, and every other mount the agent could have made
//! beneath its root is taken down: anything mounted directly in `volumes/`
//! that no record explains, and any mount of a volume's disk beneath the
//! root that is not a recorded bind, or a bind that is not idmapped as
//! recorded (mountinfo's `idmapped`: a bind recorded with mappings that is
//! not idmapped, or the reverse, or one whose root's owner is not shown as
//! the recorded mappings show it, is not the bind the agent made; it is
//! taken down, and the next BindMount makes it again). A block volume's
//! mounts are binds of its disk's node (their mountinfo device is devtmpfs's): they are told by
//! the node's device number (statx), not by mountinfo's. A guest node in
//! `volumes/` that no record explains (an empty directory or file, made by
//! a publish killed before it recorded the volume) is removed. A crash at
//! any point of any request thus leaves nothing that no RPC can remove.
//!
//! Recovery writes to the state directory (a record pruned of binds that are
//! gone, the record of a volume that is gone removed) but never depends on
//! it: where a write fails (a full or read-only state filesystem), it logs
//! it, keeps the table in memory as it found it, and comes up anyway, read-
//! only with respect to state (GetAgentInfo's `state_problem` says why). A
//! record left stale that way only lists what is no longer there, which the
//! next start drops again; Unpublish needs no space.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, OFlags};
use rustix::io::Errno;
use slog::{info, warn, Logger};

use super::claims::Claims;
use super::kernel::Kernel;
use super::mounts::Mounts;
use super::state::{Record, Store};
use super::targets::Targets;
use super::volume::{guest_rel, Volume};
use crate::error::Result;
use crate::luks2::mapping::{tag_of, Live, Mapping};
use crate::model::MountId;
use crate::mount::unmount::Expect;
use crate::sys::beneath::{self, Root};
use crate::sys::mountinfo::{shown, MountEntry};
use crate::sys::sysfs::Sysfs;

/// What recovery works with, before the table exists: it enters the
/// adopted volumes' devices and bind targets, and hands the volumes to the
/// table.
pub(crate) struct Recovery<'a, K> {
    pub(crate) root: &'a Root,
    pub(crate) kernel: &'a K,
    pub(crate) store: &'a Store,
    pub(crate) claims: &'a Claims,
    pub(crate) targets: &'a Targets,
    /// Where disks' sectors are read.
    pub(crate) sysfs: &'a Sysfs,
    /// Where what is taken back or down is said.
    pub(crate) log: &'a Logger,
}

impl<K: Kernel> Recovery<'_, K> {
    /// Adopts or clears everything a previous run left (see the module
    /// doc), and returns the volumes adopted.
    pub(crate) fn run(&self) -> Result<Vec<Volume>> {
        let mut adopted = Vec::new();
        // Disks the agent mounted (recorded or found in volumes/): their
        // mounts beneath the root must all be accounted for.
        let mut own_devices: HashSet<(u32, u32)> = HashSet::new();
        // Mounts that are accounted for.
        let mut kept: HashSet<MountId> = HashSet::new();
        // Block volumes forgotten: their read-only flags are cleared once
        // every record is read, unless an adopted volume holds the device.
        let mut forgotten: Vec<Volume> = Vec::new();
        let table = self.kernel.mountinfo()?;
        for record in self.store.load(self.root.path())? {
            let vol = match record {
                Record::Bad(name, why) => {
                    let aside = self.store.set_aside(&name);
                    warn!(self.log, "state record does not decode; set aside, and its mounts are taken down";
                          "record" => shown(Path::new(OsStr::from_bytes(&name))), "why" => %why,
                          "kept_at" => shown(&aside));
                    continue;
                }
                Record::Good(vol) => *vol,
            };
            own_devices.insert((vol.device.major, vol.device.minor));
            let Some(vol) = self.adopt(vol, &mut forgotten, &table) else {
                continue;
            };
            kept.extend(vol.phase.mount_id());
            kept.extend(vol.binds.iter().filter_map(|b| b.mount_id));
            self.claim_adopted(&vol);
            info!(self.log, "volume taken back from a previous run"; "volume" => vol.id(),
                  "binds" => vol.binds.len(), "complete" => vol.phase.complete());
            adopted.push(vol);
        }
        for vol in &forgotten {
            // A stale record (one an unpublish could not remove) must not
            // make a device writable that a live volume set read-only.
            if self
                .claims
                .holder_of((vol.device.major, vol.device.minor))
                .is_none()
            {
                self.release_block(vol);
            }
        }
        self.sweep(&mut own_devices, &kept)?;
        self.clear_strays(&adopted);
        self.unmap_strays(&adopted, &forgotten);
        if let Some(why) = self.store.problem() {
            warn!(self.log, "the state directory could not be written at start: serving the volumes taken back and Unpublish; publishes and binds are refused until it can be written";
                  "why" => why);
        }
        Ok(adopted)
    }

    /// Enters an adopted volume's device and sectors in the claims, so new
    /// publishes are checked against them. Two adopted volumes that share
    /// sectors (left by an older agent that compared device numbers only)
    /// are both kept as they are mounted, and said loudly: taking either
    /// down under a pod is not recovery's call.
    fn claim_adopted(&self, vol: &Volume) {
        let disk = vol.disk();
        let extent = self.sysfs.extent((disk.major, disk.minor));
        for c in self.claims.adopt(vol, extent) {
            warn!(self.log, "volumes taken back from a previous run share sectors of one disk; unpublish one of them";
                  "volume" => vol.id(), "device" => shown(&vol.disk().path),
                  "other" => &c.id, "other_device" => shown(&c.device), "how" => extent.describe(&c.extent));
        }
    }

    /// Adopts `vol` if its mount is still there (updating what changed), or
    /// forgets it (into `forgotten`). Returns the adopted volume. Writes to
    /// the state directory that fail are logged, never fatal.
    fn adopt(
        &self,
        mut vol: Volume,
        forgotten: &mut Vec<Volume>,
        table: &[MountEntry],
    ) -> Option<Volume> {
        let rel = vol.rel();
        let here = beneath::open_parent(self.root.fd(), &rel)
            .ok()
            .and_then(|(parent, name)| self.kernel.mount_point_at(parent.as_fd(), &name).ok());
        let live = here.filter(|mp| vol.is_own_mount(mp));
        let Some(mp) = live else {
            warn!(self.log, "volume from a previous run is not mounted (as recorded) any more; forgetting it";
                  "volume" => vol.id(), "guest_path" => shown(&vol.guest_path));
            // Its binds come down in the sweep; a flag the agent set on the
            // device goes with the volume (in `recover`).
            if let Err(e) = self.store.remove(vol.id()) {
                warn!(self.log, "could not remove the record of a volume that is gone; the next start drops it again";
                      "volume" => vol.id(), "error" => %e);
            }
            self.kernel.remove_node(self.root.fd(), &rel);
            forgotten.push(vol);
            return None;
        };
        let mut changed = vol.phase.mount_id() != Some(mp.mount_id);
        vol.phase.found(mp.mount_id);
        let binds = std::mem::take(&mut vol.binds);
        for mut b in binds {
            let live = beneath::open_parent(self.root.fd(), &b.rel)
                .ok()
                .and_then(|(parent, name)| self.kernel.mount_point_at(parent.as_fd(), &name).ok())
                .filter(|m| vol.is_own_bind(&b, m));
            let Some(m) = live else {
                warn!(self.log, "bind from a previous run is gone"; "volume" => vol.id(), "target" => shown(&b.target));
                self.kernel.remove_node(self.root.fd(), &b.rel);
                changed = true;
                continue;
            };
            let mounts = Mounts {
                root: self.root,
                kernel: self.kernel,
            };
            if !mounts.idmapped_as_recorded(table, m.mount_id, &vol, &b) {
                warn!(self.log, "bind from a previous run is not idmapped as recorded; taken down, the next bind makes it again";
                      "volume" => vol.id(), "target" => shown(&b.target), "recorded" => b.idmap.is_some());
                changed = true;
                continue;
            }
            // Targets from state are reserved like a request's: a record
            // naming a taken, nested or covering target loses that bind
            // (the sweep then takes its mount down).
            match self
                .targets
                .reserve(&b.rel, &b.target, vol.id(), self.root.path())
            {
                Ok(r) => r.keep(),
                Err(e) => {
                    warn!(self.log, "bind from a previous run conflicts with another; dropped"; "volume" => vol.id(),
                          "target" => shown(&b.target), "error" => %e);
                    changed = true;
                    continue;
                }
            }
            changed |= b.mount_id != Some(m.mount_id);
            b.mount_id = Some(m.mount_id);
            vol.binds.push(b);
        }
        if changed {
            if let Err(e) = self.store.save(&vol) {
                warn!(self.log, "could not write back the record of a volume taken back; it still lists binds that are gone, which the next start drops again";
                      "volume" => vol.id(), "error" => %e);
            }
        }
        Some(vol)
    }

    /// The disk the mount `id` at `rel` is of: the device of its filesystem,
    /// or, for a bind of a block device's node, that device.
    fn disk_of(&self, rel: &Path, id: MountId, fs_dev: (u32, u32)) -> (u32, u32) {
        beneath::open_parent(self.root.fd(), rel)
            .and_then(|(parent, name)| self.kernel.mount_point_at(parent.as_fd(), &name))
            .ok()
            .filter(|mp| mp.is_root && mp.mount_id == id && mp.kind == FileType::BlockDevice)
            .map_or(fs_dev, |mp| mp.rdev)
    }

    /// Takes down what no adopted record explains: mounts directly in
    /// `volumes/`, then every mount beneath the root of a disk in
    /// `own_devices` that is not in `kept`, deepest first.
    fn sweep(&self, own_devices: &mut HashSet<(u32, u32)>, kept: &HashSet<MountId>) -> Result<()> {
        let root = self.root.path();
        let table = self.kernel.mountinfo()?;
        let mut doomed: Vec<(PathBuf, MountId, (u32, u32))> = Vec::new();
        // Mounts beneath the root that no record explains, with the disk
        // each is of.
        let unexplained: Vec<(PathBuf, MountId, (u32, u32))> = table
            .iter()
            .filter_map(|m| {
                let id = m.mount_id;
                let rel = m.mount_point.strip_prefix(root).ok()?;
                if kept.contains(&id) || rel.as_os_str().is_empty() {
                    return None;
                }
                Some((
                    rel.to_path_buf(),
                    id,
                    self.disk_of(rel, id, (m.major, m.minor)),
                ))
            })
            .collect();
        for (rel, _, disk) in &unexplained {
            if rel.parent() == Some(Path::new("volumes")) {
                own_devices.insert(*disk);
            }
        }
        for (rel, id, disk) in unexplained {
            let in_volumes = rel.parent() == Some(Path::new("volumes"));
            if in_volumes || own_devices.contains(&disk) {
                doomed.push((rel, id, disk));
            }
        }
        // Deepest first, so a mount is not taken down under one of ours still to go.
        doomed.sort_by_key(|(p, _, _)| std::cmp::Reverse(p.components().count()));
        for (rel, id, disk) in doomed {
            let at = root.join(&rel);
            match self.kernel.unmount_tree(
                self.root.fd(),
                root,
                &rel,
                Expect::Mount(id, disk.0, disk.1),
            ) {
                Ok(true) => {
                    warn!(self.log, "mount left by a previous run that no record explains; taken down";
                          "path" => shown(&at));
                    self.kernel.remove_node(self.root.fd(), &rel);
                }
                Ok(false) => {}
                Err(e) => {
                    warn!(self.log, "could not take down a mount left by a previous run";
                          "path" => shown(&at), "error" => %e)
                }
            }
        }
        Ok(())
    }

    /// Removes the guest nodes in `volumes/` that no adopted volume
    /// explains: an empty directory or an empty file, not a mount point
    /// (`remove_node`), left by a publish killed after it made its guest
    /// path and before it recorded the volume. Left there, it would refuse a
    /// later publish of the same id in the other mode (a directory where a
    /// block volume's file goes). Anything else there stays.
    fn clear_strays(&self, adopted: &[Volume]) {
        let ours: HashSet<&OsStr> = adopted.iter().map(|v| OsStr::new(v.id())).collect();
        let Ok(entries) = std::fs::read_dir(self.root.join(Path::new("volumes"))) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if !ours.contains(name.as_os_str()) {
                self.kernel
                    .remove_node(self.root.fd(), &Path::new("volumes").join(&name));
            }
        }
    }

    /// Removes the agent's own mappings that no adopted volume explains:
    /// made by a publish killed before it recorded the volume, or left by
    /// a volume `forgotten` above (its mounts are down by now). One still
    /// held open stays, said. The agent's own are those its owner's tag
    /// marks, and those a forgotten record names as agents before owners
    /// named them (untagged), if still the mapping recorded. Another
    /// agent's are never touched; an untagged one no record names may be
    /// an older agent's mid-publish, and is left, said.
    fn unmap_strays(&self, adopted: &[Volume], forgotten: &[Volume]) {
        fn mapping_of(v: &Volume) -> Option<&Mapping> {
            v.encrypted.as_ref().map(|e| &e.mapping)
        }
        let kept: HashSet<&str> = adopted
            .iter()
            .filter_map(mapping_of)
            .map(|m| m.name.as_str())
            .collect();
        let found = match self.kernel.agents_mappings() {
            Ok(found) => found,
            Err(e) => {
                warn!(self.log, "could not list device-mapper devices to remove the mappings no record explains"; "error" => %e);
                return;
            }
        };
        let owner = self.store.owner();
        for name in found.iter().filter(|n| !kept.contains(n.as_str())) {
            let recorded = forgotten
                .iter()
                .filter_map(mapping_of)
                .find(|m| &m.name == name)
                .is_some_and(|m| {
                    !matches!(self.kernel.mapping_live(m), Ok(Live::Missing) | Err(_))
                });
            if !owner.owns(name) && !recorded {
                if tag_of(name).is_none() {
                    warn!(self.log, "a mapping named as agents before owners named theirs, that no record explains: left, as it may be another agent's"; "mapping" => name);
                }
                continue;
            }
            match self.kernel.close_mapping(name) {
                Ok(_) => {
                    warn!(self.log, "mapping left by a previous run that no record explains; removed"; "mapping" => name)
                }
                Err(e) => {
                    warn!(self.log, "could not remove a mapping left by a previous run"; "mapping" => name, "error" => %e)
                }
            }
        }
    }

    /// Clears the read-only flag of a block volume that recovery forgets
    /// (its bind is gone): the agent set it, and nothing holds it now.
    fn release_block(&self, vol: &Volume) {
        if !vol.ro_set() {
            return;
        }
        match self
            .kernel
            .open_disk(&vol.device)
            .and_then(|f| self.kernel.set_read_only(&f, &vol.device, false))
        {
            Ok(()) => {
                info!(self.log, "read-only flag of a forgotten block volume cleared"; "volume" => vol.id())
            }
            Err(e) => {
                warn!(self.log, "could not clear the read-only flag of a forgotten block volume";
                            "volume" => vol.id(), "error" => %e)
            }
        }
    }
}

/// At start, before anything is taken back or down: thaws the filesystem
/// of every volume a frozen mark names, as agents before freeze leases
/// marked them (`<id>.frozen`; an agent upgraded while frozen). Only a
/// mount root at the volume's own guest path is thawed; the marks go.
pub(crate) fn thaw_left_frozen<K: Kernel>(root: &Root, kernel: &K, store: &Store, log: &Logger) {
    for id in store.frozen_marks() {
        match thaw_at(root, kernel, &id) {
            Ok(true) => {
                warn!(log, "thawed a volume a previous run left frozen"; "volume" => &id)
            }
            Ok(false) => {}
            Err(e) => {
                warn!(log, "could not thaw a volume a previous run left frozen"; "volume" => &id, "error" => %e)
            }
        }
        let _ = store.clear_frozen(&id);
    }
}

/// FITHAW on the mount root at volume `id`'s guest path, if one is there;
/// true when it was frozen.
pub(crate) fn thaw_at<K: Kernel>(root: &Root, kernel: &K, id: &str) -> Result<bool> {
    let rel = guest_rel(id);
    let (rel, path) = (rel.as_path(), &root.join(&rel));
    let at = match beneath::open_with(
        root.fd(),
        rel,
        OFlags::PATH | OFlags::DIRECTORY,
        beneath::strict(),
    ) {
        Ok(fd) => fd,
        Err(Errno::NOENT | Errno::LOOP | Errno::XDEV | Errno::NOTDIR) => return Ok(false),
        Err(e) => {
            return Err(crate::sys::error::SysError::new("openat2", path.display(), e).into())
        }
    };
    let mp = kernel
        .mount_point(at.as_fd())
        .map_err(|e| crate::sys::error::SysError::new("statx", path.display(), e))?;
    if !mp.is_root {
        return Ok(false);
    }
    kernel.thaw(at.as_fd(), path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::STATE_DIR;
    use crate::volumes::kernel::Linux;
    use crate::volumes::state::encode;
    use crate::volumes::volume::tests::sample;

    #[test]
    fn recovery_forgets_what_is_no_longer_there() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join(STATE_DIR);
        std::fs::create_dir_all(&state).unwrap();
        // A record whose mount is gone, a malformed one, and a half-written temp file.
        let gone = state.join("vol-1.vol");
        std::fs::write(&gone, encode(&sample())).unwrap();
        std::fs::write(state.join("bad.vol"), "no equals sign").unwrap();
        std::fs::write(state.join("vol-2.tmp"), "half").unwrap();
        let root = Root::open(dir.path()).unwrap();
        let store = Store::open(&root).unwrap();
        let claims = Claims::default();
        let adopted = Recovery {
            root: &root,
            kernel: &Linux,
            store: &store,
            claims: &claims,
            targets: &Targets::default(),
            sysfs: &Sysfs::system(),
            log: &crate::logging::discard(),
        }
        .run()
        .unwrap();
        assert!(adopted.is_empty() && claims.holder_of((254, 16)).is_none());
        assert!(
            !gone.exists(),
            "the record of an unmounted volume is dropped"
        );
        assert!(!state.join("vol-2.tmp").exists());
        assert!(
            !state.join("bad.vol").exists() && state.join("bad.vol.bad").exists(),
            "an unreadable record is set aside for a human"
        );
    }

    /// A mark an agent from before freeze leases left (`<id>.frozen`) is
    /// read at start, its volume thawed if it is mounted there, and the mark
    /// removed; a mark of a volume not mounted is just removed.
    #[test]
    fn marks_older_agents_left_are_read_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join(STATE_DIR);
        std::fs::create_dir_all(dir.path().join("volumes/v")).unwrap();
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join("v.frozen"), "freeze-1-1\n/x\n").unwrap();
        std::fs::write(state.join("gone.frozen"), "freeze-1-2\n/y\n").unwrap();
        let root = Root::open(dir.path()).unwrap();
        let store = Store::open(&root).unwrap();
        assert_eq!(store.frozen_marks().len(), 2);
        thaw_left_frozen(&root, &Linux, &store, &crate::logging::discard());
        assert!(store.frozen_marks().is_empty());
        assert!(
            !thaw_at(&root, &Linux, "v").unwrap(),
            "not a mount root: nothing to thaw"
        );
    }

    /// A publish killed after it made its guest path and before it recorded
    /// the volume leaves an empty directory or file: the next start removes
    /// it, so the id can be published in either mode. What is not empty stays.
    #[test]
    fn guest_nodes_no_record_explains_are_cleared_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let volumes = dir.path().join("volumes");
        std::fs::create_dir_all(volumes.join("dir-left")).unwrap();
        std::fs::write(volumes.join("file-left"), "").unwrap();
        std::fs::create_dir_all(volumes.join("full")).unwrap();
        std::fs::write(volumes.join("full/data"), "keep").unwrap();
        std::fs::write(volumes.join("written"), "keep").unwrap();
        let root = Root::open(dir.path()).unwrap();
        let store = Store::open(&root).unwrap();
        Recovery {
            root: &root,
            kernel: &Linux,
            store: &store,
            claims: &Claims::default(),
            targets: &Targets::default(),
            sysfs: &Sysfs::system(),
            log: &crate::logging::discard(),
        }
        .run()
        .unwrap();
        assert!(!volumes.join("dir-left").exists() && !volumes.join("file-left").exists());
        assert!(volumes.join("full/data").exists() && volumes.join("written").exists());
    }
}

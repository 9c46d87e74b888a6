//! Taking back a previous run's volumes: every record is checked against
//! what is mounted, by identity (the mount at `<root>/volumes/<id>` must be
//! the recorded disk, and the recorded mount where an id was kept); what is
//! still there is adopted, and every other mount the agent could have made
//! beneath its root is taken down: anything mounted directly in `volumes/`
//! that no record explains, and any mount of a volume's disk beneath the
//! root that is not a recorded bind. A block volume's mounts are binds of
//! its disk's node (their mountinfo device is devtmpfs's): they are told by
//! the node's device number (statx), not by mountinfo's. A crash at any
//! point of any request thus leaves nothing that no RPC can remove.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use rustix::fs::FileType;
use std::sync::{Arc, Mutex};

use slog::{info, warn};

use super::state::Record;
use super::{lock, Volume, Volumes};
use crate::beneath;
use crate::errors::Result;
use crate::mount::{self, Expect};
use crate::mountinfo;

impl Volumes {
    /// Adopts or clears everything a previous run left (see the module doc).
    pub(super) fn recover(&self) -> Result<()> {
        // Disks the agent mounted (recorded or found in volumes/): their
        // mounts beneath the root must all be accounted for.
        let mut own_devices: HashSet<(u32, u32)> = HashSet::new();
        // Mounts that are accounted for.
        let mut kept: HashSet<u64> = HashSet::new();
        for record in self.store.load(self.root.path())? {
            let vol = match record {
                Record::Bad(id, why) => {
                    let aside = self.store.set_aside(&id);
                    warn!(self.log, "state record does not decode; set aside, and its mounts are taken down";
                          "volume" => &id, "why" => why, "kept_at" => %aside.display());
                    continue;
                }
                Record::Good(vol) => *vol,
            };
            own_devices.insert((vol.device.major, vol.device.minor));
            if let Some(vol) = self.adopt(vol)? {
                kept.insert(vol.mount_id);
                kept.extend(vol.binds.iter().map(|b| b.mount_id));
                lock(&self.devices).insert((vol.device.major, vol.device.minor), vol.id.clone());
                self.publish_snapshot(&vol);
                info!(self.log, "volume taken back from a previous run"; "volume" => &vol.id,
                      "binds" => vol.binds.len(), "complete" => vol.complete);
                lock(&self.slots).insert(vol.id.clone(), Arc::new(Mutex::new(Some(vol))));
            }
        }
        self.sweep(&mut own_devices, &kept)
    }

    /// Adopts `vol` if its mount is still there (updating what changed), or
    /// forgets it. Returns the adopted volume.
    fn adopt(&self, mut vol: Volume) -> Result<Option<Volume>> {
        let rel = vol.rel();
        let here = beneath::open_parent(self.root.fd(), &rel)
            .ok()
            .and_then(|(parent, name)| beneath::mount_point_at(parent.as_fd(), &name).ok());
        let live = here.filter(|mp| vol.is_own_mount(mp));
        let Some(mp) = live else {
            warn!(self.log, "volume from a previous run is not mounted (as recorded) any more; forgetting it";
                  "volume" => &vol.id, "guest_path" => %vol.guest_path.display());
            // Its binds come down in the sweep; a flag the agent set on the
            // device goes with the volume.
            self.release_block(&vol);
            self.store.remove(&vol.id)?;
            mount::remove_node(self.root.fd(), &rel);
            return Ok(None);
        };
        let mut changed = vol.mount_id != mp.mount_id;
        vol.mount_id = mp.mount_id;
        let binds = std::mem::take(&mut vol.binds);
        for mut b in binds {
            let live = beneath::open_parent(self.root.fd(), &b.rel)
                .ok()
                .and_then(|(parent, name)| beneath::mount_point_at(parent.as_fd(), &name).ok())
                .filter(|m| vol.is_own_bind(&b, m));
            let Some(m) = live else {
                warn!(self.log, "bind from a previous run is gone"; "volume" => &vol.id, "target" => %b.target.display());
                mount::remove_node(self.root.fd(), &b.rel);
                changed = true;
                continue;
            };
            // Targets from state are reserved like a request's: a record
            // naming a taken, nested or covering target loses that bind
            // (the sweep then takes its mount down).
            match self.reserve(&b.rel, &b.target, &vol.id) {
                Ok(r) => r.keep(),
                Err(e) => {
                    warn!(self.log, "bind from a previous run conflicts with another; dropped"; "volume" => &vol.id,
                          "target" => %b.target.display(), "error" => %e);
                    changed = true;
                    continue;
                }
            }
            changed |= b.mount_id != m.mount_id;
            b.mount_id = m.mount_id;
            vol.binds.push(b);
        }
        if changed {
            self.store.save(&vol)?;
        }
        Ok(Some(vol))
    }

    /// The disk the mount `id` at `rel` is of: the device of its filesystem,
    /// or, for a bind of a block device's node, that device.
    fn disk_of(&self, rel: &Path, id: u64, fs_dev: (u32, u32)) -> (u32, u32) {
        beneath::open_parent(self.root.fd(), rel)
            .and_then(|(parent, name)| beneath::mount_point_at(parent.as_fd(), &name))
            .ok()
            .filter(|mp| mp.is_root && mp.mount_id == id && mp.kind == FileType::BlockDevice)
            .map_or(fs_dev, |mp| mp.rdev)
    }

    /// Takes down what no adopted record explains: mounts directly in
    /// `volumes/`, then every mount beneath the root of a disk in
    /// `own_devices` that is not in `kept`, deepest first.
    fn sweep(&self, own_devices: &mut HashSet<(u32, u32)>, kept: &HashSet<u64>) -> Result<()> {
        let root = self.root.path();
        let table = mountinfo::read()?;
        let mut doomed: Vec<(PathBuf, u64, (u32, u32))> = Vec::new();
        // Mounts beneath the root that no record explains, with the disk
        // each is of.
        let unexplained: Vec<(PathBuf, u64, (u32, u32))> = table
            .iter()
            .filter_map(|m| {
                let id = u64::from(m.mount_id);
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
            let shown = root.join(&rel);
            match mount::unmount_tree(
                self.root.fd(),
                root,
                &rel,
                Expect::Mount(id, disk.0, disk.1),
            ) {
                Ok(true) => {
                    warn!(self.log, "mount left by a previous run that no record explains; taken down";
                          "path" => %shown.display());
                    mount::remove_node(self.root.fd(), &rel);
                }
                Ok(false) => {}
                Err(e) => {
                    warn!(self.log, "could not take down a mount left by a previous run";
                          "path" => %shown.display(), "error" => %e)
                }
            }
        }
        Ok(())
    }
}

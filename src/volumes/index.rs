//! What the table knows besides each volume's own slot, kept in step with
//! the volumes by the methods here and nowhere else:
//!
//! - `claims`: which volume holds each device and the sectors it covers on
//!   its disk, publishes in flight included ("one disk, one volume" is
//!   checked against it);
//! - `targets`: every bind target (relative to the root), reserved by a bind
//!   in flight or bound, and its volume ("two binds never share, nest in or
//!   cover each other");
//! - `listed`: what ListVolumes answers, updated when an operation ends, so
//!   a list never waits behind a long walk; a volume whose fsGroup walk runs
//!   is listed with the walk, whose progress is read live.
//!
//! A claim or a reservation made for an operation in flight is a [`Held`]
//! guard: dropped, it is released; kept, it stays with the volume. Each map
//! has its own lock, taken briefly, one at a time, never while waiting for
//! anything (the lock order is in `table`'s module doc).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::error::Error;
use super::request::{VolumeInfo, VolumeState};
use super::volume::{Bind, Volume};
use super::walking::job::WalkJob;
use crate::model::{Device, Extent};
use crate::sys::mountinfo::shown;

/// A device number (major, minor).
type DevNum = (u32, u32);

/// A device a volume holds (or a publish in flight).
#[derive(Clone, Debug)]
pub(crate) struct Claim {
    /// The volume.
    pub(crate) id: String,
    /// Its device node, for messages.
    pub(crate) device: String,
    /// The sectors it covers on its whole disk.
    pub(crate) extent: Extent,
}

/// The table's side maps (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Index {
    claims: Mutex<BTreeMap<DevNum, Claim>>,
    targets: Mutex<BTreeMap<PathBuf, String>>,
    listed: Mutex<BTreeMap<String, Listed>>,
}

/// One volume as ListVolumes shows it.
#[derive(Clone, Debug)]
struct Listed {
    info: VolumeInfo,
    device: Device,
    /// Its publish's walk, while one runs.
    walk: Option<Arc<WalkJob>>,
}

/// A poisoned lock still guards consistent data here (every update is a
/// single insert or remove), so it is taken over rather than propagated.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A key an operation in flight holds in one of the index's maps (a device
/// claimed, a bind target reserved): released when dropped, unless kept.
#[must_use = "dropping a Held releases it at once"]
pub(crate) struct Held<'a, K: Ord, V> {
    map: &'a Mutex<BTreeMap<K, V>>,
    key: Option<K>,
}

impl<K: Ord, V> Held<'_, K, V> {
    /// The operation went through: the key stays held, by the volume now.
    pub(crate) fn keep(mut self) {
        self.key = None;
    }
}

impl<K: Ord, V> Drop for Held<'_, K, V> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            lock(self.map).remove(&key);
        }
    }
}

/// A device claimed for a publish in flight.
pub(crate) type DeviceClaim<'a> = Held<'a, DevNum, Claim>;
/// A bind target reserved for a bind in flight.
pub(crate) type Reservation<'a> = Held<'a, PathBuf, String>;

impl Index {
    /// Claims `device` (whose sectors are `extent`) for volume `id`: refused
    /// when another volume holds the same device or one that shares a
    /// sector with it (semantics.md §9).
    pub(crate) fn claim(
        &self,
        device: &Device,
        id: &str,
        extent: Extent,
    ) -> Result<DeviceClaim<'_>, Error> {
        let key = (device.major, device.minor);
        let mut claims = lock(&self.claims);
        for (held, c) in claims.iter().filter(|(_, c)| c.id != id) {
            if *held == key {
                return Err(Error::DeviceInUse {
                    device: shown(&device.path),
                    other: c.id.clone(),
                });
            }
            if c.extent.overlaps(&extent) {
                return Err(Error::DeviceOverlaps {
                    device: shown(&device.path),
                    held: c.device.clone(),
                    how: extent.describe(&c.extent),
                    other: c.id.clone(),
                });
            }
        }
        claims.insert(
            key,
            Claim {
                id: id.to_string(),
                device: shown(&device.path),
                extent,
            },
        );
        Ok(Held {
            map: &self.claims,
            key: Some(key),
        })
    }

    /// Enters an adopted volume's device and sectors in the claims, whatever
    /// they overlap (recovery's call: both stay as they are mounted), and
    /// returns the claims it overlaps.
    pub(crate) fn claim_adopted(&self, vol: &Volume, extent: Extent) -> Vec<Claim> {
        let mut claims = lock(&self.claims);
        let overlaps = claims
            .values()
            .filter(|c| c.extent.overlaps(&extent))
            .cloned()
            .collect();
        claims.insert(
            (vol.device.major, vol.device.minor),
            Claim {
                id: vol.id().to_string(),
                device: shown(&vol.device.path),
                extent,
            },
        );
        overlaps
    }

    /// The volume that holds device `dev`, if one does.
    pub(crate) fn holder_of(&self, dev: DevNum) -> Option<String> {
        lock(&self.claims).get(&dev).map(|c| c.id.clone())
    }

    /// Reserves `rel` as a bind target of volume `id` (`target` is how the
    /// request spelled it, `root` the canonical root, both for messages):
    /// refused when it is another bind's target, lies inside one, or holds
    /// one beneath it.
    pub(crate) fn reserve(
        &self,
        rel: &Path,
        target: &Path,
        id: &str,
        root: &Path,
    ) -> Result<Reservation<'_>, Error> {
        let mut targets = lock(&self.targets);
        for (t, owner) in targets.iter() {
            let there = || root.join(t).display().to_string();
            if t == rel {
                return Err(Error::TargetTaken {
                    target: target.display().to_string(),
                    what: format!("a bind of volume {owner}"),
                });
            }
            if rel.starts_with(t) {
                return Err(Error::TargetNested {
                    target: target.display().to_string(),
                    inner_of: there(),
                    volume: owner.clone(),
                });
            }
            if t.starts_with(rel) {
                return Err(Error::TargetCovers {
                    target: target.display().to_string(),
                    inner: there(),
                    volume: owner.clone(),
                });
            }
        }
        targets.insert(rel.to_path_buf(), id.to_string());
        Ok(Held {
            map: &self.targets,
            key: Some(rel.to_path_buf()),
        })
    }

    /// The volume whose bind target (reserved or bound) `rel` is.
    pub(crate) fn owner_of(&self, rel: &Path) -> Option<String> {
        lock(&self.targets).get(rel).cloned()
    }

    /// Shows `vol` as it is now in ListVolumes.
    pub(crate) fn show(&self, vol: &Volume) {
        let listed = Listed {
            info: vol.info(),
            device: vol.device.clone(),
            walk: vol.phase.job().cloned(),
        };
        lock(&self.listed).insert(vol.id().to_string(), listed);
    }

    /// A publish went through: its claim stays with the volume, which
    /// ListVolumes shows from now on.
    pub(crate) fn published(&self, vol: &Volume, claim: DeviceClaim<'_>) {
        claim.keep();
        self.show(vol);
    }

    /// A bind went through (already in `vol.binds`): its target stays
    /// reserved by the volume, and ListVolumes shows it.
    pub(crate) fn bound(&self, vol: &Volume, reservation: Reservation<'_>) {
        reservation.keep();
        self.show(vol);
    }

    /// Bind `i` of `vol` is gone (taken down, or found gone): it leaves the
    /// volume, its target is free again, and ListVolumes no longer shows it.
    pub(crate) fn drop_bind(&self, vol: &mut Volume, i: usize) -> Bind {
        let b = vol.binds.remove(i);
        lock(&self.targets).remove(&b.rel);
        self.show(vol);
        b
    }

    /// `vol` is unpublished (its binds dropped first): its device is free
    /// again and ListVolumes no longer shows it.
    pub(crate) fn forget(&self, vol: &Volume) {
        lock(&self.claims).remove(&(vol.device.major, vol.device.minor));
        lock(&self.listed).remove(vol.id());
    }

    /// Every volume ListVolumes shows, with its device; one still
    /// publishing shows how far its walk is now.
    pub(crate) fn listed(&self) -> Vec<(VolumeInfo, Device)> {
        let listed: Vec<Listed> = lock(&self.listed).values().cloned().collect();
        listed
            .into_iter()
            .map(|mut l| {
                if let Some(job) = l.walk.as_ref().filter(|j| !j.finished()) {
                    l.info.state = VolumeState::Publishing;
                    l.info.ownership_done = job.visited();
                }
                (l.info, l.device)
            })
            .collect()
    }
}

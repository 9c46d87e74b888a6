//! The claims room: which volume holds each device and the sectors it
//! covers on its disk, publishes in flight included, so that "one disk,
//! one volume" (semantics.md §9) is checked without taking any volume's
//! slot. A publish claims its device first and keeps the claim when it
//! goes through; an unpublish releases it. Its mutex is a leaf (lock 3 of
//! table.rs), taken for one lookup or update, never across a syscall (a
//! device's sectors are read from sysfs before its claim).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use crust_protocols::sync::LockExt;

use super::error::Error;
use super::held::Held;
use super::volume::Volume;
use crate::model::{Device, Extent};

/// A device number (major, minor).
pub(crate) type DevNum = (u32, u32);

/// A device a volume holds (or a publish in flight).
#[derive(Clone, Debug)]
pub(crate) struct Claim {
    pub(crate) id: String,
    /// Its device node, for messages.
    pub(crate) device: PathBuf,
    /// The sectors it covers on its whole disk.
    pub(crate) extent: Extent,
}

/// The devices held (the module doc).
#[derive(Debug, Default)]
pub(crate) struct Claims {
    map: Mutex<BTreeMap<DevNum, Claim>>,
}

/// A device claimed for a publish in flight.
pub(crate) type DeviceClaim<'a> = Held<'a, DevNum, Claim>;

impl Claims {
    /// Claims `device` (whose sectors are `extent`) for volume `id`: refused
    /// when another volume holds the same device or one that shares a
    /// sector with it.
    pub(crate) fn claim(
        &self,
        device: &Device,
        id: &str,
        extent: Extent,
    ) -> Result<DeviceClaim<'_>, Error> {
        let key = (device.major, device.minor);
        let mut claims = self.map.locked();
        for (held, c) in claims.iter().filter(|(_, c)| c.id != id) {
            if *held == key {
                return Err(Error::DeviceInUse {
                    device: device.path.clone(),
                    other: c.id.clone(),
                });
            }
            if c.extent.overlaps(&extent) {
                return Err(Error::DeviceOverlaps {
                    device: device.path.clone(),
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
                device: device.path.clone(),
                extent,
            },
        );
        Ok(Held::new(&self.map, key))
    }

    /// Enters an adopted volume's device and sectors, whatever they overlap
    /// (recovery's call: both stay as they are mounted), and returns the
    /// claims it overlaps.
    pub(crate) fn adopt(&self, vol: &Volume, extent: Extent) -> Vec<Claim> {
        let mut claims = self.map.locked();
        let overlaps = claims
            .values()
            .filter(|c| c.extent.overlaps(&extent))
            .cloned()
            .collect();
        claims.insert(
            (vol.disk().major, vol.disk().minor),
            Claim {
                id: vol.id().to_string(),
                device: vol.disk().path.clone(),
                extent,
            },
        );
        // An encrypted volume's mapping is its too (a device of its own).
        if vol.encrypted.is_some() {
            claims.insert(
                (vol.device.major, vol.device.minor),
                Claim {
                    id: vol.id().to_string(),
                    device: vol.device.path.clone(),
                    extent: Extent {
                        disk: (vol.device.major, vol.device.minor),
                        start: 0,
                        sectors: u64::MAX,
                        partition: false,
                    },
                },
            );
        }
        overlaps
    }

    /// The volume that holds device `dev`, if one does.
    pub(crate) fn holder_of(&self, dev: DevNum) -> Option<String> {
        self.map.locked().get(&dev).map(|c| c.id.clone())
    }

    /// `vol` is unpublished: its device is free again.
    pub(crate) fn release(&self, vol: &Volume) {
        self.map.locked().retain(|_, c| c.id != vol.id());
    }
}

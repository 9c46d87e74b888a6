//! What the table answers about a published volume: its usage and
//! condition (semantics.md §5), its growth to its disk (§4), and the list of
//! every volume, which never waits for an operation in flight.

use std::os::fd::AsFd;
use std::time::Duration;

use slog::{info, Logger};

use super::block;
use super::error::Error;
use super::freeze::not_frozen;
use super::kernel::Kernel;
use super::lease::Freezer;
use super::listing::Listing;
use super::mounts::Mounts;
use super::request::{Expanded, VolumeInfo};
use super::volume::Volume;
use crate::cancel::Cancel;
use crate::device;
use crate::error::Result;
use crate::grow;
use crate::model::VolumeMode;
use crate::stats::{self, Condition, Measured};
use crate::sys::sysfs::Sysfs;

/// The parts a stats or an expand reads: the mounts, the disks, the freezes
/// (an expand writes, which a frozen volume refuses).
pub(crate) struct Query<'a, K: Kernel> {
    pub(crate) mounts: Mounts<'a, K>,
    pub(crate) sysfs: &'a Sysfs,
    pub(crate) leases: &'a Freezer<K::Hold>,
    pub(crate) log: &'a Logger,
}

impl<K: Kernel> Query<'_, K> {
    /// Usage and condition of `vol` (semantics.md §5).
    pub(crate) fn stats(&self, vol: &Volume) -> Result<(Option<Measured>, Condition)> {
        vol.not_publishing()?;
        let rel = vol.rel();
        let fs = match vol.mode() {
            VolumeMode::Filesystem(fs) => fs,
            VolumeMode::Block => return Ok(block::stats(vol, self.mounts.root, self.sysfs)),
        };
        let (usage, condition) = stats::check(
            self.sysfs,
            &stats::Expected {
                volume: stats::judge::Volume {
                    path: &vol.guest_path,
                    mount_id: vol.phase.mount_id(),
                    device: &vol.device,
                    read_only: vol.mounted_read_only(),
                    fs,
                },
                base: self.mounts.root.fd(),
                rel: &rel,
                fs_bytes: &|at| grow::fs_size_bytes(at, &vol.guest_path, &vol.device, fs).ok(),
            },
        );
        Ok((usage.map(Measured::Filesystem), condition))
    }

    /// Grows `vol`'s filesystem to its device (semantics.md §4); a block
    /// volume waits for its device to be `required_bytes`.
    pub(crate) fn expand(
        &self,
        vol: &Volume,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Expanded> {
        let id = vol.id();
        vol.not_publishing()?;
        not_frozen(self.leases, id)?;
        let fs = match vol.mode() {
            VolumeMode::Filesystem(fs) => fs,
            VolumeMode::Block => {
                drop(self.mounts.open_mount(vol)?);
                let kernel = self.mounts.kernel;
                return block::expand(
                    vol,
                    kernel,
                    self.sysfs,
                    self.log,
                    required_bytes,
                    timeout,
                    cancel,
                );
            }
        };
        if vol.mounted_read_only() {
            return Err(Error::ReadOnly(id.to_string()).into());
        }
        let fd = self.mounts.open_mount(vol)?;
        let current = grow::fs_size_bytes(fd.as_fd(), &vol.guest_path, &vol.device, fs)?;
        if required_bytes > 0 && required_bytes <= current {
            let device_bytes = device::size_bytes(&vol.device.path)?;
            grow::fits(&vol.guest_path, fs, &vol.device, current, device_bytes)?;
            return Ok(Expanded {
                capacity_bytes: current,
                device_bytes,
            });
        }
        let device_bytes =
            device::wait_for_size(self.sysfs, &vol.device, required_bytes, timeout, cancel)?;
        let capacity_bytes = grow::grow(
            fd.as_fd(),
            &vol.guest_path,
            &vol.device,
            fs,
            device_bytes,
            self.sysfs,
        )?;
        info!(self.log, "filesystem grown"; "volume" => id, "from" => current, "to" => capacity_bytes,
              "device_bytes" => device_bytes);
        Ok(Expanded {
            capacity_bytes,
            device_bytes,
        })
    }
}

/// Every published volume as `listing` shows it, without waiting for
/// operations in flight. The device's size, a block volume's read-only
/// flag and its freeze are as they are now.
pub(crate) fn list<K: Kernel>(
    listing: &Listing,
    leases: &Freezer<K::Hold>,
    kernel: &K,
) -> Vec<VolumeInfo> {
    let mut list = listing.all();
    for (info, dev) in &mut list {
        block::refresh(info, dev, kernel);
        info.frozen = leases.holding(&info.volume_id).map(|h| (h.freeze, h.left));
    }
    list.into_iter().map(|(info, _)| info).collect()
}

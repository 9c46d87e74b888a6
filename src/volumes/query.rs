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
use crate::luks2::mapping::{Live, Mapping};
use crate::model::VolumeMode;
use crate::stats::problem::Problem;
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
        let (measured, mut condition) = self.stats_of_device(vol)?;
        if let Some(problem) = self.mapping_problem(vol) {
            condition.abnormal = true;
            condition.message = match condition.problems.is_empty() {
                true => problem.to_string(),
                false => format!("{}; {problem}", condition.message),
            };
            condition.problems.push(problem);
        }
        Ok((measured, condition))
    }

    /// What is wrong with an encrypted volume's mapping, if anything: a
    /// suspended or missing mapping is not serving its filesystem.
    fn mapping_problem(&self, vol: &Volume) -> Option<Problem> {
        let enc = vol.encrypted.as_ref()?;
        let mapping = enc.mapping.name.clone();
        match self.mounts.kernel.mapping_live(&enc.mapping) {
            Ok(Live::Serving(dev)) if dev == enc.mapping.dev => self.tamper_problem(&enc.mapping),
            Ok(Live::Serving(_)) => Some(Problem::MappingGone {
                mapping,
                how: "another device now",
            }),
            Ok(Live::Suspended) => Some(Problem::MappingSuspended { mapping }),
            Ok(Live::NoTable) => Some(Problem::MappingGone {
                mapping,
                how: "without a live table",
            }),
            Ok(Live::Missing) => Some(Problem::MappingGone {
                mapping,
                how: "gone",
            }),
            Err(e) => Some(Problem::Device(format!(
                "the state of the volume's dm-crypt mapping {mapping} cannot be read: {e}"
            ))),
        }
    }

    /// What the kernel refused of a live mapping with integrity, if anything.
    fn tamper_problem(&self, m: &Mapping) -> Option<Problem> {
        let integrity = m.integrity.clone()?;
        let mapping = m.name.clone();
        match self.mounts.kernel.mapping_tampered(m) {
            Ok(0) => None,
            Ok(sectors) => Some(Problem::IntegrityMismatches {
                mapping,
                integrity,
                sectors,
            }),
            Err(e) => Some(Problem::Device(format!(
                "whether the kernel refused sectors of the volume's mapping {mapping} as tampered cannot be read: {e}"
            ))),
        }
    }

    /// Usage and condition of `vol`'s filesystem or block device.
    fn stats_of_device(&self, vol: &Volume) -> Result<(Option<Measured>, Condition)> {
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

    /// An encrypted volume's mapping, grown once its disk is
    /// `required_bytes` (waited for as a block volume's device is) to the
    /// disk's end; what the mapping must then be (0: as it is now). For a
    /// volume in the clear, `required_bytes` as it is.
    fn grow_mapping(
        &self,
        vol: &Volume,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<u64> {
        let Some(enc) = &vol.encrypted else {
            return Ok(required_bytes);
        };
        let disk_bytes =
            device::wait_for_size(self.sysfs, &enc.disk, required_bytes, timeout, cancel)?;
        let mapped = self
            .mounts
            .kernel
            .grow_mapping(&enc.mapping.name, disk_bytes)?;
        info!(self.log, "mapping grown with its disk"; "volume" => vol.id(),
              "mapping" => &enc.mapping.name, "disk_bytes" => disk_bytes, "mapping_bytes" => mapped);
        Ok(0)
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
        if vol.mounted_read_only() && vol.mode() != VolumeMode::Block {
            return Err(Error::ReadOnly(id.to_string()).into());
        }
        let required_bytes = self.grow_mapping(vol, required_bytes, timeout, cancel)?;
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

//! What the table answers about a published volume: its usage and
//! condition (semantics.md §5), its growth to its disk (§4), and the list of
//! every volume, which never waits for an operation in flight.

use std::os::fd::AsFd;
use std::time::Duration;

use slog::info;

use super::block::refresh;
use super::error::Error;
use super::request::{Expanded, VolumeInfo};
use super::table::Volumes;
use crate::cancel::Cancel;
use crate::device;
use crate::error::Result;
use crate::grow;
use crate::model::VolumeMode;
use crate::stats::{self, Condition, Measured};

impl Volumes {
    /// Usage and condition of a volume (semantics.md §5).
    pub fn stats(&self, id: &str, cancel: &Cancel) -> Result<(Option<Measured>, Condition)> {
        self.with_volume(id, cancel, |vol| {
            vol.not_publishing()?;
            let rel = vol.rel();
            let fs = match vol.mode() {
                VolumeMode::Filesystem(fs) => fs,
                VolumeMode::Block => return Ok(self.stats_block(vol)),
            };
            let (usage, condition) = stats::check(
                self.sysfs(),
                &stats::Expected {
                    volume: stats::judge::Volume {
                        path: &vol.guest_path,
                        mount_id: vol.phase.mount_id(),
                        device: &vol.device,
                        read_only: vol.mounted_read_only(),
                        fs,
                    },
                    base: self.root_dir().fd(),
                    rel: &rel,
                    fs_bytes: &|at| grow::fs_size_bytes(at, &vol.guest_path, &vol.device, fs).ok(),
                },
            );
            Ok((usage.map(Measured::Filesystem), condition))
        })
    }

    /// Grows a volume's filesystem to its device (semantics.md §4).
    pub fn expand(
        &self,
        id: &str,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Expanded> {
        let cancel = &self.stop_with(cancel);
        self.with_volume(id, cancel, |vol| {
            vol.not_publishing()?;
            self.not_frozen(id)?;
            let fs = match vol.mode() {
                VolumeMode::Filesystem(fs) => fs,
                VolumeMode::Block => return self.expand_block(vol, required_bytes, timeout, cancel),
            };
            if vol.mounted_read_only() {
                return Err(Error::ReadOnly(id.to_string()).into());
            }
            let fd = self.open_mount(vol)?;
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
                device::wait_for_size(self.sysfs(), &vol.device, required_bytes, timeout, cancel)?;
            let capacity_bytes = grow::grow(
                fd.as_fd(),
                &vol.guest_path,
                &vol.device,
                fs,
                device_bytes,
                self.sysfs(),
            )?;
            info!(self.log(), "filesystem grown"; "volume" => id, "from" => current, "to" => capacity_bytes,
                  "device_bytes" => device_bytes);
            Ok(Expanded {
                capacity_bytes,
                device_bytes,
            })
        })
    }

    /// Every published volume, without waiting for operations in flight.
    /// The device's size, and a block volume's read-only flag, are the
    /// kernel's now.
    pub fn list(&self) -> Vec<VolumeInfo> {
        let mut list = self.index().listed();
        for (info, dev) in &mut list {
            refresh(info, dev);
            info.frozen = self
                .freezer()
                .holding(&info.volume_id)
                .map(|h| (h.freeze, h.left));
        }
        list.into_iter().map(|(info, _)| info).collect()
    }
}

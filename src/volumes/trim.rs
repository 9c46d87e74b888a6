//! Giving a volume's free space back to its disk (semantics.md §10): FITRIM
//! over the filesystem, range by range, so the caller's deadline, its going
//! away or a shutdown stop it between two ranges with what was done said.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use slog::{info, Logger};

use super::error::Error;
use super::freeze::not_frozen;
use super::kernel::Kernel;
use super::lease::Freezer;
use super::mounts::Mounts;
use super::volume::Volume;
use crate::cancel::Cancel;
use crate::error::Result;
use crate::grow;
use crate::model::VolumeMode;
use crate::quiesce;

/// Bytes of the filesystem one FITRIM covers: small enough that a
/// deadline is honoured within a range's time, large enough that a
/// terabyte takes a thousand calls, not millions.
pub const RANGE_BYTES: u64 = 1 << 30;

/// What a trim answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trimmed {
    /// Bytes the filesystem discarded.
    pub trimmed_bytes: u64,
    /// Bytes of the filesystem the ranges covered.
    pub covered_bytes: u64,
    /// How long it took.
    pub duration: Duration,
}

/// Discards the free extents of at least `min_extent` bytes of `vol`'s
/// filesystem (held under its lock), range by range until `cancel` fires.
pub(crate) fn trim<K: Kernel>(
    vol: &Volume,
    mounts: Mounts<'_, K>,
    leases: &Freezer<K::Hold>,
    log: &Logger,
    min_extent: u64,
    cancel: &Cancel,
) -> Result<Trimmed> {
    let id = vol.id();
    let VolumeMode::Filesystem(fs) = vol.mode() else {
        return Err(Error::NoFilesystem {
            id: id.to_string(),
            what: "trimmed",
        }
        .into());
    };
    vol.not_publishing()?;
    if vol
        .encrypted
        .as_ref()
        .is_some_and(|e| !e.mapping.allow_discards)
    {
        return Err(Error::DiscardsNotAllowed(id.to_string()).into());
    }
    not_frozen(leases, id)?;
    if vol.mounted_read_only() {
        return Err(quiesce::Error::ReadOnly {
            path: vol.guest_path.clone(),
        }
        .into());
    }
    let at = mounts.open_mount(vol)?;
    let total = grow::fs_size_bytes(at.as_fd(), &vol.guest_path, &vol.device, fs)?;
    let fs = mounts.kernel.open_fs(at.as_fd(), &vol.guest_path)?;
    let start = Instant::now();
    let (mut done, mut trimmed) = (0u64, 0u64);
    while done < total {
        if let Some(why) = cancel.why() {
            info!(log, "trim stopped"; "volume" => id, "done_bytes" => done,
                  "total_bytes" => total, "trimmed_bytes" => trimmed);
            return Err(Error::TrimStopped {
                id: id.to_string(),
                why,
                done,
                total,
                trimmed,
            }
            .into());
        }
        let len = RANGE_BYTES.min(total - done);
        let discarded = mounts
            .kernel
            .trim(&fs, &vol.guest_path, done, len, min_extent)?;
        trimmed = trimmed.saturating_add(discarded);
        done += len;
    }
    info!(log, "volume trimmed"; "volume" => id, "trimmed_bytes" => trimmed,
          "total_bytes" => total);
    Ok(Trimmed {
        trimmed_bytes: trimmed,
        covered_bytes: total,
        duration: start.elapsed(),
    })
}

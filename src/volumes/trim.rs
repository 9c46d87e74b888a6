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

/// How far a trim got: bytes of the filesystem covered, bytes given
/// back, time spent in FITRIM. A scheduled trim that yields keeps it and
/// goes on from `done`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub done: u64,
    pub trimmed: u64,
    pub spent: Duration,
}

/// A volume's filesystem opened for FITRIM, and its size.
pub(crate) struct Target<F> {
    fs: F,
    /// The filesystem's size in bytes.
    pub(crate) total: u64,
}

/// `vol`'s filesystem (held under its lock), opened for FITRIM: refused
/// for a block volume, one still publishing, an encrypted one without
/// allow_discards, a frozen one and a read-only one.
pub(crate) fn target<K: Kernel>(
    vol: &Volume,
    mounts: Mounts<'_, K>,
    leases: &Freezer<K::Hold>,
) -> Result<Target<K::Fs>> {
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
    let total = mounts
        .kernel
        .fs_bytes(at.as_fd(), &vol.guest_path, &vol.device, fs)?;
    let fs = mounts.kernel.open_fs(at.as_fd(), &vol.guest_path)?;
    Ok(Target { fs, total })
}

/// FITRIM of `t` in ranges of `range` bytes from `p.done` to its end,
/// adding to `p`; before each range, `stop` may end it early. True when it
/// reached the end.
pub(crate) fn ranges<K: Kernel>(
    kernel: &K,
    t: &Target<K::Fs>,
    path: &std::path::Path,
    (range, min_extent): (u64, u64),
    p: &mut Progress,
    mut stop: impl FnMut() -> bool,
) -> Result<bool> {
    while p.done < t.total {
        if stop() {
            return Ok(false);
        }
        let len = range.min(t.total - p.done);
        let start = Instant::now();
        let discarded = kernel.trim(&t.fs, path, p.done, len, min_extent);
        p.spent = p.spent.saturating_add(start.elapsed());
        p.trimmed = p.trimmed.saturating_add(discarded?);
        p.done += len;
    }
    Ok(true)
}

/// Discards the free extents of at least `min_extent` bytes of `vol`'s
/// filesystem (held under its lock), range by range until `cancel` fires,
/// once `turn` (the agent's one trim at a time) is had.
pub(crate) fn trim<K: Kernel, G>(
    vol: &Volume,
    mounts: Mounts<'_, K>,
    leases: &Freezer<K::Hold>,
    log: &Logger,
    min_extent: u64,
    cancel: &Cancel,
    turn: impl FnOnce() -> Result<G>,
) -> Result<Trimmed> {
    let id = vol.id();
    let t = target(vol, mounts, leases)?;
    let _turn = turn()?;
    let start = Instant::now();
    let mut p = Progress::default();
    let mut why = None;
    let whole = ranges(
        mounts.kernel,
        &t,
        &vol.guest_path,
        (RANGE_BYTES, min_extent),
        &mut p,
        || {
            why = cancel.why();
            why.is_some()
        },
    )?;
    let (done, total, trimmed) = (p.done, t.total, p.trimmed);
    if let (false, Some(why)) = (whole, why) {
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
    info!(log, "volume trimmed"; "volume" => id, "trimmed_bytes" => trimmed,
          "total_bytes" => total);
    Ok(Trimmed {
        trimmed_bytes: trimmed,
        covered_bytes: total,
        duration: start.elapsed(),
    })
}

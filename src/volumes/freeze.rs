//! Freezing volumes for a consistent snapshot, and thawing them
//! (semantics.md §10): all or none, each volume under its own lock in
//! turn. A freeze is a lease (lease/): recorded before anything is frozen,
//! ended only by its id, its timer, an unpublish, the agent stopping or a
//! forced thaw. This file is the table's side of it: which volumes can be
//! frozen, the kernel's FIFREEZE on each volume's own mount, and a thaw.

use std::os::fd::AsFd;

use slog::{info, Logger};

use super::error::Error;
use super::kernel::Kernel;
use super::lease::{Error as LeaseError, Freezer, How, Thaw as Held};
use super::mounts::Mounts;
use super::volume::Volume;
use crate::error::Result;
use crate::model::VolumeMode;

pub use super::lease::Frozen;

/// What a thaw ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Thaw {
    /// The freeze with this id, and only it.
    Freeze(String),
    /// Whatever holds these volumes (an operator's forced thaw).
    Force(Vec<String>),
}

/// Freezes `vol` (held under its lock) for lease `lease`: refused for a
/// block volume, one not completely published, one frozen already.
pub(crate) fn freeze_one<K: Kernel>(
    vol: &Volume,
    lease: &str,
    mounts: Mounts<'_, K>,
    leases: &Freezer<K::Hold>,
) -> Result<()> {
    if vol.mode() == VolumeMode::Block {
        return Err(Error::NoFilesystem {
            id: vol.id().to_string(),
            what: "frozen",
        }
        .into());
    }
    vol.not_publishing()?;
    if !vol.phase.complete() {
        return Err(Error::StillPublishing {
            id: vol.id().to_string(),
            visited: 0,
        }
        .into());
    }
    let at = mounts.open_mount(vol)?;
    leases.freeze_part(lease, vol.id(), || {
        mounts.kernel.freeze(at.as_fd(), &vol.guest_path)
    })
}

/// Refuses what writes to a frozen volume (expand, a bind, a walk, a
/// trim), naming the freeze.
pub(crate) fn not_frozen<H: Held>(leases: &Freezer<H>, id: &str) -> Result<()> {
    match leases.holding(id) {
        Some(h) => Err(LeaseError::Frozen {
            id: id.to_string(),
            freeze: h.freeze,
            seconds_left: h.left.as_secs(),
        }
        .into()),
        None => Ok(()),
    }
}

/// Ends a freeze (ThawVolumes); answers the volumes it thawed. A forced
/// thaw thaws every volume it can, then reports the ones not `published`.
pub(crate) fn thaw<H: Held>(
    leases: &Freezer<H>,
    log: &Logger,
    what: &Thaw,
    published: impl Fn(&str) -> bool,
) -> Result<Vec<String>> {
    match what {
        Thaw::Freeze(id) => {
            let thawed = leases.thaw(id);
            info!(log, "freeze thawed by its id"; "freeze" => id,
                  "thawed" => thawed.as_ref().map_or_else(|e| e.to_string(), |t| t.join(" ")));
            thawed
        }
        Thaw::Force(ids) => {
            let thawed = leases.end_volumes(ids, How::Forced);
            info!(log, "forced thaw"; "volumes" => ids.join(" "), "thawed" => thawed.join(" "));
            let missing: Vec<&str> = ids
                .iter()
                .filter(|id| !published(id))
                .map(String::as_str)
                .collect();
            if missing.is_empty() {
                return Ok(thawed);
            }
            let missing = match missing.as_slice() {
                [one] => format!("volume {one} is"),
                many => format!("volumes {} are", many.join(", ")),
            };
            let thawed = if thawed.is_empty() {
                "none".to_string()
            } else {
                thawed.join(", ")
            };
            Err(LeaseError::Missing { missing, thawed }.into())
        }
    }
}

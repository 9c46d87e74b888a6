//! Freezing volumes for a consistent snapshot, and thawing them
//! (semantics.md §10): all or none, each volume under its own lock in
//! turn. A freeze is a lease (lease/): recorded before anything is frozen,
//! ended only by its id, its timer, an unpublish, the agent stopping or a
//! forced thaw. This file is the table's side of it: which volumes can be
//! frozen, and the kernel's FIFREEZE on each volume's own mount.

use std::os::fd::AsFd;
use std::time::Duration;

use slog::info;

use super::error::Error;
use super::lease::{Error as LeaseError, Hold, How};
use super::table::Volumes;
use super::volume::Volume;
use crate::cancel::Cancel;
use crate::error::Result;
use crate::model::VolumeMode;
use crate::quiesce;

pub use super::lease::Frozen;

/// What a thaw ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Thaw {
    /// The freeze with this id, and only it.
    Freeze(String),
    /// Whatever holds these volumes (an operator's forced thaw).
    Force(Vec<String>),
}

impl Volumes {
    /// Freezes the filesystems of `ids` (distinct, validated), all or none,
    /// until its id thaws them or `timeout` passes. `asked`: the caller's
    /// own id for it, which answers a retry of the same call again.
    pub fn freeze(
        &self,
        ids: &[String],
        timeout: Duration,
        asked: Option<&str>,
        cancel: &Cancel,
    ) -> Result<Frozen> {
        self.accepting()?;
        let cancel = &self.stop_with(cancel);
        let frozen = self.freezer().freeze(
            asked,
            ids,
            timeout,
            |id, vol| self.with_volume(vol, cancel, |v| self.freeze_one(v, id)),
            // A caller gone before the answer would hold an id it never heard.
            || Ok(cancel.check(|| format!("freezing {}", ids.join(", ")))?),
        )?;
        info!(self.log(), "volumes frozen"; "freeze" => &frozen.freeze_id, "volumes" => ids.join(" "),
              "timeout_ms" => u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        Ok(frozen)
    }

    /// Freezes one volume for lease `id`, under its lock: refused for a
    /// block volume, one not completely published, one frozen already.
    fn freeze_one(&self, vol: &mut Volume, id: &str) -> Result<()> {
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
        let at = self.open_mount(vol)?;
        let dir = quiesce::open(at.as_fd(), &vol.guest_path)?;
        let path = vol.guest_path.clone();
        self.freezer().freeze_part(id, vol.id(), || {
            quiesce::freeze(&dir, &path)?;
            Ok(Hold::new(dir, path))
        })
    }

    /// Refuses what writes to a frozen volume (expand, a bind, a walk, a
    /// trim), naming the freeze.
    pub(crate) fn not_frozen(&self, id: &str) -> Result<()> {
        match self.freezer().holding(id) {
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
    /// thaw thaws every volume it can, then reports the ones not published.
    pub fn thaw(&self, what: &Thaw) -> Result<Vec<String>> {
        match what {
            Thaw::Freeze(id) => {
                let thawed = self.freezer().thaw(id);
                info!(self.log(), "freeze thawed by its id"; "freeze" => id,
                      "thawed" => thawed.as_ref().map_or_else(|e| e.to_string(), |t| t.join(" ")));
                thawed
            }
            Thaw::Force(ids) => {
                let thawed = self.freezer().end_volumes(ids, How::Forced);
                info!(self.log(), "forced thaw"; "volumes" => ids.join(" "), "thawed" => thawed.join(" "));
                let missing: Vec<&str> = ids
                    .iter()
                    .filter(|id| self.existing_slot(id).is_none())
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

    /// Ends every freeze (the agent exits leaving its volumes mounted);
    /// answers how many volumes were frozen.
    pub fn thaw_all(&self) -> usize {
        self.freezer().end_all(How::Stopped)
    }

    /// Ends every freeze and stops the freeze timer for good, before the
    /// table lets go of its root: no timer of this table can act on a
    /// volume another table on the same root froze later.
    pub fn close_freezes(&self) -> usize {
        let n = self.thaw_all();
        self.freezer().close();
        n
    }
}

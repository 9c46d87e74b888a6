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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::code::Code;
    use crate::model::{FsType, MountId};
    use crate::sys::beneath::Root;
    use crate::volumes::fake::Fake;
    use crate::volumes::lease::Ledger;
    use crate::volumes::phase::Phase;
    use crate::volumes::volume::tests::sample;

    /// What one volume's freeze refuses (a block volume, a publish not
    /// finished, a mount that is not the volume's), and that a volume
    /// frozen by one lease is refused to another, naming it.
    #[test]
    fn a_volume_is_frozen_only_when_it_is_a_finished_filesystem_on_its_own_mount() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::open(dir.path()).unwrap();
        let fake = Fake::default();
        let log = crate::logging::discard();
        let leases = Freezer::open(Ledger::open(&root).unwrap(), log.clone(), |_| Ok(false));
        let mounts = Mounts {
            root: &root,
            kernel: &fake,
        };
        let disk = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
        std::fs::create_dir_all(root.path().join("volumes/vol-1")).unwrap();
        let id = fake.mount_behind(&disk, &root.path().join("volumes/vol-1"));
        let mut vol = sample();
        vol.device = disk;
        vol.guest_path = root.path().join("volumes/vol-1");
        vol.phase = Phase::Published(Some(id));
        let freeze = |vol: &Volume, lease: &str| {
            let ids = [vol.id().to_string()];
            leases.freeze(
                Some(lease),
                &ids,
                Duration::from_secs(60),
                |l, _| freeze_one(vol, l, mounts, &leases),
                || Ok(()),
            )
        };
        let code = |r: Result<Frozen>| r.map(|_| ()).map_err(|e| e.code());
        let mut block = vol.clone();
        block.spec.mode = VolumeMode::Block;
        assert_eq!(
            code(freeze(&block, "f-block")),
            Err(Code::FailedPrecondition)
        );
        let mut unfinished = vol.clone();
        unfinished.phase = Phase::Mounted(id);
        assert_eq!(
            code(freeze(&unfinished, "f-half")),
            Err(Code::FailedPrecondition)
        );
        let mut moved = vol.clone();
        moved.phase = Phase::Published(Some(MountId(1)));
        assert_eq!(
            code(freeze(&moved, "f-moved")),
            Err(Code::FailedPrecondition)
        );
        assert!(!fake.frozen(&vol.guest_path));
        freeze(&vol, "f-1").unwrap();
        assert!(fake.frozen(&vol.guest_path));
        let e = freeze(&vol, "f-2").unwrap_err();
        assert!(e.to_string().contains("f-1"), "{e}");
        assert_eq!(
            thaw(&leases, &log, &Thaw::Freeze("f-1".into()), |_| true).unwrap(),
            ["vol-1"]
        );
        assert!(!fake.frozen(&vol.guest_path));
        let e = not_frozen(&leases, "vol-1");
        assert!(e.is_ok());
    }
}

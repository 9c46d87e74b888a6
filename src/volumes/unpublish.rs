//! Unpublishing a volume (semantics.md §2): its fsGroup walk stopped, its
//! freeze ended, its binds (last made first), its own mount (`takedown`),
//! any mount of its disk left beneath the root (moved or copied behind the
//! agent's back), its record, and what the table's maps hold of it.
//! Nothing is written on the way, so an unpublish needs no space in the
//! state directory.

use slog::{warn, Logger};

use super::claims::Claims;
use super::failures::Failures;
use super::kernel::Kernel;
use super::lease::{Freezer, How};
use super::state::Store;
use super::takedown::Takedown;
use super::targets::Targets;
use super::volume::Volume;
use crate::cancel::Cancel;
use crate::error::Result;

/// The parts an unpublish lets go of the volume in.
pub(crate) struct Unpublisher<'a, K: Kernel> {
    pub(crate) takedown: Takedown<'a, K>,
    pub(crate) store: &'a Store,
    pub(crate) claims: &'a Claims,
    pub(crate) targets: &'a Targets,
    pub(crate) leases: &'a Freezer<K::Hold>,
    pub(crate) failures: &'a Failures,
    pub(crate) log: &'a Logger,
}

impl<K: Kernel> Unpublisher<'_, K> {
    /// Unpublishes the volume in `slot` (volume `id`'s, held by the
    /// caller), leaving the slot empty. False when there was none. Stopped half-way, the volume
    /// stays with what is still up, and ListVolumes shows that.
    pub(crate) fn run(&self, id: &str, slot: &mut Option<Volume>, cancel: &Cancel) -> Result<bool> {
        let Some(vol) = slot.as_mut() else {
            // No volume; a mapping a failed publish of it could not remove
            // goes now, so that some call can always remove it.
            self.takedown.leftover_mapping(id, self.store.owner())?;
            return Ok(false);
        };
        // A publish's fsGroup walk still running is stopped first, and
        // waited for until it let go of the mount (milliseconds: it looks
        // at its token between two entries).
        if let Some(job) = vol.phase.job() {
            job.stop_and_wait(vol.id(), cancel)?;
            vol.phase.walk_stopped();
        }
        // Thawed first: a frozen filesystem would hang its flush and unmount.
        self.leases
            .end_volumes(&[vol.id().to_string()], How::Unpublished);
        self.failures.forget(vol.id());
        // Nothing is written on the way: an unpublish needs no space in the
        // state directory. A record that still lists binds taken down (if
        // this stops half-way) lists only what recovery drops; the table in
        // memory follows every unmount, so ListVolumes stays true.
        while let Some(b) = vol.binds.last() {
            self.takedown
                .take_down(&b.rel, b.mount_identity(&vol.device))?;
            self.targets.drop_bind(vol, vol.binds.len() - 1);
        }
        self.takedown.volume(vol)?;
        // Never OK while the disk is still mounted beneath the root.
        self.takedown.leftovers(vol)?;
        self.takedown.unmap(vol)?;
        // Unlinking needs no space; where even that fails (a read-only or
        // failing state filesystem), every mount is down all the same, and
        // the record names a volume whose mount is gone, which recovery drops.
        if let Err(e) = self.store.remove(vol.id()) {
            warn!(self.log, "could not remove the record of an unpublished volume; the next start drops it";
                  "volume" => vol.id(), "error" => %e);
        }
        self.claims.release(vol);
        *slot = None;
        Ok(true)
    }
}

//! The scheduled trim itself (`Scheduled`): each volume that is due, one
//! at a time, under its slot, in ranges, yielding between two ranges to
//! any call that waits for the volume or for the trim turn, and to a
//! shutdown. Nothing here waits for a lock: the turn and the slot are only
//! tried, and a trim that cannot have them is tried again soon.

use std::time::Instant;

use slog::{info, warn, Logger};

use super::schedule::{Due, Schedule, BUSY_RETRY, YIELD_RETRY};
use super::turn::Turn;
use crate::cancel::Token;
use crate::volumes::kernel::Kernel;
use crate::volumes::lease::Freezer;
use crate::volumes::mounts::Mounts;
use crate::volumes::slots::Slots;
use crate::volumes::trim;
use crate::volumes::volume::Volume;

/// Bytes of the filesystem one scheduled FITRIM covers: a call that comes
/// meanwhile waits for at most one such range.
pub const SCHEDULED_RANGE_BYTES: u64 = 256 << 20;

/// The parts a scheduled trim works with.
pub(crate) struct Scheduled<'a, K: Kernel> {
    pub(crate) slots: &'a Slots,
    pub(crate) schedule: &'a Schedule,
    pub(crate) turn: &'a Turn,
    pub(crate) mounts: Mounts<'a, K>,
    pub(crate) leases: &'a Freezer<K::Hold>,
    /// Shutdown's token: a trim stops between two ranges when it fires.
    pub(crate) stop: &'a Token,
    pub(crate) log: &'a Logger,
}

/// Why `vol` is not trimmed now, if it is not: frozen, or its publish not
/// finished (its fsGroup walk runs, or a restart found it unfinished).
pub(crate) fn busy<H: crate::volumes::lease::Thaw>(
    vol: &Volume,
    leases: &Freezer<H>,
) -> Option<&'static str> {
    if !vol.phase.complete() {
        return Some("its publish has not finished");
    }
    if leases.holding(vol.id()).is_some() {
        return Some("it is frozen");
    }
    None
}

/// Milliseconds since the epoch, now.
pub(crate) fn unix_ms() -> i64 {
    i64::try_from(crate::volumes::lease::unix_ms()).unwrap_or(i64::MAX)
}

impl<K: Kernel> Scheduled<'_, K> {
    /// Runs every trim due at `now`, one at a time; stops at a shutdown.
    pub(crate) fn run_due(&self, now: Instant) {
        for due in self.schedule.due(now) {
            if self.stop.fired() {
                return;
            }
            let id = &due.id;
            // A fault in one volume's trim fails that trim, not the runner:
            // the other volumes' schedules (and this one's next) go on.
            let one = std::panic::AssertUnwindSafe(|| self.run_one(&due, now));
            if std::panic::catch_unwind(one).is_err() {
                let why = format!("the agent hit an internal fault in the scheduled trim of volume {id}; the volume keeps working, and the next trim is tried at its time");
                warn!(self.log, "scheduled trim failed"; "volume" => id, "error" => &why);
                self.schedule.ended(&due, now, unix_ms(), Err(why));
            }
            // The slot's map keeps no empty slot this trim held on to.
            self.slots.forget(id);
        }
    }

    fn run_one(&self, due: &Due, now: Instant) {
        let id = due.id.as_str();
        let Some(_turn) = self.turn.try_take() else {
            return self.schedule.later(due, now, YIELD_RETRY);
        };
        let Some(slot) = self.slots.get(id) else {
            return;
        };
        let Some(guard) = slot.try_lock() else {
            return self.schedule.later(due, now, YIELD_RETRY);
        };
        let Some(vol) = guard.as_ref() else {
            return;
        };
        if busy(vol, self.leases).is_some() {
            return self.schedule.later(due, now, BUSY_RETRY);
        }
        // The volume under the slot is the one `due` was of only while its
        // entry is: one published again since has its own (or none).
        let Some(mut p) = self.schedule.resume(due) else {
            return;
        };
        let kernel = self.mounts.kernel;
        let result = trim::target(vol, self.mounts, self.leases).and_then(|t| {
            trim::ranges(
                kernel,
                &t,
                &vol.guest_path,
                (SCHEDULED_RANGE_BYTES, 0),
                &mut p,
                || slot.waiting() || self.turn.wanted() || self.stop.fired(),
            )
        });
        drop(guard);
        let ended = now + p.spent;
        match result {
            Ok(true) => {
                if p.trimmed > 0 {
                    info!(self.log, "scheduled trim done"; "volume" => id,
                          "trimmed_bytes" => p.trimmed, "spent_us" => p.spent.as_micros());
                }
                self.schedule.ended(due, ended, unix_ms(), Ok(p));
            }
            Ok(false) => self.schedule.yielded(due, ended, p),
            Err(e) => {
                warn!(self.log, "scheduled trim failed; the volume keeps working, and the next trim is tried at its time";
                      "volume" => id, "error" => %e);
                self.schedule
                    .ended(due, ended, unix_ms(), Err(e.to_string()));
            }
        }
    }
}

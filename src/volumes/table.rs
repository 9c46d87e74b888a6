//! The volume table's façade: it owns the parts, takes a volume's slot for
//! each operation and hands the operation the parts it needs, named in its
//! signature (`Publisher`, `Unpublisher`, `Binder`, `Query`, the freeze and
//! trim steps); no part is handed out whole. What a slot's volume looks
//! like when the operation lets go of it is what ListVolumes shows.
//!
//! The parts, each owning its state: the slots (`slots`), the records
//! (`state`), the devices claimed (`claims`), the bind targets and their
//! limit (`targets`), the list (`listing`), the freezes (`lease/`), the
//! failed publishes (`failures`) and Shutdown's stop (`stop`).
//!
//! # Locks, and the order they are taken in
//!
//! 1. `slots`, the map of slots (`slots.rs`): held only to find, make or
//!    drop a slot, never while waiting for anything.
//! 2. A volume's slot: held for a whole operation on that volume, I/O and
//!    waits included. It is taken in turn, with the request's cancellation
//!    (`Slot::lock`), so a request waiting behind a long walk gives up at
//!    its deadline, when its caller goes, or at shutdown, and waiters are
//!    served in the order they came. No operation holds two slots.
//! 3. The maps of the claims, the targets and the listing, under a slot
//!    or without one: each taken for one lookup or update, one at a time,
//!    never while another of them is held, never across a syscall (a
//!    device's sectors are read from sysfs before its claim). The listing
//!    is updated as a slot is let go, while it is still held.
//! 4. The state store's `problem` note: a leaf, taken alone.
//! 5. A walk job's phase (walking/): a leaf. Unpublish, holding a slot,
//!    waits on it for the walk to let go of the mount; the walk's thread
//!    takes the slot only after it let go, with a cancellation Unpublish
//!    fires, so the two never wait for each other.
//! 6. The leases' record lock, then their map (lease/), and the failed
//!    publishes' map (failures.rs): the maps are leaves, each taken alone
//!    for one lookup or update, never across a syscall.
//! 7. `unlocks` (unlocks.rs): one key derivation at a time, under a slot,
//!    held across the derivation (seconds of CPU, never a wait on anything
//!    else), and waited for with the request's cancellation, so a publish
//!    behind another gives up at its deadline.
//! 8. The trim turn (trimming/turn.rs): one trim at a time. A caller's
//!    TrimVolume waits for it under its volume's slot, with its
//!    cancellation; the schedule's runner only tries it, then only tries
//!    the volume's slot (`Slot::try_lock`), so it never waits while holding
//!    anything and nothing waits for it longer than one range of FITRIM:
//!    between two ranges it lets both go when a call waits for either.
//!    The schedule's own map (trimming/schedule.rs) is a leaf.
//!
//! So a thread holds at most: a slot, then one of the maps, the store's
//! note, a job's phase, `unlocks` or the trim turn, in that order (the
//! runner: the turn, then a slot it found free); nothing ever waits for a
//! slot while holding anything else.
//!
//! # Size
//!
//! The operations the wire calls from a closure of its own (publish,
//! bind_checked, unmount_checked, expand, freeze, thaw, trim) are kept out
//! of line (`#[inline(never)]`): inlined into those closures, they cost the agent
//! 3,136 bytes (2,103,104 against 2,099,968, measured with the release
//! profile), and the agent's size is bounded.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use slog::{info, warn, Logger};

use super::bind::Binder;
use super::claims::Claims;
use super::error::Error;
use super::failures::{Failure, Failures};
use super::freeze::{self, Frozen, Thaw};
use super::health::{self, Said};
use super::kernel::{Kernel, Linux};
use super::lease::{Freezer, Ledger};
use super::listing::Listing;
use super::mounts::Mounts;
use super::publish::{self, Publisher};
use super::query::{self, Query};
use super::recover::{thaw_at, thaw_left_frozen, Recovery};
use super::request::{BindOutcome, BindRequest, Expanded, PublishRequest, Published, VolumeInfo};
use super::slots::{Slot, Slots};
use super::state::Store;
use super::stop::Stop;
use super::takedown::Takedown;
use super::targets::Targets;
use super::trim::{self, Trimmed};
use super::trimming::run::unix_ms;
use super::trimming::run::Scheduled;
use super::trimming::schedule::Schedule;
use super::trimming::turn::Turn;
use super::unlocks::Unlocks;
use super::unpublish::Unpublisher;
use super::volume::Volume;
use super::walking::{self, Outcome, WalkJob};
use crate::cancel::Cancel;
use crate::error::Result;
use crate::keys;
use crate::ownership::walk::Report;
use crate::stats::{Condition, Measured};
use crate::sys::beneath::Root;
use crate::sys::sysfs::Sysfs;
use crate::validate::{self, Invalid};

/// The agent's volumes, on the kernel `K`: the running one, or in the
/// table's tests a fake.
pub struct Volumes<K: Kernel = Linux> {
    /// The agent's root, opened once: what every path the table acts on
    /// is resolved beneath.
    root: Root,
    kernel: K,
    /// Where disks are found and their sectors read.
    sysfs: Sysfs,
    /// Where encrypted volumes' keys are resolved from.
    keys: keys::resolve::Config,
    /// One key derivation at a time.
    unlocks: Unlocks,
    log: Logger,
    /// One slot per volume id (locks 1 and 2 of the module doc).
    slots: Slots,
    /// `<root>/state`: the records.
    store: Store,
    claims: Claims,
    targets: Targets,
    listing: Listing,
    leases: Arc<Freezer<K::Hold>>,
    failures: Failures,
    stop: Stop,
    /// The volumes trimmed on a schedule, and the runner's wait.
    schedule: Arc<Schedule>,
    /// One trim at a time, a caller's or the schedule's.
    turn: Turn,
    /// The table itself, for the threads of fsGroup walks, which finish
    /// their publish under the volume's slot long after the call.
    me: Weak<Volumes<K>>,
}

impl Volumes {
    /// Opens the table at `root` (created if missing; canonicalized, so a
    /// root given through a symlink is the same root) and takes back the
    /// volumes of a previous run (`recover`).
    pub fn open(root: &Path, sysfs: Sysfs, log: Logger) -> Result<Arc<Volumes>> {
        Volumes::open_on(Linux, root, sysfs, log)
    }

    /// `open`, with encrypted volumes' keys resolved as `keys` says (the
    /// Confidential Data Hub's socket).
    pub fn open_with_keys(
        root: &Path,
        sysfs: Sysfs,
        log: Logger,
        keys: keys::resolve::Config,
    ) -> Result<Arc<Volumes>> {
        Volumes::open_keyed(Linux, root, sysfs, log, keys, false)
    }
}

impl<K: Kernel> Volumes<K> {
    /// `open`, on `kernel`.
    pub(crate) fn open_on(
        kernel: K,
        root: &Path,
        sysfs: Sysfs,
        log: Logger,
    ) -> Result<Arc<Volumes<K>>> {
        let keys = keys::resolve::Config::default();
        Volumes::open_keyed(kernel, root, sysfs, log, keys, false)
    }

    /// `open_on`, with scheduled trims run only by `run_due_trims`, never
    /// by a thread: the tests say when it is.
    #[cfg(test)]
    pub(crate) fn open_manual(
        kernel: K,
        root: &Path,
        sysfs: Sysfs,
        log: Logger,
    ) -> Result<Arc<Volumes<K>>> {
        let keys = keys::resolve::Config::default();
        Volumes::open_keyed(kernel, root, sysfs, log, keys, true)
    }

    /// `open_on`, with encrypted volumes' keys resolved as `keys` says;
    /// `manual`: no runner thread for scheduled trims.
    fn open_keyed(
        kernel: K,
        root: &Path,
        sysfs: Sysfs,
        log: Logger,
        keys: keys::resolve::Config,
        manual: bool,
    ) -> Result<Arc<Volumes<K>>> {
        let root = Root::open(root)?;
        root.own_dir("volumes", 0o750)?;
        let store = Store::open(&root)?;
        let (claims, targets) = (Claims::default(), Targets::default());
        // Before anything is taken back or down: a frozen filesystem hangs
        // its writers and its unmount.
        let leases = Freezer::open(Ledger::open(&root)?, log.clone(), |vol| {
            thaw_at(&root, &kernel, vol)
        });
        thaw_left_frozen(&root, &kernel, &store, &log);
        let adopted = Recovery {
            root: &root,
            kernel: &kernel,
            store: &store,
            claims: &claims,
            targets: &targets,
            sysfs: &sysfs,
            log: &log,
        }
        .run()?;
        let listing = Listing::default();
        let mut scheduled = Vec::new();
        for vol in &adopted {
            listing.show(vol.id(), Some(vol));
            scheduled.push((vol.id().to_string(), vol.spec.trim_interval_s));
        }
        let v = Arc::new_cyclic(|me| Volumes {
            root,
            kernel,
            sysfs,
            keys,
            unlocks: Unlocks::default(),
            log,
            slots: Slots::adopted(adopted),
            store,
            claims,
            targets,
            listing,
            leases,
            failures: Failures::default(),
            stop: Stop::default(),
            schedule: Arc::new(Schedule::new(manual)),
            turn: Turn::default(),
            me: me.clone(),
        });
        // The schedules resume, each first due at a random point within
        // its interval, as for a new publish.
        for (id, every) in scheduled {
            v.schedule_as(&id, every);
        }
        Ok(v)
    }

    /// Why the last write to the state directory failed, while it keeps
    /// failing (GetAgentInfo's `state_problem`); None when the state is writable.
    pub fn state_problem(&self) -> Option<String> {
        self.store.problem()
    }

    /// The agent's root, canonical.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Validates a bind or unmount target (validate.rs's rules) given under
    /// either spelling of the root, and returns its canonical spelling.
    pub fn target(&self, s: &str) -> std::result::Result<PathBuf, Invalid> {
        match validate::target(self.root.path(), s) {
            Ok(p) => Ok(p),
            Err(e) if self.root.given() == self.root.path() => Err(e),
            Err(e) => {
                let p = validate::target(self.root.given(), s).map_err(|_| e)?;
                let rel = p.strip_prefix(self.root.given()).unwrap_or(&p);
                Ok(self.root.join(rel))
            }
        }
    }

    /// Publishes a volume (semantics.md §1): idempotent for the same
    /// request, refused for another. A publish whose fsGroup walk outlives
    /// the caller's deadline answers DEADLINE_EXCEEDED (CANCELLED when the
    /// caller went away) while the walk goes on; the same publish again
    /// waits for that walk (semantics.md §4.1).
    #[inline(never)]
    pub fn publish(&self, req: &PublishRequest, cancel: &Cancel) -> Result<Published> {
        self.stop.accepting()?;
        let cancel = &self.stop.with(cancel);
        let id = &req.spec.volume_id;
        let slot = self.slots.get_or_make(id);
        let result = self.locked(id, &slot, cancel, |guard| {
            // Checked again now that the slot exists: a Shutdown that
            // listed the slots before this one was made set the flag
            // first, so no publish can slip past it.
            self.stop.accepting()?;
            self.publisher()
                .run(guard, req, cancel, |vol, fd| self.start_walk(vol, fd))
        });
        drop(slot);
        match &result {
            Ok(_) => self.failures.forget(id),
            Err(e) => self.failures.note(
                id,
                Failure {
                    code: e.code(),
                    message: e.to_string(),
                },
            ),
        }
        match result {
            Ok((None, out)) => Ok(out),
            Ok((Some(job), mut out)) => match job.wait(id, cancel)? {
                Outcome::Done(report) => {
                    out.ownership = report;
                    Ok(out)
                }
                Outcome::Failed { code, message } => {
                    Err(Error::PublishFailed { code, message }.into())
                }
            },
            Err(e) => {
                // A publish that failed leaves no trace, not even an empty
                // slot (unless its volume stayed, mounted).
                self.slots.forget(id);
                Err(e)
            }
        }
    }

    /// Unpublishes a volume: its binds, then its mount (flushed first), its
    /// directory and its record. False when it was not published.
    pub fn unpublish(&self, id: &str, cancel: &Cancel) -> Result<bool> {
        let slot = self.slots.get_or_make(id);
        let result = self.locked(id, &slot, cancel, |guard| {
            self.unpublisher().run(id, guard, cancel)
        });
        drop(slot);
        if result.is_ok() {
            self.slots.forget(id);
        }
        result
    }

    /// Stops work in flight, refuses new volumes and binds, and unpublishes
    /// every volume. Returns how many were unpublished.
    pub fn shutdown(&self) -> u32 {
        self.stop.close();
        // A scheduled trim stops between two ranges, and the runner ends.
        self.schedule.close();
        // Recorded as the agent stopping, before each unpublish would say
        // its volume was unpublished.
        self.close_freezes();
        let mut ids = self.slots.ids();
        let mut n = 0;
        while let Some(id) = ids.pop() {
            match self.unpublish(&id, &Cancel::never()) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    warn!(self.log, "could not unpublish at shutdown"; "volume" => &id, "error" => %e)
                }
            }
        }
        n
    }

    /// Usage and condition of a volume (semantics.md §5).
    pub fn stats(&self, id: &str, cancel: &Cancel) -> Result<(Option<Measured>, Condition)> {
        self.with_volume(id, cancel, |vol| self.query().stats(vol))
    }

    /// Grows a volume's filesystem to its device (semantics.md §4).
    #[inline(never)]
    pub fn expand(
        &self,
        id: &str,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Expanded> {
        let cancel = &self.stop.with(cancel);
        self.with_volume(id, cancel, |vol| {
            self.query().expand(vol, required_bytes, timeout, cancel)
        })
    }

    /// Every published volume, without waiting for operations in flight.
    /// The device's size, and a block volume's read-only flag, are the
    /// kernel's now; so is a trim schedule.
    pub fn list(&self) -> Vec<VolumeInfo> {
        let mut list = query::list(&self.listing, &self.leases, &self.kernel);
        let (now, now_ms) = (Instant::now(), unix_ms());
        for info in &mut list {
            info.trim = self.schedule.info(&info.volume_id, now, now_ms);
        }
        list
    }

    /// The health of volume `id`, CSI's list of what is wrong: its
    /// condition's problems, and a scheduled trim that failed.
    pub fn health(&self, id: &str, cancel: &Cancel) -> Result<Vec<Said>> {
        if self.slots.get(id).is_none() {
            return health::unpublished(&self.failures, id);
        }
        let mut said = health::published(self.stats(id, cancel))?;
        if let Some(why) = self.schedule.error(id) {
            said.push(health::trim_failed(id, why));
        }
        Ok(said)
    }

    /// Binds a volume (or a subpath) at a target beneath the root
    /// (semantics.md §6). A repeat of a live bind answers `already_mounted`.
    pub fn bind(&self, req: &BindRequest, cancel: &Cancel) -> Result<BindOutcome> {
        self.stop.accepting()?;
        let target = self.target_of(&req.target)?;
        self.bind_checked(
            &BindRequest {
                target,
                ..req.clone()
            },
            cancel,
        )
    }

    /// [`Volumes::bind`] of a request whose target [`Volumes::target`]
    /// answered: the service checks every field of a request before it
    /// calls the table, so the check is not made twice.
    #[inline(never)]
    pub fn bind_checked(&self, req: &BindRequest, cancel: &Cancel) -> Result<BindOutcome> {
        self.stop.accepting()?;
        let cancel = &self.stop.with(cancel);
        let target = &req.target;
        let rel = self.rel_of(target)?.to_path_buf();
        self.with_volume(&req.volume_id, cancel, |vol| {
            self.binder().bind(vol, req, target, &rel)
        })
    }

    /// Takes down a bind the agent made at `target` (validated here, in any
    /// spelling of the root). False when nothing is mounted there; a mount
    /// the agent did not make is refused and left alone.
    pub fn unmount(&self, target: &Path, cancel: &Cancel) -> Result<bool> {
        self.unmount_checked(&self.target_of(target)?, cancel)
    }

    /// [`Volumes::unmount`] of a target [`Volumes::target`] answered.
    #[inline(never)]
    pub fn unmount_checked(&self, target: &Path, cancel: &Cancel) -> Result<bool> {
        let rel = self.rel_of(target)?.to_path_buf();
        if let Some(id) = self.targets.owner_of(&rel) {
            let r = self.with_volume(&id, cancel, |vol| self.binder().unbind(vol, &rel, target));
            match r {
                Ok(Some(was)) => return Ok(was),
                Ok(None) => {}
                Err(crate::error::Error::Volume(Error::NotPublished(_))) => {}
                Err(e) => return Err(e),
            }
        }
        self.binder().not_ours(&rel, target)
    }

    /// Freezes the filesystems of `ids` (distinct, validated), all or none,
    /// until its id thaws them or `timeout` passes. `asked`: the caller's
    /// own id for it, which answers a retry of the same call again.
    #[inline(never)]
    pub fn freeze(
        &self,
        ids: &[String],
        timeout: Duration,
        asked: Option<&str>,
        cancel: &Cancel,
    ) -> Result<Frozen> {
        self.stop.accepting()?;
        let cancel = &self.stop.with(cancel);
        let frozen = self.leases.freeze(
            asked,
            ids,
            timeout,
            |lease, vol| {
                self.with_volume(vol, cancel, |v| {
                    freeze::freeze_one(v, lease, self.mounts(), &self.leases)
                })
            },
            // A caller gone before the answer would hold an id it never heard.
            || Ok(cancel.check(|| format!("freezing {}", ids.join(", ")))?),
        )?;
        info!(self.log, "volumes frozen"; "freeze" => &frozen.freeze_id, "volumes" => ids.join(" "),
              "timeout_ms" => u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        Ok(frozen)
    }

    /// Ends a freeze (ThawVolumes); answers the volumes it thawed. A forced
    /// thaw thaws every volume it can, then reports the ones not published.
    #[inline(never)]
    pub fn thaw(&self, what: &Thaw) -> Result<Vec<String>> {
        freeze::thaw(&self.leases, &self.log, what, |id| {
            self.slots.get(id).is_some()
        })
    }

    /// Ends every freeze and stops the freeze timer and the trim
    /// schedule's runner for good, before the table lets go of its root: no
    /// thread of this table can act on a volume another table on the same
    /// root published or froze later. Answers how many volumes were
    /// frozen.
    pub fn close_freezes(&self) -> usize {
        self.schedule.close();
        self.leases.stop()
    }

    /// Discards the free extents of at least `min_extent` bytes of volume
    /// `id`'s filesystem.
    #[inline(never)]
    pub fn trim(&self, id: &str, min_extent: u64, cancel: &Cancel) -> Result<Trimmed> {
        let cancel = &self.stop.with(cancel);
        let turn = || {
            let during = || format!("waiting for another trim to end before trimming {id}");
            Ok(self.turn.wait(cancel, during)?)
        };
        self.with_volume(id, cancel, |vol| {
            trim::trim(
                vol,
                self.mounts(),
                &self.leases,
                &self.log,
                min_extent,
                cancel,
                turn,
            )
        })
    }

    /// Runs every scheduled trim due at `now`, one at a time (the runner
    /// thread's step; the tests call it with the time they choose).
    pub(crate) fn run_due_trims(&self, now: Instant) {
        let token = self.stop.token();
        Scheduled {
            slots: &self.slots,
            schedule: &self.schedule,
            turn: &self.turn,
            mounts: self.mounts(),
            leases: &self.leases,
            stop: &token,
            log: &self.log,
        }
        .run_due(now);
    }

    /// When the next scheduled trim is due (tests).
    #[cfg(test)]
    pub(crate) fn next_trim_due(&self) -> Option<Instant> {
        self.schedule.next_due()
    }

    /// Whether a call waits for volume `id`'s slot, and whether one waits
    /// for the trim turn (tests).
    #[cfg(test)]
    pub(crate) fn waiting(&self, id: &str) -> (bool, bool) {
        let slot = self.slots.get(id).is_some_and(|s| s.waiting());
        (slot, self.turn.wanted())
    }

    /// Volume `id` trimmed every `every` seconds from now on (0: never),
    /// the runner thread started if it is not running.
    fn schedule_as(&self, id: &str, every: u32) {
        if !self.schedule.show(id, every, Instant::now()) {
            return;
        }
        let (schedule, me) = (Arc::clone(&self.schedule), self.me.clone());
        let spawned = std::thread::Builder::new()
            .name("trim-schedule".into())
            .spawn(move || {
                while let Some(now) = schedule.wait_due() {
                    let Some(table) = me.upgrade() else {
                        return;
                    };
                    table.run_due_trims(now);
                }
            });
        match spawned {
            Ok(h) => self.schedule.started(h),
            Err(e) => {
                self.schedule.not_started();
                warn!(self.log, "could not start the trim schedule's thread; scheduled trims wait for the next publish"; "error" => %e);
            }
        }
    }

    /// Lets a volume have at most `max` binds (tests reach the bound with a few).
    #[cfg(test)]
    pub(crate) fn limit_binds(&self, max: usize) {
        self.targets.limit(max);
    }

    /// A bind or unmount target as the request gave it, validated
    /// (`target`); a target that is not UTF-8 cannot have come from the wire
    /// and is refused the same way.
    fn target_of(&self, given: &Path) -> Result<PathBuf> {
        let s = given
            .to_str()
            .ok_or_else(|| Invalid(format!("target {} is not UTF-8", given.display())))?;
        Ok(self.target(s)?)
    }

    /// `target` (canonical, validated) relative to the root.
    fn rel_of<'a>(&self, target: &'a Path) -> Result<&'a Path> {
        self.root.relative(target).ok_or_else(|| {
            Invalid(format!(
                "target {} is not beneath the agent's root {}",
                target.display(),
                self.root.path().display()
            ))
            .into()
        })
    }

    /// Runs `f` on volume `id`'s slot, taken in turn; ListVolumes then
    /// shows the volume as `f` left it, before the slot is let go.
    fn locked<T>(
        &self,
        id: &str,
        slot: &Slot,
        cancel: &Cancel,
        f: impl FnOnce(&mut Option<Volume>) -> Result<T>,
    ) -> Result<T> {
        let mut guard = slot.lock(id, cancel)?;
        let r = f(&mut guard);
        self.show(id, guard.as_ref());
        r
    }

    /// Runs `f` on a published volume under its lock.
    fn with_volume<T>(
        &self,
        id: &str,
        cancel: &Cancel,
        f: impl FnOnce(&mut Volume) -> Result<T>,
    ) -> Result<T> {
        let slot = self
            .slots
            .get(id)
            .ok_or_else(|| Error::NotPublished(id.to_string()))?;
        self.locked(id, &slot, cancel, |guard| {
            let vol = guard
                .as_mut()
                .ok_or_else(|| Error::NotPublished(id.to_string()))?;
            f(vol)
        })
    }

    /// Starts `vol`'s fsGroup walk (refused while it is frozen), to be
    /// finished by `finish_walk` on the walk's thread.
    fn start_walk(&self, vol: &mut Volume, fd: std::os::fd::OwnedFd) -> Result<Arc<WalkJob>> {
        freeze::not_frozen(&self.leases, vol.id())?;
        // The table is only ever made by `open`, inside an Arc, and a call
        // on it holds a reference: the upgrade cannot fail.
        let me = self
            .me
            .upgrade()
            .expect("the table lives in the Arc open made");
        walking::start(
            vol,
            fd,
            self.stop.token(),
            self.log.clone(),
            move |id: &str, job: &Arc<WalkJob>, walked, cancel: &Cancel| {
                me.finish_walk(id, job, walked, cancel)
            },
        )
    }

    /// Takes a walk's outcome under the volume's lock: the volume complete
    /// (recorded, then listed ready), or, when the walk or the record
    /// failed, the volume taken down as by Unpublish. An Unpublish or a
    /// Shutdown that stopped the walk holds the lock and takes the volume
    /// down itself: `cancel` (fired by them) gives the lock up.
    fn finish_walk(
        &self,
        id: &str,
        job: &Arc<WalkJob>,
        walked: Result<Option<Report>>,
        cancel: &Cancel,
    ) -> Outcome {
        let failed = |e: &crate::error::Error| Outcome::Failed {
            code: e.code(),
            message: e.to_string(),
        };
        let Some(slot) = self.slots.get(id) else {
            return walked.map_or_else(|e| failed(&e), Outcome::Done);
        };
        let mut guard = match slot.lock(id, cancel) {
            Ok(g) => g,
            Err(e) => return failed(&walked.err().unwrap_or(e)),
        };
        let ours = guard
            .as_ref()
            .and_then(|v| v.phase.job())
            .is_some_and(|j| Arc::ptr_eq(j, job));
        if !ours {
            return walked.map_or_else(|e| failed(&e), Outcome::Done);
        }
        let recorded = walked.and_then(|report| {
            let vol = guard.as_mut().expect("checked above");
            publish::walked(vol, &self.store)?;
            Ok(report)
        });
        let outcome = match recorded {
            Ok(report) => Outcome::Done(report),
            Err(e) => {
                warn!(self.log, "publish failed after mounting; unpublishing the volume";
                      "volume" => id, "error" => %e);
                if let Err(undo) = self.unpublisher().run(id, &mut guard, &Cancel::never()) {
                    warn!(self.log, "could not take the volume down; the next unpublish or start does";
                          "volume" => id, "error" => %undo);
                }
                failed(&e)
            }
        };
        self.show(id, guard.as_ref());
        let gone = guard.is_none();
        drop(guard);
        drop(slot);
        if gone {
            self.slots.forget(id);
        }
        outcome
    }

    /// Volume `id` as its slot holds it now, shown in the list and the
    /// trim schedule (each lets go of the volume when it is gone).
    fn show(&self, id: &str, vol: Option<&Volume>) {
        self.listing.show(id, vol);
        self.schedule_as(id, vol.map_or(0, |v| v.spec.trim_interval_s));
    }

    fn mounts(&self) -> Mounts<'_, K> {
        Mounts {
            root: &self.root,
            kernel: &self.kernel,
        }
    }

    fn takedown(&self) -> Takedown<'_, K> {
        Takedown {
            mounts: self.mounts(),
            log: &self.log,
        }
    }

    fn publisher(&self) -> Publisher<'_, K> {
        Publisher {
            mounts: self.mounts(),
            store: &self.store,
            claims: &self.claims,
            sysfs: &self.sysfs,
            keys: &self.keys,
            unlocks: &self.unlocks,
            log: &self.log,
        }
    }

    fn unpublisher(&self) -> Unpublisher<'_, K> {
        Unpublisher {
            takedown: self.takedown(),
            store: &self.store,
            claims: &self.claims,
            targets: &self.targets,
            leases: &self.leases,
            failures: &self.failures,
            log: &self.log,
        }
    }

    fn binder(&self) -> Binder<'_, K> {
        Binder {
            takedown: self.takedown(),
            store: &self.store,
            targets: &self.targets,
            claims: &self.claims,
            leases: &self.leases,
        }
    }

    fn query(&self) -> Query<'_, K> {
        Query {
            mounts: self.mounts(),
            sysfs: &self.sysfs,
            leases: &self.leases,
            log: &self.log,
        }
    }
}

impl<K: Kernel> Drop for Volumes<K> {
    /// The runner thread holds only a weak reference: it is woken and
    /// ended here, so no thread outlives its table.
    fn drop(&mut self) {
        self.schedule.close();
    }
}

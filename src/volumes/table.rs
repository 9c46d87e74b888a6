//! The volume table: one slot per volume id, whose lock serializes the
//! operations on that volume while different volumes proceed in parallel;
//! the side maps (`index`); the state store; and what every operation
//! shares (the root, finding a volume's own mount, cancellation at
//! shutdown). The operations themselves are in `publish`, `block`, `bind`,
//! `unpublish` and `query`, each an `impl Volumes` of its own.
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
//! 3. The index's maps (`claims`, `targets`, `listed`), under a slot or
//!    without one: each taken for one lookup or update, one at a time,
//!    never while another lock of the index is held, never across a
//!    syscall (a device's sectors are read from sysfs before its claim).
//! 4. The state store's `problem` note: a leaf, taken alone.
//!
//! 5. A walk job's phase (walking.rs): a leaf. Unpublish, holding a slot,
//!    waits on it for the walk to let go of the mount; the walk's thread
//!    takes the slot only after it let go, with a cancellation Unpublish
//!    fires, so the two never wait for each other.
//!
//! 6. The leases' record lock, then their map (lease/), and the failed
//!    publishes' map (failures.rs): the maps are leaves, each taken alone
//!    for one lookup or update, never across a syscall.
//!
//! So a thread holds at most: a slot, then one index map, the store's note
//! or a job's phase, in that order; nothing ever waits for a slot while
//! holding anything else.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use rustix::io::Errno;
use slog::Logger;

use super::error::Error;
use super::failures::Failures;
use super::index::Index;
use super::lease::{Freezer, Ledger};
use super::recover::{thaw_at, thaw_left_frozen, Recovery};
use super::slots::{Slot, Slots};
use super::state::Store;
use super::volume::Volume;
use crate::cancel::{Cancel, Token, Why};
use crate::error::Result;
use crate::mount;
use crate::sys::beneath::Root;
use crate::sys::error::SysError;
use crate::sys::sysfs::Sysfs;
use crate::validate::{self, Invalid};

/// Binds one volume may have: a pod's containers need a handful; the bound
/// keeps one client from filling the mount table and the state file.
pub const MAX_BINDS: usize = 1024;

/// The agent's volumes.
pub struct Volumes {
    /// The agent's root, opened once.
    root: Root,
    /// `<root>/state`: the records.
    store: Store,
    /// Where disks are listed.
    sysfs: Sysfs,
    /// Where what happens is said.
    log: Logger,
    /// One slot per volume id (locks 1 and 2 of the module doc).
    slots: Slots,
    /// Claims, targets and the list (lock 3).
    index: Index,
    /// Set by Shutdown: no new volume or bind is accepted.
    shutting_down: AtomicBool,
    /// Fired by Shutdown: stops every wait and walk in flight.
    stop: Token,
    /// MAX_BINDS (smaller in tests).
    max_binds: std::sync::atomic::AtomicUsize,
    /// The freezes (lock 6).
    freezer: Arc<Freezer>,
    /// The last failure of publishes that left no volume (lock 6).
    failures: Failures,
    /// The table itself, for the threads of fsGroup walks (walking.rs),
    /// which outlive the call that started them.
    me: Weak<Volumes>,
}

/// What an openat2 failure on a path the agent resolves means.
pub(crate) fn unsafe_or_sys(e: Errno, call: &'static str, path: &Path) -> crate::error::Error {
    match e {
        Errno::LOOP | Errno::XDEV | Errno::NOTDIR => mount::error::Error::Unsafe {
            path: path.display().to_string(),
        }
        .into(),
        _ => SysError::new(call, path.display(), e).into(),
    }
}

impl Volumes {
    /// Opens the table at `root` (created if missing; canonicalized, so a
    /// root given through a symlink is the same root) and takes back the
    /// volumes of a previous run (`recover`).
    pub fn open(root: &Path, sysfs: Sysfs, log: Logger) -> Result<Arc<Volumes>> {
        let root = Root::open(root)?;
        root.own_dir("volumes", 0o750)?;
        let store = Store::open(&root)?;
        let index = Index::default();
        // Before anything is taken back or down: a frozen filesystem hangs
        // its writers and its unmount.
        let freezer = Freezer::open(Ledger::open(&root)?, log.clone(), |vol| thaw_at(&root, vol));
        thaw_left_frozen(&root, &store, &log);
        let adopted = Recovery {
            root: &root,
            store: &store,
            index: &index,
            sysfs: &sysfs,
            log: &log,
        }
        .run()?;
        Ok(Arc::new_cyclic(|me| Volumes {
            root,
            store,
            sysfs,
            log,
            slots: Slots::adopted(adopted),
            index,
            shutting_down: AtomicBool::new(false),
            stop: Token::new(Why::Shutdown),
            max_binds: MAX_BINDS.into(),
            freezer,
            failures: Failures::default(),
            me: me.clone(),
        }))
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

    /// Where the table reads sysfs.
    pub fn sysfs(&self) -> &Sysfs {
        &self.sysfs
    }

    /// The agent's root, opened: what every path the table acts on is
    /// resolved beneath.
    pub(crate) fn root_dir(&self) -> &Root {
        &self.root
    }

    /// The records (state.rs's room).
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// The side maps: claims, bind targets, the list (index.rs's room).
    pub(crate) fn index(&self) -> &Index {
        &self.index
    }

    /// Where what happens is said.
    pub(crate) fn log(&self) -> &Logger {
        &self.log
    }

    /// The freezes (lease/'s room).
    pub(crate) fn freezer(&self) -> &Freezer {
        &self.freezer
    }

    /// The failed publishes (failures.rs's room).
    pub(crate) fn failures(&self) -> &Failures {
        &self.failures
    }

    /// MAX_BINDS (smaller in tests).
    pub(crate) fn max_binds_cell(&self) -> &std::sync::atomic::AtomicUsize {
        &self.max_binds
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

    /// A bind or unmount target as the request gave it, validated
    /// (`target`); a target that is not UTF-8 cannot have come from the wire
    /// and is refused the same way.
    pub(crate) fn target_of(&self, given: &Path) -> Result<PathBuf> {
        let s = given
            .to_str()
            .ok_or_else(|| Invalid(format!("target {} is not UTF-8", given.display())))?;
        Ok(self.target(s)?)
    }

    /// `target` (canonical, validated) relative to the root.
    pub(crate) fn rel_of<'a>(&self, target: &'a Path) -> Result<&'a Path> {
        self.root.relative(target).ok_or_else(|| {
            Invalid(format!(
                "target {} is not beneath the agent's root {}",
                target.display(),
                self.root.path().display()
            ))
            .into()
        })
    }

    /// Refuses new volumes and binds once Shutdown began.
    pub(crate) fn accepting(&self) -> Result<()> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown.into());
        }
        Ok(())
    }

    /// Stops accepting, and fires the token every wait and walk in flight
    /// watches. The slots are listed after this, so no publish slips past.
    pub(crate) fn stop_accepting(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.stop.fire();
    }

    /// The ids of every slot (Shutdown's list to unpublish).
    pub(crate) fn slot_ids(&self) -> Vec<String> {
        self.slots.ids()
    }

    /// The slot of volume `id`, made if missing (a first publish).
    pub(crate) fn slot(&self, id: &str) -> Arc<Slot> {
        self.slots.get_or_make(id)
    }

    /// The slot of volume `id`, if it has one.
    pub(crate) fn existing_slot(&self, id: &str) -> Option<Arc<Slot>> {
        self.slots.get(id)
    }

    /// Drops an empty slot nobody else holds.
    pub(crate) fn forget_slot(&self, id: &str) {
        self.slots.forget(id)
    }

    /// The table, shared with a thread that outlives the call (a walk).
    pub(crate) fn shared(&self) -> Arc<Volumes> {
        // The table is only ever made by `open`, inside an Arc, and a call
        // on it holds a reference: the upgrade cannot fail.
        self.me
            .upgrade()
            .expect("the table lives in the Arc open made")
    }

    /// The token Shutdown fires.
    pub(crate) fn stop_token(&self) -> Token {
        self.stop.clone()
    }

    /// `cancel`, also fired by Shutdown.
    pub(crate) fn stop_with(&self, cancel: &Cancel) -> Cancel {
        cancel.clone().with_token(&self.stop)
    }

    /// Runs `f` on a published volume under its lock.
    pub(crate) fn with_volume<T>(
        &self,
        id: &str,
        cancel: &Cancel,
        f: impl FnOnce(&mut Volume) -> Result<T>,
    ) -> Result<T> {
        let slot = self
            .existing_slot(id)
            .ok_or_else(|| Error::NotPublished(id.to_string()))?;
        let mut guard = slot.lock(id, cancel)?;
        let vol = guard
            .as_mut()
            .ok_or_else(|| Error::NotPublished(id.to_string()))?;
        f(vol)
    }
}

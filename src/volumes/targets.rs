//! The bind targets room: every bind target (relative to the root),
//! reserved by a bind in flight or bound, and its volume, so that two
//! binds never share, nest in or cover each other (semantics.md §6)
//! without taking any other volume's slot; and how many binds one volume
//! may have. A bind reserves its target first and keeps it when it goes
//! through; a bind taken down or found gone leaves its volume and frees
//! its target here, in one call. Its mutex is a leaf (lock 3 of table.rs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crust_protocols::sync::LockExt;

use super::error::Error;
use super::held::Held;
use super::volume::{Bind, Volume};

/// Binds one volume may have: a pod's containers need a handful; the bound
/// keeps one client from filling the mount table and the state file.
pub const MAX_BINDS: usize = 1024;

/// The bind targets (the module doc).
#[derive(Debug)]
pub(crate) struct Targets {
    map: Mutex<BTreeMap<PathBuf, String>>,
    /// Binds one volume may have: MAX_BINDS, smaller in tests.
    max: AtomicUsize,
}

impl Default for Targets {
    fn default() -> Targets {
        Targets {
            map: Mutex::default(),
            max: AtomicUsize::new(MAX_BINDS),
        }
    }
}

/// A bind target reserved for a bind in flight.
pub(crate) type Reservation<'a> = Held<'a, PathBuf, String>;

impl Targets {
    /// Reserves `rel` as a bind target of volume `id` (`target` is how the
    /// request spelled it, `root` the canonical root, both for messages):
    /// refused when it is another bind's target, lies inside one, or holds
    /// one beneath it.
    pub(crate) fn reserve(
        &self,
        rel: &Path,
        target: &Path,
        id: &str,
        root: &Path,
    ) -> Result<Reservation<'_>, Error> {
        let mut targets = self.map.locked();
        for (t, owner) in targets.iter() {
            let there = || root.join(t);
            if t == rel {
                return Err(Error::TargetTaken {
                    target: target.to_path_buf(),
                    what: format!("a bind of volume {owner}"),
                });
            }
            if rel.starts_with(t) {
                return Err(Error::TargetNested {
                    target: target.to_path_buf(),
                    inner_of: there(),
                    volume: owner.clone(),
                });
            }
            if t.starts_with(rel) {
                return Err(Error::TargetCovers {
                    target: target.to_path_buf(),
                    inner: there(),
                    volume: owner.clone(),
                });
            }
        }
        targets.insert(rel.to_path_buf(), id.to_string());
        Ok(Held::new(&self.map, rel.to_path_buf()))
    }

    /// The volume whose bind target (reserved or bound) `rel` is.
    pub(crate) fn owner_of(&self, rel: &Path) -> Option<String> {
        self.map.locked().get(rel).cloned()
    }

    /// Refuses one more bind of `vol` when it has as many as it may.
    pub(crate) fn room_for_one_more(&self, vol: &Volume) -> Result<(), Error> {
        let max = self.max.load(Ordering::Relaxed);
        if vol.binds.len() >= max {
            return Err(Error::TooManyBinds {
                id: vol.id().to_string(),
                max,
            });
        }
        Ok(())
    }

    /// Bind `i` of `vol` is gone (taken down, or found gone): it leaves the
    /// volume and its target is free again.
    pub(crate) fn drop_bind(&self, vol: &mut Volume, i: usize) -> Bind {
        let b = vol.binds.remove(i);
        self.map.locked().remove(&b.rel);
        b
    }

    /// Lets a volume have at most `max` binds (tests reach the bound with a few).
    #[cfg(test)]
    pub(crate) fn limit(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }
}

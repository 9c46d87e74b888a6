//! Locks by key, each wait bounded: one per volume (two calls for one
//! volume run one after the other) and one per sandbox for QMP and for its
//! state file. Calls on different keys never wait for each other. A key's
//! entry lives only while someone holds or waits for it, so a caller naming
//! ever new volumes makes the map no larger than the calls in flight.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::sync::{CondvarExt, LockExt};

/// One key's lock.
#[derive(Default)]
struct Slot {
    /// Whether someone holds it.
    taken: Mutex<bool>,
    /// Signalled when it is let go.
    freed: Condvar,
}

/// A lock per key, created on first use and dropped when unused.
pub struct KeyedLocks<K> {
    /// The keys held or waited for now.
    map: Mutex<HashMap<K, Arc<Slot>>>,
}

impl<K: Eq + Hash + Clone> Default for KeyedLocks<K> {
    fn default() -> Self {
        KeyedLocks {
            map: Mutex::new(HashMap::new()),
        }
    }
}

/// A held key; let go when dropped.
pub struct Guard<'a, K: Eq + Hash + Clone> {
    locks: &'a KeyedLocks<K>,
    key: K,
    slot: Arc<Slot>,
    /// False for a waiter that gave up: dropping it unlocks nothing.
    held: bool,
}

impl<K: Eq + Hash + Clone> KeyedLocks<K> {
    /// Takes `key`'s lock, waiting until `until` at the latest: `None` when
    /// someone else still holds it then.
    pub fn lock_until(&self, key: &K, until: Instant) -> Option<Guard<'_, K>> {
        let slot = self.map.locked().entry(key.clone()).or_default().clone();
        // The guard owns the only reference besides the map's, so that
        // dropping it (held or not) can tell whether anyone else is waiting.
        let mut guard = Guard {
            locks: self,
            key: key.clone(),
            slot,
            held: false,
        };
        guard.held = take(&guard.slot, until);
        // Never held: dropping it lets the entry go, unlocking nothing.
        guard.held.then_some(guard)
    }

    /// How many keys are held or waited for (for tests and bounds).
    pub fn len(&self) -> usize {
        self.map.locked().len()
    }

    /// Whether no key is held or waited for.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops `key`'s entry if nobody else holds a reference to `slot`.
    fn prune(&self, key: &K, slot: &Arc<Slot>) {
        let mut map = self.map.locked();
        // The map's reference and the caller's: nobody holds or waits.
        if Arc::strong_count(slot) <= 2 && map.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            map.remove(key);
        }
    }
}

impl<K: Eq + Hash + Clone> Drop for Guard<'_, K> {
    fn drop(&mut self) {
        if self.held {
            *self.slot.taken.locked() = false;
            self.slot.freed.notify_one();
        }
        self.locks.prune(&self.key, &self.slot);
    }
}

/// Takes `slot`, waiting until `until`; whether it was taken.
fn take(slot: &Slot, until: Instant) -> bool {
    let mut taken = slot.taken.locked();
    while *taken {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        taken = slot.freed.waited_for(taken, left);
    }
    *taken = true;
    true
}

/// The instant `d` from now, or far in the future (a year) when that overflows.
pub fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_waits_other_key_does_not_and_waits_end_at_their_deadline() {
        let locks: Arc<KeyedLocks<String>> = Arc::default();
        let far = || after(Duration::from_secs(60));
        let g = locks.lock_until(&"a".to_string(), far()).unwrap();
        let l2 = locks.clone();
        let other = std::thread::spawn(move || {
            let t = Instant::now();
            let _g = l2.lock_until(&"b".to_string(), far()).unwrap();
            t.elapsed()
        });
        assert!(other.join().unwrap() < Duration::from_millis(100));
        // A wait bounded by its deadline gives up, leaving the holder alone.
        let t = Instant::now();
        let none = locks.lock_until(&"a".to_string(), after(Duration::from_millis(150)));
        assert!(none.is_none());
        assert!(t.elapsed() >= Duration::from_millis(150));
        let l3 = locks.clone();
        let same = std::thread::spawn(move || {
            let t = Instant::now();
            let _g = l3.lock_until(&"a".to_string(), far()).unwrap();
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(g);
        assert!(same.join().unwrap() >= Duration::from_millis(150));
    }

    #[test]
    fn keys_nobody_holds_leave_the_map() {
        let locks: KeyedLocks<String> = KeyedLocks::default();
        for i in 0..10_000 {
            let g = locks.lock_until(&format!("/dev/x{i}"), after(Duration::from_secs(1)));
            assert!(g.is_some());
        }
        assert!(locks.is_empty());
        let g = locks.lock_until(&"k".to_string(), after(Duration::from_secs(1)));
        assert_eq!(locks.len(), 1);
        assert!(locks
            .lock_until(&"k".to_string(), after(Duration::from_millis(10)))
            .is_none());
        assert_eq!(
            locks.len(),
            1,
            "a timed-out waiter leaves the holder's entry"
        );
        drop(g);
        assert!(locks.is_empty());
    }
}

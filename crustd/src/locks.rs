//! Locks by key: one mutex per volume (two calls for one volume run one after
//! the other) and one per sandbox for QMP and for its state file, created on
//! first use. Calls on different keys never wait for each other.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

/// A mutex per key.
pub struct KeyedLocks<K> {
    /// Every key seen so far and its mutex (a few bytes each; never pruned).
    map: Mutex<HashMap<K, Arc<Mutex<()>>>>,
}

impl<K: Eq + Hash + Clone> Default for KeyedLocks<K> {
    fn default() -> Self {
        KeyedLocks {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash + Clone> KeyedLocks<K> {
    /// The mutex of `key`; lock it with [`hold`].
    pub fn get(&self, key: &K) -> Arc<Mutex<()>> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key.clone()).or_default().clone()
    }
}

/// Locks `m`, surviving poisoning (a panicked holder left no invariant behind:
/// the state on disk is rewritten whole).
pub fn hold(m: &Mutex<()>) -> MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn same_key_waits_other_key_does_not() {
        let locks: Arc<KeyedLocks<String>> = Arc::default();
        let a = locks.get(&"a".to_string());
        let g = hold(&a);
        let l2 = locks.clone();
        let other = std::thread::spawn(move || {
            let t = Instant::now();
            let b = l2.get(&"b".to_string());
            let _g = hold(&b);
            t.elapsed()
        });
        assert!(other.join().unwrap() < Duration::from_millis(100));
        let l3 = locks.clone();
        let same = std::thread::spawn(move || {
            let t = Instant::now();
            let a = l3.get(&"a".to_string());
            let _g = hold(&a);
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(g);
        assert!(same.join().unwrap() >= Duration::from_millis(150));
    }
}

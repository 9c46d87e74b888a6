//! What the table's maps share: a key an operation in flight holds in one
//! of them (a device claimed, a bind target reserved), released when the
//! operation fails and kept by the volume when it goes through.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crust_protocols::sync::LockExt;

/// A key an operation in flight holds in a map: released when dropped,
/// unless kept.
#[must_use = "dropping a Held releases it at once"]
pub(crate) struct Held<'a, K: Ord, V> {
    map: &'a Mutex<BTreeMap<K, V>>,
    key: Option<K>,
}

impl<'a, K: Ord, V> Held<'a, K, V> {
    /// `key`, just inserted in `map` by the caller, holding the map's lock.
    pub(crate) fn new(map: &'a Mutex<BTreeMap<K, V>>, key: K) -> Held<'a, K, V> {
        Held {
            map,
            key: Some(key),
        }
    }

    /// The operation went through: the key stays held, by the volume now.
    pub(crate) fn keep(mut self) {
        self.key = None;
    }
}

impl<K: Ord, V> Drop for Held<'_, K, V> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.map.locked().remove(&key);
        }
    }
}

//! The node-wide table of host devices crustd has claimed: for every volume
//! recorded in a live sandbox, where its device's bytes lie and crustd's
//! exclusive hold on it. "One disk, one volume" is decided here, in memory,
//! so the node-wide lock is held only for a lookup and an insert: never
//! across a file read, a QMP session or an agent call. The table is filled
//! from the sandboxes' records when crustd starts and kept in step with
//! them after: a claim is made before a volume's record is written, and
//! released after its record is forgotten (the device has left the guest).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::hostdev::{Extent, Hold};

/// (sandbox id, host_volume_id).
pub type Key = (String, String);

/// One claimed device.
#[derive(Debug)]
pub struct Claim {
    /// The device node, for messages.
    pub device: String,
    /// Where its bytes lie; `None` when it was not found at a restart (it
    /// can then conflict with nothing).
    pub extent: Option<Extent>,
    /// crustd's O_EXCL hold; `None` while being taken, or when the kernel
    /// refused it at a restart.
    pub hold: Option<Hold>,
}

/// Who already has bytes of a device asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub sandbox: String,
    pub host_volume_id: String,
    pub device: String,
    /// The two extents are equal: the same device, not just shared bytes.
    pub same: bool,
}

/// The table; see the module doc.
#[derive(Debug, Default)]
pub struct Claims {
    table: Mutex<HashMap<Key, Claim>>,
}

impl Claims {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Claim>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `key` has a claim, and whether it holds its device.
    pub fn get(&self, key: &Key) -> Option<bool> {
        self.table().get(key).map(|c| c.hold.is_some())
    }

    /// Claims `extent` for `key` (without a hold yet) unless another volume,
    /// in any sandbox, has bytes of it: then answers that one. A claim
    /// already there for `key` is kept.
    pub fn reserve(&self, key: &Key, device: &str, extent: Option<Extent>) -> Result<(), Conflict> {
        let mut t = self.table();
        if let Some(e) = &extent {
            let hit = t
                .iter()
                .find(|(k, c)| *k != key && c.extent.as_ref().is_some_and(|o| o.overlaps(e)));
            if let Some(((sandbox, hv), c)) = hit {
                return Err(Conflict {
                    sandbox: sandbox.clone(),
                    host_volume_id: hv.clone(),
                    device: c.device.clone(),
                    same: c.extent.as_ref() == Some(e),
                });
            }
        }
        t.entry(key.clone()).or_insert(Claim {
            device: device.to_string(),
            extent,
            hold: None,
        });
        Ok(())
    }

    /// Gives `key`'s claim its hold. Answers the hold back when the claim
    /// is gone meanwhile (the caller drops it outside the lock).
    pub fn set_hold(&self, key: &Key, hold: Hold) -> Option<Hold> {
        match self.table().get_mut(key) {
            Some(c) => {
                c.hold = Some(hold);
                None
            }
            None => Some(hold),
        }
    }

    /// Takes `key`'s hold out of its claim (the claim stays), for the caller
    /// to drop outside the lock: while createFilesystem runs mkfs, which
    /// opens the device O_EXCL itself.
    #[must_use = "dropping the hold releases it"]
    pub fn take_hold(&self, key: &Key) -> Option<Hold> {
        self.table().get_mut(key).and_then(|c| c.hold.take())
    }

    /// Removes `key`'s claim and answers it, so that its hold is closed by
    /// the caller after the lock is released (the last close of a block
    /// device flushes it).
    #[must_use = "dropping the claim releases the hold"]
    pub fn release(&self, key: &Key) -> Option<Claim> {
        self.table().remove(key)
    }

    /// Removes every claim of `sandbox` (its VM is gone) and answers them.
    #[must_use = "dropping the claims releases the holds"]
    pub fn release_sandbox(&self, sandbox: &str) -> Vec<Claim> {
        let mut t = self.table();
        let keys: Vec<Key> = t.keys().filter(|k| k.0 == sandbox).cloned().collect();
        keys.iter().filter_map(|k| t.remove(k)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostdev::Backing;

    fn ext(disk: u32, start: u64, end: Option<u64>) -> Option<Extent> {
        Some(Extent {
            backing: Backing::Disk {
                major: 7,
                minor: disk,
            },
            start,
            end,
        })
    }

    fn key(s: &str, v: &str) -> Key {
        (s.into(), v.into())
    }

    #[test]
    fn overlapping_bytes_conflict_in_both_orders_and_across_sandboxes() {
        let whole = || ext(0, 0, None);
        let p1 = || ext(0, 1 << 20, Some(33 << 20));
        let p2 = || ext(0, 33 << 20, Some(64 << 20));
        let overlapping = || ext(0, 32 << 20, Some(40 << 20));
        for (first, second) in [(whole(), p1()), (p1(), whole()), (p1(), overlapping())] {
            for other_sandbox in [false, true] {
                let c = Claims::default();
                c.reserve(&key("a", "/x"), "x", first.clone()).unwrap();
                let sb = if other_sandbox { "b" } else { "a" };
                let e = c.reserve(&key(sb, "/y"), "y", second.clone()).unwrap_err();
                assert_eq!((e.sandbox.as_str(), e.host_volume_id.as_str()), ("a", "/x"));
                assert!(!e.same);
                assert!(c.get(&key(sb, "/y")).is_none(), "nothing left by a refusal");
            }
        }
        // Partitions side by side, and another disk: no conflict.
        let c = Claims::default();
        c.reserve(&key("a", "/p1"), "p1", p1()).unwrap();
        c.reserve(&key("b", "/p2"), "p2", p2()).unwrap();
        c.reserve(&key("b", "/other"), "o", ext(1, 0, None))
            .unwrap();
        // The same device under two names.
        let e = c.reserve(&key("b", "/link"), "l", p1()).unwrap_err();
        assert!(e.same);
        // The same key again keeps its claim; a device not found conflicts with nothing.
        c.reserve(&key("a", "/p1"), "p1", p1()).unwrap();
        c.reserve(&key("c", "/gone"), "g", None).unwrap();
        assert_eq!(c.release_sandbox("b").len(), 2);
        c.reserve(&key("d", "/p2"), "p2", p2()).unwrap();
        assert!(c.release(&key("a", "/p1")).is_some());
        c.reserve(&key("d", "/whole"), "w", whole()).unwrap_err();
        assert!(c.release(&key("d", "/p2")).is_some());
        c.reserve(&key("d", "/whole"), "w", whole()).unwrap();
    }
}

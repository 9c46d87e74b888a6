//! The slots room: one slot per volume id, holding the volume (or nothing
//! while a first publish runs, or after an unpublish). A slot's lock
//! serializes the operations on its volume while different volumes go on;
//! waiters are served in the order they came, and each wait ends when its
//! request's cancellation fires (the caller left, its deadline passed, or
//! Shutdown). The map of slots holds only slots in use: an empty slot
//! nobody holds or waits for is dropped.

use std::collections::{HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use crust_protocols::sync::{CondvarExt, LockExt};

use super::volume::Volume;
use crate::cancel::Cancel;
use crate::error::Result;

/// How long a waiter sleeps before it looks at its cancellation again.
const LOOK: Duration = Duration::from_millis(20);

/// Whose turn it is.
#[derive(Default)]
struct Turns {
    /// Someone holds the slot.
    held: bool,
    /// Waiters' tickets, first come first.
    queue: VecDeque<u64>,
    /// The next ticket to hand out.
    next: u64,
}

/// One volume's slot.
#[derive(Default)]
pub(crate) struct Slot {
    turns: Mutex<Turns>,
    /// Signalled when the slot is let go, or a waiter leaves the queue.
    turned: Condvar,
    /// The volume: only the holder of the turn locks it.
    volume: Mutex<Option<Volume>>,
}

/// A held slot: the volume, or `None`; let go when dropped.
pub(crate) struct SlotGuard<'a> {
    slot: &'a Slot,
    volume: Option<MutexGuard<'a, Option<Volume>>>,
}

impl Deref for SlotGuard<'_> {
    type Target = Option<Volume>;
    fn deref(&self) -> &Option<Volume> {
        self.volume.as_deref().unwrap_or(&None)
    }
}

impl DerefMut for SlotGuard<'_> {
    fn deref_mut(&mut self) -> &mut Option<Volume> {
        // Set in `Slot::lock`, taken only by `drop`.
        self.volume
            .as_deref_mut()
            .expect("a held slot has its volume until dropped")
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        // The volume first, then the turn: the next holder finds it free.
        drop(self.volume.take());
        self.slot.turns.locked().held = false;
        self.slot.turned.notify_all();
    }
}

impl Slot {
    fn with(volume: Volume) -> Slot {
        Slot {
            volume: Mutex::new(Some(volume)),
            ..Slot::default()
        }
    }

    /// Takes the slot of volume `id` in turn, giving up when `cancel` fires.
    pub(crate) fn lock(&self, id: &str, cancel: &Cancel) -> Result<SlotGuard<'_>> {
        let mut t = self.turns.locked();
        let me = t.next;
        t.next = t.next.wrapping_add(1);
        t.queue.push_back(me);
        loop {
            if !t.held && t.queue.front() == Some(&me) {
                t.queue.pop_front();
                t.held = true;
                drop(t);
                return Ok(SlotGuard {
                    slot: self,
                    volume: Some(self.volume.locked()),
                });
            }
            if let Err(stopped) =
                cancel.check(|| format!("waiting for another operation on volume {id} to end"))
            {
                t.queue.retain(|x| *x != me);
                drop(t);
                // The one behind may be first now.
                self.turned.notify_all();
                return Err(stopped.into());
            }
            t = self.turned.waited_for(t, cancel.slice(LOOK));
        }
    }

    /// The slot, only if nobody holds it or waits for it: a scheduled trim
    /// never queues, so it never makes a call wait behind it.
    pub(crate) fn try_lock(&self) -> Option<SlotGuard<'_>> {
        let mut t = self.turns.locked();
        if t.held || !t.queue.is_empty() {
            return None;
        }
        t.held = true;
        drop(t);
        Some(SlotGuard {
            slot: self,
            volume: Some(self.volume.locked()),
        })
    }

    /// Whether a call waits for the slot (its holder's scheduled trim then
    /// yields).
    pub(crate) fn waiting(&self) -> bool {
        !self.turns.locked().queue.is_empty()
    }

    /// Whether nobody holds or waits for the slot and it holds no volume.
    fn idle(&self) -> bool {
        let t = self.turns.locked();
        let empty = match self.volume.try_lock() {
            Ok(v) => v.is_none(),
            // A holder that panicked (a fault caught in a scheduled trim)
            // left the volume as its last whole update, as `locked` says.
            Err(TryLockError::Poisoned(v)) => v.into_inner().is_none(),
            Err(TryLockError::WouldBlock) => false,
        };
        !t.held && t.queue.is_empty() && empty
    }
}

/// The slots of every volume id in use.
#[derive(Default)]
pub(crate) struct Slots {
    map: Mutex<HashMap<String, Arc<Slot>>>,
}

impl Slots {
    /// The slots of volumes taken back at start.
    pub(crate) fn adopted(volumes: Vec<Volume>) -> Slots {
        let map = volumes
            .into_iter()
            .map(|v| (v.id().to_string(), Arc::new(Slot::with(v))))
            .collect();
        Slots {
            map: Mutex::new(map),
        }
    }

    /// The ids of every slot (Shutdown's list to unpublish).
    pub(crate) fn ids(&self) -> Vec<String> {
        self.map.locked().keys().cloned().collect()
    }

    /// The slot of volume `id`, made if missing (a first publish).
    pub(crate) fn get_or_make(&self, id: &str) -> Arc<Slot> {
        self.map.locked().entry(id.to_string()).or_default().clone()
    }

    /// The slot of volume `id`, if it has one.
    pub(crate) fn get(&self, id: &str) -> Option<Arc<Slot>> {
        self.map.locked().get(id).cloned()
    }

    /// Drops the slot of `id` if it is empty and nobody else has it.
    pub(crate) fn forget(&self, id: &str) {
        let mut map = self.map.locked();
        if map
            .get(id)
            .is_some_and(|s| Arc::strong_count(s) == 1 && s.idle())
        {
            map.remove(id);
        }
    }

    /// How many slots there are (a bound tests check).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.locked().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    #[test]
    fn waiters_are_served_in_the_order_they_came() {
        let slot = Arc::new(Slot::default());
        let first = slot.lock("v", &Cancel::never()).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let arrived = Arc::new(AtomicUsize::new(0));
        let mut hs = Vec::new();
        for i in 0..8 {
            // Each waiter queues only after the one before it.
            while arrived.load(Ordering::SeqCst) < i {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (slot, order, arrived) = (slot.clone(), order.clone(), arrived.clone());
            hs.push(std::thread::spawn(move || {
                let cancel = Cancel::never();
                // Counted just before queueing; the queue itself is the order.
                arrived.fetch_add(1, Ordering::SeqCst);
                let g = slot.lock("v", &cancel).unwrap();
                order.lock().unwrap().push(i);
                std::thread::sleep(Duration::from_millis(5));
                drop(g);
            }));
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(first);
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn a_waiter_that_gives_up_leaves_its_turn_to_the_next() {
        let slot = Arc::new(Slot::default());
        let held = slot.lock("v", &Cancel::never()).unwrap();
        let t0 = Instant::now();
        let e = slot
            .lock(
                "v",
                &Cancel::never().with_timeout(Duration::from_millis(100)),
            )
            .err()
            .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(100));
        assert!(
            e.to_string()
                .contains("waiting for another operation on volume v"),
            "{e}"
        );
        drop(held);
        // Nobody is left in line: the next one takes it at once.
        let t0 = Instant::now();
        drop(slot.lock("v", &Cancel::never()).unwrap());
        assert!(t0.elapsed() < Duration::from_millis(50));
    }

    #[test]
    fn a_try_never_queues_and_a_waiter_is_seen() {
        let slot = Arc::new(Slot::default());
        let held = slot.try_lock().unwrap();
        assert!(slot.try_lock().is_none() && !slot.waiting());
        let s = slot.clone();
        let waiter = std::thread::spawn(move || drop(s.lock("v", &Cancel::never()).unwrap()));
        let t0 = Instant::now();
        while !slot.waiting() {
            assert!(t0.elapsed() < Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(held);
        waiter.join().unwrap();
        assert!(!slot.waiting());
        assert!(slot.try_lock().is_some());
    }

    #[test]
    fn empty_slots_nobody_holds_are_dropped() {
        let slots = Slots::default();
        for i in 0..1000 {
            let s = slots.get_or_make(&format!("v{i}"));
            drop(s.lock("v", &Cancel::never()).unwrap());
            drop(s);
            slots.forget(&format!("v{i}"));
        }
        assert_eq!(slots.len(), 0);
        let s = slots.get_or_make("kept");
        *s.lock("kept", &Cancel::never()).unwrap() = Some(super::super::volume::tests::sample());
        drop(s);
        slots.forget("kept");
        assert_eq!(slots.len(), 1, "a slot holding a volume stays");
    }

    /// A slot whose holder panicked (its volume's lock poisoned) is
    /// dropped all the same once it is empty, and kept while it holds one.
    #[test]
    fn a_slot_a_panic_let_go_of_is_dropped_once_empty() {
        let slots = Arc::new(Slots::default());
        let s = slots.get_or_make("v");
        *s.lock("v", &Cancel::never()).unwrap() = Some(super::super::volume::tests::sample());
        let (ss, panicked) = (s.clone(), Arc::new(Mutex::new(false)));
        let p = panicked.clone();
        let _ = std::thread::spawn(move || {
            let _g = ss.try_lock().unwrap();
            *p.lock().unwrap() = true;
            panic!("a fault while holding the slot");
        })
        .join();
        assert!(*panicked.lock().unwrap() && s.volume.is_poisoned());
        drop(s);
        slots.forget("v");
        assert_eq!(slots.len(), 1, "it still holds its volume");
        let s = slots.get("v").unwrap();
        *s.lock("v", &Cancel::never()).unwrap() = None;
        drop(s);
        slots.forget("v");
        assert_eq!(slots.len(), 0, "empty: dropped");
    }
}

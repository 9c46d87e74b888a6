//! Locks that outlive a panic, written once for every crate. A thread that
//! panics while holding a lock leaves the data as its last whole update
//! (every holder here changes it in steps that each leave it consistent), so
//! the next holder takes it over rather than panicking in turn: one handler's
//! panic must not take the agent, crustd or a test harness down with it.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// [`Mutex::lock`], a poisoned lock taken over.
pub trait LockExt<T: ?Sized> {
    /// The guard, whether or not a holder panicked.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`Condvar::wait`] and [`Condvar::wait_timeout`], a poisoned lock taken
/// over. Every waiter here checks its condition again when it wakes, so the
/// timeout's flag is not returned.
pub trait CondvarExt {
    /// Waits until notified (or woken spuriously).
    fn waited<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T>;
    /// Waits until notified, woken spuriously, or `limit` has passed.
    fn waited_for<'a, T>(&self, guard: MutexGuard<'a, T>, limit: Duration) -> MutexGuard<'a, T>;
}

impl CondvarExt for Condvar {
    fn waited<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.wait(guard).unwrap_or_else(PoisonError::into_inner)
    }

    fn waited_for<'a, T>(&self, guard: MutexGuard<'a, T>, limit: Duration) -> MutexGuard<'a, T> {
        self.wait_timeout(guard, limit)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn poisoned() -> Arc<Mutex<u32>> {
        let m = Arc::new(Mutex::new(7));
        let held = Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let _g = held.lock().unwrap();
            panic!("poison the lock");
        })
        .join();
        assert!(m.is_poisoned());
        m
    }

    #[test]
    fn a_poisoned_lock_is_taken_over() {
        let m = poisoned();
        *m.locked() += 1;
        assert_eq!(*m.locked(), 8);
    }

    #[test]
    fn a_wait_on_a_poisoned_lock_returns_its_guard() {
        let m = poisoned();
        let cv = Condvar::new();
        let g = cv.waited_for(m.locked(), Duration::from_millis(1));
        assert_eq!(*g, 7);
    }
}

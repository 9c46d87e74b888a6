//! The unlocks room: one key derivation at a time. An Argon2 keyslot may
//! take half of the guest's free memory (`luks2::mapping::guest_limits`),
//! and a keyslot the agent makes an eighth: two at once could ask the
//! kernel for more than there is, and the OOM killer's choice in a guest
//! whose PID 1 is the agent ends the sandbox. So opening or making an
//! encrypted volume waits here for any other to finish, within its
//! caller's deadline, holding nothing else of the table but its own slot.

use std::sync::{Mutex, TryLockError};
use std::time::Duration;

use crate::cancel::Cancel;
use crate::error::Result;

/// How often a waiting publish looks again.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// The one derivation in flight (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Unlocks {
    busy: Mutex<()>,
}

impl Unlocks {
    /// Runs `f` (an unlock, or a format) once no other runs, or answers
    /// why the caller stopped waiting (its deadline, its going away,
    /// shutdown).
    pub(crate) fn one<T>(&self, cancel: &Cancel, f: impl FnOnce() -> T) -> Result<T> {
        loop {
            match self.busy.try_lock() {
                Ok(held) => {
                    let out = f();
                    drop(held);
                    return Ok(out);
                }
                // A derivation that panicked holds nothing: the lock guards no data.
                Err(TryLockError::Poisoned(p)) => {
                    let held = p.into_inner();
                    let out = f();
                    drop(held);
                    return Ok(out);
                }
                Err(TryLockError::WouldBlock) => cancel.sleep(LOOK_EVERY, || {
                    "waiting for another encrypted volume's key derivation".into()
                })?,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::code::Code;

    #[test]
    fn derivations_run_one_at_a_time_and_a_waiter_keeps_its_deadline() {
        let u = Arc::new(Unlocks::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let held = {
            let u = Arc::clone(&u);
            std::thread::spawn(move || {
                u.one(&Cancel::never(), || {
                    tx.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(300));
                })
                .unwrap()
            })
        };
        rx.recv().unwrap();
        let t = Instant::now();
        let cancel = Cancel::never().with_timeout(Duration::from_millis(50));
        let e = u.one(&cancel, || ()).unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "{:?}",
            t.elapsed()
        );
        assert!(e.to_string().contains("key derivation"), "{e}");
        // Once the first is done, the next runs.
        u.one(&Cancel::never(), || ()).unwrap();
        held.join().unwrap();
    }
}

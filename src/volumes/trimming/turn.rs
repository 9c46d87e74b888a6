//! One trim at a time in the agent: a caller's TrimVolume and the
//! schedule's trims take turns, so the host never sees two volumes'
//! discards at once from one guest. A caller waits for its turn with its
//! request's cancellation; the schedule only ever tries (it never waits),
//! and gives its turn up between two ranges as soon as a caller wants it.
//! The turn's mutex is a leaf (table.rs's lock order).

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crust_protocols::sync::{CondvarExt, LockExt};

use crate::cancel::{Cancel, Stopped};

/// How long a waiting caller sleeps before it looks at its cancellation again.
const LOOK: Duration = Duration::from_millis(20);

#[derive(Default)]
struct State {
    /// A trim runs.
    busy: bool,
    /// Callers waiting for their turn.
    waiting: u32,
}

/// The agent's one trim turn (the module doc).
#[derive(Default)]
pub(crate) struct Turn {
    state: Mutex<State>,
    /// Signalled when the turn is let go, or a waiter leaves.
    freed: Condvar,
}

/// A turn held; let go when dropped.
pub(crate) struct TurnGuard<'a> {
    turn: &'a Turn,
}

impl Drop for TurnGuard<'_> {
    fn drop(&mut self) {
        self.turn.state.locked().busy = false;
        self.turn.freed.notify_all();
    }
}

impl Turn {
    /// A caller's turn, waited for until `cancel` fires; `during` says
    /// what the caller was doing, should it give up.
    pub(crate) fn wait(
        &self,
        cancel: &Cancel,
        during: impl Fn() -> String,
    ) -> Result<TurnGuard<'_>, Stopped> {
        let mut st = self.state.locked();
        st.waiting += 1;
        loop {
            if !st.busy {
                st.busy = true;
                st.waiting -= 1;
                return Ok(TurnGuard { turn: self });
            }
            if let Err(stopped) = cancel.check(&during) {
                st.waiting -= 1;
                return Err(stopped);
            }
            st = self.freed.waited_for(st, cancel.slice(LOOK));
        }
    }

    /// The schedule's turn: only when no trim runs and no caller waits.
    pub(crate) fn try_take(&self) -> Option<TurnGuard<'_>> {
        let mut st = self.state.locked();
        if st.busy || st.waiting > 0 {
            return None;
        }
        st.busy = true;
        Some(TurnGuard { turn: self })
    }

    /// Whether a caller waits for the turn (the schedule's trim then yields).
    pub(crate) fn wanted(&self) -> bool {
        self.state.locked().waiting > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_caller_waits_for_the_turn_and_the_schedule_never_does() {
        let turn = Arc::new(Turn::default());
        let held = turn.try_take().unwrap();
        assert!(turn.try_take().is_none(), "one trim at a time");
        let t = turn.clone();
        let caller = std::thread::spawn(move || {
            let _g = t.wait(&Cancel::never(), String::new).unwrap();
            Instant::now()
        });
        let t0 = Instant::now();
        while !turn.wanted() {
            assert!(t0.elapsed() < Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(1));
        }
        let freed = Instant::now();
        drop(held);
        assert!(caller.join().unwrap() >= freed);
        assert!(!turn.wanted());
        // A caller waiting keeps the schedule out even while the turn is free.
        let held = turn.try_take().unwrap();
        let t = turn.clone();
        let gives_up = std::thread::spawn(move || {
            t.wait(
                &Cancel::never().with_timeout(Duration::from_millis(50)),
                || "waiting for the trim turn".into(),
            )
            .err()
            .unwrap()
            .to_string()
        });
        let e = gives_up.join().unwrap();
        assert!(e.contains("waiting for the trim turn"), "{e}");
        assert!(!turn.wanted(), "a caller that gave up no longer wants it");
        drop(held);
        assert!(turn.try_take().is_some());
    }
}

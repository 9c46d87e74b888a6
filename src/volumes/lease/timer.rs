//! The one timer thread: it runs while any volume is frozen, thaws each
//! lease's parts at that lease's deadline (recorded as ended by its
//! timeout), and tries again every second where a thaw failed. It acts on
//! the parts it takes out of their lease, never on a volume's current
//! holder, so it cannot end a newer freeze. It stops when nothing is held,
//! and for good when the table closes (`close`), which joins it.

use std::sync::Arc;
use std::time::Instant;

use crust_protocols::sync::{CondvarExt, LockExt};
use slog::{info, warn};

use super::{Freezer, How, Inner, Part, Taken, Thaw, TimerState};

impl<H: Thaw> Freezer<H> {
    /// Starts the timer thread unless it runs, or the table closed. A
    /// spawn that fails leaves the freezes to their callers, and says so.
    pub(super) fn start_timer(&self) {
        {
            let mut g = self.inner.locked();
            if g.timer != TimerState::Idle {
                return;
            }
            g.timer = TimerState::Running;
        }
        let Some(me) = self.me.upgrade() else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("freeze-timer".into())
            .spawn(move || me.run_timer());
        match spawned {
            Ok(h) => {
                if let Some(old) = self.thread.locked().replace(h) {
                    // It had ended (the state was Idle): joined at once.
                    let _ = old.join();
                }
            }
            Err(e) => {
                self.inner.locked().timer = TimerState::Idle;
                warn!(self.log, "could not start the freeze timer; freezes end only when thawed"; "error" => %e);
            }
        }
    }

    fn run_timer(self: Arc<Self>) {
        while let Some(due) = self.next_due() {
            self.save_unsaved();
            for (id, taken) in due {
                let how = taken.how;
                let vol = taken.vol.clone();
                if self.end(&id, vec![taken]).is_none() && how == How::Timeout {
                    warn!(self.log, "freeze ended by itself at its timeout; the volume is thawed";
                          "volume" => &vol, "freeze" => &id);
                }
            }
        }
        info!(self.log, "nothing is frozen; the freeze timer stops");
    }

    /// Waits for the next part to come due and takes out every part that
    /// is; None once nothing is held or the table closed.
    fn next_due(&self) -> Option<Vec<(String, Taken<H>)>> {
        let mut g = self.inner.locked();
        loop {
            if g.timer == TimerState::Closed {
                return None;
            }
            let now = Instant::now();
            let (due, mut next) = take_due(&mut g, now);
            if !due.is_empty() {
                return Some(due);
            }
            if g.leases.values().any(|l| l.unsaved) {
                // A record to write again: at most a second from now.
                let soon = now + super::RETRY;
                next = Some(next.map_or(soon, |n| n.min(soon)));
                if g.saved_try.is_none_or(|t| t + super::RETRY <= now) {
                    g.saved_try = Some(now);
                    return Some(Vec::new());
                }
            }
            let Some(next) = next else {
                g.timer = TimerState::Idle;
                return None;
            };
            g = self.wake.waited_for(g, next - now);
        }
    }

    /// Ends every lease's timer for good (the table closes): nothing is
    /// frozen after this call returns but what `end_all` could not thaw,
    /// and no timer thread is left to act later on another table's freeze.
    pub(crate) fn close(&self) {
        self.inner.locked().timer = TimerState::Closed;
        self.wake.notify_all();
        let handle = self.thread.locked().take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// The held parts due at `now` (at their lease's deadline, or their retry
/// time), taken out; and when the next one comes due.
fn take_due<H>(g: &mut Inner<H>, now: Instant) -> (Vec<(String, Taken<H>)>, Option<Instant>) {
    let mut due = Vec::new();
    let mut next: Option<Instant> = None;
    for (id, lease) in g.leases.iter_mut().filter(|(_, l)| !l.settled) {
        let deadline = lease.deadline;
        for (vol, part) in &mut lease.parts {
            let Part::Held { retry, .. } = part else {
                continue;
            };
            let (at, how) = retry.unwrap_or((deadline, How::Timeout));
            if at > now {
                next = Some(next.map_or(at, |n| n.min(at)));
                continue;
            }
            if let Part::Held { hold, .. } = std::mem::replace(part, Part::ending(how)) {
                let vol = vol.clone();
                due.push((id.clone(), Taken { vol, hold, how }));
            }
        }
    }
    (due, next)
}

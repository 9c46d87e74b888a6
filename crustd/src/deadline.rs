//! When a call's caller gives up: the `grpc-timeout` kubelet sent, read when
//! the call arrived. Every wait of the call (a lock, a free slot, the agent)
//! ends by it. A call that outlives its caller is joined by the caller's
//! retry, which extends the deadline to its own, so the work goes on for
//! whoever waits for it now. And whether anyone waits at all: a caller
//! that gave up, or went away, leaves; a work whose answer would be a
//! lease nobody holds (a freeze) looks before it answers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::sync::LockExt;

/// A call's deadline, shared by the work and whoever waits for it.
#[derive(Debug, Clone)]
pub struct Deadline {
    at: Arc<Mutex<Option<Instant>>>,
    /// How many callers wait for the answer now.
    callers: Arc<AtomicUsize>,
}

impl Deadline {
    /// `at`: when the caller gives up; `None`: it said nothing, and crustd's
    /// own bounds apply. Its one caller waits.
    pub fn new(at: Option<Instant>) -> Deadline {
        Deadline {
            at: Arc::new(Mutex::new(at)),
            callers: Arc::new(AtomicUsize::new(1)),
        }
    }

    /// Whether a caller still waits for the answer.
    pub fn attended(&self) -> bool {
        self.callers.load(Ordering::SeqCst) > 0
    }

    /// A caller stops waiting (answered, gave up, or went away); answers
    /// how many still wait.
    pub fn leave(&self) -> usize {
        self.callers
            .fetch_sub(1, Ordering::SeqCst)
            .saturating_sub(1)
    }

    /// A retry joins a call nobody waits for; false when someone does.
    pub fn rejoin(&self) -> bool {
        self.callers
            .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// A deadline `d` from now.
    pub fn after(d: Duration) -> Deadline {
        Deadline::new(Instant::now().checked_add(d))
    }

    /// When the caller gives up, if it said.
    pub fn at(&self) -> Option<Instant> {
        *self.at.locked()
    }

    /// When waits end: the caller's deadline, or `fallback` from now.
    pub fn until(&self, fallback: Duration) -> Instant {
        self.at().unwrap_or_else(|| crate::locks::after(fallback))
    }

    /// Whether the caller has given up.
    pub fn passed(&self) -> bool {
        self.at().is_some_and(|d| Instant::now() >= d)
    }

    /// A retry joined the call: the later of the two deadlines holds (none
    /// at all, crustd's own bounds, when the retry set none).
    pub fn extend(&self, to: Option<Instant>) {
        let mut at = self.at.locked();
        *at = match (*at, to) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_joining_retry_extends_the_deadline() {
        let d = Deadline::after(Duration::from_millis(10));
        let later = Instant::now() + Duration::from_secs(5);
        d.clone().extend(Some(later));
        assert_eq!(d.at(), Some(later));
        d.extend(Some(Instant::now()));
        assert_eq!(d.at(), Some(later), "an earlier deadline changes nothing");
        assert!(!d.passed());
        d.extend(None);
        assert_eq!(d.at(), None);
        assert!(d.until(Duration::from_secs(1)) > Instant::now());
        assert!(Deadline::after(Duration::ZERO).passed());
    }

    #[test]
    fn a_call_is_attended_until_its_last_caller_leaves() {
        let d = Deadline::new(None);
        assert!(d.attended());
        assert!(!d.rejoin(), "its caller still waits");
        assert_eq!(d.clone().leave(), 0);
        assert!(!d.attended(), "a clone shares the callers");
        assert!(d.rejoin());
        assert!(d.attended());
    }
}

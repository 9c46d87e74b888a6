//! When a call's caller gives up: the `grpc-timeout` kubelet sent, read when
//! the call arrived. Every wait of the call (a lock, a free slot, the agent)
//! ends by it. A call that outlives its caller is joined by the caller's
//! retry, which extends the deadline to its own, so the work goes on for
//! whoever waits for it now.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A call's deadline, shared by the work and whoever waits for it.
#[derive(Debug, Clone)]
pub struct Deadline(Arc<Mutex<Option<Instant>>>);

impl Deadline {
    /// `at`: when the caller gives up; `None`: it said nothing, and crustd's
    /// own bounds apply.
    pub fn new(at: Option<Instant>) -> Deadline {
        Deadline(Arc::new(Mutex::new(at)))
    }

    /// A deadline `d` from now.
    pub fn after(d: Duration) -> Deadline {
        Deadline::new(Instant::now().checked_add(d))
    }

    /// When the caller gives up, if it said.
    pub fn at(&self) -> Option<Instant> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
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
        let mut at = self.0.lock().unwrap_or_else(|e| e.into_inner());
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
}

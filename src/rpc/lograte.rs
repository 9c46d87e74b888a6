//! A rate limit for the transport's own log lines (refusals, evictions,
//! malformed frames): a flood of bad frames must not become a flood of
//! console lines. Up to `PER_SECOND` lines a second; the rest are counted
//! and the count is reported on the next line that gets through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Lines allowed per second.
pub(crate) const PER_SECOND: u64 = 20;

/// Counts lines per one-second window.
#[derive(Debug)]
pub(crate) struct LogRate {
    start: Instant,
    /// The current window (seconds since `start`) in the high 32 bits,
    /// lines let through in it in the low 32.
    window: AtomicU64,
    /// Lines held back since the last one let through.
    dropped: AtomicU64,
}

impl LogRate {
    pub(crate) fn new() -> LogRate {
        LogRate {
            start: Instant::now(),
            window: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when a line may be written now, `n` being how many were
    /// held back before it; `None` when this one is held back.
    pub(crate) fn allow(&self) -> Option<u64> {
        let now = self.start.elapsed().as_secs() & 0xffff_ffff;
        let mut cur = self.window.load(Ordering::Relaxed);
        loop {
            let (win, n) = (cur >> 32, cur & 0xffff_ffff);
            let next = if win == now {
                if n >= PER_SECOND {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                cur + 1
            } else {
                (now << 32) | 1
            };
            match self
                .window
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(self.dropped.swap(0, Ordering::Relaxed)),
                Err(actual) => cur = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_the_rate_then_the_count_of_the_rest() {
        let r = LogRate::new();
        let allowed = (0..1000).filter(|_| r.allow().is_some()).count() as u64;
        // All in one window unless the test straddles a second boundary.
        assert!(
            (PER_SECOND..=2 * PER_SECOND).contains(&allowed),
            "{allowed}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let held = r.allow().expect("a new second lets a line through");
        assert_eq!(held, 1000 - allowed);
        assert_eq!(r.allow(), Some(0));
    }
}

//! One volume's fsGroup walk in flight, and how it ends (the room's doc is
//! in `mod.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::sync::{CondvarExt, LockExt};

use crate::cancel::{Cancel, Token, Why};
use crate::code::Code;
use crate::ownership::walk::Report;
use crate::volumes::error::Error;

/// How a job ended, as every waiter is told.
#[derive(Clone, Debug)]
pub(crate) enum Outcome {
    /// The walk went through and the volume is complete.
    Done(Option<Report>),
    /// The walk, or finishing the publish, failed; the volume was taken
    /// down (or, when stopped by Unpublish, is being taken down).
    Failed {
        /// The error's code.
        code: Code,
        /// The error, as a sentence.
        message: String,
    },
}

#[derive(Debug)]
enum Phase {
    Walking,
    Ended,
    Finished(Outcome),
}

/// One volume's fsGroup walk in flight (see the module doc).
pub(crate) struct WalkJob {
    /// Entries the walk has visited so far (ListVolumes' `ownership_done`).
    visited: AtomicU64,
    /// When it started.
    started: Instant,
    /// Fired by Unpublish: stops the walk.
    stop: Token,
    phase: Mutex<Phase>,
    changed: Condvar,
}

impl std::fmt::Debug for WalkJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalkJob")
            .field("visited", &self.visited())
            .field("phase", &*self.phase.locked())
            .finish()
    }
}

impl WalkJob {
    /// A job about to start walking.
    pub(crate) fn new() -> WalkJob {
        WalkJob {
            visited: AtomicU64::new(0),
            started: Instant::now(),
            stop: Token::new(Why::Unpublished),
            phase: Mutex::new(Phase::Walking),
            changed: Condvar::new(),
        }
    }

    fn set(&self, phase: Phase) {
        *self.phase.locked() = phase;
        self.changed.notify_all();
    }

    /// Entries visited so far.
    pub(crate) fn visited(&self) -> u64 {
        self.visited.load(Ordering::Relaxed)
    }

    /// Records the walk's progress (from its progress report).
    pub(crate) fn progress(&self, visited: u64) {
        self.visited.fetch_max(visited, Ordering::Relaxed);
    }

    /// The walk's own cancellation: Unpublish's token, and `shutdown`.
    pub(crate) fn cancel(&self, shutdown: &Token) -> Cancel {
        Cancel::never().with_token(&self.stop).with_token(shutdown)
    }

    /// Whether the outcome is known.
    pub(crate) fn finished(&self) -> bool {
        matches!(*self.phase.locked(), Phase::Finished(_))
    }

    /// Whether the walk is still running (not yet Ended).
    #[cfg(test)]
    pub(crate) fn walking(&self) -> bool {
        matches!(*self.phase.locked(), Phase::Walking)
    }

    /// The walk returned and let go of the mount.
    pub(crate) fn ended(&self) {
        self.set(Phase::Ended);
    }

    /// The outcome is known.
    pub(crate) fn finish(&self, outcome: Outcome) {
        self.set(Phase::Finished(outcome));
    }

    /// Stops the walk (Unpublish) and waits until it has let go of the
    /// mount. The walk looks at its token between two entries, so this
    /// takes milliseconds unless one syscall on the disk hangs; the wait
    /// gives up with `cancel`.
    pub(crate) fn stop_and_wait(
        &self,
        id: &str,
        cancel: &Cancel,
    ) -> Result<(), crate::cancel::Stopped> {
        self.stop.fire();
        let mut phase = self.phase.locked();
        while matches!(*phase, Phase::Walking) {
            cancel.check(|| format!("waiting for the fsGroup walk of volume {id} to stop"))?;
            let slice = cancel.slice(Duration::from_millis(50));
            phase = self.changed.waited_for(phase, slice);
        }
        Ok(())
    }

    /// Waits for the outcome within the caller's `cancel`. When the caller's
    /// deadline passes or it goes away first, the answer says the walk goes
    /// on and how far it is. A shutdown is not the caller's: it stops the
    /// walk itself, and the caller is told the outcome.
    pub(crate) fn wait(&self, id: &str, cancel: &Cancel) -> Result<Outcome, Error> {
        let mut phase = self.phase.locked();
        loop {
            if let Phase::Finished(outcome) = &*phase {
                return Ok(outcome.clone());
            }
            match cancel.why() {
                Some(why @ (Why::Deadline | Why::CallerGone)) => {
                    return Err(Error::WalkContinues {
                        id: id.to_string(),
                        why,
                        visited: self.visited(),
                        seconds: self.started.elapsed().as_secs(),
                    });
                }
                // Shutdown or Unpublish: the walk stops; its outcome follows.
                Some(Why::Shutdown | Why::Unpublished) | None => {}
            }
            let slice = cancel
                .slice(Duration::from_millis(50))
                .max(Duration::from_millis(1));
            phase = self.changed.waited_for(phase, slice);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_waiter_whose_deadline_passes_is_told_the_walk_goes_on() {
        let job = WalkJob::new();
        job.progress(1234);
        let cancel = Cancel::never().with_timeout(Duration::from_millis(20));
        let e = job.wait("vol-1", &cancel).unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
        let msg = e.to_string();
        assert!(
            msg.contains("continues") && msg.contains("1234 entries"),
            "{msg}"
        );
        // A caller that went away: CANCELLED, same news.
        let gone = Token::new(Why::CallerGone);
        gone.fire();
        let e = job
            .wait("vol-1", &Cancel::never().with_token(&gone))
            .unwrap_err();
        assert_eq!(e.code(), Code::Cancelled);
        // The walk was untouched by either.
        assert!(job.walking());
    }

    #[test]
    fn every_waiter_gets_the_outcome_and_a_shutdown_waits_for_it() {
        let job = Arc::new(WalkJob::new());
        let down = Token::new(Why::Shutdown);
        down.fire();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let (job, down) = (Arc::clone(&job), down.clone());
                std::thread::spawn(move || job.wait("v", &Cancel::never().with_token(&down)))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(30));
        job.ended();
        job.finish(Outcome::Done(Some(Report {
            visited: 7,
            ..Report::default()
        })));
        for w in waiters {
            match w.join().unwrap().unwrap() {
                Outcome::Done(Some(r)) => assert_eq!(r.visited, 7),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn stopping_fires_the_walks_token_and_waits_until_it_ended() {
        let job = Arc::new(WalkJob::new());
        let shutdown = Token::new(Why::Shutdown);
        let walk_cancel = job.cancel(&shutdown);
        let j = Arc::clone(&job);
        let walker = std::thread::spawn(move || {
            while walk_cancel.why().is_none() {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(20));
            j.ended();
            walk_cancel.why()
        });
        let start = Instant::now();
        job.stop_and_wait("v", &Cancel::never()).unwrap();
        assert!(!job.walking());
        assert_eq!(walker.join().unwrap(), Some(Why::Unpublished));
        assert!(start.elapsed() < Duration::from_secs(1));
        // A stop whose own deadline passes first gives up, saying so.
        let stuck = WalkJob::new();
        let e = stuck
            .stop_and_wait(
                "v",
                &Cancel::never().with_timeout(Duration::from_millis(10)),
            )
            .unwrap_err();
        assert_eq!(e.why, Why::Deadline);
    }
}

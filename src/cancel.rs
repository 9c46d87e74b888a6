//! Cancellation that travels with the work: every wait and every walk takes
//! a [`Cancel`] and stops soon after it fires, so a request ends at its
//! caller's deadline, when its caller goes away, or when the agent shuts
//! down — never holding a lock for longer than that.
//!
//! A `Cancel` is a deadline plus any number of [`Token`]s (the agent's
//! shutdown, the request's connection). Waits sleep in slices of at most
//! [`SLICE`], so a fired token is noticed within that time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::code::Code;

/// The longest a wait sleeps before it looks at its tokens again.
pub const SLICE: Duration = Duration::from_millis(100);

/// Why work was stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The agent is shutting down (Shutdown request or SIGTERM).
    Shutdown,
    /// The caller's connection closed: nobody waits for the answer.
    CallerGone,
    /// The caller's deadline (its ttrpc timeout) passed.
    Deadline,
    /// The volume is being unpublished (stops its fsGroup walk).
    Unpublished,
}

impl Why {
    /// Why, as the start of a sentence ("the caller's deadline passed").
    pub fn text(self) -> &'static str {
        match self {
            Why::Shutdown => "the agent is shutting down",
            Why::CallerGone => "the caller closed its connection",
            Why::Deadline => "the caller's deadline passed",
            Why::Unpublished => "the volume was unpublished",
        }
    }
}

/// Work stopped by a [`Cancel`]; what was done has been undone by the caller.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{}", self.message())]
pub struct Stopped {
    pub why: Why,
    /// What was under way ("waiting for the disk with serial vol-1").
    pub during: String,
}

impl Stopped {
    fn message(&self) -> String {
        match self.why {
            Why::Shutdown => format!(
                "the agent is shutting down: stopped while {}; nothing was left half-done",
                self.during
            ),
            Why::CallerGone => format!(
                "the caller closed its connection: stopped while {}; nothing was left half-done",
                self.during
            ),
            Why::Deadline => format!(
                "the caller's deadline passed while {}; stopped, and nothing was left half-done (retry with a longer timeout)",
                self.during
            ),
            Why::Unpublished => format!(
                "the volume was unpublished: stopped while {}",
                self.during
            ),
        }
    }

    /// The wire code: shutting down is FAILED_PRECONDITION, as every refusal
    /// after Shutdown, and so is an unpublish that overtook the work; a
    /// passed deadline DEADLINE_EXCEEDED; a gone caller CANCELLED.
    pub fn code(&self) -> Code {
        match self.why {
            Why::Shutdown | Why::Unpublished => Code::FailedPrecondition,
            Why::CallerGone => Code::Cancelled,
            Why::Deadline => Code::DeadlineExceeded,
        }
    }
}

/// A flag that fires once and stays fired.
#[derive(Clone)]
pub struct Token {
    fired: Arc<AtomicBool>,
    why: Why,
    /// A signal owned elsewhere that fires the token once it says so
    /// (asked on every look): ttrpc's per-connection cancel channel.
    watch: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token")
            .field("why", &self.why)
            .field("fired", &self.fired.load(Ordering::SeqCst))
            .field("watching", &self.watch.is_some())
            .finish()
    }
}

impl Token {
    /// A token that stops work for `why` once fired.
    pub fn new(why: Why) -> Token {
        Token {
            fired: Arc::new(AtomicBool::new(false)),
            why,
            watch: None,
        }
    }

    /// A token that also fires by itself once `gone()` returns true — for
    /// a signal another layer owns, like the transport's "this caller
    /// disconnected". `gone` must be cheap: waits ask it every slice.
    pub fn watching(why: Why, gone: impl Fn() -> bool + Send + Sync + 'static) -> Token {
        Token {
            watch: Some(Arc::new(gone)),
            ..Token::new(why)
        }
    }

    /// Fires the token: every `Cancel` holding it stops.
    pub fn fire(&self) {
        self.fired.store(true, Ordering::SeqCst);
    }

    /// Whether it has fired.
    pub fn fired(&self) -> bool {
        if self.fired.load(Ordering::SeqCst) {
            return true;
        }
        match &self.watch {
            Some(gone) if gone() => {
                self.fire();
                true
            }
            _ => false,
        }
    }
}

/// A deadline and the tokens whose firing stops the work.
#[derive(Clone, Debug, Default)]
pub struct Cancel {
    deadline: Option<Instant>,
    tokens: Vec<Token>,
}

impl Cancel {
    /// Never stops (tests, and work that must finish, like the final unmounts).
    pub fn never() -> Cancel {
        Cancel::default()
    }

    /// Also stops at `deadline` (the earlier of it and any deadline already set).
    pub fn with_deadline(mut self, deadline: Instant) -> Cancel {
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline)));
        self
    }

    /// Also stops after `d` from now (saturating on absurd durations).
    pub fn with_timeout(self, d: Duration) -> Cancel {
        match Instant::now().checked_add(d) {
            Some(at) => self.with_deadline(at),
            None => self,
        }
    }

    /// Also stops when `token` fires.
    pub fn with_token(mut self, token: &Token) -> Cancel {
        self.tokens.push(token.clone());
        self
    }

    /// The deadline, if one is set.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Why the work must stop now, if it must. Tokens win over the deadline:
    /// a shutdown is reported as such even when the deadline passed too.
    pub fn why(&self) -> Option<Why> {
        if let Some(t) = self.tokens.iter().find(|t| t.fired()) {
            return Some(t.why);
        }
        match self.deadline {
            Some(d) if Instant::now() >= d => Some(Why::Deadline),
            _ => None,
        }
    }

    /// Ok while the work may go on; `Stopped` naming `during` once it must stop.
    pub fn check(&self, during: impl FnOnce() -> String) -> Result<(), Stopped> {
        match self.why() {
            None => Ok(()),
            Some(why) => Err(Stopped {
                why,
                during: during(),
            }),
        }
    }

    /// How long a wait may sleep before looking again: at most `want`, at
    /// most [`SLICE`], and never past the deadline.
    pub fn slice(&self, want: Duration) -> Duration {
        let mut d = want.min(SLICE);
        if let Some(dl) = self.deadline {
            d = d.min(dl.saturating_duration_since(Instant::now()));
        }
        d
    }

    /// Sleeps `d` in slices, returning early with `Stopped` if the work must stop.
    pub fn sleep(&self, d: Duration, during: impl Fn() -> String) -> Result<(), Stopped> {
        let end = Instant::now().checked_add(d);
        loop {
            self.check(&during)?;
            let left = match end {
                Some(e) => e.saturating_duration_since(Instant::now()),
                None => SLICE,
            };
            if left.is_zero() {
                return Ok(());
            }
            std::thread::sleep(self.slice(left).max(Duration::from_millis(1)));
        }
    }
}

/// The time left until `deadline`, at most `cap`.
pub fn until(deadline: Instant, cap: Duration) -> Duration {
    deadline.saturating_duration_since(Instant::now()).min(cap)
}

/// `start + timeout`, without overflowing on absurd timeouts.
pub fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_stops_until_a_token_fires() {
        let t = Token::new(Why::Shutdown);
        let c = Cancel::never().with_token(&t);
        assert_eq!(c.why(), None);
        assert!(c.check(|| "x".into()).is_ok());
        t.fire();
        let e = c.check(|| "waiting for x".into()).unwrap_err();
        assert_eq!(e.why, Why::Shutdown);
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("waiting for x"), "{e}");
        // Clones share the token.
        assert_eq!(c.clone().why(), Some(Why::Shutdown));
    }

    #[test]
    fn the_earlier_deadline_wins_and_tokens_win_over_it() {
        let now = Instant::now();
        let c = Cancel::never()
            .with_deadline(now + Duration::from_secs(60))
            .with_deadline(now);
        assert_eq!(c.deadline(), Some(now));
        assert_eq!(c.why(), Some(Why::Deadline));
        assert_eq!(
            c.check(String::new).unwrap_err().code(),
            Code::DeadlineExceeded
        );
        let t = Token::new(Why::CallerGone);
        t.fire();
        let c = c.with_token(&t);
        assert_eq!(c.why(), Some(Why::CallerGone));
        assert_eq!(c.check(String::new).unwrap_err().code(), Code::Cancelled);
        // An absurd timeout is no deadline, not an overflow.
        assert_eq!(Cancel::never().with_timeout(Duration::MAX).deadline(), None);
    }

    #[test]
    fn a_watching_token_fires_when_its_signal_says_so_and_stays_fired() {
        let gone = Arc::new(AtomicBool::new(false));
        let g = gone.clone();
        let t = Token::watching(Why::CallerGone, move || g.load(Ordering::SeqCst));
        let c = Cancel::never().with_token(&t);
        assert_eq!(c.why(), None);
        gone.store(true, Ordering::SeqCst);
        assert_eq!(c.why(), Some(Why::CallerGone));
        gone.store(false, Ordering::SeqCst);
        assert!(t.fired(), "once fired, always fired");
        assert_eq!(c.check(String::new).unwrap_err().code(), Code::Cancelled);
    }

    #[test]
    fn slices_are_short_and_stop_at_the_deadline() {
        let c = Cancel::never();
        assert_eq!(c.slice(Duration::from_secs(5)), SLICE);
        assert_eq!(c.slice(Duration::from_millis(3)), Duration::from_millis(3));
        let c = Cancel::never().with_timeout(Duration::from_millis(20));
        assert!(c.slice(Duration::from_secs(5)) <= Duration::from_millis(20));
    }

    #[test]
    fn a_sleep_ends_soon_after_a_token_fires() {
        let t = Token::new(Why::Shutdown);
        let c = Cancel::never().with_token(&t);
        let t2 = t.clone();
        let firer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            t2.fire();
        });
        let start = Instant::now();
        let r = c.sleep(Duration::from_secs(30), || "sleeping".into());
        firer.join().unwrap();
        assert_eq!(r.unwrap_err().why, Why::Shutdown);
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        // A short sleep with nothing fired just sleeps.
        assert!(Cancel::never()
            .sleep(Duration::from_millis(5), String::new)
            .is_ok());
    }
}

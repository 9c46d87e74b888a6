//! The table's stop: a flag Shutdown sets, after which no new volume,
//! bind or freeze is accepted, and a token it fires, which every wait and
//! walk in flight watches.

use std::sync::atomic::{AtomicBool, Ordering};

use super::error::Error;
use crate::cancel::{Cancel, Token, Why};

/// Shutdown's flag and token (the module doc).
pub(crate) struct Stop {
    closed: AtomicBool,
    token: Token,
}

impl Default for Stop {
    fn default() -> Stop {
        Stop {
            closed: AtomicBool::new(false),
            token: Token::new(Why::Shutdown),
        }
    }
}

impl Stop {
    /// Refuses new volumes, binds and freezes once Shutdown began.
    pub(crate) fn accepting(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown);
        }
        Ok(())
    }

    /// Stops accepting, then fires the token: a publish that checked the
    /// flag before this finds its slot listed by Shutdown, one after it is
    /// refused.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.token.fire();
    }

    /// The token Shutdown fires, for a walk that outlives its call.
    pub(crate) fn token(&self) -> Token {
        self.token.clone()
    }

    /// `cancel`, also fired by Shutdown.
    pub(crate) fn with(&self, cancel: &Cancel) -> Cancel {
        cancel.clone().with_token(&self.token)
    }
}

//! How a part of a freeze ended, in a record's words and a sentence's.

/// How a part of a freeze ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum How {
    /// By a thaw naming its id: the one way that keeps a snapshot whole.
    Thawed,
    /// At its timeout, by the agent's timer.
    Timeout,
    /// Its volume was unpublished.
    Unpublished,
    /// The agent stopped (Shutdown, SIGTERM, an embedder's table closed).
    Stopped,
    /// The agent that froze it died; the next one thawed it.
    Restart,
    /// A forced thaw ended whatever held the volume.
    Forced,
    /// Its own freeze call failed, and undid what it froze.
    Undone,
    /// Something other than the agent thawed it first: FITHAW found it
    /// not frozen, so writes may have gone through before this end.
    Lost,
}

const HOWS: [(How, &str, &str); 8] = [
    (How::Thawed, "thawed", "thawed by its id"),
    (
        How::Timeout,
        "timeout",
        "thawed by the agent when its timeout passed",
    ),
    (
        How::Unpublished,
        "unpublished",
        "thawed when the volume was unpublished",
    ),
    (How::Stopped, "stopped", "thawed when the agent stopped"),
    (
        How::Restart,
        "restart",
        "thawed by the agent's next start, after the agent that froze it died",
    ),
    (How::Forced, "forced", "thawed by a forced thaw"),
    (
        How::Undone,
        "undone",
        "thawed when its own freeze call failed",
    ),
    (
        How::Lost,
        "lost",
        "found thawed by something other than the agent (FITHAW said it was not frozen), so writes may have gone through before",
    ),
];

impl How {
    /// Its name in a record.
    pub(crate) fn name(self) -> &'static str {
        HOWS.iter().find(|h| h.0 == self).map_or("", |h| h.1)
    }

    pub(crate) fn parse(s: &str) -> Option<How> {
        HOWS.iter().find(|h| h.1 == s).map(|h| h.0)
    }

    /// As a sentence says it.
    pub(crate) fn said(self) -> &'static str {
        HOWS.iter().find(|h| h.0 == self).map_or("", |h| h.2)
    }
}

/// How and when a part ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct End {
    pub(crate) how: How,
    pub(crate) at_unix_ms: u64,
}

impl End {
    /// "volume v1 thawed by ... 12 s ago (unix time N ms)".
    pub(crate) fn said(&self, vol: &str, now: u64) -> String {
        format!(
            "volume {vol} {} {} s ago (unix time {} ms)",
            self.how.said(),
            now.saturating_sub(self.at_unix_ms) / 1000,
            self.at_unix_ms
        )
    }
}

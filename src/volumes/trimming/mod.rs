//! Trim on a schedule (semantics.md §10): a volume published with a trim
//! interval is trimmed in the background by one runner thread per agent,
//! at its interval with jitter, never while frozen, publishing, or under
//! another operation, one trim at a time in the agent (a caller's
//! TrimVolume included), yielding between two ranges to any call.
//!
//! - `schedule`: the room, one entry per such volume (when due, how the
//!   last trim went), where the runner sleeps;
//! - `turn`: one trim at a time, callers and schedule alike;
//! - `run`: the scheduled trim, under the volume's slot, taken only if free.

pub(crate) mod run;
pub(crate) mod schedule;
pub(crate) mod turn;

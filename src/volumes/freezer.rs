//! Which volumes are frozen, by which freeze, until when; and the one timer
//! thread that thaws a freeze nobody thawed when its timeout passes, so a
//! caller that crashed between its freeze and its thaw never leaves a pod
//! hanging on its writes. The freezer holds each frozen filesystem's root
//! open, so a thaw needs no lock a long operation holds and no path: it
//! never waits behind anything (FITHAW itself writes one superblock).
//!
//! A freeze that ended by itself is remembered for its volumes (one entry
//! each, until the volume is frozen again or unpublished): thawing it then
//! answers ABORTED with when it ended, since a snapshot taken after that
//! may be torn.
//!
//! Its mutex is a leaf (lock 6 of table.rs): taken alone, for one lookup
//! or update, never across a syscall.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::index::lock;
use crate::quiesce;

/// How long a freeze lasts when the caller names no timeout.
pub const DEFAULT_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::DEFAULT_TIMEOUT_MS as u64);
/// The longest freeze: a snapshot on the host takes seconds; a pod's
/// writes wait for all of it.
pub const MAX_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::MAX_TIMEOUT_MS as u64);

/// Milliseconds since the epoch, now.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One frozen volume.
struct Held {
    /// The freeze that holds it.
    freeze: Arc<str>,
    /// Its mount root, open for FITHAW.
    dir: File,
    /// Its guest path, for messages.
    path: PathBuf,
    /// When the freeze ends by itself.
    deadline: Instant,
    /// The freeze's timeout.
    timeout: Duration,
}

/// A freeze that ended by itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ended {
    /// Its name.
    pub(crate) freeze: String,
    /// When it ended, in milliseconds since the epoch.
    pub(crate) at_unix_ms: u64,
    /// Its timeout.
    pub(crate) timeout: Duration,
}

/// What holds a volume frozen, as ListVolumes and refusals say it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Holding {
    /// The freeze.
    pub(crate) freeze: String,
    /// Until it ends by itself.
    pub(crate) left: Duration,
}

#[derive(Default)]
struct Inner {
    /// Frozen volumes, by id.
    held: HashMap<String, Held>,
    /// Freezes that ended by themselves, by volume id.
    ended: HashMap<String, Ended>,
    /// Whether the timer thread runs.
    timer: bool,
    /// Freezes made, for their names.
    seq: u64,
}

/// The frozen volumes (the module doc).
#[derive(Default)]
pub(crate) struct Freezer {
    inner: Mutex<Inner>,
    /// Wakes the timer when a freeze is added or taken away.
    wake: Condvar,
}

/// A frozen volume taken out of the freezer, to be thawed.
pub(crate) struct Taken {
    /// The freeze that held it.
    pub(crate) freeze: Arc<str>,
    dir: File,
    path: PathBuf,
}

impl Taken {
    /// FITHAW. False when it was not frozen any more.
    pub(crate) fn thaw(&self) -> Result<bool, quiesce::Error> {
        quiesce::thaw(&self.dir, &self.path)
    }
}

impl Freezer {
    /// A new freeze's name.
    pub(crate) fn name(&self) -> Arc<str> {
        let mut g = lock(&self.inner);
        g.seq += 1;
        Arc::from(format!("freeze-{}-{}", unix_ms() / 1000, g.seq))
    }

    /// What holds volume `id` frozen, if anything.
    pub(crate) fn holding(&self, id: &str) -> Option<Holding> {
        let g = lock(&self.inner);
        g.held.get(id).map(|h| Holding {
            freeze: h.freeze.to_string(),
            left: h.deadline.saturating_duration_since(Instant::now()),
        })
    }

    /// The ids of every frozen volume.
    pub(crate) fn held_ids(&self) -> Vec<String> {
        lock(&self.inner).held.keys().cloned().collect()
    }

    /// The freeze of volume `id` that ended by itself, if one did since it
    /// was last frozen.
    pub(crate) fn ended(&self, id: &str) -> Option<Ended> {
        lock(&self.inner).ended.get(id).cloned()
    }

    /// Forgets everything about volume `id` (it is unpublished).
    pub(crate) fn forget(&self, id: &str) {
        lock(&self.inner).ended.remove(id);
    }

    /// Notes volume `id` frozen by `freeze` (FIFREEZE done on `dir`) until
    /// `timeout` from now. True when the timer thread must be started.
    pub(crate) fn hold(
        &self,
        id: &str,
        freeze: &Arc<str>,
        dir: File,
        path: PathBuf,
        timeout: Duration,
    ) -> bool {
        let mut g = lock(&self.inner);
        g.ended.remove(id);
        g.held.insert(
            id.to_string(),
            Held {
                freeze: Arc::clone(freeze),
                dir,
                path,
                deadline: Instant::now() + timeout,
                timeout,
            },
        );
        self.wake.notify_all();
        !std::mem::replace(&mut g.timer, true)
    }

    /// Takes volume `id` out of the freezer, to thaw it.
    pub(crate) fn take(&self, id: &str) -> Option<Taken> {
        let taken = lock(&self.inner).held.remove(id);
        self.wake.notify_all();
        taken.map(|h| Taken {
            freeze: h.freeze,
            dir: h.dir,
            path: h.path,
        })
    }

    /// Puts back a volume whose thaw failed: its timer tries again.
    pub(crate) fn put_back(&self, id: &str, t: Taken, timeout: Duration) {
        let mut g = lock(&self.inner);
        g.held.insert(
            id.to_string(),
            Held {
                freeze: t.freeze,
                dir: t.dir,
                path: t.path,
                deadline: Instant::now() + timeout,
                timeout,
            },
        );
        self.wake.notify_all();
    }

    /// Waits for the next freeze to end by itself and takes out every
    /// volume whose freeze has; None once nothing is frozen (the timer
    /// thread then ends).
    pub(crate) fn next_expired(&self) -> Option<Vec<(String, Taken, Duration)>> {
        let mut g = lock(&self.inner);
        loop {
            let Some(first) = g.held.values().map(|h| h.deadline).min() else {
                g.timer = false;
                return None;
            };
            let now = Instant::now();
            if first <= now {
                let due: Vec<String> = g
                    .held
                    .iter()
                    .filter(|(_, h)| h.deadline <= now)
                    .map(|(id, _)| id.clone())
                    .collect();
                let at_unix_ms = unix_ms();
                let mut out = Vec::new();
                for id in due {
                    if let Some(h) = g.held.remove(&id) {
                        g.ended.insert(
                            id.clone(),
                            Ended {
                                freeze: h.freeze.to_string(),
                                at_unix_ms,
                                timeout: h.timeout,
                            },
                        );
                        let taken = Taken {
                            freeze: h.freeze,
                            dir: h.dir,
                            path: h.path,
                        };
                        out.push((id, taken, h.timeout));
                    }
                }
                return Some(out);
            }
            g = self
                .wake
                .wait_timeout(g, first - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

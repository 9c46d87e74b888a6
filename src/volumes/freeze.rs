//! Freezing volumes for a consistent snapshot, and thawing them
//! (semantics.md §10): all or none, each volume under its own lock in turn,
//! recorded before it is frozen (`<id>.frozen`), so that a restarted agent
//! thaws what a dead one left frozen (recover.rs, `thaw_left_frozen`). The
//! timer thread that ends a freeze at its timeout runs here. The freezer
//! (freezer.rs) holds what is frozen and ends a freeze at its timeout.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use slog::{info, warn};

use super::error::Error;
use super::freezer::{unix_ms, Taken};
use super::table::Volumes;
use super::volume::Volume;
use crate::cancel::Cancel;
use crate::error::Result;
use crate::model::VolumeMode;
use crate::quiesce;

/// What a freeze answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frozen {
    /// The freeze's name.
    pub freeze_id: String,
    /// When it ends by itself, in milliseconds since the epoch.
    pub thaw_at_unix_ms: u64,
    /// Its timeout.
    pub timeout: Duration,
}

impl Volumes {
    /// Freezes the filesystems of `ids` (distinct, validated), all or none,
    /// until thawed or `timeout` passes.
    pub fn freeze(&self, ids: &[String], timeout: Duration, cancel: &Cancel) -> Result<Frozen> {
        self.accepting()?;
        let cancel = &self.stop_with(cancel);
        let freeze = self.freezer().name();
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // At or before every volume's own deadline: the first was frozen after this.
        let thaw_at_unix_ms = unix_ms().saturating_add(timeout_ms);
        let mut done: Vec<&str> = Vec::new();
        for id in ids {
            let frozen = self.with_volume(id, cancel, |vol| self.freeze_one(vol, &freeze, timeout));
            if let Err(e) = frozen {
                for id in done.iter().rev() {
                    self.thaw_one(id);
                }
                return Err(e);
            }
            done.push(id);
        }
        info!(self.log(), "volumes frozen"; "freeze" => &*freeze, "volumes" => ids.join(" "),
              "timeout_ms" => u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        Ok(Frozen {
            freeze_id: freeze.to_string(),
            thaw_at_unix_ms,
            timeout,
        })
    }

    /// Freezes one volume, under its lock: refused for a block volume, one
    /// not completely published, one frozen already; marked, then frozen.
    fn freeze_one(&self, vol: &mut Volume, freeze: &Arc<str>, timeout: Duration) -> Result<()> {
        if vol.mode() == VolumeMode::Block {
            return Err(Error::NoFilesystem {
                id: vol.id().to_string(),
                what: "frozen",
            }
            .into());
        }
        self.not_frozen(vol.id())?;
        vol.not_publishing()?;
        if !vol.complete {
            return Err(Error::StillPublishing {
                id: vol.id().to_string(),
                visited: 0,
            }
            .into());
        }
        let at = self.open_mount(vol)?;
        let dir = quiesce::open(at.as_fd(), &vol.guest_path)?;
        self.store().mark_frozen(
            vol.id(),
            &format!("{freeze}\n{}\n", vol.guest_path.display()),
        )?;
        if let Err(e) = quiesce::freeze(&dir, &vol.guest_path) {
            let _ = self.store().clear_frozen(vol.id());
            return Err(e.into());
        }
        if self
            .freezer()
            .hold(vol.id(), freeze, dir, vol.guest_path.clone(), timeout)
        {
            self.start_freeze_timer();
        }
        Ok(())
    }

    /// Refuses what writes to a frozen volume (expand, a bind, a walk, a
    /// trim), naming the freeze.
    pub(crate) fn not_frozen(&self, id: &str) -> Result<()> {
        match self.freezer().holding(id) {
            Some(h) => Err(Error::Frozen {
                id: id.to_string(),
                freeze: h.freeze,
                seconds_left: h.left.as_secs(),
            }
            .into()),
            None => Ok(()),
        }
    }

    /// Thaws volume `id` if it is frozen (no lock needed: the freezer holds
    /// its root open); answers the freeze that held it. A thaw that fails
    /// leaves it to the freezer's timer, and says so.
    pub(crate) fn thaw_one(&self, id: &str) -> Option<Arc<str>> {
        let taken = self.freezer().take(id)?;
        match taken.thaw() {
            Ok(_) => {
                if let Err(e) = self.store().clear_frozen(id) {
                    warn!(self.log(), "could not remove a volume's frozen mark; the next start thaws it again (harmless)";
                          "volume" => id, "error" => %e);
                }
                Some(Arc::clone(&taken.freeze))
            }
            Err(e) => {
                warn!(self.log(), "could not thaw; the freeze's timer tries again in a second";
                      "volume" => id, "freeze" => &*taken.freeze, "error" => %e);
                let freeze = Arc::clone(&taken.freeze);
                self.put_back(id, taken);
                Some(freeze)
            }
        }
    }

    /// Thaws every frozen volume (the agent exits leaving its volumes
    /// mounted); answers how many were frozen.
    pub fn thaw_all(&self) -> usize {
        let ids = self.freezer().held_ids();
        ids.iter().filter(|id| self.thaw_one(id).is_some()).count()
    }

    fn put_back(&self, id: &str, taken: Taken) {
        self.freezer().put_back(id, taken, Duration::from_secs(1));
    }

    /// Thaws the filesystems of `ids` (validated). Unknown ids are refused
    /// before anything is thawed; volumes not frozen are fine. When a
    /// volume's freeze ended by itself, the rest are thawed and the call
    /// answers ABORTED, saying when it ended.
    pub fn thaw(&self, ids: &[String]) -> Result<Vec<String>> {
        if let Some(id) = ids.iter().find(|id| self.existing_slot(id).is_none()) {
            return Err(Error::NotPublished(id.clone()).into());
        }
        let mut thawed = Vec::new();
        for id in ids {
            if let Some(freeze) = self.thaw_one(id) {
                info!(self.log(), "volume thawed"; "volume" => id, "freeze" => &*freeze);
                thawed.push(id.clone());
            }
        }
        let ended: Vec<(String, _)> = ids
            .iter()
            .filter_map(|id| self.freezer().ended(id).map(|e| (id.clone(), e)))
            .collect();
        if let Some((_, first)) = ended.first() {
            let names: Vec<String> = ended.iter().map(|(id, _)| id.clone()).collect();
            return Err(Error::FreezeEnded {
                ids: names.join(", "),
                freeze: first.freeze.clone(),
                seconds_ago: unix_ms().saturating_sub(first.at_unix_ms) / 1000,
                at_unix_ms: first.at_unix_ms,
                timeout_s: first.timeout.as_secs(),
            }
            .into());
        }
        Ok(thawed)
    }
}

impl Volumes {
    /// Starts the timer thread that thaws freezes at their timeout (one
    /// for the agent, while anything is frozen). A spawn that fails leaves
    /// the freezes to their callers' thaws, and says so.
    pub(crate) fn start_freeze_timer(&self) {
        let me = self.shared();
        let spawned = std::thread::Builder::new()
            .name("freeze-timer".into())
            .spawn(move || me.run_freeze_timer());
        if let Err(e) = spawned {
            warn!(self.log(), "could not start the freeze timer; freezes end only when thawed"; "error" => %e);
        }
    }

    fn run_freeze_timer(&self) {
        while let Some(expired) = self.freezer().next_expired() {
            for (id, taken, timeout) in expired {
                match taken.thaw() {
                    Ok(_) => {
                        let _ = self.store().clear_frozen(&id);
                        warn!(self.log(), "freeze ended by itself at its timeout; the volume is thawed";
                              "volume" => &id, "freeze" => &*taken.freeze, "timeout_ms" => u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
                    }
                    Err(e) => {
                        warn!(self.log(), "could not thaw at the freeze's timeout; trying again in a second";
                              "volume" => &id, "freeze" => &*taken.freeze, "error" => %e);
                        self.freezer().put_back(&id, taken, Duration::from_secs(1));
                    }
                }
            }
        }
        info!(self.log(), "nothing is frozen; the freeze timer stops");
    }
}

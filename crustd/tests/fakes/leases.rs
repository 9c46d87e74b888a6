//! The fake agent's freezes, kept as the agent keeps them (crust.proto,
//! semantics.md §10): a freeze is a lease named by its id, ended by a thaw
//! naming that id, its own timeout, an unpublish of a volume, or a forced
//! thaw, each end recorded against the id. Nothing here touches a
//! filesystem: "frozen" is a volume's holder.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crust_protocols::ttrpc;

/// Milliseconds since the epoch, now.
pub fn unix_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// An error status with `code` and `msg`, as the agent answers one.
pub fn status(code: ttrpc::Code, msg: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

/// One freeze.
#[derive(Debug, Clone)]
pub struct Lease {
    pub volumes: Vec<String>,
    pub timeout_ms: u32,
    pub thaw_at_unix_ms: u64,
    deadline: Instant,
    /// Its freeze call still runs.
    pub making: bool,
    /// A thaw by its id came while it was being made.
    pub stopped: bool,
    /// Volume → (how, unix ms) for each part that ended.
    pub ends: BTreeMap<String, (&'static str, u64)>,
}

impl Lease {
    fn holds(&self) -> bool {
        !self.making && self.ends.is_empty()
    }

    /// The parts that ended some other way than by its id.
    fn broken(&self) -> Vec<String> {
        self.ends
            .iter()
            .filter(|(_, (how, _))| *how != "thawed")
            .map(|(v, (how, at))| format!("volume {v} {how} at unix time {at} ms"))
            .collect()
    }
}

/// Every freeze this agent made, and which holds each volume.
pub struct Leases {
    pub leases: BTreeMap<String, Lease>,
    /// Volume → the freeze holding it.
    pub holders: BTreeMap<String, String>,
    /// The agent's own timer runs (false: a guest that lost it).
    pub own_timer: bool,
    made: u64,
}

impl Default for Leases {
    fn default() -> Leases {
        Leases {
            leases: BTreeMap::new(),
            holders: BTreeMap::new(),
            own_timer: true,
            made: 0,
        }
    }
}

impl Leases {
    /// The agent's timer: every freeze past its timeout ends.
    pub fn expire(&mut self) {
        if !self.own_timer {
            return;
        }
        let now = Instant::now();
        let ids: Vec<String> = self
            .leases
            .iter()
            .filter(|(_, l)| !l.making && l.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.end_all(&id, "thawed by the agent when its timeout passed");
        }
    }

    /// Freeze `id`'s timeout passes now, as for a guest whose clock runs
    /// ahead of the host's: the agent's timer ends it.
    pub fn time_out(&mut self, id: &str) {
        self.end_all(id, "thawed by the agent when its timeout passed");
    }

    /// Ends every part of `id` still held, as `how`; answers those.
    fn end_all(&mut self, id: &str, how: &'static str) -> Vec<String> {
        let mut thawed = Vec::new();
        let Some(l) = self.leases.get_mut(id) else {
            return thawed;
        };
        for v in &l.volumes {
            if self.holders.get(v).map(String::as_str) == Some(id) {
                self.holders.remove(v);
                l.ends.insert(v.clone(), (how, unix_ms()));
                thawed.push(v.clone());
            }
        }
        thawed
    }

    /// Which freeze holds `vol` now.
    pub fn holder(&mut self, vol: &str) -> Option<String> {
        self.expire();
        self.holders.get(vol).cloned()
    }

    /// How volume `vol`'s part of freeze `id` ended, if it did.
    pub fn how(&mut self, id: &str, vol: &str) -> Option<&'static str> {
        self.expire();
        self.leases.get(id)?.ends.get(vol).map(|(how, _)| *how)
    }

    /// A FreezeVolumes begins: the lease is recorded and its volumes
    /// claimed; `Ok(None)` for the caller's id of a freeze that holds
    /// these volumes already (answer it again).
    pub fn begin(
        &mut self,
        asked: &str,
        ids: &[String],
        timeout_ms: u32,
        published: impl Fn(&str) -> bool,
    ) -> ttrpc::Result<Option<String>> {
        self.expire();
        let timeout_ms = if timeout_ms == 0 { 60_000 } else { timeout_ms };
        if let Some(l) = self.leases.get(asked) {
            if l.making {
                return Err(status(
                    ttrpc::Code::UNAVAILABLE,
                    format!("freeze {asked} is still being made by an earlier call"),
                ));
            }
            let same = l.timeout_ms == timeout_ms
                && l.volumes.len() == ids.len()
                && ids.iter().all(|v| l.volumes.contains(v));
            if same && l.holds() {
                return Ok(None);
            }
            return Err(status(
                ttrpc::Code::ALREADY_EXISTS,
                format!("freeze id {asked} is taken"),
            ));
        }
        for v in ids {
            if !published(v) {
                return Err(status(ttrpc::Code::NOT_FOUND, format!("no volume {v}")));
            }
            if let Some(other) = self.holders.get(v) {
                return Err(status(
                    ttrpc::Code::FAILED_PRECONDITION,
                    format!("volume {v} is frozen by {other}"),
                ));
            }
        }
        let id = if asked.is_empty() {
            self.made += 1;
            format!("freeze-fake-{}", self.made)
        } else {
            asked.to_string()
        };
        for v in ids {
            self.holders.insert(v.clone(), id.clone());
        }
        let lease = Lease {
            volumes: ids.to_vec(),
            timeout_ms,
            thaw_at_unix_ms: unix_ms() + u64::from(timeout_ms),
            deadline: Instant::now() + Duration::from_millis(u64::from(timeout_ms)),
            making: true,
            stopped: false,
            ends: BTreeMap::new(),
        };
        self.leases.insert(id.clone(), lease);
        Ok(Some(id))
    }

    /// The freeze of `id` is done: it holds, unless a thaw by its id came
    /// meanwhile (then what it froze is thawed, and the call is ABORTED).
    pub fn complete(&mut self, id: &str) -> ttrpc::Result<()> {
        let l = self.leases.get_mut(id).unwrap();
        l.making = false;
        if l.stopped {
            self.end_all(id, "thawed by its id while it was being frozen");
            return Err(status(
                ttrpc::Code::ABORTED,
                format!("freeze {id} was thawed by its id while it was being made"),
            ));
        }
        let timeout = Duration::from_millis(u64::from(l.timeout_ms));
        l.deadline = Instant::now() + timeout;
        Ok(())
    }

    /// ThawVolumes by id: OK while every part held up to now; ABORTED
    /// (the rest thawed) when one ended first; NOT_FOUND for an id never issued.
    pub fn thaw(&mut self, id: &str) -> ttrpc::Result<Vec<String>> {
        self.expire();
        let Some(l) = self.leases.get_mut(id) else {
            return Err(status(
                ttrpc::Code::NOT_FOUND,
                format!("no freeze {id} was made on this agent's root"),
            ));
        };
        if l.making {
            l.stopped = true;
        }
        let thawed = self.end_all(id, "thawed");
        let broken = self.leases[id].broken();
        if !broken.is_empty() {
            return Err(status(
                ttrpc::Code::ABORTED,
                format!("freeze {id} did not hold: {}", broken.join("; ")),
            ));
        }
        Ok(thawed)
    }

    /// ThawVolumes with force: ends whatever holds each volume, recorded
    /// as forced; NOT_FOUND, after the others, for one not published.
    pub fn force(
        &mut self,
        vols: &[String],
        published: impl Fn(&str) -> bool,
    ) -> ttrpc::Result<Vec<String>> {
        self.expire();
        let mut thawed = Vec::new();
        let mut missing = Vec::new();
        for v in vols {
            if !published(v) {
                missing.push(v.clone());
                continue;
            }
            if self.end_volume(v, "thawed by a forced thaw") {
                thawed.push(v.clone());
            }
        }
        if !missing.is_empty() {
            return Err(status(
                ttrpc::Code::NOT_FOUND,
                format!("{} not published here", missing.join(", ")),
            ));
        }
        Ok(thawed)
    }

    /// Ends the part of whatever freeze holds `vol`, as `how`.
    pub fn end_volume(&mut self, vol: &str, how: &'static str) -> bool {
        let Some(id) = self.holders.remove(vol) else {
            return false;
        };
        if let Some(l) = self.leases.get_mut(&id) {
            l.ends.insert(vol.to_string(), (how, unix_ms()));
        }
        true
    }
}

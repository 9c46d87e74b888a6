//! What the snapshot calls share (a request's volumes checked, a
//! freeze's timeout, each volume's agent id read under its lock and the
//! lock let go before any guest is asked), and RuntimeTrimVolume and
//! RuntimeGetVolumeHealth, which ask the volume's agent (docs/crustd.md
//! §3). Freezes are `freeze` and `thaw`.

use std::time::Duration;

use crate::agent::Health;
use crate::deadline::Deadline;
use crate::error::Result;
use crate::hostdev;
use crate::registry::{self, Sandbox};

use super::error::Error as Refused;
use super::shrink;
use super::Crustd;
use crate::devices::Key;

/// The most volumes one freeze or thaw names.
pub const MAX_GROUP: usize = crust_protocols::freeze::MAX_VOLUMES;
/// A freeze's timeout when the caller names none, and the longest (the agent's).
pub const DEFAULT_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::DEFAULT_TIMEOUT_MS as u64);
pub const MAX_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::MAX_TIMEOUT_MS as u64);

/// A freeze's or a thaw's volumes, checked: 1 to [`MAX_GROUP`], each once.
pub fn check_refs(refs: &[Key]) -> Result<()> {
    if refs.is_empty() || refs.len() > MAX_GROUP {
        return Err(Refused::GroupSize(refs.len()).into());
    }
    for (i, k) in refs.iter().enumerate() {
        registry::check_id(&k.sandbox)?;
        hostdev::check_path(&k.host_volume)?;
        if refs[..i].contains(k) {
            return Err(Refused::Twice(k.clone()).into());
        }
    }
    Ok(())
}

/// A freeze's timeout: 0 is the default; more than the maximum is refused.
pub fn freeze_timeout(ms: u32) -> Result<Duration> {
    match Duration::from_millis(u64::from(ms)) {
        d if d.is_zero() => Ok(DEFAULT_TIMEOUT),
        d if d > MAX_TIMEOUT => Err(Refused::FreezeTimeout(ms).into()),
        d => Ok(d),
    }
}

/// One sandbox's part of a request: its VM and its agent's volume ids.
pub(super) struct Part {
    pub sb: Sandbox,
    /// (host volume, agent volume id).
    pub volumes: Vec<(String, String)>,
}

impl Part {
    /// Its agent's volume ids.
    pub fn ids(&self) -> Vec<String> {
        self.volumes.iter().map(|(_, id)| id.clone()).collect()
    }
}

impl Crustd {
    /// The agent volume id of a published volume, read under its lock
    /// (`publishing`: one whose fsGroup walk still runs will do).
    pub(super) fn agent_id(
        &self,
        sandbox: &str,
        volume: &str,
        publishing: bool,
        deadline: &Deadline,
    ) -> Result<(Sandbox, String)> {
        let (sb, v) = self.agent_volume(sandbox, volume, publishing, deadline)?;
        Ok((sb, v.volume_id))
    }

    /// [`Crustd::agent_id`], with the volume's whole record.
    fn agent_volume(
        &self,
        sandbox: &str,
        volume: &str,
        publishing: bool,
        deadline: &Deadline,
    ) -> Result<(Sandbox, crate::state::Volume)> {
        // The volume's lock is let go (with `o`) before the guest is asked.
        let o = self.open_volume(sandbox, volume, deadline)?;
        let sb = o.home.vm()?;
        let v = Crustd::published(sandbox, volume, o.record, publishing)?;
        Ok((sb, v))
    }

    /// The request's volumes by sandbox, in the order they are named.
    pub(super) fn parts(&self, refs: &[Key], deadline: &Deadline) -> Result<Vec<Part>> {
        let mut parts: Vec<Part> = Vec::new();
        for k in refs {
            let (sb, id) = self.agent_id(&k.sandbox, &k.host_volume, false, deadline)?;
            add_to(&mut parts, sb, &k.host_volume, id);
        }
        Ok(parts)
    }

    /// RuntimeTrimVolume: the bytes the guest gave back.
    pub fn trim(
        &self,
        sandbox: &str,
        volume: &str,
        min_extent: u64,
        deadline: &Deadline,
    ) -> Result<u64> {
        let (sb, v) = self.agent_volume(sandbox, volume, false, deadline)?;
        let key = Key::new(sandbox, volume);
        if let Some(s) = self.shrinks.check(&key, &v) {
            return Err(Refused::Shrunk(shrink::message(&key, s)).into());
        }
        let trimmed = self
            .agent(&sb, deadline)
            .trim(&v.volume_id, min_extent)
            .map_err(|e| self.unless_dead(&sb, e))?;
        match self.shrinks.check(&key, &v) {
            Some(s) => Err(Refused::ShrankByTrim(shrink::message(&key, s)).into()),
            None => Ok(trimmed),
        }
    }

    /// RuntimeGetVolumeHealth: the agent's CSI list.
    pub fn health(&self, sandbox: &str, volume: &str, deadline: &Deadline) -> Result<Vec<Health>> {
        let (sb, v) = self.agent_volume(sandbox, volume, false, deadline)?;
        let key = Key::new(sandbox, volume);
        let shrunk = self.shrinks.check(&key, &v).map(|s| Health {
            status: crust_protocols::crust::volume_health::Status::DATA_LOSS as i32,
            reason: "BackingStoreShrank".into(),
            message: shrink::message(&key, s),
        });
        let mut said = self
            .agent(&sb, deadline)
            .health(&v.volume_id)
            .map_err(|e| self.unless_dead(&sb, e))?;
        said.splice(0..0, shrunk);
        Ok(said)
    }
}

/// Adds `volume` (agent id `id`) of `sb` to its sandbox's part, or a new one.
pub(super) fn add_to(parts: &mut Vec<Part>, sb: Sandbox, volume: &str, id: String) {
    match parts.iter_mut().find(|p| p.sb.id() == sb.id()) {
        Some(p) => p.volumes.push((volume.to_string(), id)),
        None => parts.push(Part {
            sb,
            volumes: vec![(volume.to_string(), id)],
        }),
    }
}

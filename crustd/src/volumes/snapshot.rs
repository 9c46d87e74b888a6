//! RuntimeFreezeVolumes and RuntimeThawVolumes across sandboxes (a
//! VolumeGroupSnapshot can span pods), RuntimeTrimVolume and
//! RuntimeGetVolumeHealth: each asks the volumes' agents, which do the work
//! (docs/crustd.md §3).
//!
//! A freeze is all or none: one FreezeVolumes per sandbox, in the order the
//! request names them; a sandbox that refuses has the sandboxes frozen
//! before it thawed, and the call answers its error. The group is kept in
//! `freezes` with the host's own timer. No volume lock is held across a
//! call to a guest: each volume's record is read under its lock, and the
//! lock let go before the agent is asked.

use std::sync::Arc;
use std::time::Duration;

use crate::agent::{Agent, Connections, Health};
use crate::deadline::Deadline;
use crate::error::{Code, Error, Result};
use crate::freezes::{unix_ms, Member};
use crate::hostdev;
use crate::registry::{self, Sandbox};

use super::Crustd;

/// The most volumes one freeze or thaw names.
pub const MAX_GROUP: usize = crust_protocols::freeze::MAX_VOLUMES;
/// A freeze's timeout when the caller names none, and the longest (the agent's).
pub const DEFAULT_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::DEFAULT_TIMEOUT_MS as u64);
pub const MAX_TIMEOUT: Duration =
    Duration::from_millis(crust_protocols::freeze::MAX_TIMEOUT_MS as u64);

/// A freeze's or a thaw's volumes, checked: 1 to [`MAX_GROUP`], each once.
pub fn check_refs(refs: &[(String, String)]) -> Result<()> {
    if refs.is_empty() || refs.len() > MAX_GROUP {
        return Err(Error::invalid(format!(
            "volumes names {} volumes; name 1 to {MAX_GROUP}",
            refs.len()
        )));
    }
    for (i, (sandbox, volume)) in refs.iter().enumerate() {
        registry::check_id(sandbox)?;
        hostdev::check_path(volume)?;
        if refs[..i].contains(&refs[i]) {
            return Err(Error::invalid(format!(
                "volumes names host volume {volume} of sandbox {sandbox} twice"
            )));
        }
    }
    Ok(())
}

/// A freeze's timeout: 0 is the default; more than the maximum is refused.
pub fn freeze_timeout(ms: u32) -> Result<Duration> {
    match Duration::from_millis(u64::from(ms)) {
        d if d.is_zero() => Ok(DEFAULT_TIMEOUT),
        d if d > MAX_TIMEOUT => Err(Error::invalid(format!(
            "timeout_ms {ms} is longer than the longest freeze, {} ms",
            MAX_TIMEOUT.as_millis()
        ))),
        d => Ok(d),
    }
}

/// One sandbox's part of a group: its VM and its agent's volume ids.
struct Part {
    sb: Sandbox,
    /// (host volume, agent volume id).
    volumes: Vec<(String, String)>,
}

impl Crustd {
    /// The agent volume id of a published volume, read under its lock.
    fn agent_id(
        &self,
        sandbox: &str,
        volume: &str,
        deadline: &Deadline,
    ) -> Result<(Sandbox, String)> {
        let o = self.open_volume(sandbox, volume, deadline)?;
        let sb = o.home.vm()?;
        let v = Crustd::published(sandbox, volume, o.record, false)?;
        Ok((sb, v.volume_id))
    }

    /// The request's volumes by sandbox, in the order they are named.
    fn parts(&self, refs: &[(String, String)], deadline: &Deadline) -> Result<Vec<Part>> {
        let mut parts: Vec<Part> = Vec::new();
        for (sandbox, volume) in refs {
            let (sb, id) = self.agent_id(sandbox, volume, deadline)?;
            match parts.iter_mut().find(|p| p.sb.id() == sandbox) {
                Some(p) => p.volumes.push((volume.clone(), id)),
                None => parts.push(Part {
                    sb,
                    volumes: vec![(volume.clone(), id)],
                }),
            }
        }
        Ok(parts)
    }

    /// RuntimeFreezeVolumes: answers the group's name and when it ends.
    pub fn freeze(
        self: &Arc<Self>,
        refs: &[(String, String)],
        timeout_ms: u32,
        deadline: &Deadline,
    ) -> Result<(String, u64)> {
        check_refs(refs)?;
        let timeout = freeze_timeout(timeout_ms)?;
        if !self.freezes.has_room() {
            return Err(Error::new(
                Code::ResourceExhausted,
                format!(
                    "{} groups are frozen on this node, as many as crustd keeps: thaw one first",
                    crate::freezes::MAX_GROUPS
                ),
            ));
        }
        let parts = self.parts(refs, deadline)?;
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        for (i, p) in parts.iter().enumerate() {
            let ids: Vec<String> = p.volumes.iter().map(|(_, id)| id.clone()).collect();
            let frozen = self
                .agent(&p.sb, deadline)
                .freeze(&ids, ms)
                .map_err(|e| self.unless_dead(&p.sb, e));
            if let Err(e) = frozen {
                for done in &parts[..i] {
                    let ids: Vec<String> = done.volumes.iter().map(|(_, id)| id.clone()).collect();
                    let _ = self.agent(&done.sb, deadline).thaw(&ids);
                }
                return Err(Error::new(
                    e.code,
                    format!(
                        "sandbox {} could not freeze its volumes, so none is frozen: {}",
                        p.sb.id(),
                        e.message
                    ),
                ));
            }
        }
        let members = parts
            .iter()
            .flat_map(|p| {
                p.volumes.iter().map(|(host, id)| Member {
                    sandbox: p.sb.id().to_string(),
                    host_volume: host.clone(),
                    volume_id: id.clone(),
                    agent: p.sb.agent.clone(),
                })
            })
            .collect();
        let (group, start) = self.freezes.add(members, timeout);
        if start {
            self.start_freeze_timer();
        }
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        Ok((group, unix_ms().saturating_add(ms)))
    }

    /// RuntimeThawVolumes: every volume named is thawed; ABORTED when a
    /// freeze of one of them had ended by itself (in its guest or here).
    pub fn thaw(&self, refs: &[(String, String)], deadline: &Deadline) -> Result<()> {
        check_refs(refs)?;
        let parts = self.parts(refs, deadline)?;
        let mut ended: Vec<String> = Vec::new();
        for (sandbox, volume) in refs {
            if let Some(e) = self.freezes.release(sandbox, volume) {
                ended.push(format!(
                    "{volume} of sandbox {sandbox} ({}, {} s ago, by crustd's timer)",
                    e.freeze_id,
                    unix_ms().saturating_sub(e.at_unix_ms) / 1000
                ));
            }
        }
        let mut failed: Option<Error> = None;
        for p in &parts {
            let ids: Vec<String> = p.volumes.iter().map(|(_, id)| id.clone()).collect();
            match self.agent(&p.sb, deadline).thaw(&ids) {
                Ok(()) => {}
                Err(e) if e.code == Code::Aborted => {
                    ended.push(format!("sandbox {}: {}", p.sb.id(), e.message))
                }
                Err(e) => {
                    failed.get_or_insert(self.unless_dead(&p.sb, e));
                }
            }
        }
        if !ended.is_empty() {
            return Err(Error::new(
                Code::Aborted,
                format!(
                    "a freeze ended by itself before this thaw, so a snapshot taken after it may be torn (every volume named is thawed): {}",
                    ended.join("; ")
                ),
            ));
        }
        failed.map_or(Ok(()), Err)
    }

    /// RuntimeTrimVolume: the bytes the guest gave back.
    pub fn trim(
        &self,
        sandbox: &str,
        volume: &str,
        min_extent: u64,
        deadline: &Deadline,
    ) -> Result<u64> {
        let (sb, id) = self.agent_id(sandbox, volume, deadline)?;
        self.agent(&sb, deadline)
            .trim(&id, min_extent)
            .map_err(|e| self.unless_dead(&sb, e))
    }

    /// RuntimeGetVolumeHealth: the agent's CSI list.
    pub fn health(&self, sandbox: &str, volume: &str, deadline: &Deadline) -> Result<Vec<Health>> {
        let (sb, id) = self.agent_id(sandbox, volume, deadline)?;
        self.agent(&sb, deadline)
            .health(&id)
            .map_err(|e| self.unless_dead(&sb, e))
    }

    /// The host's timer (freezes.rs): thaws each group at its deadline,
    /// on a thread of its own, while any group is frozen.
    fn start_freeze_timer(self: &Arc<Self>) {
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("freeze-timer".into())
            .spawn(move || {
                let connections = Connections::default();
                while let Some((group, members)) = me.freezes.next_expired() {
                    for m in members {
                        let agent = Agent {
                            connections: &connections,
                            addr: &m.agent,
                            sandbox: &m.sandbox,
                            timeout: me.cfg.agent_timeout,
                            device_wait: me.cfg.device_wait,
                            deadline: None,
                        };
                        let r = agent.thaw(std::slice::from_ref(&m.volume_id));
                        eprintln!(
                            "{}",
                            serde_json::json!({
                                "event": "freeze ended by crustd's timer",
                                "group": group,
                                "sandbox": m.sandbox,
                                "host_volume": m.host_volume,
                                "thaw": r.map_or_else(|e| e.message, |()| "OK".into()),
                            })
                        );
                    }
                }
            });
        if let Err(e) = spawned {
            eprintln!(
                "crustd: could not start the freeze timer ({e}); freezes end by the guests' timers"
            );
        }
    }
}

//! What each CRUST call does, as steps over the sandbox registry, crustd's
//! state, QEMU and the agent. Locks: one per (sandbox, host volume), so two
//! calls for one volume run one after the other while other volumes and
//! sandboxes go on; one per sandbox around QMP sessions (QEMU serves one
//! client at a time) and around its state file; one for the whole node while
//! a device is claimed, so a host device cannot enter two sandboxes at once.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use crust_client::proto as apb;

use crate::agent::{self, Agent};
use crate::error::{Error, Result};
use crate::hostdev::{self, HostDevice, Names};
use crate::hotplug;
use crate::locks::{hold, KeyedLocks};
use crate::qmp::Qmp;
use crate::registry::{self, Sandbox};
use crate::state::{self, Phase, State, Volume};

/// Block volumes (volumeMode: Block): the agent publishes the raw device
/// (VolumeMode BLOCK). This one switch gates both the publish and the
/// BLOCK_VOLUME capability.
pub const BLOCK_VOLUMES: bool = true;

/// The filesystems crustd publishes: what the guest this project builds mounts.
pub const FILE_SYSTEMS: [&str; 2] = ["ext4", "xfs"];

/// Deadlines and places.
#[derive(Debug, Clone)]
pub struct Config {
    /// The sandbox registry, `DIR/<sandbox>/sandbox.json`.
    pub sandboxes: PathBuf,
    /// Deadline of one agent call (and of connecting to it).
    pub agent_timeout: Duration,
    /// How long the agent may wait for a hot-plugged disk to appear or grow.
    pub device_wait: Duration,
    /// Deadline of one QMP reply.
    pub qmp_timeout: Duration,
    /// How long the guest may take to release a device after device_del.
    pub unplug_timeout: Duration,
}

impl Config {
    pub fn new(sandboxes: impl Into<PathBuf>) -> Config {
        Config {
            sandboxes: sandboxes.into(),
            agent_timeout: Duration::from_secs(30),
            device_wait: Duration::from_secs(30),
            qmp_timeout: Duration::from_secs(10),
            unplug_timeout: Duration::from_secs(60),
        }
    }
}

/// RuntimePublishVolume, in plain types.
#[derive(Debug, Clone, Default)]
pub struct PublishRequest {
    pub sandbox_id: String,
    pub host_volume_id: String,
    pub host_target_path: String,
    pub file_system: String,
    pub mount_options: Vec<String>,
    pub fsgroup_gid: Option<i64>,
    pub fsgroup_policy: String,
    pub read_only: bool,
    pub block: bool,
}

/// Bytes or inodes, as the agent counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub available: i64,
    pub total: i64,
    pub used: i64,
    /// true: inodes; false: bytes.
    pub inodes: bool,
}

/// RuntimeGetVolumeStats, in plain types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    pub usage: Vec<Usage>,
    pub abnormal: bool,
    pub message: String,
}

/// The daemon's shared state: configuration and locks.
pub struct Crustd {
    cfg: Config,
    /// Per (sandbox, host_volume_id).
    volume_locks: KeyedLocks<(String, String)>,
    /// Per sandbox: one QMP session at a time.
    qmp_locks: KeyedLocks<String>,
    /// Per sandbox: read-modify-write of crustd.json.
    state_locks: KeyedLocks<String>,
    /// Node-wide: checking that a device is in no other sandbox and recording it.
    claims: Mutex<()>,
    /// Agent connections kept per sandbox.
    connections: agent::Connections,
}

/// Checks a publish request without looking at the host or the sandbox.
pub fn validate(r: &PublishRequest) -> Result<()> {
    registry::check_id(&r.sandbox_id)?;
    hostdev::check_path(&r.host_volume_id)?;
    if r.block {
        if !BLOCK_VOLUMES {
            return Err(Error::new(
                crate::error::Code::Unimplemented,
                "block volumes (volumeMode: Block) are not supported by this crustd yet: the guest agent cannot publish raw block devices; use a filesystem volume",
            ));
        }
        if !r.file_system.is_empty() {
            return Err(Error::invalid(format!(
                "file_system {:?} with block = true: a block volume has no filesystem, leave it empty",
                r.file_system
            )));
        }
        if !r.mount_options.is_empty() {
            return Err(Error::invalid(format!(
                "mount_options {:?} with block = true: a block volume is not mounted, leave them empty",
                r.mount_options
            )));
        }
    } else if !FILE_SYSTEMS.contains(&r.file_system.as_str()) {
        return Err(Error::invalid(format!(
            "file_system {:?} is not supported: use one of {}",
            r.file_system,
            FILE_SYSTEMS.join(", ")
        )));
    }
    fs_group(r)?;
    Ok(())
}

/// fsGroup as the agent takes it: (gid, OnRootMismatch).
fn fs_group(r: &PublishRequest) -> Result<Option<(u32, bool)>> {
    let on_root_mismatch = match r.fsgroup_policy.as_str() {
        "" | "Always" => false,
        "OnRootMismatch" => true,
        other => {
            return Err(Error::invalid(format!(
                "fsgroup_policy {other:?} is not a policy: use \"Always\" or \"OnRootMismatch\" (Kubernetes' spelling)"
            )))
        }
    };
    match r.fsgroup_gid {
        None => Ok(None),
        Some(g) => match u32::try_from(g) {
            Ok(gid) if gid != u32::MAX => Ok(Some((gid, on_root_mismatch))),
            _ => Err(Error::invalid(format!(
                "fsgroup_gid {g} is not a group id (0 to 4294967294)"
            ))),
        },
    }
}

impl Crustd {
    pub fn new(cfg: Config) -> Crustd {
        Crustd {
            cfg,
            volume_locks: KeyedLocks::default(),
            qmp_locks: KeyedLocks::default(),
            state_locks: KeyedLocks::default(),
            claims: Mutex::new(()),
            connections: agent::Connections::default(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn agent<'a>(&'a self, sb: &'a Sandbox) -> Agent<'a> {
        Agent {
            connections: &self.connections,
            addr: &sb.agent,
            sandbox: &sb.id,
            timeout: self.cfg.agent_timeout,
            device_wait: self.cfg.device_wait,
        }
    }

    /// Runs `f` on a fresh QMP session of `sb`, one session per sandbox at a time.
    fn with_qmp<T>(&self, sb: &Sandbox, f: impl FnOnce(&mut Qmp) -> Result<T>) -> Result<T> {
        let l = self.qmp_locks.get(&sb.id);
        let _g = hold(&l);
        let mut q = Qmp::connect(&sb.qmp, self.cfg.qmp_timeout)
            .map_err(|e| e.and(format!("sandbox {}", sb.id)))?;
        f(&mut q)
    }

    /// Reads, changes and writes `sb`'s state under its lock; answers what `f` answers.
    fn update<T>(&self, sb: &Sandbox, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        let l = self.state_locks.get(&sb.id);
        let _g = hold(&l);
        let mut st = state::load(&sb.dir)?;
        let out = f(&mut st)?;
        state::save(&sb.dir, &st)?;
        Ok(out)
    }

    fn record(&self, sb: &Sandbox, host_volume_id: &str) -> Result<Option<Volume>> {
        let l = self.state_locks.get(&sb.id);
        let _g = hold(&l);
        Ok(state::load(&sb.dir)?.volumes.remove(host_volume_id))
    }

    fn set_phase(&self, sb: &Sandbox, host_volume_id: &str, phase: Phase) -> Result<()> {
        self.update(sb, |st| {
            if let Some(v) = st.volumes.get_mut(host_volume_id) {
                v.phase = phase;
            }
            Ok(())
        })
    }

    fn forget(&self, sb: &Sandbox, host_volume_id: &str) -> Result<()> {
        self.update(sb, |st| {
            st.volumes.remove(host_volume_id);
            Ok(())
        })
    }

    /// RuntimePublishVolume: answers the guest path.
    pub fn publish(&self, r: &PublishRequest) -> Result<String> {
        validate(r)?;
        let fs_group = fs_group(r)?;
        let sb = registry::open(&self.cfg.sandboxes, &r.sandbox_id)?;
        let dev = hostdev::resolve(&r.host_volume_id)?;
        let names = Names::derive(&r.host_volume_id);
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), r.host_volume_id.clone()));
        let _v = hold(&l);

        let prior = self.claim(&sb, r, &dev, &names)?;
        if prior.as_ref().is_some_and(|p| p.phase == Phase::Unplugging) {
            // A previous unpublish or undo did not finish: finish it first.
            self.take_out(&sb, &r.host_volume_id, &names, false)?;
            self.claim(&sb, r, &dev, &names)?;
        }
        // Whether kubelet was ever told this volume is published: if not, a
        // failure below leaves nothing behind, whoever plugged it.
        let published_before = prior.as_ref().is_some_and(|p| p.phase == Phase::Published);

        let mut reached_qemu = false;
        let plugged = self.with_qmp(&sb, |q| {
            reached_qemu = true;
            hotplug::plug(q, &names, &dev.path, r.read_only)
        });
        if let Err(e) = plugged {
            if !reached_qemu && prior.is_none() {
                // QEMU never heard of it: only the record made above to forget.
                return Err(match self.forget(&sb, &r.host_volume_id) {
                    Ok(()) => e,
                    Err(e2) => e.and(e2),
                });
            }
            return Err(self.undo(&sb, r, &names, published_before, e));
        }
        if !published_before {
            self.set_phase(&sb, &r.host_volume_id, Phase::Plugged)?;
        }
        let published = self.agent(&sb).publish(&agent::Publish {
            volume_id: &names.volume_id,
            serial: &names.serial,
            fs_type: &r.file_system,
            mount_options: &r.mount_options,
            read_only: r.read_only,
            // fsGroup does not apply to a raw device (kubelet does not chown one either).
            fs_group: if r.block { None } else { fs_group },
            block: r.block,
        });
        match published {
            Ok(guest_path) => {
                self.update(&sb, |st| {
                    if let Some(v) = st.volumes.get_mut(&r.host_volume_id) {
                        v.phase = Phase::Published;
                        v.guest_path = guest_path.clone();
                        v.host_target_path = r.host_target_path.clone();
                    }
                    Ok(())
                })?;
                Ok(guest_path)
            }
            Err(e) => Err(self.undo(&sb, r, &names, published_before, e)),
        }
    }

    /// Checks that `dev` is in no other sandbox (nor under another id in this
    /// one) and records the volume before anything is plugged. Answers the
    /// record as it was.
    fn claim(
        &self,
        sb: &Sandbox,
        r: &PublishRequest,
        dev: &HostDevice,
        names: &Names,
    ) -> Result<Option<Volume>> {
        let _c = hold(&self.claims);
        for other in registry::all_ids(&self.cfg.sandboxes) {
            // A sandbox whose entry is gone (its VM is down) holds nothing.
            let odir = self.cfg.sandboxes.join(&other);
            if other == sb.id || !odir.join(registry::SANDBOX_FILE).exists() {
                continue;
            }
            // A sandbox whose state cannot be read cannot claim anything here;
            // QEMU's own image locking still stands behind this check.
            let Ok(st) = state::load(&odir) else {
                continue;
            };
            if let Some((id, _)) = st.volumes.iter().find(|(_, v)| v.rdev == dev.rdev) {
                return Err(Error::precondition(format!(
                    "host device {} ({}) is already published in sandbox {other} as {id}: unpublish it there first",
                    r.host_volume_id, dev.rdev
                )));
            }
        }
        self.update(sb, |st| {
            if let Some((id, _)) = st
                .volumes
                .iter()
                .find(|(id, v)| v.rdev == dev.rdev && *id != &r.host_volume_id)
            {
                return Err(Error::precondition(format!(
                    "host device {} ({}) is already published in sandbox {} as {id}: one device, one volume",
                    r.host_volume_id, dev.rdev, sb.id
                )));
            }
            let prior = st.volumes.get(&r.host_volume_id).cloned();
            if prior.is_none() {
                st.volumes.insert(
                    r.host_volume_id.clone(),
                    Volume {
                        volume_id: names.volume_id.clone(),
                        serial: names.serial.clone(),
                        node: names.node.clone(),
                        device: names.device.clone(),
                        rdev: dev.rdev.clone(),
                        host_target_path: r.host_target_path.clone(),
                        guest_path: String::new(),
                        file_system: r.file_system.clone(),
                        read_only: r.read_only,
                        block: r.block,
                        phase: Phase::Plugging,
                    },
                );
            }
            Ok(prior)
        })
    }

    /// After a failed publish: unless kubelet was told before that this volume
    /// is published, take it out again and forget it. Answers `err`, with any
    /// failure of the undo added to it.
    fn undo(
        &self,
        sb: &Sandbox,
        r: &PublishRequest,
        names: &Names,
        published_before: bool,
        err: Error,
    ) -> Error {
        if published_before {
            return err;
        }
        match self.take_out(sb, &r.host_volume_id, names, true) {
            Ok(()) => err,
            Err(e2) => err.and(format!(
                "undoing the hot-plug failed too ({e2}); RuntimeUnpublishVolume will finish it"
            )),
        }
    }

    /// Agent unpublish, device_del + DEVICE_DELETED, blockdev-del, forget.
    /// The record stays (as unplugging) until every step has succeeded.
    /// `undoing`: the volume was never reported published, so an agent that
    /// cannot be reached does not keep the disk in (nothing uses it yet);
    /// an agent that answers no (e.g. busy) always does.
    fn take_out(
        &self,
        sb: &Sandbox,
        host_volume_id: &str,
        names: &Names,
        undoing: bool,
    ) -> Result<()> {
        self.set_phase(sb, host_volume_id, Phase::Unplugging)?;
        match self.agent(sb).unpublish(&names.volume_id) {
            Err(e) if !(undoing && e.code == crate::error::Code::Unavailable) => return Err(e),
            _ => {}
        }
        let timeout = self.cfg.unplug_timeout;
        self.with_qmp(sb, |q| hotplug::unplug(q, names, timeout))?;
        self.forget(sb, host_volume_id)
    }

    /// RuntimeUnpublishVolume: OK when the volume is not (or no longer) published.
    pub fn unpublish(&self, sandbox_id: &str, host_volume_id: &str) -> Result<()> {
        hostdev::check_path(host_volume_id)?;
        let sb = registry::open(&self.cfg.sandboxes, sandbox_id)?;
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), host_volume_id.to_string()));
        let _v = hold(&l);
        match self.record(&sb, host_volume_id)? {
            None => Ok(()),
            Some(v) => self.take_out(&sb, host_volume_id, &names_of(&v), false),
        }
    }

    /// The record of a published volume, else NOT_FOUND.
    fn published(&self, sb: &Sandbox, host_volume_id: &str) -> Result<Volume> {
        match self.record(sb, host_volume_id)? {
            Some(v) if v.phase == Phase::Published => Ok(v),
            _ => Err(Error::not_found(format!(
                "host volume {host_volume_id} is not published in sandbox {}",
                sb.id
            ))),
        }
    }

    /// RuntimeGetVolumeStats: the agent's usage and condition, as they are.
    pub fn stats(&self, sandbox_id: &str, host_volume_id: &str) -> Result<Stats> {
        hostdev::check_path(host_volume_id)?;
        let sb = registry::open(&self.cfg.sandboxes, sandbox_id)?;
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), host_volume_id.to_string()));
        let _v = hold(&l);
        let v = self.published(&sb, host_volume_id)?;
        let s = self.agent(&sb).stats(&v.volume_id)?;
        Ok(Stats {
            usage: s
                .usage
                .iter()
                .map(|u| Usage {
                    available: u.available,
                    total: u.total,
                    used: u.used,
                    inodes: u.unit.enum_value() == Ok(apb::volume_usage::Unit::INODES),
                })
                .collect(),
            abnormal: s.condition.abnormal,
            message: s.condition.message.clone(),
        })
    }

    /// RuntimeExpandVolume: QEMU grown to the host device's size, then the
    /// filesystem by the agent; answers the capacity.
    pub fn expand(
        &self,
        sandbox_id: &str,
        host_volume_id: &str,
        required_bytes: i64,
    ) -> Result<i64> {
        hostdev::check_path(host_volume_id)?;
        if required_bytes < 0 {
            return Err(Error::invalid(format!(
                "required_bytes {required_bytes} is negative"
            )));
        }
        let sb = registry::open(&self.cfg.sandboxes, sandbox_id)?;
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), host_volume_id.to_string()));
        let _v = hold(&l);
        let v = self.published(&sb, host_volume_id)?;
        let dev = hostdev::resolve(host_volume_id)?;
        let size = hostdev::size(&dev.path)?;
        if size < required_bytes.unsigned_abs() {
            return Err(Error::new(
                crate::error::Code::OutOfRange,
                format!(
                    "host device {host_volume_id} has {size} bytes, fewer than the {required_bytes} required: grow it on the host first (for a loop device: grow the file, then losetup -c)"
                ),
            ));
        }
        self.with_qmp(&sb, |q| hotplug::grow(q, &v.node, size))?;
        self.agent(&sb).expand(&v.volume_id, required_bytes)
    }
}

fn names_of(v: &Volume) -> Names {
    Names {
        volume_id: v.volume_id.clone(),
        serial: v.serial.clone(),
        node: v.node.clone(),
        device: v.device.clone(),
    }
}

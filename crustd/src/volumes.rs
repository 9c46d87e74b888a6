//! What each CRUST call does, as steps over the sandbox registry, crustd's
//! state, QEMU and the agent. Locks: one per (sandbox, host volume), so two
//! calls for one volume run one after the other while other volumes and
//! sandboxes go on; one per sandbox around QMP sessions (QEMU serves one
//! client at a time) and around its state file; and the node-wide table of
//! claimed devices (`claims`), locked only for a lookup and an insert, so
//! that no two volumes anywhere on the node share a byte of a host device.
//! Order: volume, then sandbox state or QMP (never both), then claims.
//!
//! A new volume's device is claimed in the table, checked for use by the
//! host, held exclusively (O_EXCL), and only then recorded and plugged; it
//! is released after its record is forgotten, which happens once QEMU has
//! let go of it. A restarted crustd claims and holds the device of every
//! volume recorded in a live sandbox again before it serves.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crust_client::proto as apb;

use crate::agent::{self, Agent};
use crate::claims::{Claims, Conflict, Key};
use crate::direct::{self, Records};
use crate::error::{Code, Error, Result};
use crate::hostdev::{self, Extent, HostDevice, Names};
use crate::hotplug;
use crate::locks::{hold, KeyedLocks};
use crate::mkfs;
use crate::registry::{self, Sandbox};
use crate::state::{self, Phase, State, Volume};
use crust_client::qmp::{self, Qmp};

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
    /// Where CSI drivers file Kata's direct-volume records.
    pub direct_volumes: PathBuf,
    /// How long blkid or mkfs may take for createFilesystem.
    pub mkfs_timeout: Duration,
}

impl Config {
    pub fn new(sandboxes: impl Into<PathBuf>) -> Config {
        Config {
            direct_volumes: PathBuf::from(direct::DEFAULT_ROOT),
            mkfs_timeout: Duration::from_secs(300),
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
    /// Format the device first if it is provably blank (never anything else).
    pub create_file_system: bool,
    /// The volume path of the direct-volume record this publish comes from.
    pub direct: Option<String>,
    /// When the caller gives up (its gRPC deadline), if it said.
    pub deadline: Option<Instant>,
}

/// RuntimePublishDirectVolume, in plain types.
#[derive(Debug, Clone, Default)]
pub struct DirectRequest {
    pub sandbox_id: String,
    pub volume_path: String,
    pub read_only: bool,
    /// When the caller gives up (its gRPC deadline), if it said.
    pub deadline: Option<Instant>,
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
    /// Node-wide: every claimed device, where its bytes lie, and its hold.
    claims: Claims,
    /// Agent connections kept per sandbox.
    connections: agent::Connections,
    /// Kata's direct-volume records.
    records: Records,
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
        if r.create_file_system {
            return Err(Error::invalid(
                "create_file_system with block = true: a block volume has no filesystem to create",
            ));
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
            volume_locks: KeyedLocks::default(),
            qmp_locks: KeyedLocks::default(),
            state_locks: KeyedLocks::default(),
            claims: Claims::default(),
            connections: agent::Connections::default(),
            records: Records::new(&cfg.direct_volumes),
            cfg,
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
        let mut q = hotplug::connect(&sb.qmp, self.cfg.qmp_timeout)
            .map_err(|e| e.and(format!("sandbox {}", sb.id)))?;
        f(&mut q)
    }

    /// Reads, changes and writes `sb`'s state under its lock; answers what `f` answers.
    fn update<T>(&self, sb: &Sandbox, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        let l = self.state_locks.get(&sb.id);
        let _g = hold(&l);
        let mut st = state::load(sb.fd(), &sb.dir)?;
        let out = f(&mut st)?;
        state::save(sb.fd(), &sb.dir, &st)?;
        Ok(out)
    }

    /// `sb`'s state as it is now.
    fn load(&self, sb: &Sandbox) -> Result<State> {
        let l = self.state_locks.get(&sb.id);
        let _g = hold(&l);
        state::load(sb.fd(), &sb.dir)
    }

    fn record(&self, sb: &Sandbox, host_volume_id: &str) -> Result<Option<Volume>> {
        Ok(self.load(sb)?.volumes.remove(host_volume_id))
    }

    /// Opens sandbox `id`. One that is gone (no sandbox.json) holds nothing:
    /// its claims are released.
    fn sandbox(&self, id: &str) -> Result<Sandbox> {
        let out = registry::open(&self.cfg.sandboxes, id);
        if out.as_ref().is_err_and(|e| e.code == Code::NotFound) {
            drop(self.claims.release_sandbox(id));
        }
        out
    }

    fn set_phase(&self, sb: &Sandbox, host_volume_id: &str, phase: Phase) -> Result<()> {
        self.update(sb, |st| {
            if let Some(v) = st.volumes.get_mut(host_volume_id) {
                v.phase = phase;
            }
            Ok(())
        })
    }

    /// Forgets the volume, then lets go of its device (it has left QEMU).
    fn forget(&self, sb: &Sandbox, host_volume_id: &str) -> Result<()> {
        self.update(sb, |st| {
            st.volumes.remove(host_volume_id);
            Ok(())
        })?;
        drop(
            self.claims
                .release(&(sb.id.clone(), host_volume_id.to_string())),
        );
        Ok(())
    }

    /// RuntimePublishVolume: answers the guest path.
    pub fn publish(&self, r: &PublishRequest) -> Result<String> {
        validate(r)?;
        let fs_group = fs_group(r)?;
        let sb = self.sandbox(&r.sandbox_id)?;
        let dev = hostdev::resolve(&r.host_volume_id)?;
        let names = Names::derive(&r.host_volume_id);
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), r.host_volume_id.clone()));
        let _v = hold(&l);

        let mut prior = self.claim(&sb, r, &dev, &names)?;
        if let Some(p) = prior.as_ref().filter(|p| p.phase == Phase::Unplugging) {
            // A previous unpublish or undo did not finish: finish it first.
            let direct = p.direct.clone();
            self.take_out(&sb, &r.host_volume_id, &names, false, direct.as_deref())?;
            prior = self.claim(&sb, r, &dev, &names)?;
        }
        if r.create_file_system && prior.is_none() {
            // Only a volume this call claimed: a republish never reformats.
            if let Err(e) = self.create_file_system(&sb, r, &dev) {
                return Err(match self.forget(&sb, &r.host_volume_id) {
                    Ok(()) => e,
                    Err(e2) => e.and(e2),
                });
            }
        }
        // Whether kubelet was ever told this volume is published, or that its
        // publish goes on (its fsGroup walk outlived an earlier call): if
        // neither, a failure below leaves nothing behind, whoever plugged it.
        let published_before = prior
            .as_ref()
            .is_some_and(|p| matches!(p.phase, Phase::Published | Phase::Publishing));

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
            deadline: r.deadline,
        });
        match published {
            Ok(guest_path) => {
                self.update(&sb, |st| {
                    if let Some(v) = st.volumes.get_mut(&r.host_volume_id) {
                        v.phase = Phase::Published;
                        v.guest_path = guest_path.clone();
                        v.host_target_path = r.host_target_path.clone();
                        if r.direct.is_some() {
                            v.direct = r.direct.clone();
                        }
                    }
                    Ok(())
                })?;
                Ok(guest_path)
            }
            Err(e) if matches!(e.code, Code::DeadlineExceeded | Code::Cancelled) => {
                self.outlived(&sb, r, &names, published_before, e)
            }
            Err(e) => Err(self.undo(&sb, r, &names, published_before, e)),
        }
    }

    /// The agent's publish ended with DEADLINE_EXCEEDED or CANCELLED. If the
    /// agent lists the volume, it is mounted and its fsGroup walk goes on in
    /// the guest: the disk stays plugged, the volume is recorded as
    /// `publishing` (a retry joins the walk, Unpublish takes it out), and the
    /// caller gets DEADLINE_EXCEEDED with the agent's message. If the agent
    /// does not list it (no disk appeared in time), it is undone as any
    /// failure is. If the agent cannot say, the disk stays: unplugging it
    /// under a running walk would be worse than a record the next call settles.
    fn outlived(
        &self,
        sb: &Sandbox,
        r: &PublishRequest,
        names: &Names,
        published_before: bool,
        e: Error,
    ) -> Result<String> {
        if matches!(self.agent(sb).lists(&names.volume_id), Ok(false)) {
            return Err(self.undo(sb, r, names, published_before, e));
        }
        self.update(sb, |st| {
            if let Some(v) = st.volumes.get_mut(&r.host_volume_id) {
                if v.phase != Phase::Published {
                    v.phase = Phase::Publishing;
                }
                v.host_target_path = r.host_target_path.clone();
                if r.direct.is_some() {
                    v.direct = r.direct.clone();
                }
            }
            Ok(())
        })?;
        Err(Error::new(Code::DeadlineExceeded, e.message))
    }

    /// createFilesystem for a volume this call has just claimed and holds:
    /// a device that already holds `file_system` is left as it is; a
    /// provably blank one is formatted (the hold let go for mkfs, which
    /// opens the device O_EXCL itself, and taken again after); anything
    /// else is FAILED_PRECONDITION and not a byte of it is written.
    fn create_file_system(&self, sb: &Sandbox, r: &PublishRequest, dev: &HostDevice) -> Result<()> {
        let timeout = self.cfg.mkfs_timeout;
        if mkfs::inspect(dev, &r.file_system, timeout)? == mkfs::Content::Same {
            return Ok(());
        }
        let key: Key = (sb.id.clone(), r.host_volume_id.clone());
        drop(self.claims.take_hold(&key));
        let formatted = mkfs::format(dev, &r.file_system, timeout);
        // Held again whatever mkfs did; a host that took the device
        // meanwhile makes this fail, and the publish with it.
        let held = dev.hold()?;
        drop(self.claims.set_hold(&key, held));
        formatted
    }

    /// RuntimePublishDirectVolume: reads and checks the record filed for
    /// `volume_path`, publishes its device as RuntimePublishVolume would,
    /// then writes the sandbox-id file. Answers (guest path, device).
    pub fn publish_direct(&self, r: &DirectRequest) -> Result<(String, String)> {
        registry::check_id(&r.sandbox_id)?;
        let found = self.records.read(r.volume_path.as_bytes())?;
        self.records
            .check_sandbox_slot(r.volume_path.as_bytes(), &r.sandbox_id)?;
        let rec = found.record;
        let p = PublishRequest {
            sandbox_id: r.sandbox_id.clone(),
            host_volume_id: rec.device.clone(),
            host_target_path: r.volume_path.clone(),
            file_system: rec.fstype,
            mount_options: rec.options,
            fsgroup_gid: rec.fs_group.map(i64::from),
            fsgroup_policy: if rec.on_root_mismatch {
                "OnRootMismatch".into()
            } else {
                String::new()
            },
            read_only: r.read_only,
            block: false,
            create_file_system: rec.create_filesystem,
            direct: Some(r.volume_path.clone()),
            deadline: r.deadline,
        };
        let guest_path = self.publish(&p).map_err(|e| {
            if e.code == Code::InvalidArgument && e.message.starts_with("host_volume_id") {
                // The record's device: say which file named it.
                Error::invalid(format!(
                    "direct-volume record {} names {}",
                    found.file.display(),
                    e.message.trim_start_matches("host_volume_id ")
                ))
            } else {
                e
            }
        })?;
        self.records
            .record_sandbox(r.volume_path.as_bytes(), &r.sandbox_id)?;
        Ok((guest_path, rec.device))
    }

    /// Claims `dev` for this volume and records it before anything is
    /// plugged: no other volume, in this sandbox or another, may have a byte
    /// of it, the host must not use it, and crustd holds it exclusively from
    /// here on. A volume already recorded keeps its claim. Answers the
    /// record as it was.
    fn claim(
        &self,
        sb: &Sandbox,
        r: &PublishRequest,
        dev: &HostDevice,
        names: &Names,
    ) -> Result<Option<Volume>> {
        let key: Key = (sb.id.clone(), r.host_volume_id.clone());
        let st = self.load(sb)?;
        // Records the table lacks (a state file repaired since crustd
        // started) or whose hold the kernel refused before: again now.
        let failed = self.adopt(sb, &st);
        if let Some(prior) = st.volumes.get(&r.host_volume_id) {
            if let Some((_, e)) = failed.into_iter().find(|(hv, _)| *hv == r.host_volume_id) {
                return Err(e);
            }
            return Ok(Some(prior.clone()));
        }
        let extent = dev.extent()?;
        self.reserve(sb, &key, &dev.path.display().to_string(), Some(extent))?;
        // From here on a failure releases the claim.
        let held = dev.check_unused().and_then(|()| dev.hold());
        let hold = match held {
            Ok(h) => h,
            Err(e) => {
                drop(self.claims.release(&key));
                return Err(e);
            }
        };
        drop(self.claims.set_hold(&key, hold));
        let recorded = self.update(sb, |st| {
            st.volumes
                .entry(r.host_volume_id.clone())
                .or_insert_with(|| Volume {
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
                    direct: r.direct.clone(),
                });
            Ok(())
        });
        if let Err(e) = recorded {
            drop(self.claims.release(&key));
            return Err(e);
        }
        Ok(None)
    }

    /// Claims `extent` for `key` in the node-wide table. A conflict with a
    /// sandbox whose VM is gone (no sandbox.json) releases that sandbox's
    /// claims and tries again (it looks at the other sandbox outside the lock).
    fn reserve(&self, sb: &Sandbox, key: &Key, device: &str, extent: Option<Extent>) -> Result<()> {
        for _ in 0..8 {
            let c = match self.claims.reserve(key, device, extent.clone()) {
                Ok(()) => return Ok(()),
                Err(c) => c,
            };
            if c.sandbox != sb.id && !registry::alive(&self.cfg.sandboxes, &c.sandbox) {
                drop(self.claims.release_sandbox(&c.sandbox));
                continue;
            }
            return Err(conflict(sb, &key.1, device, &c));
        }
        Err(Error::unavailable(format!(
            "host device {}: the sandboxes claiming it kept changing; try again",
            hostdev::named(&key.1, device)
        )))
    }

    /// Brings `sb`'s records into the claims table: each record the table
    /// lacks is claimed again (its device found by number), and each claim
    /// without its exclusive hold tries to take it. Answers what failed, by
    /// host_volume_id (a device gone, another volume's bytes, the host
    /// using it).
    fn adopt(&self, sb: &Sandbox, st: &State) -> Vec<(String, Error)> {
        let mut failed = Vec::new();
        for (hv, v) in &st.volumes {
            let key: Key = (sb.id.clone(), hv.clone());
            let known = self.claims.get(&key);
            if known == Some(true) {
                continue;
            }
            let dev = match hostdev::open_recorded(&v.rdev) {
                Ok(d) => d,
                Err(e) => {
                    if known.is_none() {
                        // Gone: it can conflict with nothing, but it is still this volume's.
                        let _ = self.claims.reserve(&key, &v.rdev, None);
                    }
                    failed.push((hv.clone(), e));
                    continue;
                }
            };
            if known.is_none() {
                let extent = match dev.extent() {
                    Ok(e) => Some(e),
                    Err(e) => {
                        failed.push((hv.clone(), e));
                        None
                    }
                };
                let device = dev.path.display().to_string();
                if let Err(e) = self.reserve(sb, &key, &device, extent) {
                    failed.push((hv.clone(), e));
                    continue;
                }
            }
            match dev.hold() {
                Ok(h) => drop(self.claims.set_hold(&key, h)),
                Err(e) => failed.push((hv.clone(), e)),
            }
        }
        failed
    }

    /// At start, before serving: claims and holds the device of every
    /// volume recorded in every live sandbox. Answers what failed, as
    /// (sandbox, host_volume_id, error), for the log.
    pub fn recover(&self) -> Vec<(String, String, Error)> {
        let mut failed = Vec::new();
        for id in registry::all_ids(&self.cfg.sandboxes) {
            let sb = match registry::open(&self.cfg.sandboxes, &id) {
                Ok(sb) => sb,
                // Its VM is gone: it holds nothing.
                Err(e) if e.code == Code::NotFound => continue,
                Err(e) => {
                    failed.push((id, String::new(), e));
                    continue;
                }
            };
            let st = match self.load(&sb) {
                Ok(st) => st,
                Err(e) => {
                    failed.push((id, String::new(), e));
                    continue;
                }
            };
            for (hv, e) in self.adopt(&sb, &st) {
                failed.push((id.clone(), hv, e));
            }
        }
        failed
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
        match self.take_out(sb, &r.host_volume_id, names, true, r.direct.as_deref()) {
            Ok(()) => err,
            Err(e2) => err.and(format!(
                "undoing the hot-plug failed too ({e2}); RuntimeUnpublishVolume will finish it"
            )),
        }
    }

    /// Agent unpublish, device_del + DEVICE_DELETED, blockdev-del, the
    /// direct-volume record's sandbox-id file, forget. The record stays (as
    /// unplugging) until every step has succeeded.
    /// `undoing`: the volume was never reported published, so an agent that
    /// cannot be reached does not keep the disk in (nothing uses it yet);
    /// an agent that answers no (e.g. busy) always does.
    fn take_out(
        &self,
        sb: &Sandbox,
        host_volume_id: &str,
        names: &Names,
        undoing: bool,
        direct: Option<&str>,
    ) -> Result<()> {
        self.set_phase(sb, host_volume_id, Phase::Unplugging)?;
        match self.agent(sb).unpublish(&names.volume_id) {
            Err(e) if !(undoing && e.code == crate::error::Code::Unavailable) => return Err(e),
            _ => {}
        }
        let timeout = self.cfg.unplug_timeout;
        self.with_qmp(sb, |q| hotplug::unplug(q, names, timeout))?;
        if let Some(path) = direct {
            self.records.forget_sandbox(path.as_bytes(), &sb.id)?;
        }
        self.forget(sb, host_volume_id)
    }

    /// Unpublish in a sandbox whose VM is gone (`why`): nothing to unplug,
    /// so forget the volume, remove its sandbox-id file and free its device.
    /// Unless a process still has the device open (a VMM whose monitor
    /// socket was removed under it would): then freeing it could put one
    /// disk in two VMs, and the answer is FAILED_PRECONDITION.
    fn forget_dead(&self, sb: &Sandbox, host_volume_id: &str, v: &Volume, why: &str) -> Result<()> {
        let holders = hostdev::openers(&v.rdev);
        if !holders.is_empty() {
            return Err(Error::precondition(format!(
                "sandbox {}'s VM looks gone ({why}), yet {} still has host device {host_volume_id} ({}) open: crustd does not free a device a process may still write; stop that process, or restore the VM's QMP socket and unpublish again",
                sb.id,
                holders.join(", "),
                v.rdev
            )));
        }
        if let Some(path) = &v.direct {
            self.records.forget_sandbox(path.as_bytes(), &sb.id)?;
        }
        self.forget(sb, host_volume_id)?;
        self.connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&sb.id);
        Ok(())
    }

    /// FAILED_PRECONDITION for a call that needs the VM of `sb`, gone (`why`).
    fn dead(sb: &Sandbox, why: &str) -> Error {
        Error::precondition(format!(
            "sandbox {}'s VM is gone ({why}): its volumes can only be unpublished, which frees their devices",
            sb.id
        ))
    }

    /// `err` from a call that could not reach `sb`'s VM, or FAILED_PRECONDITION
    /// when the VM is gone.
    fn unless_dead(&self, sb: &Sandbox, err: Error) -> Error {
        if err.code != Code::Unavailable {
            return err;
        }
        match qmp::gone(&sb.qmp, self.cfg.qmp_timeout) {
            Some(why) => Crustd::dead(sb, &why),
            None => err,
        }
    }

    /// At start, after [`Crustd::recover`]: every sandbox with volumes
    /// recorded whose VM is gone, as (sandbox, why, host volumes), for the
    /// log. They stay recorded (and their devices held) until unpublished.
    pub fn dead_sandboxes(&self) -> Vec<(String, String, Vec<String>)> {
        let mut out = Vec::new();
        for id in registry::all_ids(&self.cfg.sandboxes) {
            let Ok(sb) = registry::open(&self.cfg.sandboxes, &id) else {
                continue;
            };
            let Ok(st) = self.load(&sb) else { continue };
            if st.volumes.is_empty() {
                continue;
            }
            if let Some(why) = qmp::gone(&sb.qmp, self.cfg.qmp_timeout) {
                out.push((id, why, st.volumes.keys().cloned().collect()));
            }
        }
        out
    }

    /// RuntimeUnpublishVolume: OK when the volume is not (or no longer) published.
    pub fn unpublish(&self, sandbox_id: &str, host_volume_id: &str) -> Result<()> {
        hostdev::check_path(host_volume_id)?;
        let sb = self.sandbox(sandbox_id)?;
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), host_volume_id.to_string()));
        let _v = hold(&l);
        let Some(v) = self.record(&sb, host_volume_id)? else {
            return Ok(());
        };
        // A dead VM has nothing to unplug: asking its agent would only wait.
        if let Some(why) = qmp::gone(&sb.qmp, self.cfg.qmp_timeout) {
            return self.forget_dead(&sb, host_volume_id, &v, &why);
        }
        self.take_out(
            &sb,
            host_volume_id,
            &names_of(&v),
            false,
            v.direct.as_deref(),
        )
    }

    /// The record of a published volume, else NOT_FOUND; one still
    /// publishing (its fsGroup walk runs in the guest) only if `publishing`
    /// may be, else FAILED_PRECONDITION.
    fn published(&self, sb: &Sandbox, host_volume_id: &str, publishing: bool) -> Result<Volume> {
        match self.record(sb, host_volume_id)? {
            Some(v) if v.phase == Phase::Published => Ok(v),
            Some(v) if v.phase == Phase::Publishing && publishing => Ok(v),
            Some(v) if v.phase == Phase::Publishing => Err(Error::precondition(format!(
                "host volume {host_volume_id} in sandbox {} is still publishing (the guest is applying fsGroup): retry RuntimePublishVolume until it answers OK, then this call",
                sb.id
            ))),
            _ => Err(Error::not_found(format!(
                "host volume {host_volume_id} is not published in sandbox {}",
                sb.id
            ))),
        }
    }

    /// RuntimeGetVolumeStats: the agent's usage and condition, as they are.
    pub fn stats(&self, sandbox_id: &str, host_volume_id: &str) -> Result<Stats> {
        hostdev::check_path(host_volume_id)?;
        let sb = self.sandbox(sandbox_id)?;
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), host_volume_id.to_string()));
        let _v = hold(&l);
        // Still publishing: the agent says how it stands (FAILED_PRECONDITION
        // while its walk runs, the usage once it is done).
        let v = self.published(&sb, host_volume_id, true)?;
        let s = self
            .agent(&sb)
            .stats(&v.volume_id)
            .map_err(|e| self.unless_dead(&sb, e))?;
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
        let sb = self.sandbox(sandbox_id)?;
        let l = self
            .volume_locks
            .get(&(sb.id.clone(), host_volume_id.to_string()));
        let _v = hold(&l);
        let v = self.published(&sb, host_volume_id, false)?;
        if let Some(why) = qmp::gone(&sb.qmp, self.cfg.qmp_timeout) {
            return Err(Crustd::dead(&sb, &why));
        }
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
        self.with_qmp(&sb, |q| hotplug::grow(q, &v.node, size))
            .map_err(|e| self.unless_dead(&sb, e))?;
        self.agent(&sb)
            .expand(&v.volume_id, required_bytes)
            .map_err(|e| self.unless_dead(&sb, e))
    }
}

/// "One device, one volume": `host_volume_id` (node `device`) shares bytes
/// with the volume `c` claimed.
fn conflict(sb: &Sandbox, host_volume_id: &str, device: &str, c: &Conflict) -> Error {
    let how = if c.same {
        "is the same device as"
    } else {
        "shares sectors with"
    };
    let what = format!(
        "host device {} {how} {}, already published in sandbox {}",
        hostdev::named(host_volume_id, device),
        hostdev::named(&c.host_volume_id, &c.device),
        c.sandbox
    );
    if c.sandbox == sb.id {
        Error::precondition(format!("{what}: one device, one volume"))
    } else {
        Error::precondition(format!(
            "{what}: one device, one volume; unpublish it there first"
        ))
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

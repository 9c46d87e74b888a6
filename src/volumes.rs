//! The volume table: publish, unpublish, stats, expand, bind and unmount as
//! steps over the capability modules, one lock per volume so operations on
//! one volume are serialized while different volumes proceed in parallel.
//! The table is mirrored in `<root>/state/` so a restarted agent serves what
//! it had published (cross-checked against the live mount table).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use slog::{info, warn, Logger};

use crate::cancel::{Cancel, Token, Why};
use crate::device::{self, Device, Sysfs};
use crate::errors::{Code, Result, SysError};
use crate::mount::{self, BindSpec, MountOptions, RecursiveReadOnly};
use crate::ownership::{self, Policy};
use crate::probe::{self, FsType};
use crate::stats::{self, Condition, Usage};
use crate::{grow, mountinfo};

/// What the volume table refuses.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// NOT_FOUND: stats, expand or bind of an unknown volume.
    #[error("volume {0} is not published; publish it first")]
    NotPublished(String),
    /// ALREADY_EXISTS: the id is taken by a publish with other parameters.
    #[error("volume {id} is already published with different parameters ({differs}); unpublish it first, or repeat the original request")]
    Conflict {
        /// The volume id.
        id: String,
        /// Which parameter differs.
        differs: String,
    },
    /// FAILED_PRECONDITION: the device is published under another id.
    #[error("device {device} is already published as volume {other}; a disk is mounted once, under one volume id")]
    DeviceInUse {
        /// The device node.
        device: String,
        /// The volume that holds it.
        other: String,
    },
    /// FAILED_PRECONDITION: the device is mounted by someone else.
    #[error("device {device} is already mounted at {at}; the agent never mounts one disk twice")]
    DeviceMounted {
        /// The device node.
        device: String,
        /// Where it is mounted.
        at: String,
    },
    /// FAILED_PRECONDITION: something is already mounted where the volume goes.
    #[error(
        "{path} is already a mount point, though no volume is published there; unmount it first"
    )]
    GuestPathBusy {
        /// The volume's guest path.
        path: String,
    },
    /// FAILED_PRECONDITION: expand of a read-only volume.
    #[error("volume {0} is published read-only; a read-only filesystem cannot grow online")]
    ReadOnly(String),
    /// ALREADY_EXISTS: the bind target is already a mount of something else.
    #[error("bind target {target} is already {what}; unmount it first or choose another target")]
    TargetTaken {
        /// The target path.
        target: String,
        /// What holds it.
        what: String,
    },
    /// FAILED_PRECONDITION: the volume's mount went away behind the agent's back.
    #[error("volume {id} is published, but its mount at {path} is gone (unmounted behind the agent's back); unpublish it, then publish it again")]
    MountGone {
        /// The volume id.
        id: String,
        /// The guest path.
        path: String,
    },
    /// FAILED_PRECONDITION: the agent is shutting down.
    #[error("the agent is shutting down and accepts no new volumes or binds")]
    ShuttingDown,
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::NotPublished(_) => Code::NotFound,
            Error::Conflict { .. } | Error::TargetTaken { .. } => Code::AlreadyExists,
            Error::DeviceInUse { .. }
            | Error::DeviceMounted { .. }
            | Error::GuestPathBusy { .. }
            | Error::ReadOnly(_)
            | Error::MountGone { .. }
            | Error::ShuttingDown => Code::FailedPrecondition,
        }
    }
}

/// Where the disk comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The virtio-blk serial the host gave the disk.
    Serial(String),
    /// A device node under /dev.
    Path(PathBuf),
}

/// fsGroup settings of a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsGroup {
    /// The pod's fsGroup.
    pub gid: u32,
    /// When to walk.
    pub policy: Policy,
}

/// A validated PublishVolume request.
#[derive(Clone, Debug)]
pub struct PublishRequest {
    /// The host's volume id.
    pub volume_id: String,
    /// Where the disk comes from.
    pub source: Source,
    /// The filesystem the disk must hold.
    pub fs: FsType,
    /// Mount options as given: what a repeated request is compared with.
    pub options: Vec<String>,
    /// The same options parsed, with `read_only` applied.
    pub mount: MountOptions,
    /// Mount read-only.
    pub read_only: bool,
    /// fsGroup, if any.
    pub fs_group: Option<FsGroup>,
    /// How long to wait for the device to appear.
    pub timeout: Duration,
}

/// The answer to a publish.
#[derive(Clone, Debug)]
pub struct Published {
    /// `<root>/volumes/<id>`.
    pub guest_path: PathBuf,
    /// The device node.
    pub device: PathBuf,
    /// The same request had already been served.
    pub already_published: bool,
    /// The fsGroup walk's report, when one was asked for (and the volume is writable).
    pub ownership: Option<ownership::Report>,
}

/// A validated BindMount request.
#[derive(Clone, Debug)]
pub struct BindRequest {
    /// The volume to bind.
    pub volume_id: String,
    /// Relative to the volume root; empty for the root.
    pub subpath: PathBuf,
    /// Absolute, beneath the agent's root.
    pub target: PathBuf,
    /// Read-only bind.
    pub read_only: bool,
    /// KEP-3857 mode.
    pub recursive_read_only: RecursiveReadOnly,
}

/// The answer to a bind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BindOutcome {
    /// Whether the bind is recursively read-only.
    pub recursive_read_only_applied: bool,
    /// The same bind already existed.
    pub already_mounted: bool,
}

/// What ListVolumes reports of one volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    /// The volume id.
    pub volume_id: String,
    /// The device node.
    pub device: String,
    /// The serial, when published by serial.
    pub serial: String,
    /// "ext4" or "xfs".
    pub fs_type: String,
    /// Where it is mounted.
    pub guest_path: String,
    /// Mounted read-only.
    pub read_only: bool,
    /// Its binds.
    pub bind_targets: Vec<String>,
}

/// The answer to an expand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expanded {
    /// The filesystem's size after the call.
    pub capacity_bytes: u64,
    /// The device's size.
    pub device_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Bind {
    target: PathBuf,
    subpath: PathBuf,
    read_only: bool,
    rro: RecursiveReadOnly,
    rro_applied: bool,
}

#[derive(Clone, Debug)]
struct Volume {
    id: String,
    source: Source,
    device: Device,
    fs: FsType,
    options: Vec<String>,
    /// `options` parsed with `read_only` applied: the flags it is mounted with.
    mount: MountOptions,
    read_only: bool,
    fs_group: Option<FsGroup>,
    guest_path: PathBuf,
    binds: Vec<Bind>,
}

impl Volume {
    fn info(&self) -> VolumeInfo {
        VolumeInfo {
            volume_id: self.id.clone(),
            device: self.device.path.display().to_string(),
            serial: match &self.source {
                Source::Serial(s) => s.clone(),
                Source::Path(_) => self.device.serial.clone().unwrap_or_default(),
            },
            fs_type: self.fs.name().to_string(),
            guest_path: self.guest_path.display().to_string(),
            read_only: self.mounted_read_only(),
            bind_targets: self
                .binds
                .iter()
                .map(|b| b.target.display().to_string())
                .collect(),
        }
    }

    /// Whether the volume is mounted read-only: `read_only`, or an `ro` that
    /// the mount options leave in effect.
    fn mounted_read_only(&self) -> bool {
        self.mount.flags & libc::MS_RDONLY != 0
    }

    /// Which publish parameter differs from `req`, if any.
    fn differs_from(&self, req: &PublishRequest) -> Option<String> {
        if self.source != req.source {
            return Some(format!("source {:?} vs {:?}", self.source, req.source));
        }
        if self.fs != req.fs {
            return Some(format!("fs_type {} vs {}", self.fs.name(), req.fs.name()));
        }
        if self.options != req.options {
            return Some(format!(
                "mount_options {:?} vs {:?}",
                self.options, req.options
            ));
        }
        if self.read_only != req.read_only {
            return Some(format!("read_only {} vs {}", self.read_only, req.read_only));
        }
        if self.fs_group != req.fs_group {
            return Some(format!(
                "fs_group {:?} vs {:?}",
                self.fs_group, req.fs_group
            ));
        }
        None
    }
}

type Slot = Arc<Mutex<Option<Volume>>>;

/// The table of published volumes.
pub struct Volumes {
    root: PathBuf,
    sysfs: Sysfs,
    log: Logger,
    /// One slot per volume id; a slot's lock serializes that volume's operations.
    slots: Mutex<HashMap<String, Slot>>,
    /// Devices (major, minor) claimed by a volume id, so two ids never mount one disk.
    devices: Mutex<HashMap<(u32, u32), String>>,
    /// Bind targets and the volume each belongs to.
    binds: Mutex<HashMap<PathBuf, String>>,
    /// What ListVolumes answers, updated whenever a volume changes.
    snapshot: Mutex<BTreeMap<String, VolumeInfo>>,
    shutting_down: AtomicBool,
    /// Fired by `shutdown`: stops every wait and walk in flight.
    stop: Token,
}

/// Locks a mutex even if a panicking request poisoned it: every update below
/// leaves the data consistent before anything can panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Locks a volume's slot, giving up when `cancel` fires: a request waiting
/// behind a long operation on the same volume ends at its own deadline.
fn lock_slot<'a>(
    slot: &'a Mutex<Option<Volume>>,
    id: &str,
    cancel: &Cancel,
) -> Result<MutexGuard<'a, Option<Volume>>> {
    let mut pause = Duration::from_micros(200);
    loop {
        match slot.try_lock() {
            Ok(g) => return Ok(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Ok(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                cancel.check(|| format!("waiting for another operation on volume {id} to end"))?;
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
        }
    }
}

impl Volumes {
    /// Opens the table under `root`, creating `volumes/` and `state/`, and
    /// takes back the volumes a previous run left published.
    pub fn open(root: &Path, sysfs: Sysfs, log: Logger) -> Result<Volumes> {
        for (dir, mode) in [
            (root.to_path_buf(), 0o755),
            (root.join("volumes"), 0o750),
            (root.join("state"), 0o700),
        ] {
            make_dir(&dir, mode)?;
        }
        let v = Volumes {
            root: root.to_path_buf(),
            sysfs,
            log,
            slots: Mutex::new(HashMap::new()),
            devices: Mutex::new(HashMap::new()),
            binds: Mutex::new(HashMap::new()),
            snapshot: Mutex::new(BTreeMap::new()),
            shutting_down: AtomicBool::new(false),
            stop: Token::new(Why::Shutdown),
        };
        v.recover()?;
        Ok(v)
    }

    /// The agent's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn slot(&self, id: &str) -> Slot {
        lock(&self.slots).entry(id.to_string()).or_default().clone()
    }

    fn existing_slot(&self, id: &str) -> Option<Slot> {
        lock(&self.slots).get(id).cloned()
    }

    /// Drops the slot of a volume that is gone, unless someone else holds it.
    fn forget_slot(&self, id: &str) {
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get(id) {
            if Arc::strong_count(s) == 1 && matches!(s.try_lock().as_deref(), Ok(None)) {
                slots.remove(id);
            }
        }
    }

    fn publish_snapshot(&self, vol: &Volume) {
        lock(&self.snapshot).insert(vol.id.clone(), vol.info());
    }

    /// The request's cancellation joined with the agent's shutdown.
    fn stop_with(&self, cancel: &Cancel) -> Cancel {
        cancel.clone().with_token(&self.stop)
    }

    /// PublishVolume: find the disk, check its filesystem, mount it, apply fsGroup.
    pub fn publish(&self, req: &PublishRequest, cancel: &Cancel) -> Result<Published> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown.into());
        }
        let cancel = &self.stop_with(cancel);
        let slot = self.slot(&req.volume_id);
        let locked = lock_slot(&slot, &req.volume_id, cancel);
        let mut guard = match locked {
            Ok(g) => g,
            Err(e) => {
                self.forget_slot(&req.volume_id);
                return Err(e);
            }
        };
        if let Some(vol) = guard.as_ref() {
            if let Some(differs) = vol.differs_from(req) {
                return Err(Error::Conflict {
                    id: req.volume_id.clone(),
                    differs,
                }
                .into());
            }
            // Idempotent only if it is still true: a mount taken away behind
            // the agent's back is not "already published".
            let table = mountinfo::read()?;
            let live = mountinfo::mount_at(&table, &vol.guest_path)
                .is_some_and(|m| (m.major, m.minor) == (vol.device.major, vol.device.minor));
            if !live {
                return Err(Error::MountGone {
                    id: req.volume_id.clone(),
                    path: vol.guest_path.display().to_string(),
                }
                .into());
            }
            return Ok(Published {
                guest_path: vol.guest_path.clone(),
                device: vol.device.path.clone(),
                already_published: true,
                ownership: None,
            });
        }
        let result = self.publish_new(req, cancel);
        match result {
            Ok((vol, report)) => {
                let out = Published {
                    guest_path: vol.guest_path.clone(),
                    device: vol.device.path.clone(),
                    already_published: false,
                    ownership: report,
                };
                self.publish_snapshot(&vol);
                *guard = Some(vol);
                Ok(out)
            }
            Err(e) => {
                drop(guard);
                self.forget_slot(&req.volume_id);
                Err(e)
            }
        }
    }

    fn publish_new(
        &self,
        req: &PublishRequest,
        cancel: &Cancel,
    ) -> Result<(Volume, Option<ownership::Report>)> {
        let device = match &req.source {
            Source::Serial(s) => device::find_by_serial(&self.sysfs, s, req.timeout, cancel)?,
            Source::Path(p) => device::from_path(p)?,
        };
        let claim = self.claim_device(&device, &req.volume_id)?;
        let guest_path = self.root.join("volumes").join(&req.volume_id);
        let table = mountinfo::read()?;
        if let Some(m) = table
            .iter()
            .find(|m| (m.major, m.minor) == (device.major, device.minor))
        {
            return Err(Error::DeviceMounted {
                device: device.path.display().to_string(),
                at: m.mount_point.display().to_string(),
            }
            .into());
        }
        if mountinfo::mount_at(&table, &guest_path).is_some() {
            return Err(Error::GuestPathBusy {
                path: guest_path.display().to_string(),
            }
            .into());
        }
        probe::check(&device.path, req.fs)?;
        make_dir(&guest_path, 0o750)?;
        if let Err(e) =
            mount::mount_filesystem(&device.path, &guest_path, req.fs.name(), &req.mount)
        {
            let _ = std::fs::remove_dir(&guest_path);
            return Err(e.into());
        }
        let vol = Volume {
            id: req.volume_id.clone(),
            source: req.source.clone(),
            device: device.clone(),
            fs: req.fs,
            options: req.options.clone(),
            mount: req.mount.clone(),
            read_only: req.read_only,
            fs_group: req.fs_group,
            guest_path: guest_path.clone(),
            binds: Vec::new(),
        };
        let undo = |e: crate::errors::Error| -> crate::errors::Error {
            if let Err(u) = mount::unmount_tree(&guest_path) {
                warn!(self.log, "could not undo a failed publish"; "volume" => &req.volume_id, "error" => %u);
            } else {
                let _ = std::fs::remove_dir(&guest_path);
            }
            e
        };
        let report = match (req.fs_group, vol.mounted_read_only()) {
            (Some(g), false) => {
                // semantics.md §4: a long walk says how far it got every 10 s.
                let progress = |p: &ownership::Report| {
                    info!(self.log, "fsGroup walk in progress"; "volume" => &req.volume_id,
                          "visited" => p.visited, "changed" => p.changed, "errors" => p.errors,
                          "elapsed_ms" => p.duration.as_millis() as u64);
                };
                let every = Duration::from_secs(10);
                let r = ownership::apply_with_progress(
                    &guest_path,
                    g.gid,
                    g.policy,
                    false,
                    every,
                    &progress,
                    cancel,
                )
                .map_err(|e| undo(e.into()))?;
                info!(self.log, "fsGroup applied"; "volume" => &req.volume_id, "gid" => g.gid,
                      "skipped" => r.skipped, "visited" => r.visited, "changed" => r.changed,
                      "errors" => r.errors, "duration_us" => r.duration.as_micros() as u64);
                Some(r)
            }
            // kubelet leaves read-only volumes' ownership alone: report the skip.
            (Some(_), true) => Some(ownership::Report {
                skipped: true,
                ..Default::default()
            }),
            (None, _) => None,
        };
        self.save(&vol).map_err(|e| undo(e.into()))?;
        claim.keep();
        Ok((vol, report))
    }

    fn claim_device(&self, device: &Device, id: &str) -> Result<DeviceClaim<'_>> {
        let mut devices = lock(&self.devices);
        let key = (device.major, device.minor);
        if let Some(other) = devices.get(&key) {
            if other != id {
                return Err(Error::DeviceInUse {
                    device: device.path.display().to_string(),
                    other: other.clone(),
                }
                .into());
            }
        }
        devices.insert(key, id.to_string());
        Ok(DeviceClaim {
            table: self,
            key,
            kept: false,
        })
    }

    /// UnpublishVolume: unmount the binds, sync, unmount. Idempotent.
    /// `cancel` bounds only the wait for the volume's lock: once unmounting
    /// has begun it goes to the end.
    pub fn unpublish(&self, id: &str, cancel: &Cancel) -> Result<bool> {
        let Some(slot) = self.existing_slot(id) else {
            return Ok(false);
        };
        let mut guard = lock_slot(&slot, id, cancel)?;
        let Some(vol) = guard.as_mut() else {
            drop(guard);
            self.forget_slot(id);
            return Ok(false);
        };
        while let Some(b) = vol.binds.last().cloned() {
            mount::unmount_tree(&b.target)?;
            remove_target_node(&b.target);
            vol.binds.pop();
            lock(&self.binds).remove(&b.target);
            self.save(vol)?;
        }
        mount::sync_filesystem(&vol.guest_path)?;
        mount::unmount_tree(&vol.guest_path)?;
        let _ = std::fs::remove_dir(&vol.guest_path);
        let state = self.state_file(id);
        std::fs::remove_file(&state)
            .or_else(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .map_err(|e| SysError::new("unlink", state.display(), e))?;
        lock(&self.devices).remove(&(vol.device.major, vol.device.minor));
        lock(&self.snapshot).remove(id);
        *guard = None;
        drop(guard);
        self.forget_slot(id);
        Ok(true)
    }

    fn with_volume<T>(
        &self,
        id: &str,
        cancel: &Cancel,
        f: impl FnOnce(&mut Volume) -> Result<T>,
    ) -> Result<T> {
        let slot = self
            .existing_slot(id)
            .ok_or_else(|| Error::NotPublished(id.to_string()))?;
        let mut guard = lock_slot(&slot, id, cancel)?;
        let vol = guard
            .as_mut()
            .ok_or_else(|| Error::NotPublished(id.to_string()))?;
        f(vol)
    }

    /// GetVolumeStats: usage (whenever statfs works) and the condition.
    pub fn stats(&self, id: &str, cancel: &Cancel) -> Result<(Option<Usage>, Condition)> {
        self.with_volume(id, cancel, |vol| {
            Ok(stats::check(
                &self.sysfs,
                &stats::Expected {
                    path: &vol.guest_path,
                    device: &vol.device,
                    read_only: vol.mounted_read_only(),
                    fs: vol.fs,
                },
            ))
        })
    }

    /// ExpandVolume: wait for the device to reach `required_bytes` (0: its
    /// current size), then grow the filesystem to fill it.
    pub fn expand(
        &self,
        id: &str,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Expanded> {
        let cancel = &self.stop_with(cancel);
        self.with_volume(id, cancel, |vol| {
            if vol.mounted_read_only() {
                return Err(Error::ReadOnly(id.to_string()).into());
            }
            let current = grow::fs_size_bytes(&vol.guest_path, &vol.device, vol.fs)?;
            if required_bytes > 0 && required_bytes <= current {
                let device_bytes = device::size_bytes(&vol.device.path)?;
                return Ok(Expanded { capacity_bytes: current, device_bytes });
            }
            let device_bytes = device::wait_for_size(
                &self.sysfs,
                &vol.device,
                required_bytes,
                timeout,
                cancel,
            )?;
            let capacity_bytes = grow::grow(&vol.guest_path, &vol.device, vol.fs, device_bytes)?;
            info!(self.log, "filesystem grown"; "volume" => id, "from" => current, "to" => capacity_bytes,
                  "device_bytes" => device_bytes);
            Ok(Expanded { capacity_bytes, device_bytes })
        })
    }

    /// BindMount: the volume (or a subpath) at a target beneath the root.
    pub fn bind(&self, req: &BindRequest, cancel: &Cancel) -> Result<BindOutcome> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown.into());
        }
        let cancel = &self.stop_with(cancel);
        self.with_volume(&req.volume_id, cancel, |vol| {
            if let Some(b) = vol.binds.iter().find(|b| b.target == req.target) {
                if b.subpath == req.subpath
                    && b.read_only == req.read_only
                    && b.rro == req.recursive_read_only
                {
                    return Ok(BindOutcome {
                        recursive_read_only_applied: b.rro_applied,
                        already_mounted: true,
                    });
                }
                return Err(Error::TargetTaken {
                    target: req.target.display().to_string(),
                    what: format!("a bind of volume {} with other parameters", vol.id),
                }
                .into());
            }
            if let Some(other) = lock(&self.binds).get(&req.target) {
                return Err(Error::TargetTaken {
                    target: req.target.display().to_string(),
                    what: format!("a bind of volume {other}"),
                }
                .into());
            }
            let table = mountinfo::read()?;
            if let Some(m) = mountinfo::mount_at(&table, &req.target) {
                return Err(Error::TargetTaken {
                    target: req.target.display().to_string(),
                    what: format!("a mount of {} ({})", m.source, m.fs_type),
                }
                .into());
            }
            let subpath = req.subpath.to_string_lossy();
            let out = mount::bind(&BindSpec {
                volume_root: &vol.guest_path,
                subpath: &subpath,
                agent_root: &self.root,
                target: &req.target,
                read_only: req.read_only,
                recursive_read_only: req.recursive_read_only,
            })?;
            vol.binds.push(Bind {
                target: req.target.clone(),
                subpath: req.subpath.clone(),
                read_only: req.read_only,
                rro: req.recursive_read_only,
                rro_applied: out.recursive_read_only_applied,
            });
            if let Err(e) = self.save(vol) {
                vol.binds.pop();
                let _ = mount::unmount_tree(&req.target);
                return Err(e.into());
            }
            lock(&self.binds).insert(req.target.clone(), vol.id.clone());
            self.publish_snapshot(vol);
            Ok(BindOutcome {
                recursive_read_only_applied: out.recursive_read_only_applied,
                already_mounted: false,
            })
        })
    }

    /// Unmount: a bind target, recursively. Idempotent.
    pub fn unmount(&self, target: &Path, cancel: &Cancel) -> Result<bool> {
        let owner = lock(&self.binds).get(target).cloned();
        if let Some(id) = owner {
            let r = self.with_volume(&id, cancel, |vol| {
                let was = mount::unmount_tree(target)?;
                if was {
                    remove_target_node(target);
                }
                vol.binds.retain(|b| b.target != target);
                self.save(vol)?;
                self.publish_snapshot(vol);
                Ok(was)
            });
            match r {
                Ok(was) => {
                    lock(&self.binds).remove(target);
                    return Ok(was);
                }
                // The volume went away meanwhile: fall through to a plain unmount.
                Err(crate::errors::Error::Volume(Error::NotPublished(_))) => {
                    lock(&self.binds).remove(target);
                }
                Err(e) => return Err(e),
            }
        }
        let was = mount::unmount_tree(target)?;
        if was {
            remove_target_node(target);
        }
        Ok(was)
    }

    /// ListVolumes.
    pub fn list(&self) -> Vec<VolumeInfo> {
        lock(&self.snapshot).values().cloned().collect()
    }

    /// Shutdown: refuse new work, then unpublish every volume. Returns how
    /// many were unmounted; failures are logged and the rest go on.
    pub fn shutdown(&self) -> u32 {
        self.shutting_down.store(true, Ordering::SeqCst);
        // Waits and walks in flight stop within a slice and undo their work,
        // releasing their volumes' locks for the unmounts below.
        self.stop.fire();
        let ids: Vec<String> = lock(&self.slots).keys().cloned().collect();
        let mut n = 0;
        for id in ids {
            match self.unpublish(&id, &Cancel::never()) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    warn!(self.log, "could not unpublish at shutdown"; "volume" => &id, "error" => %e)
                }
            }
        }
        n
    }

    fn state_file(&self, id: &str) -> PathBuf {
        self.root.join("state").join(format!("{id}.vol"))
    }

    /// Writes the volume's record atomically (temp file, fsync, rename).
    fn save(&self, vol: &Volume) -> Result<(), SysError> {
        use std::io::Write;
        let path = self.state_file(&vol.id);
        let tmp = path.with_extension("tmp");
        let text = state::encode(vol);
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| SysError::new("write", path.display(), e))
    }

    /// Takes back what a previous run published, if it is still mounted.
    fn recover(&self) -> Result<()> {
        let dir = self.root.join("state");
        let entries =
            std::fs::read_dir(&dir).map_err(|e| SysError::new("readdir", dir.display(), e))?;
        let table = mountinfo::read()?;
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("vol") {
                if path.extension().and_then(|e| e.to_str()) == Some("tmp") {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) => {
                    warn!(self.log, "unreadable state file skipped"; "path" => %path.display(), "error" => %e);
                    continue;
                }
            };
            let Some(mut vol) = state::decode(&text, &self.root) else {
                warn!(self.log, "malformed state file skipped"; "path" => %path.display());
                continue;
            };
            let mounted = mountinfo::mount_at(&table, &vol.guest_path)
                .is_some_and(|m| (m.major, m.minor) == (vol.device.major, vol.device.minor));
            if !mounted {
                warn!(self.log, "volume from a previous run is no longer mounted; forgetting it";
                      "volume" => &vol.id, "guest_path" => %vol.guest_path.display());
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let binds_before = vol.binds.len();
            vol.binds.retain(|b| {
                let live = mountinfo::mount_at(&table, &b.target)
                    .is_some_and(|m| (m.major, m.minor) == (vol.device.major, vol.device.minor));
                if !live {
                    warn!(self.log, "bind from a previous run is gone"; "volume" => &vol.id, "target" => %b.target.display());
                }
                live
            });
            for b in &vol.binds {
                lock(&self.binds).insert(b.target.clone(), vol.id.clone());
            }
            lock(&self.devices).insert((vol.device.major, vol.device.minor), vol.id.clone());
            // Rewritten only when a bind was dropped: start-up does no needless I/O.
            if vol.binds.len() != binds_before {
                self.save(&vol)?;
            }
            self.publish_snapshot(&vol);
            info!(self.log, "volume taken back from a previous run"; "volume" => &vol.id, "binds" => vol.binds.len());
            lock(&self.slots).insert(vol.id.clone(), Arc::new(Mutex::new(Some(vol))));
        }
        Ok(())
    }
}

/// A device reserved for one volume id during a publish; released on drop unless kept.
struct DeviceClaim<'a> {
    table: &'a Volumes,
    key: (u32, u32),
    kept: bool,
}

impl DeviceClaim<'_> {
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for DeviceClaim<'_> {
    fn drop(&mut self) {
        if !self.kept {
            lock(&self.table.devices).remove(&self.key);
        }
    }
}

fn make_dir(path: &Path, mode: u32) -> Result<(), SysError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(SysError::new("mkdir", path.display(), e)),
    }
}

/// Removes the directory or empty file a bind created, once nothing is mounted there.
fn remove_target_node(target: &Path) {
    match std::fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir(target);
        }
        Ok(m) if m.is_file() && m.len() == 0 => {
            let _ = std::fs::remove_file(target);
        }
        _ => {}
    }
}

/// The on-disk record of a volume: `key=value` lines, values percent-escaped.
mod state {
    use super::*;

    fn esc(s: &str) -> String {
        let mut o = String::with_capacity(s.len());
        for c in s.chars() {
            match c {
                '%' => o.push_str("%25"),
                '\n' => o.push_str("%0A"),
                '\t' => o.push_str("%09"),
                c => o.push(c),
            }
        }
        o
    }

    fn unesc(s: &str) -> String {
        s.replace("%0A", "\n")
            .replace("%09", "\t")
            .replace("%25", "%")
    }

    fn rro_name(r: RecursiveReadOnly) -> &'static str {
        match r {
            RecursiveReadOnly::Disabled => "disabled",
            RecursiveReadOnly::IfPossible => "if-possible",
            RecursiveReadOnly::Enabled => "enabled",
        }
    }

    fn rro_parse(s: &str) -> Option<RecursiveReadOnly> {
        Some(match s {
            "disabled" => RecursiveReadOnly::Disabled,
            "if-possible" => RecursiveReadOnly::IfPossible,
            "enabled" => RecursiveReadOnly::Enabled,
            _ => return None,
        })
    }

    pub(super) fn encode(v: &Volume) -> String {
        let mut o = String::from("version=1\n");
        o += &format!("id={}\n", esc(&v.id));
        match &v.source {
            Source::Serial(s) => o += &format!("serial={}\n", esc(s)),
            Source::Path(p) => o += &format!("device_path={}\n", esc(&p.to_string_lossy())),
        }
        o += &format!("device={}\n", esc(&v.device.path.to_string_lossy()));
        o += &format!("name={}\n", esc(&v.device.name));
        o += &format!("devnum={}:{}\n", v.device.major, v.device.minor);
        if let Some(s) = &v.device.serial {
            o += &format!("device_serial={}\n", esc(s));
        }
        o += &format!("fs={}\n", v.fs.name());
        for opt in &v.options {
            o += &format!("option={}\n", esc(opt));
        }
        o += &format!("read_only={}\n", v.read_only);
        if let Some(g) = v.fs_group {
            let p = match g.policy {
                Policy::Always => "always",
                Policy::OnRootMismatch => "on-root-mismatch",
            };
            o += &format!("fs_group={}:{p}\n", g.gid);
        }
        for b in &v.binds {
            o += &format!(
                "bind={}\t{}\t{}\t{}\t{}\n",
                b.read_only,
                rro_name(b.rro),
                b.rro_applied,
                esc(&b.subpath.to_string_lossy()),
                esc(&b.target.to_string_lossy())
            );
        }
        o
    }

    pub(super) fn decode(text: &str, root: &Path) -> Option<Volume> {
        let (mut id, mut source, mut dev, mut name, mut devnum, mut dserial, mut fs) =
            (None, None, None, None, None, None, None);
        let (mut options, mut read_only, mut fs_group, mut binds) =
            (Vec::new(), false, None, Vec::new());
        for line in text.lines() {
            let (k, v) = line.split_once('=')?;
            match k {
                "version" if v != "1" => return None,
                "id" => id = Some(unesc(v)),
                "serial" => source = Some(Source::Serial(unesc(v))),
                "device_path" => source = Some(Source::Path(PathBuf::from(unesc(v)))),
                "device" => dev = Some(PathBuf::from(unesc(v))),
                "name" => name = Some(unesc(v)),
                "devnum" => {
                    let (a, b) = v.split_once(':')?;
                    devnum = Some((a.parse().ok()?, b.parse().ok()?));
                }
                "device_serial" => dserial = Some(unesc(v)),
                "fs" => fs = FsType::parse(v),
                "option" => options.push(unesc(v)),
                "read_only" => read_only = v == "true",
                "fs_group" => {
                    let (g, p) = v.split_once(':')?;
                    let policy = match p {
                        "always" => Policy::Always,
                        "on-root-mismatch" => Policy::OnRootMismatch,
                        _ => return None,
                    };
                    fs_group = Some(FsGroup {
                        gid: g.parse().ok()?,
                        policy,
                    });
                }
                "bind" => {
                    let f: Vec<&str> = v.split('\t').collect();
                    if f.len() != 5 {
                        return None;
                    }
                    binds.push(Bind {
                        read_only: f[0] == "true",
                        rro: rro_parse(f[1])?,
                        rro_applied: f[2] == "true",
                        subpath: PathBuf::from(unesc(f[3])),
                        target: PathBuf::from(unesc(f[4])),
                    });
                }
                _ => {}
            }
        }
        let id: String = id?;
        crate::validate::volume_id(&id).ok()?;
        let (major, minor) = devnum?;
        Some(Volume {
            guest_path: root.join("volumes").join(&id),
            id,
            source: source?,
            device: Device {
                name: name?,
                path: dev?,
                major,
                minor,
                serial: dserial,
            },
            fs: fs?,
            mount: mount::parse_options(&options, read_only).ok()?,
            options,
            read_only,
            fs_group,
            binds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Volume {
        let options = vec!["noatime".into(), "weird%opt\twith\nbreaks".into()];
        Volume {
            id: "vol-1".into(),
            source: Source::Serial("vol-0123".into()),
            device: Device {
                name: "vdb".into(),
                path: "/dev/vdb".into(),
                major: 254,
                minor: 16,
                serial: Some("vol-0123".into()),
            },
            fs: FsType::Xfs,
            mount: mount::parse_options(&options, false).unwrap(),
            options,
            read_only: false,
            fs_group: Some(FsGroup {
                gid: 2000,
                policy: Policy::OnRootMismatch,
            }),
            guest_path: "/r/volumes/vol-1".into(),
            binds: vec![Bind {
                target: "/r/pods/a b".into(),
                subpath: "data/x".into(),
                read_only: true,
                rro: RecursiveReadOnly::IfPossible,
                rro_applied: true,
            }],
        }
    }

    #[test]
    fn state_round_trips() {
        let v = sample();
        let back = state::decode(&state::encode(&v), Path::new("/r")).unwrap();
        assert_eq!(back.info(), v.info());
        assert_eq!(back.options, v.options);
        assert_eq!(back.mount, v.mount);
        assert_eq!(back.fs_group, v.fs_group);
        assert_eq!(back.binds, v.binds);
        assert_eq!(back.device, v.device);
        assert_eq!(back.source, v.source);
    }

    #[test]
    fn state_refuses_garbage() {
        assert!(state::decode("", Path::new("/r")).is_none());
        assert!(state::decode("version=2\nid=a\n", Path::new("/r")).is_none());
        assert!(state::decode("no equals sign", Path::new("/r")).is_none());
        let mut text = state::encode(&sample());
        text = text.replace("id=vol-1", "id=../../etc");
        assert!(
            state::decode(&text, Path::new("/r")).is_none(),
            "an id that escapes the root must be refused"
        );
        let text = state::encode(&sample()).replace("option=noatime", "option=remount");
        assert!(
            state::decode(&text, Path::new("/r")).is_none(),
            "options publishing refuses are refused from a state file too"
        );
    }

    fn table(root: &Path) -> Volumes {
        Volumes::open(root, Sysfs::system(), crate::logging::discard()).unwrap()
    }

    #[test]
    fn after_shutdown_nothing_new_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let v = table(dir.path());
        assert_eq!(v.shutdown(), 0);
        let s = sample();
        let req = PublishRequest {
            volume_id: "late".into(),
            source: s.source.clone(),
            fs: s.fs,
            options: s.options.clone(),
            mount: s.mount.clone(),
            read_only: false,
            fs_group: None,
            timeout: Duration::from_millis(1),
        };
        let e = v.publish(&req, &Cancel::never()).unwrap_err();
        assert!(
            matches!(e, crate::errors::Error::Volume(Error::ShuttingDown)),
            "{e}"
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        let b = BindRequest {
            volume_id: "late".into(),
            subpath: PathBuf::new(),
            target: dir.path().join("t"),
            read_only: false,
            recursive_read_only: RecursiveReadOnly::Disabled,
        };
        assert!(matches!(
            v.bind(&b, &Cancel::never()),
            Err(crate::errors::Error::Volume(Error::ShuttingDown))
        ));
    }

    #[test]
    fn recovery_forgets_what_is_no_longer_there() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        // A record whose mount is gone, a malformed one, and a half-written temp file.
        let gone = state.join("vol-1.vol");
        std::fs::write(&gone, state::encode(&sample())).unwrap();
        std::fs::write(state.join("bad.vol"), "no equals sign").unwrap();
        std::fs::write(state.join("vol-2.tmp"), "half").unwrap();
        let v = table(dir.path());
        assert!(v.list().is_empty());
        assert!(
            !gone.exists(),
            "the record of an unmounted volume is dropped"
        );
        assert!(!state.join("vol-2.tmp").exists());
        assert!(
            state.join("bad.vol").exists(),
            "an unreadable record is left for a human"
        );
    }

    #[test]
    fn an_ro_option_counts_as_read_only() {
        let mut v = sample();
        assert!(!v.mounted_read_only());
        v.options = vec!["noatime,ro".into()];
        v.mount = mount::parse_options(&v.options, false).unwrap();
        assert!(v.mounted_read_only() && v.info().read_only);
        let back = state::decode(&state::encode(&v), Path::new("/r")).unwrap();
        assert!(back.mounted_read_only());
        v.options = vec!["ro".into(), "rw".into()];
        v.mount = mount::parse_options(&v.options, false).unwrap();
        assert!(!v.mounted_read_only(), "a later rw overrides ro");
    }

    #[test]
    fn differences_are_named() {
        let v = sample();
        let mut req = PublishRequest {
            volume_id: "vol-1".into(),
            source: Source::Serial("vol-0123".into()),
            fs: FsType::Xfs,
            options: v.options.clone(),
            mount: v.mount.clone(),
            read_only: false,
            fs_group: v.fs_group,
            timeout: Duration::from_secs(1),
        };
        assert_eq!(v.differs_from(&req), None);
        req.timeout = Duration::from_secs(9);
        assert_eq!(
            v.differs_from(&req),
            None,
            "the wait is not a parameter of the volume"
        );
        req.read_only = true;
        assert!(v.differs_from(&req).unwrap().contains("read_only"));
        req.read_only = false;
        req.fs = FsType::Ext4;
        assert!(v.differs_from(&req).unwrap().contains("fs_type"));
    }
}

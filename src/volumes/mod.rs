//! The volume table: publish, unpublish, stats, expand, bind and unmount as
//! steps over the capability modules, one lock per volume so operations on
//! one volume are serialized while different volumes proceed in parallel.
//!
//! Everything the table acts on is beneath the agent's root and reached from
//! its fds (`crate::beneath`): a volume is mounted on the directory fd of
//! `<root>/volumes/<id>`, binds and unmounts resolve their targets with no
//! symlinks, and mounts are recognised by their mount id and device, never by
//! their spelling. Bind targets are reserved atomically, so two binds never
//! share or nest. The table is mirrored in `<root>/state/` before anything is
//! mounted (`state`), so a restarted agent accounts for every mount it made
//! (`recover`): it takes back what it can and takes down what it cannot.

mod block;
mod recover;
pub(crate) mod state;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustix::fs::OFlags;
use rustix::io::Errno;
use slog::{info, warn, Logger};

use crate::beneath::{self, Leaf, MountPoint, Root};
use crate::cancel::{Cancel, Token, Why};
use crate::device::{self, Device, Sysfs};
use crate::errors::{Code, Result, SysError};
use crate::mount::{self, BindSpec, Expect, MountOptions, RecursiveReadOnly};
use crate::mountinfo::shown;
use crate::ownership::{self, Policy};
use crate::probe::{self, FsType};
use crate::stats::{self, Condition, Measured};
use crate::validate::{self, Invalid};
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
    #[error("device {device} is already published as volume {other}; a disk is published once, under one volume id (as a filesystem or as a block volume, not both)")]
    DeviceInUse {
        /// The device node.
        device: String,
        /// The volume that holds it.
        other: String,
    },
    /// FAILED_PRECONDITION: the device shares sectors with a device published
    /// under another id (a whole disk and one of its partitions, or two
    /// partitions that overlap).
    #[error("device {device} shares sectors with {held} ({how}), which is published as volume {other}; a disk is published once: a whole disk and its partitions, or partitions that overlap, are never published side by side")]
    DeviceOverlaps {
        /// The device node asked for.
        device: String,
        /// The device the other volume holds.
        held: String,
        /// How they overlap, in sectors of the whole disk.
        how: String,
        /// The volume that holds it.
        other: String,
    },
    /// FAILED_PRECONDITION: a device that shares sectors with this one is mounted by someone else.
    #[error("device {device} shares sectors with {other_device} ({how}), which is mounted at {at}; the agent never mounts or publishes a disk whose sectors are in use")]
    DeviceOverlapsMount {
        /// The device node asked for.
        device: String,
        /// The mounted device.
        other_device: String,
        /// How they overlap.
        how: String,
        /// Where it is mounted.
        at: String,
    },
    /// RESOURCE_EXHAUSTED: the state filesystem is full.
    #[error("no space left to write the agent's state record {path}; nothing was changed: free space on the filesystem that holds the agent's state directory, then retry (unpublish needs no space)")]
    StateFull {
        /// The record.
        path: String,
    },
    /// FAILED_PRECONDITION: the state filesystem is read-only.
    #[error("the agent's state record {path} cannot be written: its filesystem is read-only; nothing was changed: make it writable, then retry")]
    StateReadOnly {
        /// The record.
        path: String,
    },
    /// FAILED_PRECONDITION: a mount of the volume's disk is left after unpublish took down its own.
    #[error("volume {id} is still mounted at {at} ({why}); the disk must not be detached yet: unmount it there, then unpublish again")]
    StillMounted {
        /// The volume id.
        id: String,
        /// Where its disk is still mounted.
        at: String,
        /// Why the agent left it.
        why: String,
    },
    /// FAILED_PRECONDITION: a mount of the agent's was moved outside its root.
    #[error("the mount the agent made at {was} was moved behind its back to {now}, outside the agent's root, where the agent acts on nothing; unmount it there, then retry")]
    MovedOutside {
        /// Where the agent made it.
        was: String,
        /// Where it is now.
        now: String,
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
    /// FAILED_PRECONDITION: the guest path is a symlink or not what the
    /// agent makes there (a directory; an empty file for a block volume).
    #[error("{path} is not {what} of the agent's (a symlink or something else was put there); remove it, then publish again")]
    GuestPathUnsafe {
        /// The volume's guest path.
        path: String,
        /// What the agent expected there.
        what: &'static str,
    },
    /// INVALID_ARGUMENT: a bind of a block volume with a subpath or recursive read-only.
    #[error("volume {id} is a block volume: {why}")]
    BlockBindInvalid {
        /// The volume id.
        id: String,
        /// What the request asked that a device cannot do.
        why: &'static str,
    },
    /// FAILED_PRECONDITION: a read-only bind of a read-write block volume.
    #[error("volume {id} is a read-write block volume: a read-only bind of it is impossible, since a device node's mount flags do not stop writes and the device's own read-only flag is shared by every bind of it; publish the volume read-only instead")]
    BlockBindReadOnly {
        /// The volume id.
        id: String,
    },
    /// INVALID_ARGUMENT: the bind target lies inside another bind.
    #[error("bind target {target} lies inside {inner_of}, the bind of volume {volume}; a bind there would be created inside that volume: choose a target outside every bind")]
    TargetNested {
        /// The target asked for.
        target: String,
        /// The bind it lies in.
        inner_of: String,
        /// That bind's volume.
        volume: String,
    },
    /// FAILED_PRECONDITION: the bind target holds other binds below it.
    #[error("bind target {target} holds {inner}, the bind of volume {volume}, beneath it; a bind over it would hide that bind: unmount it first or choose another target")]
    TargetCovers {
        /// The target asked for.
        target: String,
        /// The bind beneath it.
        inner: String,
        /// That bind's volume.
        volume: String,
    },
    /// RESOURCE_EXHAUSTED: the volume has as many binds as the agent keeps.
    #[error("volume {id} already has {max} binds, as many as the agent keeps for one volume; unmount some first")]
    TooManyBinds {
        /// The volume id.
        id: String,
        /// The bound.
        max: usize,
    },
    /// INVALID_ARGUMENT: the bind target's directory is on a volume's filesystem.
    #[error("bind target {target} would be created on the filesystem of volume {volume}; binds go outside the volumes")]
    TargetInVolume {
        /// The target asked for.
        target: String,
        /// The volume whose filesystem holds the target's directory.
        volume: String,
    },
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::NotPublished(_) => Code::NotFound,
            Error::TooManyBinds { .. } => Code::ResourceExhausted,
            Error::Conflict { .. } | Error::TargetTaken { .. } => Code::AlreadyExists,
            Error::TargetNested { .. }
            | Error::TargetInVolume { .. }
            | Error::BlockBindInvalid { .. } => Code::InvalidArgument,
            Error::GuestPathUnsafe { .. }
            | Error::TargetCovers { .. }
            | Error::BlockBindReadOnly { .. } => Code::FailedPrecondition,
            Error::StateFull { .. } => Code::ResourceExhausted,
            Error::DeviceInUse { .. }
            | Error::DeviceOverlaps { .. }
            | Error::DeviceOverlapsMount { .. }
            | Error::StateReadOnly { .. }
            | Error::StillMounted { .. }
            | Error::MovedOutside { .. }
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

/// What a volume is published as (KEP-565's volumeMode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeMode {
    /// The disk's filesystem, mounted on a directory.
    Filesystem(FsType),
    /// The disk itself: its node bound onto an empty file. The agent never
    /// reads or writes its contents.
    Block,
}

impl VolumeMode {
    /// "ext4", "xfs", or "block".
    pub fn name(self) -> &'static str {
        match self {
            VolumeMode::Filesystem(fs) => fs.name(),
            VolumeMode::Block => "block",
        }
    }
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
    /// Filesystem (and which one the disk must hold) or block.
    pub mode: VolumeMode,
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
    /// "ext4" or "xfs"; empty for a block volume.
    pub fs_type: String,
    /// Where it is mounted.
    pub guest_path: String,
    /// Mounted read-only; for a block volume, whether the kernel refuses
    /// writes to the device (BLKROGET) when it was last asked.
    pub read_only: bool,
    /// Its binds.
    pub bind_targets: Vec<String>,
    /// A block volume (volumeMode: Block).
    pub block: bool,
    /// The device's size in bytes when it was last asked (0 if unknown).
    pub device_bytes: u64,
}

/// The answer to an expand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expanded {
    /// The filesystem's size after the call.
    pub capacity_bytes: u64,
    /// The device's size.
    pub device_bytes: u64,
}

/// One bind of a volume, as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Bind {
    /// Absolute and canonical (beneath the canonical root).
    target: PathBuf,
    /// The same, relative to the root: what the agent resolves.
    rel: PathBuf,
    subpath: PathBuf,
    read_only: bool,
    rro: RecursiveReadOnly,
    rro_applied: bool,
    /// The bind's mount id; 0 when a record from an older agent had none.
    mount_id: u64,
}

impl Bind {
    fn expect(&self, dev: &Device) -> Expect {
        if self.mount_id != 0 {
            Expect::Mount(self.mount_id, dev.major, dev.minor)
        } else {
            Expect::Device(dev.major, dev.minor)
        }
    }
}

/// A published volume.
#[derive(Clone, Debug)]
struct Volume {
    id: String,
    source: Source,
    device: Device,
    mode: VolumeMode,
    options: Vec<String>,
    mount: MountOptions,
    read_only: bool,
    fs_group: Option<FsGroup>,
    /// `<canonical root>/volumes/<id>`.
    guest_path: PathBuf,
    /// The mount's id (statx); 0 until it is mounted, or from an older record.
    mount_id: u64,
    /// False while the publish is not finished (mounted, fsGroup walk pending).
    complete: bool,
    /// A block volume whose device the agent set read-only (BLKROSET): it
    /// clears the flag when the volume is unpublished.
    ro_set: bool,
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
            fs_type: match self.mode {
                VolumeMode::Filesystem(fs) => fs.name().to_string(),
                VolumeMode::Block => String::new(),
            },
            guest_path: self.guest_path.display().to_string(),
            read_only: self.mounted_read_only(),
            bind_targets: self
                .binds
                .iter()
                .map(|b| b.target.display().to_string())
                .collect(),
            block: self.mode == VolumeMode::Block,
            device_bytes: 0,
        }
    }

    /// Whether `mp` is a mount of this volume's disk: of its filesystem,
    /// or, for a block volume, a bind of its node.
    fn of_disk(&self, mp: &MountPoint) -> bool {
        let dev = (self.device.major, self.device.minor);
        match self.mode {
            VolumeMode::Filesystem(_) => mp.dev == dev,
            VolumeMode::Block => mp.is_block_node(dev),
        }
    }

    /// Whether `mp` is the mount the agent made at the guest path: a mount
    /// root of the disk, with the recorded mount id where one was kept.
    fn is_own_mount(&self, mp: &MountPoint) -> bool {
        mp.is_root && self.of_disk(mp) && (self.mount_id == 0 || self.mount_id == mp.mount_id)
    }

    /// Whether `mp` is bind `b` of this volume, as the agent made it.
    fn is_own_bind(&self, b: &Bind, mp: &MountPoint) -> bool {
        mp.is_root && self.of_disk(mp) && (b.mount_id == 0 || b.mount_id == mp.mount_id)
    }

    /// Read-only as mounted: `read_only`, or an `ro` among the options.
    fn mounted_read_only(&self) -> bool {
        self.mount.flags & libc::MS_RDONLY != 0
    }

    /// `volumes/<id>`, relative to the root.
    fn rel(&self) -> PathBuf {
        guest_rel(&self.id)
    }

    fn expect(&self) -> Expect {
        if self.mount_id != 0 {
            Expect::Mount(self.mount_id, self.device.major, self.device.minor)
        } else {
            Expect::Device(self.device.major, self.device.minor)
        }
    }

    /// Names the first parameter in which `req` differs from this volume.
    fn differs_from(&self, req: &PublishRequest) -> Option<String> {
        if self.source != req.source {
            return Some(format!("source {:?} vs {:?}", self.source, req.source));
        }
        if self.mode != req.mode {
            return Some(match (self.mode, req.mode) {
                (VolumeMode::Filesystem(a), VolumeMode::Filesystem(b)) => {
                    format!("fs_type {a} vs {b}")
                }
                (a, b) => format!("volume_mode {} vs {}", a.name(), b.name()),
            });
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

/// Binds one volume may have: a pod's containers need a handful; the bound
/// keeps one client from filling the mount table and the state file.
pub const MAX_BINDS: usize = 1024;

/// `volumes/<id>`.
fn guest_rel(id: &str) -> PathBuf {
    Path::new("volumes").join(id)
}

type Slot = Arc<Mutex<Option<Volume>>>;

/// The agent's volumes.
pub struct Volumes {
    root: Root,
    store: state::Store,
    sysfs: Sysfs,
    log: Logger,
    /// One slot per volume id; its lock serializes operations on the volume.
    slots: Mutex<HashMap<String, Slot>>,
    /// Which volume holds each device (major, minor), and the sectors it
    /// covers on its disk, including publishes in flight.
    devices: Mutex<HashMap<(u32, u32), Claim>>,
    /// Bind targets (relative to the root), reserved or bound, and their volume.
    targets: Mutex<BTreeMap<PathBuf, String>>,
    /// What ListVolumes answers, updated when an operation ends, so a list
    /// never waits behind a long walk.
    snapshot: Mutex<BTreeMap<String, (VolumeInfo, Device)>>,
    shutting_down: AtomicBool,
    /// Fired by Shutdown: stops every wait and walk in flight.
    stop: Token,
    /// MAX_BINDS (smaller in tests).
    max_binds: usize,
}

/// A poisoned lock still guards consistent data here (every update is a
/// single insert/remove), so it is taken over rather than propagated.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Locks a volume's slot, giving up when `cancel` fires (the caller left,
/// its deadline passed, or the agent is shutting down).
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

/// What an openat2 failure on a path the agent resolves means.
fn unsafe_or_sys(e: Errno, call: &'static str, path: &Path) -> crate::errors::Error {
    match e {
        Errno::LOOP | Errno::XDEV | Errno::NOTDIR => mount::Error::Unsafe {
            path: path.display().to_string(),
        }
        .into(),
        _ => SysError::new(call, path.display(), e).into(),
    }
}

impl Volumes {
    /// Opens the table at `root` (created if missing; canonicalized, so a
    /// root given through a symlink is the same root) and takes back the
    /// volumes of a previous run.
    pub fn open(root: &Path, sysfs: Sysfs, log: Logger) -> Result<Volumes> {
        let root = Root::open(root)?;
        root.own_dir("volumes", 0o750)?;
        let store = state::Store::open(&root)?;
        let v = Volumes {
            root,
            store,
            sysfs,
            log,
            slots: Mutex::new(HashMap::new()),
            devices: Mutex::new(HashMap::new()),
            targets: Mutex::new(BTreeMap::new()),
            snapshot: Mutex::new(BTreeMap::new()),
            shutting_down: AtomicBool::new(false),
            stop: Token::new(Why::Shutdown),
            max_binds: MAX_BINDS,
        };
        v.recover()?;
        Ok(v)
    }

    /// Why the last write to the state directory failed, while it keeps
    /// failing (GetAgentInfo's `state_problem`); None when the state is writable.
    pub fn state_problem(&self) -> Option<String> {
        self.store.problem()
    }

    /// The agent's root, canonical.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Validates a bind or unmount target (validate.rs's rules) given under
    /// either spelling of the root, and returns its canonical spelling.
    pub fn target(&self, s: &str) -> std::result::Result<PathBuf, Invalid> {
        match validate::target(self.root.path(), s) {
            Ok(p) => Ok(p),
            Err(e) if self.root.given() == self.root.path() => Err(e),
            Err(e) => {
                let p = validate::target(self.root.given(), s).map_err(|_| e)?;
                let rel = p.strip_prefix(self.root.given()).unwrap_or(&p);
                Ok(self.root.join(rel))
            }
        }
    }

    /// `target` (canonical, validated) relative to the root.
    fn rel_of<'a>(&self, target: &'a Path) -> Result<&'a Path> {
        self.root.relative(target).ok_or_else(|| {
            validate::Invalid(format!(
                "target {} is not beneath the agent's root {}",
                target.display(),
                self.root.path().display()
            ))
            .into()
        })
    }

    fn slot(&self, id: &str) -> Slot {
        lock(&self.slots).entry(id.to_string()).or_default().clone()
    }

    fn existing_slot(&self, id: &str) -> Option<Slot> {
        lock(&self.slots).get(id).cloned()
    }

    /// Drops an empty slot nobody else holds.
    fn forget_slot(&self, id: &str) {
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get(id) {
            if Arc::strong_count(s) == 1 && matches!(s.try_lock().as_deref(), Ok(None)) {
                slots.remove(id);
            }
        }
    }

    fn publish_snapshot(&self, vol: &Volume) {
        lock(&self.snapshot).insert(vol.id.clone(), (vol.info(), vol.device.clone()));
    }

    fn stop_with(&self, cancel: &Cancel) -> Cancel {
        cancel.clone().with_token(&self.stop)
    }

    /// An fd of the volume's mount root, checked to be the very mount the
    /// agent made (resolved beneath the root with no symlinks; its mount id,
    /// or its device where no id was recorded).
    fn open_mount(&self, vol: &Volume) -> Result<OwnedFd> {
        let gone = || -> crate::errors::Error {
            Error::MountGone {
                id: vol.id.clone(),
                path: vol.guest_path.display().to_string(),
            }
            .into()
        };
        let fd = match beneath::open_with(
            self.root.fd(),
            &vol.rel(),
            OFlags::PATH | block::guest_path_kind(vol.mode),
            beneath::strict(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT | Errno::LOOP | Errno::XDEV | Errno::NOTDIR) => return Err(gone()),
            Err(e) => return Err(SysError::new("openat2", vol.guest_path.display(), e).into()),
        };
        let mp = beneath::mount_point(fd.as_fd())
            .map_err(|e| SysError::new("statx", vol.guest_path.display(), e))?;
        if vol.is_own_mount(&mp) {
            Ok(fd)
        } else {
            Err(gone())
        }
    }

    /// Publishes a volume (semantics.md §1): idempotent for the same
    /// request, refused for another.
    pub fn publish(&self, req: &PublishRequest, cancel: &Cancel) -> Result<Published> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown.into());
        }
        let cancel = &self.stop_with(cancel);
        let result = {
            let slot = self.slot(&req.volume_id);
            let locked = lock_slot(&slot, &req.volume_id, cancel);
            locked.and_then(|mut guard| {
                // Checked again now that the slot exists: a Shutdown that
                // listed the slots before this one was made set the flag
                // first, so no publish can slip past it.
                if self.shutting_down.load(Ordering::SeqCst) {
                    return Err(Error::ShuttingDown.into());
                }
                self.publish_locked(&mut guard, req, cancel)
            })
        };
        if result.is_err() {
            // A publish that failed leaves no trace, not even an empty slot.
            self.forget_slot(&req.volume_id);
        }
        result
    }

    fn publish_locked(
        &self,
        guard: &mut Option<Volume>,
        req: &PublishRequest,
        cancel: &Cancel,
    ) -> Result<Published> {
        if let Some(vol) = guard.as_mut() {
            if let Some(differs) = vol.differs_from(req) {
                return Err(Error::Conflict {
                    id: req.volume_id.clone(),
                    differs,
                }
                .into());
            }
            // An idempotent answer is only given while it is still true.
            let fd = self.open_mount(vol)?;
            let already = vol.complete;
            let ownership = if vol.complete {
                None
            } else {
                // Taken back from a run that stopped before the fsGroup walk ended: finish it.
                let report = self.walk(vol, &fd, cancel)?;
                // Complete in memory only once the record says so.
                let mut done = vol.clone();
                done.complete = true;
                self.store.save(&done)?;
                vol.complete = true;
                self.publish_snapshot(vol);
                report
            };
            return Ok(Published {
                guest_path: vol.guest_path.clone(),
                device: vol.device.path.clone(),
                already_published: already,
                ownership,
            });
        }
        let (vol, report) = self.publish_new(req, cancel)?;
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

    /// The fsGroup walk of a freshly mounted volume (if asked for and writable).
    fn walk(
        &self,
        vol: &Volume,
        fd: &OwnedFd,
        cancel: &Cancel,
    ) -> Result<Option<ownership::Report>> {
        let Some(g) = vol.fs_group else {
            return Ok(None);
        };
        if vol.mounted_read_only() {
            return Ok(Some(ownership::Report {
                skipped: true,
                ..Default::default()
            }));
        }
        let progress = |p: &ownership::Report| {
            info!(self.log, "fsGroup walk in progress"; "volume" => &vol.id,
                  "visited" => p.visited, "changed" => p.changed, "errors" => p.errors,
                  "elapsed_ms" => u64::try_from(p.duration.as_millis()).unwrap_or(u64::MAX));
        };
        // The walk starts from the mount's own fd, not its name.
        let r = ownership::apply_with_progress(
            &beneath::proc_path(fd.as_fd()),
            &vol.guest_path,
            g.gid,
            g.policy,
            false,
            Duration::from_secs(10),
            &progress,
            cancel,
        )?;
        info!(self.log, "fsGroup applied"; "volume" => &vol.id, "gid" => g.gid,
              "skipped" => r.skipped, "visited" => r.visited, "changed" => r.changed,
              "errors" => r.errors,
              "duration_us" => u64::try_from(r.duration.as_micros()).unwrap_or(u64::MAX));
        Ok(Some(r))
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
        // Claimed for the whole publish: a concurrent publish of the same disk is refused.
        let claim = self.claim_device(&device, &req.volume_id)?;
        let rel = guest_rel(&req.volume_id);
        let guest_path = self.root.join(&rel);
        self.check_not_mounted(&device, &claim.extent)?;
        let fs = match req.mode {
            VolumeMode::Filesystem(fs) => fs,
            VolumeMode::Block => {
                let vol = self.publish_block(req, device)?;
                claim.keep();
                return Ok((vol, None));
            }
        };
        let mut created = Vec::new();
        let dir =
            match beneath::make_path(self.root.fd(), &rel, 0o750, Leaf::Dir(0o750), &mut created) {
                Ok(fd) => fd,
                Err(Errno::LOOP | Errno::XDEV | Errno::NOTDIR) => {
                    return Err(Error::GuestPathUnsafe {
                        path: guest_path.display().to_string(),
                        what: "a plain directory",
                    }
                    .into())
                }
                Err(e) => return Err(SysError::new("mkdir", guest_path.display(), e).into()),
            };
        let undo_dir = |created: &mut Vec<beneath::Created>| beneath::remove_created(created);
        let here = beneath::mount_point(dir.as_fd())
            .map_err(|e| SysError::new("statx", guest_path.display(), e))?;
        if here.is_root {
            return Err(Error::GuestPathBusy {
                path: guest_path.display().to_string(),
            }
            .into());
        }
        if let Err(e) = probe::check(&device.path, fs) {
            undo_dir(&mut created);
            return Err(e.into());
        }
        let mut vol = Volume {
            id: req.volume_id.clone(),
            source: req.source.clone(),
            device: device.clone(),
            mode: req.mode,
            options: req.options.clone(),
            mount: req.mount.clone(),
            read_only: req.read_only,
            fs_group: req.fs_group,
            guest_path: guest_path.clone(),
            mount_id: 0,
            complete: false,
            ro_set: false,
            binds: Vec::new(),
        };
        // Recorded before anything is mounted: a crash from here on leaves a
        // record that recovery adopts or clears, never an unknown mount.
        if let Err(e) = self.store.save(&vol) {
            undo_dir(&mut created);
            return Err(e);
        }
        if let Err(e) = mount::mount_filesystem(
            &device.path,
            dir.as_fd(),
            &guest_path,
            fs.name(),
            &req.mount,
        ) {
            self.drop_record(&vol.id, &mut created);
            return Err(e.into());
        }
        drop(dir);
        // What is mounted at the guest path now must be the device just mounted.
        let fd = match beneath::open_with(
            self.root.fd(),
            &rel,
            OFlags::PATH | OFlags::DIRECTORY,
            beneath::strict(),
        ) {
            Ok(fd) => fd,
            Err(e) => {
                warn!(self.log, "the guest path changed during publish; recovery at the next start takes the mount down";
                      "volume" => &vol.id, "error" => %e);
                return Err(unsafe_or_sys(e, "openat2", &guest_path));
            }
        };
        let mp = beneath::mount_point(fd.as_fd())
            .map_err(|e| SysError::new("statx", guest_path.display(), e))?;
        if !mp.is_root || mp.dev != (device.major, device.minor) {
            warn!(self.log, "the guest path changed during publish; recovery at the next start takes the mount down";
                  "volume" => &vol.id);
            return Err(mount::Error::Moved {
                path: guest_path.display().to_string(),
            }
            .into());
        }
        vol.mount_id = mp.mount_id;
        vol.complete = vol.fs_group.is_none() || vol.mounted_read_only();
        let undo = |e: crate::errors::Error, created: &mut Vec<beneath::Created>| {
            match mount::unmount_tree(
                self.root.fd(),
                self.root.path(),
                &rel,
                Expect::Mount(mp.mount_id, device.major, device.minor),
            ) {
                Ok(_) => self.drop_record(&req.volume_id, created),
                Err(u) => {
                    warn!(self.log, "could not undo a failed publish"; "volume" => &req.volume_id, "error" => %u)
                }
            }
            e
        };
        if let Err(e) = self.store.save(&vol) {
            drop(fd);
            return Err(undo(e, &mut created));
        }
        let walked = self.walk(&vol, &fd, cancel);
        // Nothing of the agent's may hold the mount when it is taken down
        // (an fd on it, even O_PATH, makes umount fail with EBUSY).
        drop(fd);
        let report = match walked {
            Ok(r) => r,
            Err(e) => return Err(undo(e, &mut created)),
        };
        if !vol.complete {
            vol.complete = true;
            if let Err(e) = self.store.save(&vol) {
                return Err(undo(e, &mut created));
            }
        }
        claim.keep();
        Ok((vol, report))
    }

    /// Undoes the first steps of a failed publish: its record, then the
    /// nodes it created.
    fn drop_record(&self, id: &str, created: &mut Vec<beneath::Created>) {
        if let Err(e) = self.store.remove(id) {
            warn!(self.log, "could not remove the record of a failed publish"; "volume" => id, "error" => %e);
        }
        beneath::remove_created(created);
    }

    /// Claims `device` for volume `id` for as long as the publish runs (and
    /// after, if it is kept): refused when another volume holds the same
    /// device or one that shares a sector with it (semantics.md §9).
    fn claim_device(&self, device: &Device, id: &str) -> Result<DeviceClaim<'_>> {
        let key = (device.major, device.minor);
        // Read before the lock is taken: sysfs is slow next to a map.
        let extent = self.sysfs.extent(key);
        let mut devices = lock(&self.devices);
        for (held, c) in devices.iter() {
            if c.id == id {
                continue;
            }
            if *held == key {
                return Err(Error::DeviceInUse {
                    device: shown(&device.path),
                    other: c.id.clone(),
                }
                .into());
            }
            if c.extent.overlaps(&extent) {
                return Err(Error::DeviceOverlaps {
                    device: shown(&device.path),
                    held: c.device.clone(),
                    how: extent.describe(&c.extent),
                    other: c.id.clone(),
                }
                .into());
            }
        }
        devices.insert(
            key,
            Claim {
                id: id.to_string(),
                device: shown(&device.path),
                extent,
            },
        );
        Ok(DeviceClaim {
            table: self,
            key,
            extent,
            kept: false,
        })
    }

    /// Refuses a device whose filesystem is mounted already, or one that
    /// shares sectors with a mounted device (a partition of it, the disk it
    /// is a partition of, an overlapping partition): mounted by someone
    /// else, since the agent's own volumes are refused by their claims.
    fn check_not_mounted(&self, device: &Device, extent: &device::Extent) -> Result<()> {
        let key = (device.major, device.minor);
        let mut extents: HashMap<(u32, u32), device::Extent> = HashMap::new();
        for m in mountinfo::read()? {
            let dev = (m.major, m.minor);
            if dev == key {
                return Err(Error::DeviceMounted {
                    device: shown(&device.path),
                    at: shown(&m.mount_point),
                }
                .into());
            }
            // Major 0: no block device behind it (tmpfs, proc, overlay…).
            if dev.0 == 0 {
                continue;
            }
            let other = *extents.entry(dev).or_insert_with(|| self.sysfs.extent(dev));
            if other.overlaps(extent) {
                return Err(Error::DeviceOverlapsMount {
                    device: shown(&device.path),
                    other_device: format!("{} ({}:{})", m.source, dev.0, dev.1),
                    how: extent.describe(&other),
                    at: shown(&m.mount_point),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Reserves `rel` as a bind target of volume `id`: refused when it is
    /// another bind's target, lies inside one, or holds one beneath it.
    fn reserve(&self, rel: &Path, target: &Path, id: &str) -> Result<Reservation<'_>> {
        let mut targets = lock(&self.targets);
        for (t, owner) in targets.iter() {
            let shown = || self.root.join(t).display().to_string();
            if t == rel {
                return Err(Error::TargetTaken {
                    target: target.display().to_string(),
                    what: format!("a bind of volume {owner}"),
                }
                .into());
            }
            if rel.starts_with(t) {
                return Err(Error::TargetNested {
                    target: target.display().to_string(),
                    inner_of: shown(),
                    volume: owner.clone(),
                }
                .into());
            }
            if t.starts_with(rel) {
                return Err(Error::TargetCovers {
                    target: target.display().to_string(),
                    inner: shown(),
                    volume: owner.clone(),
                }
                .into());
            }
        }
        targets.insert(rel.to_path_buf(), id.to_string());
        Ok(Reservation {
            table: self,
            rel: rel.to_path_buf(),
            kept: false,
        })
    }

    /// Unpublishes a volume: its binds, then its mount (flushed first), its
    /// directory and its record. False when it was not published.
    pub fn unpublish(&self, id: &str, cancel: &Cancel) -> Result<bool> {
        let Some(slot) = self.existing_slot(id) else {
            return Ok(false);
        };
        let result = {
            let locked = lock_slot(&slot, id, cancel);
            locked.and_then(|mut guard| self.unpublish_locked(&mut guard))
        };
        drop(slot);
        if result.is_ok() {
            self.forget_slot(id);
        }
        result
    }

    fn unpublish_locked(&self, guard: &mut Option<Volume>) -> Result<bool> {
        let Some(vol) = guard.as_mut() else {
            return Ok(false);
        };
        // Nothing is written on the way: an unpublish needs no space in the
        // state directory. A record that still lists binds taken down (if
        // this stops half-way) lists only what recovery drops; the table in
        // memory follows every unmount, so ListVolumes stays true.
        while let Some(b) = vol.binds.last().cloned() {
            self.take_down(&b.rel, b.expect(&vol.device))?;
            vol.binds.pop();
            lock(&self.targets).remove(&b.rel);
            self.publish_snapshot(vol);
        }
        match vol.mode {
            // Flushed while it is certainly the volume's own mount.
            VolumeMode::Filesystem(_) => {
                if let Ok(fd) = self.open_mount(vol) {
                    mount::sync_filesystem(fd.as_fd(), &vol.guest_path)?;
                }
                self.take_down(&vol.rel(), vol.expect())?;
            }
            VolumeMode::Block => self.unpublish_block(vol)?,
        }
        // Never OK while the disk is still mounted beneath the root.
        self.take_down_leftovers(vol)?;
        // Unlinking needs no space; where even that fails (a read-only or
        // failing state filesystem), every mount is down all the same, and
        // the record names a volume whose mount is gone, which recovery drops.
        if let Err(e) = self.store.remove(&vol.id) {
            warn!(self.log, "could not remove the record of an unpublished volume; the next start drops it";
                  "volume" => &vol.id, "error" => %e);
        }
        lock(&self.devices).remove(&(vol.device.major, vol.device.minor));
        lock(&self.snapshot).remove(&vol.id);
        *guard = None;
        Ok(true)
    }

    /// Takes down every mount of `vol`'s disk still beneath the root once
    /// the agent's own are down: its filesystem, or a bind of its node (a
    /// devtmpfs mount of the node's name, checked by its device number
    /// before it comes off). They are binds moved or copied behind the
    /// agent's back, which recovery would take down too; leaving one would
    /// let the host detach a disk that is still mounted. One that cannot be
    /// taken down is an error naming it.
    fn take_down_leftovers(&self, vol: &Volume) -> Result<()> {
        let (root_fd, root) = (self.root.fd(), self.root.path());
        let disk = (vol.device.major, vol.device.minor);
        let node = Path::new("/").join(&vol.device.name);
        let of_disk = |m: &mountinfo::MountEntry| match vol.mode {
            VolumeMode::Filesystem(_) => (m.major, m.minor) == disk,
            VolumeMode::Block => m.fs_type == "devtmpfs" && m.root == node,
        };
        let beneath_root = |m: &mountinfo::MountEntry| {
            m.mount_point
                .strip_prefix(root)
                .ok()
                .filter(|r| !r.as_os_str().is_empty())
                .map(Path::to_path_buf)
        };
        let mut left: Vec<(PathBuf, u64)> = mountinfo::read()?
            .iter()
            .filter(|m| of_disk(m))
            .filter_map(|m| beneath_root(m).map(|r| (r, u64::from(m.mount_id))))
            .collect();
        left.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (rel, id) in &left {
            let expect = Expect::Mount(*id, disk.0, disk.1);
            match mount::unmount_tree(root_fd, root, rel, expect) {
                Ok(true) => {
                    warn!(self.log, "a mount of the volume's disk was left beneath the root (moved or copied behind the agent's back); taken down";
                          "volume" => &vol.id, "path" => shown(&root.join(rel)));
                }
                Ok(false) => {}
                Err(e) => {
                    return Err(Error::StillMounted {
                        id: vol.id.clone(),
                        at: shown(&root.join(rel)),
                        why: e.to_string(),
                    }
                    .into())
                }
            }
        }
        if let Some(m) = mountinfo::read()?
            .iter()
            .find(|m| of_disk(m) && beneath_root(m).is_some())
        {
            return Err(Error::StillMounted {
                id: vol.id.clone(),
                at: shown(&m.mount_point),
                why: "it came back or could not be reached beneath the root".into(),
            }
            .into());
        }
        Ok(())
    }

    /// Takes down the agent's mount `expect` made at `rel` and removes the
    /// node it was made on. A mount moved away from `rel` behind the agent's
    /// back (its parent renamed, say, whether or not something now sits at
    /// `rel`, under any name, UTF-8 or not) is still the agent's own: it is
    /// found by its id and taken down where it is now, if that is beneath the
    /// root; moved outside the root, it is an error naming where it is.
    fn take_down(&self, rel: &Path, expect: Expect) -> Result<bool> {
        let (root_fd, root) = (self.root.fd(), self.root.path());
        match mount::unmount_tree(root_fd, root, rel, expect) {
            Ok(was) => {
                if was {
                    mount::remove_node(root_fd, rel);
                }
                Ok(was)
            }
            Err(e @ (mount::Error::Moved { .. } | mount::Error::Unsafe { .. })) => {
                if !matches!(expect, Expect::Mount(..)) {
                    return Err(e.into());
                }
                let table = mountinfo::read()?;
                let Some(now) = mount::listed(&table, expect) else {
                    return Ok(false);
                };
                match now.mount_point.strip_prefix(root) {
                    Ok(moved) if moved != rel && !moved.as_os_str().is_empty() => {
                        warn!(self.log, "mount moved behind the agent's back; taken down where it is now";
                              "was" => shown(&root.join(rel)), "now" => shown(&now.mount_point));
                        Ok(mount::unmount_tree(root_fd, root, moved, expect)?)
                    }
                    Ok(_) => Err(e.into()),
                    Err(_) => Err(Error::MovedOutside {
                        was: shown(&root.join(rel)),
                        now: shown(&now.mount_point),
                    }
                    .into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Runs `f` on a published volume under its lock.
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

    /// Usage and condition of a volume (semantics.md §5).
    pub fn stats(&self, id: &str, cancel: &Cancel) -> Result<(Option<Measured>, Condition)> {
        self.with_volume(id, cancel, |vol| {
            let rel = vol.rel();
            let fs = match vol.mode {
                VolumeMode::Filesystem(fs) => fs,
                VolumeMode::Block => return Ok(self.stats_block(vol)),
            };
            let (usage, condition) = stats::check(
                &self.sysfs,
                &stats::Expected {
                    path: &vol.guest_path,
                    base: self.root.fd(),
                    rel: &rel,
                    mount_id: (vol.mount_id != 0).then_some(vol.mount_id),
                    device: &vol.device,
                    read_only: vol.mounted_read_only(),
                    fs,
                },
            );
            Ok((usage.map(Measured::Filesystem), condition))
        })
    }

    /// Grows a volume's filesystem to its device (semantics.md §4).
    pub fn expand(
        &self,
        id: &str,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Expanded> {
        let cancel = &self.stop_with(cancel);
        self.with_volume(id, cancel, |vol| {
            let fs = match vol.mode {
                VolumeMode::Filesystem(fs) => fs,
                VolumeMode::Block => return self.expand_block(vol, required_bytes, timeout, cancel),
            };
            if vol.mounted_read_only() {
                return Err(Error::ReadOnly(id.to_string()).into());
            }
            let fd = self.open_mount(vol)?;
            let current = grow::fs_size_bytes(fd.as_fd(), &vol.guest_path, &vol.device, fs)?;
            if required_bytes > 0 && required_bytes <= current {
                let device_bytes = device::size_bytes(&vol.device.path)?;
                grow::fits(&vol.guest_path, fs, &vol.device, current, device_bytes)?;
                return Ok(Expanded {
                    capacity_bytes: current,
                    device_bytes,
                });
            }
            let device_bytes =
                device::wait_for_size(&self.sysfs, &vol.device, required_bytes, timeout, cancel)?;
            let capacity_bytes =
                grow::grow(fd.as_fd(), &vol.guest_path, &vol.device, fs, device_bytes)?;
            info!(self.log, "filesystem grown"; "volume" => id, "from" => current, "to" => capacity_bytes,
                  "device_bytes" => device_bytes);
            Ok(Expanded {
                capacity_bytes,
                device_bytes,
            })
        })
    }

    /// Whether bind `b` of `vol` is still mounted, as the agent made it.
    fn bind_is_live(&self, vol: &Volume, b: &Bind) -> bool {
        let Ok((parent, name)) = beneath::open_parent(self.root.fd(), &b.rel) else {
            return false;
        };
        beneath::mount_point_at(parent.as_fd(), &name).is_ok_and(|mp| vol.is_own_bind(b, &mp))
    }

    /// Refuses a target whose nearest existing node is already a mount, or
    /// lies on a volume's filesystem (a bind there would write into it).
    fn check_target(&self, rel: &Path, target: &Path) -> Result<()> {
        let mut at = Some(rel);
        while let Some(p) = at {
            let found = if p.as_os_str().is_empty() {
                Ok(rustix::io::fcntl_dupfd_cloexec(self.root.fd(), 0)
                    .map_err(|e| SysError::new("dup", self.root.path().display(), e))?)
            } else {
                beneath::open_path(self.root.fd(), p)
            };
            match found {
                Ok(fd) => {
                    let mp = beneath::mount_point(fd.as_fd())
                        .map_err(|e| SysError::new("statx", self.root.join(p).display(), e))?;
                    if p == rel && mp.is_root {
                        let table = mountinfo::read()?;
                        let what = mountinfo::by_id(&table, mp.mount_id)
                            .map(|m| format!("a mount of {} ({})", m.source, m.fs_type))
                            .unwrap_or_else(|| "a mount point".to_string());
                        return Err(Error::TargetTaken {
                            target: target.display().to_string(),
                            what,
                        }
                        .into());
                    }
                    if let Some(claim) = lock(&self.devices).get(&mp.dev) {
                        return Err(Error::TargetInVolume {
                            target: target.display().to_string(),
                            volume: claim.id.clone(),
                        }
                        .into());
                    }
                    return Ok(());
                }
                Err(Errno::NOENT) => at = p.parent(),
                Err(e) => return Err(unsafe_or_sys(e, "openat2", &self.root.join(p))),
            }
        }
        Ok(())
    }

    /// Binds a volume (or a subpath) at a target beneath the root
    /// (semantics.md §6). A repeat of a live bind answers `already_mounted`.
    pub fn bind(&self, req: &BindRequest, cancel: &Cancel) -> Result<BindOutcome> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown.into());
        }
        let cancel = &self.stop_with(cancel);
        let rel = self.rel_of(&req.target)?.to_path_buf();
        self.with_volume(&req.volume_id, cancel, |vol| {
            if vol.mode == VolumeMode::Block {
                block::check_bind(vol, req)?;
            }
            if let Some(i) = vol.binds.iter().position(|b| b.rel == rel) {
                let b = &vol.binds[i];
                if b.subpath != req.subpath
                    || b.read_only != req.read_only
                    || b.rro != req.recursive_read_only
                {
                    return Err(Error::TargetTaken {
                        target: req.target.display().to_string(),
                        what: format!("a bind of volume {} with other parameters", vol.id),
                    }
                    .into());
                }
                if self.bind_is_live(vol, b) {
                    return Ok(BindOutcome {
                        recursive_read_only_applied: b.rro_applied,
                        already_mounted: true,
                    });
                }
                // Unmounted behind the agent's back: forget it and bind again.
                // The record is rewritten with the new bind below; if that
                // bind fails, a record still listing the old one lists a
                // bind that is gone, which the next start drops.
                warn!(self.log, "bind was gone; binding again"; "volume" => &vol.id, "target" => shown(&req.target));
                vol.binds.remove(i);
                lock(&self.targets).remove(&rel);
                self.publish_snapshot(vol);
            }
            if vol.binds.len() >= self.max_binds {
                return Err(Error::TooManyBinds {
                    id: vol.id.clone(),
                    max: self.max_binds,
                }
                .into());
            }
            let reservation = self.reserve(&rel, &req.target, &vol.id)?;
            self.check_target(&rel, &req.target)?;
            let source = self.open_mount(vol)?;
            let out = mount::bind(&BindSpec {
                source_root: source.as_fd(),
                source_path: &vol.guest_path,
                subpath: &req.subpath,
                target_base: self.root.fd(),
                target_rel: &rel,
                target_path: &req.target,
                read_only: req.read_only,
                recursive_read_only: req.recursive_read_only,
            })?;
            vol.binds.push(Bind {
                target: self.root.join(&rel),
                rel: rel.clone(),
                subpath: req.subpath.clone(),
                read_only: req.read_only,
                rro: req.recursive_read_only,
                rro_applied: out.recursive_read_only_applied,
                mount_id: out.mount_id,
            });
            if let Err(e) = self.store.save(vol) {
                vol.binds.pop();
                let mut created = out.created;
                match mount::unmount_tree(
                    self.root.fd(),
                    self.root.path(),
                    &rel,
                    Expect::Mount(out.mount_id, vol.device.major, vol.device.minor),
                ) {
                    Ok(_) => beneath::remove_created(&mut created),
                    Err(u) => {
                        warn!(self.log, "could not undo a bind whose record failed"; "target" => %req.target.display(), "error" => %u)
                    }
                }
                return Err(e);
            }
            reservation.keep();
            self.publish_snapshot(vol);
            Ok(BindOutcome {
                recursive_read_only_applied: out.recursive_read_only_applied,
                already_mounted: false,
            })
        })
    }

    /// Takes down a bind the agent made at `target` (canonical, validated).
    /// False when nothing is mounted there; a mount the agent did not make is
    /// refused and left alone.
    pub fn unmount(&self, target: &Path, cancel: &Cancel) -> Result<bool> {
        let rel = self.rel_of(target)?.to_path_buf();
        let owner = lock(&self.targets).get(&rel).cloned();
        if let Some(id) = owner {
            let r = self.with_volume(&id, cancel, |vol| {
                let Some(i) = vol.binds.iter().position(|b| b.rel == rel) else {
                    return Ok(None);
                };
                let b = vol.binds[i].clone();
                let was = self.take_down(&rel, b.expect(&vol.device))?;
                vol.binds.remove(i);
                lock(&self.targets).remove(&rel);
                self.publish_snapshot(vol);
                // The bind is down, as asked, and the table says so. A record
                // that cannot be rewritten now (a full state filesystem) still
                // lists it: a bind that is gone, which the next write of this
                // record or the next start drops.
                if let Err(e) = self.store.save(vol) {
                    warn!(self.log, "bind taken down, but its volume's record could not be rewritten; it is dropped from the record later";
                          "volume" => &vol.id, "target" => shown(target), "error" => %e);
                }
                Ok(Some(was))
            });
            match r {
                Ok(Some(was)) => return Ok(was),
                Ok(None) => {}
                Err(crate::errors::Error::Volume(Error::NotPublished(_))) => {}
                Err(e) => return Err(e),
            }
        }
        // Not a bind of the agent's: say whether something is there, touch nothing.
        let (parent, name) = match beneath::open_parent(self.root.fd(), &rel) {
            Ok(p) => p,
            Err(Errno::NOENT | Errno::NOTDIR) => return Ok(false),
            Err(e) => return Err(unsafe_or_sys(e, "openat2", target)),
        };
        match beneath::mount_point_at(parent.as_fd(), &name) {
            Ok(mp) if mp.is_root => {
                let table = mountinfo::read()?;
                let what = mountinfo::by_id(&table, mp.mount_id)
                    .map(|m| format!("{} ({})", m.source, m.fs_type))
                    .unwrap_or_else(|| format!("mount {}", mp.mount_id));
                Err(mount::Error::NotOurs {
                    path: target.display().to_string(),
                    what,
                }
                .into())
            }
            Ok(_) | Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(SysError::new("statx", target.display(), e).into()),
        }
    }

    /// Every published volume, without waiting for operations in flight.
    /// The device's size, and a block volume's read-only flag, are the
    /// kernel's now.
    pub fn list(&self) -> Vec<VolumeInfo> {
        let mut list: Vec<(VolumeInfo, Device)> = lock(&self.snapshot).values().cloned().collect();
        for (info, dev) in &mut list {
            block::refresh(info, dev);
        }
        list.into_iter().map(|(info, _)| info).collect()
    }

    /// Stops work in flight, refuses new volumes and binds, and unpublishes
    /// every volume. Returns how many were unpublished.
    pub fn shutdown(&self) -> u32 {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.stop.fire();
        let mut ids: Vec<String> = lock(&self.slots).keys().cloned().collect();
        let mut n = 0;
        while let Some(id) = ids.pop() {
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
}

/// A device a volume holds (or a publish in flight): what ListVolumes' "one
/// disk, one volume" is checked against.
#[derive(Clone, Debug)]
struct Claim {
    /// The volume.
    id: String,
    /// Its device node, for messages.
    device: String,
    /// The sectors it covers on its whole disk.
    extent: device::Extent,
}

/// A device held by a publish in flight; released unless kept.
struct DeviceClaim<'a> {
    table: &'a Volumes,
    key: (u32, u32),
    /// The sectors claimed.
    extent: device::Extent,
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

/// A bind target held by a bind in flight; released unless kept.
struct Reservation<'a> {
    table: &'a Volumes,
    rel: PathBuf,
    kept: bool,
}

impl Reservation<'_> {
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.kept {
            lock(&self.table.targets).remove(&self.rel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use state::tests::sample;

    fn table(root: &Path) -> Volumes {
        Volumes::open(root, Sysfs::system(), crate::logging::discard()).unwrap()
    }

    fn publish_loop(v: &Volumes, id: &str, disk: &crate::testutil::LoopDisk) {
        let options: Vec<String> = Vec::new();
        let req = PublishRequest {
            volume_id: id.into(),
            source: Source::Path(disk.device.clone()),
            mode: VolumeMode::Filesystem(FsType::Ext4),
            mount: mount::parse_options(&options, false).unwrap(),
            options,
            read_only: false,
            fs_group: None,
            timeout: Duration::from_secs(1),
        };
        v.publish(&req, &Cancel::never()).unwrap();
    }

    #[test]
    fn a_bind_whose_record_cannot_be_written_leaves_nothing() {
        if !crate::testutil::root_or_skip("a_bind_whose_record_cannot_be_written_leaves_nothing") {
            return;
        }
        let disk = crate::testutil::LoopDisk::new(32, Some("ext4"));
        let dir = tempfile::tempdir().unwrap();
        let v = table(dir.path());
        publish_loop(&v, "rec", &disk);
        // A directory where the record's temp file goes: the next save fails.
        let tmp = v.root().join("state/rec.tmp");
        std::fs::create_dir(&tmp).unwrap();
        let target = v.root().join("pods/p/data");
        let req = BindRequest {
            volume_id: "rec".into(),
            subpath: PathBuf::new(),
            target: target.clone(),
            read_only: false,
            recursive_read_only: RecursiveReadOnly::Disabled,
        };
        assert!(v.bind(&req, &Cancel::never()).is_err());
        assert!(
            !v.root().join("pods").exists(),
            "the directories the bind created are gone"
        );
        let table = mountinfo::read().unwrap();
        assert!(mountinfo::mounts_under(&table, &v.root().join("pods")).is_empty());
        assert!(v.list()[0].bind_targets.is_empty());
        // The target is free again: once the record can be written, the bind works.
        std::fs::remove_dir(&tmp).unwrap();
        let out = v.bind(&req, &Cancel::never()).unwrap();
        assert!(!out.already_mounted);
        // Binds per volume are bounded (MAX_BINDS; 2 here).
        let mut v = v;
        v.max_binds = 2;
        let mut second = req.clone();
        second.target = v.root().join("pods/p/two");
        v.bind(&second, &Cancel::never()).unwrap();
        let mut third = req.clone();
        third.target = v.root().join("pods/p/three");
        let e = v.bind(&third, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        assert!(!third.target.exists(), "a refused bind creates nothing");
        assert!(v.unpublish("rec", &Cancel::never()).unwrap());
        assert!(!target.exists());
    }

    /// A sysfs in which the real devices `parts` are partitions of one fake
    /// disk at the given (start, sectors): what a hostile partition table
    /// makes of a guest's disk.
    fn fake_partitions(dir: &Path, parts: &[(&crate::testutil::LoopDisk, u64, u64)]) -> Sysfs {
        let sysfs = Sysfs {
            sys_block: dir.join("sys/block"),
            dev_dir: PathBuf::from("/dev"),
            dev_block: dir.join("sys/dev/block"),
        };
        let disk = sysfs.sys_block.join("vdz");
        std::fs::create_dir_all(&disk).unwrap();
        std::fs::create_dir_all(&sysfs.dev_block).unwrap();
        std::fs::write(disk.join("dev"), "250:0\n").unwrap();
        for (i, (d, start, sectors)) in parts.iter().enumerate() {
            let dev = device::from_path(&d.device).unwrap();
            let name = format!("vdz{}", i + 1);
            let p = disk.join(&name);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("partition"), format!("{}\n", i + 1)).unwrap();
            std::fs::write(p.join("start"), format!("{start}\n")).unwrap();
            std::fs::write(p.join("size"), format!("{sectors}\n")).unwrap();
            std::os::unix::fs::symlink(
                format!("../../block/vdz/{name}"),
                sysfs.dev_block.join(format!("{}:{}", dev.major, dev.minor)),
            )
            .unwrap();
        }
        sysfs
    }

    #[test]
    fn partitions_that_overlap_are_one_volume() {
        if !crate::testutil::root_or_skip("partitions_that_overlap_are_one_volume") {
            return;
        }
        let (a, b, c) = (
            crate::testutil::LoopDisk::new(32, Some("ext4")),
            crate::testutil::LoopDisk::new(32, None),
            crate::testutil::LoopDisk::new(32, None),
        );
        let dir = tempfile::tempdir().unwrap();
        // a: sectors 2048..67584; b overlaps its end; c lies after both.
        let sysfs = fake_partitions(
            dir.path(),
            &[(&a, 2048, 65536), (&b, 60000, 8192), (&c, 68216, 100)],
        );
        let v = Volumes::open(&dir.path().join("root"), sysfs, crate::logging::discard()).unwrap();
        let block = |id: &str, d: &crate::testutil::LoopDisk| PublishRequest {
            volume_id: id.into(),
            source: Source::Path(d.device.clone()),
            mode: VolumeMode::Block,
            options: Vec::new(),
            mount: mount::parse_options(&[], false).unwrap(),
            read_only: false,
            fs_group: None,
            timeout: Duration::from_secs(1),
        };
        publish_loop(&v, "pa", &a);
        let e = v.publish(&block("pb", &b), &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("volume pa") && msg.contains("60000..68192"),
            "{msg}"
        );
        assert!(
            v.list().iter().all(|i| i.volume_id != "pb"),
            "a refused publish leaves nothing"
        );
        // One that does not overlap is its own volume.
        v.publish(&block("pc", &c), &Cancel::never()).unwrap();
        // The other order: b first, then a is refused.
        assert!(v.unpublish("pa", &Cancel::never()).unwrap());
        v.publish(&block("pb", &b), &Cancel::never()).unwrap();
        let e = v.publish(&block("pa", &a), &Cancel::never()).unwrap_err();
        assert!(e.to_string().contains("volume pb"), "{e}");
        for id in ["pb", "pc"] {
            assert!(v.unpublish(id, &Cancel::never()).unwrap());
        }
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
            mode: s.mode,
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
            !state.join("bad.vol").exists() && state.join("bad.vol.bad").exists(),
            "an unreadable record is set aside for a human"
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
            mode: VolumeMode::Filesystem(FsType::Xfs),
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
        req.mode = VolumeMode::Filesystem(FsType::Ext4);
        assert!(v.differs_from(&req).unwrap().contains("fs_type"));
        req.mode = VolumeMode::Block;
        assert!(v
            .differs_from(&req)
            .unwrap()
            .contains("volume_mode xfs vs block"));
    }
}

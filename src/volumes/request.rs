//! What the table is asked and what it answers, as plain Rust types: the
//! wire's requests once validated (`server` builds them), and the answers
//! it translates back. No behaviour beyond what the types say.

use std::path::PathBuf;
use std::time::Duration;

use crate::model::{Policy, RecursiveReadOnly, VolumeMode};
use crate::mount::options::MountOptions;
use crate::ownership::walk::Report;

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
    pub ownership: Option<Report>,
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
    /// Ready, or still publishing (its fsGroup walk runs).
    pub state: VolumeState,
    /// While publishing: entries the fsGroup walk has visited so far.
    pub ownership_done: u64,
}

/// Whether a volume's publish has finished.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VolumeState {
    /// Published: every step done.
    #[default]
    Ready,
    /// Mounted, its fsGroup walk still running (walking.rs).
    Publishing,
}

/// The answer to an expand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expanded {
    /// The filesystem's size after the call.
    pub capacity_bytes: u64,
    /// The device's size.
    pub device_bytes: u64,
}

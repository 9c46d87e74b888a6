//! What the table is asked and what it answers, as plain Rust types: the
//! wire's requests once validated (`server` builds them), and the answers
//! it translates back. No behaviour beyond what the types say.

use std::path::PathBuf;
use std::time::Duration;

use crate::model::{IdMap, Policy, RecursiveReadOnly, VolumeMode};
use crate::mount::options::{parse_options, BadOption, MountOptions};
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

/// Mount options, carried once: as the request spelled them (what a
/// repeated request is compared with, and what the record keeps), the
/// request's read-only flag, and both parsed for mount(2).
#[derive(Clone, Debug)]
pub struct Options {
    given: Vec<String>,
    read_only: bool,
    parsed: MountOptions,
}

impl Options {
    /// `given` with the flag `read_only`, parsed (an option publishing
    /// refuses is an error).
    pub fn parse(given: Vec<String>, read_only: bool) -> Result<Options, BadOption> {
        let parsed = parse_options(&given, read_only)?;
        Ok(Options {
            given,
            read_only,
            parsed,
        })
    }

    /// The options as the request spelled them.
    pub fn given(&self) -> &[String] {
        &self.given
    }

    /// The request's read-only flag (an `ro` option is not it).
    pub fn read_only_flag(&self) -> bool {
        self.read_only
    }

    /// What mount(2) is given.
    pub fn mount(&self) -> &MountOptions {
        &self.parsed
    }

    /// Read-only as mounted: the flag, or an `ro` the options leave in force.
    pub fn read_only(&self) -> bool {
        self.parsed.flags & libc::MS_RDONLY != 0
    }
}

impl PartialEq for Options {
    /// The parsed form follows from the other two.
    fn eq(&self, other: &Options) -> bool {
        self.given == other.given && self.read_only == other.read_only
    }
}

impl Eq for Options {}

/// What a publish asks for, as the volume keeps it and its record stores
/// it: a repeated publish must ask the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The host's volume id.
    pub volume_id: String,
    /// Where the disk comes from.
    pub source: Source,
    /// Filesystem (and which one the disk must hold) or block.
    pub mode: VolumeMode,
    /// Mount options, and read-only.
    pub options: Options,
    /// fsGroup, if any.
    pub fs_group: Option<FsGroup>,
    /// A LUKS2 volume: how it is mapped (the key is not part of the spec:
    /// it is neither kept nor recorded).
    pub encryption: Option<Encryption>,
    /// Seconds between the agent's own trims of the volume (0: none);
    /// validated (`validate::trim_interval`).
    pub trim_interval_s: u32,
}

/// How an encrypted volume is opened, as the volume keeps it and its
/// record stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Encryption {
    /// Discards pass through the mapping (they reveal which blocks are free).
    pub allow_discards: bool,
    /// A blank disk is made a LUKS2 volume with the filesystem inside.
    pub format_if_blank: bool,
    /// With `format_if_blank`: the integrity a new volume is made with, and
    /// a volume already there must have (None: it must have none).
    pub integrity: Option<crate::luks2::format::Mac>,
}

/// A validated PublishVolume request.
#[derive(Debug)]
pub struct PublishRequest {
    /// What is asked.
    pub spec: Spec,
    /// How long to wait for the device to appear.
    pub timeout: Duration,
    /// An encrypted volume's passphrase, or where it comes from.
    pub key: Option<crate::keys::source::KeySource>,
}

/// The answer to a publish.
#[derive(Clone, Debug)]
pub struct Published {
    /// `<root>/volumes/<id>`.
    pub guest_path: PathBuf,
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
    /// Beneath the table's root: as given to `Volumes::bind`, which
    /// validates it; as `Volumes::target` answered for `bind_checked`.
    pub target: PathBuf,
    pub read_only: bool,
    /// KEP-3857 mode.
    pub recursive_read_only: RecursiveReadOnly,
    /// An idmapped bind's mappings (KEP-127), validated; None for a plain bind.
    pub idmap: Option<IdMap>,
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
    pub volume_id: String,
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
    /// Its binds' targets.
    pub bind_targets: Vec<String>,
    /// Its binds, with what each asked.
    pub binds: Vec<BindInfo>,
    /// A block volume (volumeMode: Block).
    pub block: bool,
    /// The device's size in bytes when it was last asked (0 if unknown).
    pub device_bytes: u64,
    /// Ready, or still publishing (its fsGroup walk runs).
    pub state: VolumeState,
    /// While publishing: entries the fsGroup walk has visited so far.
    pub ownership_done: u64,
    /// The freeze that holds it frozen, and until it ends by itself.
    pub frozen: Option<(String, std::time::Duration)>,
    /// An encrypted volume's mapping, with no key material.
    pub encryption: Option<EncryptionInfo>,
    /// Its trim schedule, if it has one.
    pub trim: Option<TrimInfo>,
}

/// What ListVolumes says of a volume's scheduled trim.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TrimInfo {
    pub interval_s: u32,
    /// When the last trim ended (ms since the epoch); 0: none yet.
    pub last_unix_ms: i64,
    /// Bytes it gave back.
    pub last_bytes: u64,
    /// Time spent in FITRIM, its parts summed.
    pub last_duration: Duration,
    /// When the next one is due (ms since the epoch).
    pub next_unix_ms: i64,
    /// Why the last one failed; None when it went through.
    pub last_error: Option<String>,
}

/// What ListVolumes says of one bind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindInfo {
    pub target: String,
    /// Relative to the volume's root; empty for the root.
    pub subpath: String,
    pub read_only: bool,
    pub recursive_read_only: RecursiveReadOnly,
    pub recursive_read_only_applied: bool,
    /// Its mappings, when idmapped.
    pub idmap: Option<IdMap>,
}

/// What ListVolumes says of an encrypted volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncryptionInfo {
    /// "luks2".
    pub kind: &'static str,
    pub cipher: String,
    pub key_bits: u32,
    /// "" when the volume has none.
    pub integrity: String,
    pub allow_discards: bool,
    /// The device-mapper name.
    pub mapping: String,
    pub luks_uuid: String,
}

/// Whether a volume's publish has finished.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VolumeState {
    /// Published: every step done.
    #[default]
    Ready,
    /// Mounted, its fsGroup walk still running (`walking`).
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

//! The refusals the calls make themselves, beyond what the modules they
//! drive refuse: a request's checks, a volume in the wrong phase, a device
//! that changed, a deadline that came first. Each with its code and its
//! sentence; `crate::error` joins them with everything else.

use std::fmt;
use std::path::PathBuf;

use crate::devices::Key;
use crate::hostdev::{Named, NotBlock};

use crust_protocols::freeze::{MAX_TIMEOUT_MS, MAX_VOLUMES as MAX_GROUP};

use super::limits::{FILE_SYSTEMS, MAX_TARGET_PATH};
use crate::state::MAX_VOLUMES;

crust_protocols::coded_errors! {
/// A call's own refusal.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(InvalidArgument)]
    #[error("host_target_path has {len} bytes{}: give kubelet's target path, at most {MAX_TARGET_PATH} bytes without NUL", if *.nul { " and a NUL byte" } else { "" })]
    TargetPath { len: usize, nul: bool },
    #[code(Unimplemented)]
    #[error("block volumes (volumeMode: Block) are not supported by this crustd yet: the guest agent cannot publish raw block devices; use a filesystem volume")]
    NoBlockVolumes,
    #[code(InvalidArgument)]
    #[error("file_system {0:?} with block = true: a block volume has no filesystem, leave it empty")]
    BlockWithFileSystem(String),
    #[code(InvalidArgument)]
    #[error("mount_options {0:?} with block = true: a block volume is not mounted, leave them empty")]
    BlockWithOptions(Vec<String>),
    #[code(InvalidArgument)]
    #[error("create_file_system with block = true: a block volume has no filesystem to create")]
    BlockWithCreate,
    #[code(InvalidArgument)]
    #[error("create_file_system with an encrypted volume: crustd never formats an encrypted volume on the host, which would write its filesystem in the clear; the guest formats a blank disk inside LUKS2 (format_if_blank)")]
    EncryptedWithCreate,
    #[code(InvalidArgument)]
    #[error("file_system {0:?} is not supported: use one of {known}", known = FILE_SYSTEMS.join(", "))]
    FileSystem(String),
    #[code(InvalidArgument)]
    #[error("fsgroup_policy {0:?} is not a policy: use \"Always\" or \"OnRootMismatch\" (Kubernetes' spelling)")]
    Policy(String),
    #[code(InvalidArgument)]
    #[error("fsgroup_gid {0} is not a group id (0 to 4294967294)")]
    Gid(i64),
    /// A direct-volume record names something that is not a block device.
    #[code(InvalidArgument)]
    #[error("direct-volume record {} names {}, which {what}", .file.display(), .device.display())]
    RecordNamesNotBlock { file: PathBuf, device: PathBuf, what: NotBlock },
    #[code(InvalidArgument)]
    #[error("required_bytes {0} is negative")]
    NegativeBytes(i64),
    #[code(InvalidArgument)]
    #[error("volumes names {0} volumes; name 1 to {MAX_GROUP}")]
    GroupSize(usize),
    #[code(InvalidArgument)]
    #[error("volumes names host volume {} of sandbox {} twice", .0.host_volume, .0.sandbox)]
    Twice(Key),
    #[code(InvalidArgument)]
    #[error("timeout_ms {0} is longer than the longest freeze, {MAX_TIMEOUT_MS} ms")]
    FreezeTimeout(u32),
    #[code(NotFound)]
    #[error("host volume {} is not published in sandbox {}", .0.host_volume, .0.sandbox)]
    NotPublished(Key),
    #[code(FailedPrecondition)]
    #[error("host volume {} in sandbox {} is still publishing (the guest is applying fsGroup): retry RuntimePublishVolume until it answers OK, then this call", .0.host_volume, .0.sandbox)]
    StillPublishing(Key),
    /// A call that needs the sandbox's VM, which is gone (why).
    #[code(FailedPrecondition)]
    #[error("sandbox {sandbox}'s VM is gone ({why}): its volumes can only be unpublished, which frees their devices")]
    Dead { sandbox: String, why: String },
    /// `host_volume_id` names another device than the one recorded.
    #[code(FailedPrecondition)]
    #[error("host_volume_id {} now names device {now}, not {was} which crustd published in sandbox {}: {}", .key.host_volume, .key.sandbox, if *.growing { "crustd grows only the device it plugged" } else { "unpublish it first" })]
    DeviceChanged { key: Key, now: String, was: String, growing: bool },
    #[code(OutOfRange)]
    #[error("host device {host_volume} has {size} bytes, fewer than the {required} required: grow it on the host first (for a loop device: grow the file, then losetup -c)")]
    TooSmall { host_volume: String, size: u64, required: i64 },
    #[code(DeadlineExceeded)]
    #[error("the caller's deadline passed before host volume {} was plugged into sandbox {}: nothing was plugged; retry", .0.host_volume, .0.sandbox)]
    LateToPlug(Key),
    #[code(ResourceExhausted)]
    #[error("sandbox {0} has {MAX_VOLUMES} volumes recorded, crustd's most for one sandbox: unpublish one first")]
    Full(String),
    #[code(Unavailable)]
    #[error("host device {0}: the sandboxes claiming it kept changing; try again")]
    Unsettled(Named),
    /// Another call for the volume held it until the caller's deadline.
    #[code(DeadlineExceeded)]
    #[error("another call for host volume {} in sandbox {} was still running at the caller's deadline; nothing was done: retry", .0.host_volume, .0.sandbox)]
    VolumeBusy(Key),
    /// Other calls kept a sandbox's monitor or state file until the caller's deadline.
    #[code(DeadlineExceeded)]
    #[error("sandbox {sandbox}: {what} stayed busy with other calls until the caller's deadline; retry")]
    Busy { sandbox: String, what: Shared },
    #[code(Internal)]
    #[error("the thaw of a sandbox panicked")]
    ThawPanicked,
    /// A host device that shrank gets no further trim.
    #[code(FailedPrecondition)]
    #[error("trim refused: {0}")]
    Shrunk(String),
    /// The trim went through in the guest, and the host device is smaller after it.
    #[code(DataLoss)]
    #[error("the guest's trim went through, and then: {0}")]
    ShrankByTrim(String),
}
}

/// What a sandbox's calls take turns on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shared {
    Monitor,
    StateFile,
}

impl fmt::Display for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Shared::Monitor => "its QMP monitor",
            Shared::StateFile => "its state file",
        })
    }
}

//! What the volume table itself refuses (a capability's refusals are its
//! own), each with its code: an unknown volume, a conflict with what is
//! published, a disk or target held by another volume, the state directory
//! full or read-only, a mount moved or stacked behind the agent's back.

use crate::cancel::Why;
use crate::code::Code;

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
    /// DEADLINE_EXCEEDED or CANCELLED: the caller stopped waiting for a
    /// publish whose fsGroup walk goes on (walking.rs).
    #[error("{} while volume {id} was applying fsGroup; the walk continues ({visited} entries so far, {seconds} s): repeat the same publish to wait for it, or unpublish to stop it", why_text(*why))]
    WalkContinues {
        /// The volume id.
        id: String,
        /// The caller's deadline passed, or the caller went away.
        why: Why,
        /// Entries visited so far.
        visited: u64,
        /// Seconds since the walk started.
        seconds: u64,
    },
    /// FAILED_PRECONDITION: stats, expand or bind of a volume whose publish
    /// is still walking.
    #[error("volume {id} is still applying fsGroup ({visited} entries so far); repeat its publish until it answers OK, then retry")]
    StillPublishing {
        /// The volume id.
        id: String,
        /// Entries visited so far.
        visited: u64,
    },
    /// The publish whose walk this call waited for failed (its code, its sentence).
    #[error("{message}")]
    PublishFailed {
        /// The failure's code.
        code: Code,
        /// The failure, as a sentence.
        message: String,
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
            | Error::StillPublishing { .. }
            | Error::ShuttingDown => Code::FailedPrecondition,
            Error::WalkContinues { why, .. } => match why {
                Why::CallerGone => Code::Cancelled,
                _ => Code::DeadlineExceeded,
            },
            Error::PublishFailed { code, .. } => *code,
        }
    }
}

/// Why a caller stopped waiting, as the start of a sentence.
fn why_text(why: Why) -> &'static str {
    match why {
        Why::CallerGone => "the caller closed its connection",
        Why::Deadline => "the caller's deadline passed",
        Why::Shutdown => "the agent is shutting down",
        Why::Unpublished => "the volume was unpublished",
    }
}

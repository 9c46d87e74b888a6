//! What the volume table itself refuses (a capability's refusals are its
//! own), each with its code: an unknown volume, a conflict with what is
//! published, a disk or target held by another volume, the state directory
//! full or read-only, a mount moved or stacked behind the agent's back.

use std::path::PathBuf;

use crate::cancel::Why;
use crate::code::Code;
use crate::sys::mountinfo::shown;

crate::code::coded_errors! {
/// What the volume table refuses.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(NotFound)]
    #[error("volume {0} is not published; publish it first")]
    NotPublished(String),
    #[code(AlreadyExists)]
    #[error("volume {id} is already published with different parameters ({differs}); unpublish it first, or repeat the original request")]
    Conflict {
        id: String,
        /// Which parameter differs.
        differs: String,
    },
    #[code(FailedPrecondition)]
    #[error("device {} is already published as volume {other}; a disk is published once, under one volume id (as a filesystem or as a block volume, not both)", shown(device))]
    DeviceInUse {
        device: PathBuf,
        /// The volume that holds it.
        other: String,
    },
    #[code(FailedPrecondition)]
    #[error("device {} shares sectors with {} ({how}), which is published as volume {other}; a disk is published once: a whole disk and its partitions, or partitions that overlap, are never published side by side", shown(device), shown(held))]
    DeviceOverlaps {
        /// The device node asked for.
        device: PathBuf,
        /// The device the other volume holds.
        held: PathBuf,
        /// How they overlap, in sectors of the whole disk.
        how: String,
        /// The volume that holds it.
        other: String,
    },
    #[code(FailedPrecondition)]
    #[error("device {} shares sectors with {other_device} ({how}), which is mounted at {}; the agent never mounts or publishes a disk whose sectors are in use", shown(device), shown(at))]
    DeviceOverlapsMount {
        /// The device node asked for.
        device: PathBuf,
        other_device: String,
        /// How they overlap.
        how: String,
        /// Where it is mounted.
        at: PathBuf,
    },
    #[code(ResourceExhausted)]
    #[error("no space left to write the agent's state record {}; nothing was changed: free space on the filesystem that holds the agent's state directory, then retry (unpublish needs no space)", shown(path))]
    StateFull {
        /// The record.
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("the agent's state record {} cannot be written: its filesystem is read-only; nothing was changed: make it writable, then retry", shown(path))]
    StateReadOnly {
        /// The record.
        path: PathBuf,
    },
    #[code(InvalidArgument)]
    #[error("volume {0} is encrypted, and the request says no key: give the passphrase or a key_uri")]
    NoKey(String),
    #[code(InvalidArgument)]
    #[error("volume {0} is asked read-only and format_if_blank: a read-only publish writes nothing to the disk; publish it read-write to make it, or without format_if_blank")]
    FormatReadOnly(String),
    #[code(FailedPrecondition)]
    #[error("volume {id}'s mapping {mapping} could not be removed ({why}); the disk must not be detached yet: close what holds the mapping, then unpublish again")]
    MappingHeld {
        id: String,
        mapping: String,
        why: String,
    },
    #[code(DataLoss)]
    #[error("volume {id} cannot be published: {why}; the kernel refused {sectors} sector(s) of its mapping {mapping} whose authentication tag does not match (dm-crypt with integrity {integrity}): the disk's ciphertext was changed outside the guest")]
    Tampered {
        id: String,
        mapping: String,
        integrity: String,
        sectors: u64,
        /// The step's own failure.
        why: String,
    },
    #[code(FailedPrecondition)]
    #[error("volume {0} is encrypted and was published without allow_discards: a trim would tell the host which blocks are free; publish it with allow_discards to trim it")]
    DiscardsNotAllowed(String),
    #[code(FailedPrecondition)]
    #[error("volume {id}'s mapping {mapping} is not serving ({how}); its filesystem cannot be reached")]
    MappingDown {
        id: String,
        mapping: String,
        /// "suspended", "gone", ….
        how: &'static str,
    },
    #[code(FailedPrecondition)]
    #[error("volume {id} is still mounted at {} ({why}); the disk must not be detached yet: unmount it there, then unpublish again", shown(at))]
    StillMounted {
        id: String,
        /// Where its disk is still mounted.
        at: PathBuf,
        /// Why the agent left it.
        why: String,
    },
    #[code(FailedPrecondition)]
    #[error("the mount the agent made at {} was moved behind its back to {}, outside the agent's root, where the agent acts on nothing; unmount it there, then retry", shown(was), shown(now))]
    MovedOutside {
        /// Where the agent made it.
        was: PathBuf,
        /// Where it is now.
        now: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("device {} is already mounted at {}; the agent never mounts one disk twice", shown(device), shown(at))]
    DeviceMounted {
        device: PathBuf,
        /// Where it is mounted.
        at: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("{} is already a mount point, though no volume is published there; unmount it first", shown(path))]
    GuestPathBusy {
        /// The volume's guest path.
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("volume {0} is published read-only; a read-only filesystem cannot grow online")]
    ReadOnly(String),
    #[code(AlreadyExists)]
    #[error("bind target {} is already {what}; unmount it first or choose another target", shown(target))]
    TargetTaken {
        target: PathBuf,
        /// What holds it.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("volume {id} is published, but its mount at {} is gone (unmounted behind the agent's back); unpublish it, then publish it again", shown(path))]
    MountGone {
        id: String,
        path: PathBuf,
    },
    #[code(why => match why {
        Why::CallerGone => Code::Cancelled,
        _ => Code::DeadlineExceeded,
    })]
    #[error("{} while volume {id} was applying fsGroup; the walk continues ({visited} entries so far, {seconds} s): repeat the same publish to wait for it, or unpublish to stop it", why.text())]
    WalkContinues {
        id: String,
        /// The caller's deadline passed, or the caller went away.
        why: Why,
        /// Entries visited so far.
        visited: u64,
        /// Seconds since the walk started.
        seconds: u64,
    },
    #[code(FailedPrecondition)]
    #[error("volume {id} is still applying fsGroup ({visited} entries so far); repeat its publish until it answers OK, then retry")]
    StillPublishing {
        id: String,
        /// Entries visited so far.
        visited: u64,
    },
    #[code(code => *code)]
    #[error("{message}")]
    PublishFailed {
        /// The failure's code.
        code: Code,
        /// The failure, as a sentence.
        message: String,
    },
    #[code(FailedPrecondition)]
    #[error("the agent is shutting down and accepts no new volumes, binds or freezes")]
    ShuttingDown,
    #[code(FailedPrecondition)]
    #[error("{} is not {what} of the agent's (a symlink or something else was put there); remove it, then publish again", shown(path))]
    GuestPathUnsafe {
        /// The volume's guest path.
        path: PathBuf,
        /// What the agent expected there.
        what: &'static str,
    },
    #[code(InvalidArgument)]
    #[error("volume {id} is a block volume: {why}")]
    BlockBindInvalid {
        id: String,
        /// What the request asked that a device cannot do.
        why: &'static str,
    },
    #[code(FailedPrecondition)]
    #[error("volume {id} is a block volume: it cannot be bound with uid and gid mappings, since a device has no file owners to map (KEP-127: a user-namespace pod cannot use a raw block volume); bind it without mappings, to a pod with host users")]
    BlockBindIdmapped {
        id: String,
    },
    #[code(FailedPrecondition)]
    #[error("volume {id} is a read-write block volume: a read-only bind of it is impossible, since a device node's mount flags do not stop writes and the device's own read-only flag is shared by every bind of it; publish the volume read-only instead")]
    BlockBindReadOnly {
        id: String,
    },
    #[code(InvalidArgument)]
    #[error("bind target {} lies inside {}, the bind of volume {volume}; a bind there would be created inside that volume: choose a target outside every bind", shown(target), shown(inner_of))]
    TargetNested {
        /// The target asked for.
        target: PathBuf,
        /// The bind it lies in.
        inner_of: PathBuf,
        /// That bind's volume.
        volume: String,
    },
    #[code(FailedPrecondition)]
    #[error("bind target {} holds {}, the bind of volume {volume}, beneath it; a bind over it would hide that bind: unmount it first or choose another target", shown(target), shown(inner))]
    TargetCovers {
        /// The target asked for.
        target: PathBuf,
        /// The bind beneath it.
        inner: PathBuf,
        /// That bind's volume.
        volume: String,
    },
    #[code(ResourceExhausted)]
    #[error("volume {id}'s binds already hold {held} uid and gid ranges, and this bind's would pass {max}, as many as the agent keeps for one volume; unmount some idmapped binds first")]
    TooManyIdRanges {
        id: String,
        /// What its binds hold.
        held: usize,
        /// The bound.
        max: usize,
    },
    #[code(ResourceExhausted)]
    #[error("volume {id} already has {max} binds, as many as the agent keeps for one volume; unmount some first")]
    TooManyBinds {
        id: String,
        /// The bound.
        max: usize,
    },
    #[code(FailedPrecondition)]
    #[error("volume {id} is a block volume: it has no filesystem the agent could have {what}")]
    NoFilesystem {
        id: String,
        /// What was asked ("frozen", "trimmed").
        what: &'static str,
    },
    #[code(why => match why {
        Why::CallerGone => Code::Cancelled,
        _ => Code::DeadlineExceeded,
    })]
    #[error("{} while trimming volume {id}: stopped after {done} of {total} bytes ({trimmed} bytes given back); trim again to go on", why.text())]
    TrimStopped {
        id: String,
        /// Why it stopped.
        why: Why,
        /// Bytes of the filesystem covered.
        done: u64,
        /// The filesystem's size.
        total: u64,
        /// Bytes given back so far.
        trimmed: u64,
    },
    #[code(FailedPrecondition)]
    #[error("volume {id} cannot be trimmed on a schedule: {why}; publish it without trim_interval_s")]
    TrimNotPossible {
        id: String,
        /// Why not, as TrimVolume would refuse it.
        why: &'static str,
    },
    #[code(InvalidArgument)]
    #[error("bind target {} would be created on the filesystem of volume {volume}; binds go outside the volumes", shown(target))]
    TargetInVolume {
        /// The target asked for.
        target: PathBuf,
        /// The volume whose filesystem holds the target's directory.
        volume: String,
    },
}
}

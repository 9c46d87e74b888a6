//! What the probe refuses, each with its code: every refusal is the disk's
//! (FAILED_PRECONDITION), never the request's; a failed read is INTERNAL.

use std::path::{Path, PathBuf};

use crate::model::FsType;
use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;

crate::code::coded_errors! {
/// What can go wrong when identifying a disk's filesystem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("{} holds {found}, not the requested {expected}; the agent never formats or mounts a mismatched disk", shown(device))]
    Mismatch {
        device: PathBuf,
        /// What the superblocks say it holds.
        found: &'static str,
        /// What the request asked for.
        expected: FsType,
    },
    #[code(FailedPrecondition)]
    #[error("{} holds no filesystem the agent recognises (it looks unformatted), not the requested {expected}; the agent never formats a disk: create the filesystem on the host first", shown(device))]
    Unformatted {
        device: PathBuf,
        /// What the request asked for.
        expected: FsType,
    },
    #[code(FailedPrecondition)]
    #[error("{} carries the signatures of several filesystems ({found}); the agent will not guess which one is real: wipe the stale signatures on the host (wipefs)", shown(device))]
    Ambiguous {
        device: PathBuf,
        /// The signatures found, comma-separated.
        found: String,
    },
    #[code(FailedPrecondition)]
    #[error("the {fs} on {} is {fs_bytes} bytes ({blocks} blocks of {block_size}) but the device holds only {device_bytes} bytes: the image was cut short or the disk shrank, and the kernel would refuse it; give the disk back at least {fs_bytes} bytes, or restore the image", shown(device))]
    LargerThanDevice {
        device: PathBuf,
        /// The filesystem.
        fs: FsType,
        /// Blocks × block size, from the superblock (beyond 64 bits when corrupt).
        fs_bytes: u128,
        /// The block count.
        blocks: u64,
        block_size: u64,
        /// The device's size.
        device_bytes: u64,
    },
    #[code(FailedPrecondition)]
    #[error("the {fs} superblock on {} is corrupt: {what}; check the disk on the host (e2fsck -fn, xfs_repair -n)", shown(device))]
    Corrupt {
        device: PathBuf,
        /// The filesystem.
        fs: FsType,
        /// What is wrong.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("the {fs} on {} {what}, which lives on another device; the agent publishes a volume from its one disk and will not let the kernel open another: use a filesystem that is whole on the disk", shown(device))]
    NeedsAnotherDevice {
        device: PathBuf,
        /// The filesystem.
        fs: FsType,
        /// "has an external journal", ….
        what: &'static str,
    },
    #[code(FailedPrecondition)]
    #[error("the ext4 on {} has multi-mount protection (MMP) and {what}; MMP is for disks shared between machines, not a sandbox's disk: turn it off on the host (tune2fs -O ^mmp), or if no other machine uses the disk, reset it (tune2fs -f -E clear_mmp)", shown(device))]
    Mmp {
        device: PathBuf,
        /// What the superblock and the MMP block say.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("the ext4 superblock on {} carries the mount option {option:?} (s_mount_opts), which the agent does not let a disk choose: {why}; clear them on the host (tune2fs -E mount_opts= {}) and give options in the request instead", shown(device), shown(device))]
    PlantedOption {
        device: PathBuf,
        /// The option, as the superblock has it.
        option: String,
        /// Why it is refused.
        why: &'static str,
    },
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

/// Refuses a filesystem of `blocks` × `block_size` bytes larger than the device.
pub fn fits(
    fs: FsType,
    blocks: u64,
    block_size: u64,
    device_bytes: u64,
    device: &Path,
) -> Result<(), Error> {
    // At most 2^64 × 2^16: a u128 holds it.
    let fs_bytes = u128::from(blocks).saturating_mul(u128::from(block_size));
    if fs_bytes > u128::from(device_bytes) {
        return Err(Error::LargerThanDevice {
            device: device.to_path_buf(),
            fs,
            fs_bytes,
            blocks,
            block_size,
            device_bytes,
        });
    }
    Ok(())
}

/// The variant name of a judgement, for the tables of the tests.
#[cfg(test)]
pub(crate) fn verdict<T>(r: Result<T, Error>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(Error::LargerThanDevice { .. }) => "too large",
        Err(Error::Corrupt { .. }) => "corrupt",
        Err(Error::NeedsAnotherDevice { .. }) => "another device",
        Err(Error::Mismatch { .. }) => "mismatch",
        Err(Error::Mmp { .. }) => "mmp",
        Err(Error::PlantedOption { .. }) => "planted",
        Err(e) => panic!("unexpected {e}"),
    }
}

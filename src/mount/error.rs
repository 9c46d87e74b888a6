//! What can go wrong while mounting, binding or unmounting, each with its
//! code: the request's fault (INVALID_ARGUMENT, NOT_FOUND), the disk's or
//! the system's state (FAILED_PRECONDITION), or an unexpected failure.

use std::io;

use crate::code::Code;
use crate::sys::error::SysError;

/// What can go wrong while mounting, binding or unmounting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option publishing forbids, or a malformed option list (the
    /// option table's own refusal, crust-protocols').
    #[error(transparent)]
    BadOption(#[from] super::options::BadOption),
    /// mount(2) said EINVAL to a data string: the filesystem refused an option.
    #[error("the kernel refused the mount options {data:?} for {fs_type} on {device} (mounting at {target}): {source}; check them against the {fs_type} documentation")]
    KernelRefusedOptions {
        /// The data string passed to mount(2).
        data: String,
        /// ext4 or xfs.
        fs_type: String,
        /// The device.
        device: String,
        /// The mount point.
        target: String,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// The kernel's own parser of `fs_type` refused one option (asked before
    /// mounting, with fsopen and fsconfig, so the option is known).
    #[error("the kernel refused the mount option {option:?} for {fs_type} on {device}: {why}; check it against the {fs_type} documentation")]
    KernelRefusedOption {
        /// The option, as it went to the kernel.
        option: String,
        /// ext4 or xfs.
        fs_type: String,
        /// The device.
        device: String,
        /// The kernel's own words when it gave any, else the errno.
        why: String,
    },
    /// mount(2) refused the disk's filesystem itself: EINVAL once every
    /// option passed the kernel's parser (or none was given), EFBIG, EUCLEAN
    /// (corrupt), EBADMSG (bad checksum), EIO (a read failed, past the
    /// disk's end for an xfs larger than it). The disk is at fault, not the request.
    #[error("the kernel refused to mount the {fs_type} on {device} at {target} ({source}){with}: the filesystem is inconsistent, larger than its device, unreadable, or uses a feature this kernel lacks, and the guest kernel's log says which; check the disk on the host (e2fsck -fn, xfs_repair -n)")]
    FilesystemRefused {
        /// ext4 or xfs.
        fs_type: String,
        /// The device.
        device: String,
        /// The mount point.
        target: String,
        /// ", with the options …" when the request gave any.
        with: String,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// mount(2) said EBUSY: the device is mounted already (or held open exclusively).
    #[error("{device} is busy and cannot be mounted at {target}: it is probably mounted elsewhere already; unmount it there first")]
    DeviceBusy {
        /// The device.
        device: String,
        /// The mount point asked for.
        target: String,
    },
    /// Something keeps a mount busy.
    #[error("{path} is still busy after {attempts} attempts to unmount it: a process has files open there; stop it and retry (the agent does not detach a volume with data in flight)")]
    Busy {
        /// The busy mount point.
        path: String,
        /// How many plain unmounts were tried.
        attempts: u32,
    },
    /// A malformed subpath, target or read-only combination (validate.rs says which).
    #[error(transparent)]
    Invalid(#[from] crate::validate::Invalid),
    /// A subpath that resolves outside the volume (through a symlink).
    #[error("subpath {subpath:?} leaves the volume at {root} (through a symlink or a magic link); use a path that stays inside the volume")]
    SubpathEscapes {
        /// The subpath as given.
        subpath: String,
        /// The volume root.
        root: String,
    },
    /// The subpath does not exist.
    #[error("subpath {subpath:?} does not exist in the volume at {root}; create it first")]
    SubpathNotFound {
        /// The subpath as given.
        subpath: String,
        /// The volume root.
        root: String,
    },
    /// A bind target that is relative, outside the agent's root, leaves it
    /// through a symlink, or is of the wrong kind.
    #[error("bind target {target} is not usable: {why}")]
    BadTarget {
        /// The target as given.
        target: String,
        /// What is wrong with it.
        why: String,
    },
    /// RRO ENABLED on a kernel without mount_setattr.
    #[error("recursive read-only was required (ENABLED) for {target}, but this kernel lacks mount_setattr (Linux 5.12+); use IF_POSSIBLE or a newer guest kernel")]
    RecursiveUnsupported {
        /// The target asked for.
        target: String,
    },
    /// The kernel lacks openat2, which safe path resolution needs.
    #[error("this kernel lacks openat2 (Linux 5.6+), which the agent needs to resolve {path} safely; use a newer guest kernel")]
    NoOpenat2 {
        /// The path that was being resolved.
        path: String,
    },
    /// A path the agent was to act on now runs through a symlink (swapped in
    /// after it was made): the agent acts only beneath its root, so it stops.
    #[error("{path} now runs through a symlink or leaves the agent's root; the agent leaves it alone (something changed it behind the agent's back: inspect and remove it by hand)")]
    Unsafe {
        /// The path.
        path: String,
    },
    /// The expected mount still exists but is no longer at its path.
    #[error("the mount the agent made at {path} is no longer there but still exists elsewhere (moved behind the agent's back); the agent does not guess where: unmount it by hand")]
    Moved {
        /// The path.
        path: String,
    },
    /// Something was mounted over the agent's mount.
    #[error("{path} has {what} mounted over the agent's mount; unmount that first")]
    Covered {
        /// The path.
        path: String,
        /// What is on top.
        what: String,
    },
    /// The mount at a path is not one the agent made.
    #[error("{path} is a mount of {what}, which the agent did not make; the agent unmounts only its own mounts")]
    NotOurs {
        /// The path.
        path: String,
        /// What is mounted there.
        what: String,
    },
    /// An unexpected syscall failure.
    #[error(transparent)]
    Sys(#[from] SysError),
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::BadOption(_)
            | Error::KernelRefusedOptions { .. }
            | Error::KernelRefusedOption { .. }
            | Error::Invalid(_)
            | Error::SubpathEscapes { .. }
            | Error::BadTarget { .. } => Code::InvalidArgument,
            Error::SubpathNotFound { .. } => Code::NotFound,
            Error::DeviceBusy { .. }
            | Error::FilesystemRefused { .. }
            | Error::Busy { .. }
            | Error::Unsafe { .. }
            | Error::Moved { .. }
            | Error::Covered { .. }
            | Error::NotOurs { .. }
            | Error::RecursiveUnsupported { .. }
            | Error::NoOpenat2 { .. } => Code::FailedPrecondition,
            Error::Sys(_) => Code::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;
    use crate::mount::options::parse_options;

    /// Every option the table refuses (its own test walks them all) is
    /// the request's fault: INVALID_ARGUMENT.
    #[test]
    fn a_refused_option_is_invalid_argument() {
        for bad in [
            "bind",
            "errors=panic",
            "journal_dev=2049",
            "noatime,,nosuid",
            "disc\0ard",
        ] {
            let err = parse_options(&[bad.to_string()], false).expect_err(bad);
            assert_eq!(Error::from(err).code(), Code::InvalidArgument, "{bad}");
        }
    }
}

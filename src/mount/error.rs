//! What can go wrong while mounting, binding or unmounting, each with its
//! code: the request's fault (INVALID_ARGUMENT, NOT_FOUND), the disk's or
//! the system's state (FAILED_PRECONDITION), or an unexpected failure.

use std::io;

use crate::sys::error::SysError;

crate::code::coded_errors! {
/// What can go wrong while mounting, binding or unmounting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(InvalidArgument)]
    #[error(transparent)]
    BadOption(#[from] super::options::BadOption),
    #[code(InvalidArgument)]
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
    #[code(InvalidArgument)]
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
    #[code(FailedPrecondition)]
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
    #[code(FailedPrecondition)]
    #[error("{device} is busy and cannot be mounted at {target}: it is probably mounted elsewhere already; unmount it there first")]
    DeviceBusy {
        /// The device.
        device: String,
        /// The mount point asked for.
        target: String,
    },
    #[code(FailedPrecondition)]
    #[error("{path} is still busy after {attempts} attempts to unmount it: a process has files open there; stop it and retry (the agent does not detach a volume with data in flight)")]
    Busy {
        /// The busy mount point.
        path: String,
        /// How many plain unmounts were tried.
        attempts: u32,
    },
    #[code(InvalidArgument)]
    #[error(transparent)]
    Invalid(#[from] crate::validate::Invalid),
    #[code(InvalidArgument)]
    #[error("subpath {subpath:?} leaves the volume at {root} (through a symlink or a magic link); use a path that stays inside the volume")]
    SubpathEscapes {
        /// The subpath as given.
        subpath: String,
        /// The volume root.
        root: String,
    },
    #[code(NotFound)]
    #[error("subpath {subpath:?} does not exist in the volume at {root}; create it first")]
    SubpathNotFound {
        /// The subpath as given.
        subpath: String,
        /// The volume root.
        root: String,
    },
    #[code(InvalidArgument)]
    #[error("bind target {target} is not usable: {why}")]
    BadTarget {
        /// The target as given.
        target: String,
        /// What is wrong with it.
        why: String,
    },
    #[code(FailedPrecondition)]
    #[error("recursive read-only was required (ENABLED) for {target}, but this kernel lacks mount_setattr (Linux 5.12+); use IF_POSSIBLE or a newer guest kernel")]
    RecursiveUnsupported {
        /// The target asked for.
        target: String,
    },
    #[code(FailedPrecondition)]
    #[error("this kernel lacks openat2 (Linux 5.6+), which the agent needs to resolve {path} safely; use a newer guest kernel")]
    NoOpenat2 {
        /// The path that was being resolved.
        path: String,
    },
    #[code(FailedPrecondition)]
    #[error("{path} now runs through a symlink or leaves the agent's root; the agent leaves it alone (something changed it behind the agent's back: inspect and remove it by hand)")]
    Unsafe {
        /// The path.
        path: String,
    },
    #[code(FailedPrecondition)]
    #[error("the mount the agent made at {path} is no longer there but still exists elsewhere (moved behind the agent's back); the agent does not guess where: unmount it by hand")]
    Moved {
        /// The path.
        path: String,
    },
    #[code(FailedPrecondition)]
    #[error("{path} has {what} mounted over the agent's mount; unmount that first")]
    Covered {
        /// The path.
        path: String,
        /// What is on top.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("{path} is a mount of {what}, which the agent did not make; the agent unmounts only its own mounts")]
    NotOurs {
        /// The path.
        path: String,
        /// What is mounted there.
        what: String,
    },
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
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

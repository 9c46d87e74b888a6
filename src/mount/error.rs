//! What can go wrong while mounting, binding or unmounting, each with its
//! code: the request's fault (INVALID_ARGUMENT, NOT_FOUND), the disk's or
//! the system's state (FAILED_PRECONDITION), or an unexpected failure.

use std::io;
use std::path::PathBuf;

use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;

crate::code::coded_errors! {
/// What can go wrong while mounting, binding or unmounting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(InvalidArgument)]
    #[error(transparent)]
    BadOption(#[from] super::options::BadOption),
    #[code(InvalidArgument)]
    #[error("the kernel refused the mount options {data:?} for {fs_type} on {} (mounting at {}): {source}; check them against the {fs_type} documentation", shown(device), shown(target))]
    KernelRefusedOptions {
        /// The data string passed to mount(2).
        data: String,
        /// ext4 or xfs.
        fs_type: String,
        device: PathBuf,
        /// The mount point.
        target: PathBuf,
        /// The errno.
        #[source]
        source: io::Error,
    },
    #[code(InvalidArgument)]
    #[error("the kernel refused the mount option {option:?} for {fs_type} on {}: {why}; check it against the {fs_type} documentation", shown(device))]
    KernelRefusedOption {
        /// The option, as it went to the kernel.
        option: String,
        /// ext4 or xfs.
        fs_type: String,
        device: PathBuf,
        /// The kernel's own words when it gave any, else the errno.
        why: String,
    },
    #[code(FailedPrecondition)]
    #[error("the kernel refused to mount the {fs_type} on {} at {} ({source}){with}: the filesystem is inconsistent, larger than its device, unreadable, or uses a feature this kernel lacks, and the guest kernel's log says which; check the disk on the host (e2fsck -fn, xfs_repair -n)", shown(device), shown(target))]
    FilesystemRefused {
        /// ext4 or xfs.
        fs_type: String,
        device: PathBuf,
        /// The mount point.
        target: PathBuf,
        /// ", with the options …" when the request gave any.
        with: String,
        /// The errno.
        #[source]
        source: io::Error,
    },
    #[code(FailedPrecondition)]
    #[error("{} is busy and cannot be mounted at {}: it is probably mounted elsewhere already; unmount it there first", shown(device), shown(target))]
    DeviceBusy {
        device: PathBuf,
        /// The mount point asked for.
        target: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("{} is still busy after {attempts} attempts to unmount it: a process has files open there; stop it and retry (the agent does not detach a volume with data in flight)", shown(path))]
    Busy {
        /// The busy mount point.
        path: PathBuf,
        /// How many plain unmounts were tried.
        attempts: u32,
    },
    #[code(InvalidArgument)]
    #[error(transparent)]
    Invalid(#[from] crate::validate::Invalid),
    #[code(InvalidArgument)]
    #[error("subpath {subpath:?} leaves the volume at {} (through a symlink or a magic link); use a path that stays inside the volume", shown(root))]
    SubpathEscapes {
        /// The subpath as given.
        subpath: PathBuf,
        root: PathBuf,
    },
    #[code(NotFound)]
    #[error("subpath {subpath:?} does not exist in the volume at {}; create it first", shown(root))]
    SubpathNotFound {
        /// The subpath as given.
        subpath: PathBuf,
        root: PathBuf,
    },
    #[code(InvalidArgument)]
    #[error("bind target {} is not usable: {why}", shown(target))]
    BadTarget {
        /// The target as given.
        target: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    #[code(FailedPrecondition)]
    #[error("recursive read-only was required (ENABLED) for {}, but this kernel lacks mount_setattr (Linux 5.12+); use IF_POSSIBLE or a newer guest kernel", shown(target))]
    RecursiveUnsupported {
        /// The target asked for.
        target: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("an idmapped bind was asked for {}, but this kernel lacks mount_setattr (Linux 5.12+), which idmaps a mount; use a newer guest kernel", shown(target))]
    IdmapUnsupported {
        /// The target asked for.
        target: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("an idmapped bind was asked for {}, but the agent cannot make a user namespace here ({source}): the kernel is built without them, user.max_user_namespaces is reached, or a sandbox around the agent forbids them (systemd's RestrictNamespaces=, a capability bounding set without CAP_SETUID and CAP_SETGID, or without CAP_SETFCAP for a map of host id 0)", shown(target))]
    NoUserNamespaces {
        /// The target asked for.
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[code(FailedPrecondition)]
    #[error("an idmapped bind was asked for {}, but this kernel cannot idmap {what} ({source}); bind it without mappings, or use a kernel whose filesystem supports idmapped mounts", shown(target))]
    FilesystemNotIdmappable {
        /// The target asked for.
        target: PathBuf,
        /// "the filesystem of /run/…/volumes/v" or "a filesystem mounted inside …".
        what: String,
        #[source]
        source: io::Error,
    },
    #[code(FailedPrecondition)]
    #[error("this kernel lacks openat2 (Linux 5.6+), which the agent needs to resolve {} safely; use a newer guest kernel", shown(path))]
    NoOpenat2 {
        /// The path that was being resolved.
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("{} now runs through a symlink or leaves the agent's root; the agent leaves it alone (something changed it behind the agent's back: inspect and remove it by hand)", shown(path))]
    Unsafe {
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("the mount the agent made at {} is no longer there but still exists elsewhere (moved behind the agent's back); the agent does not guess where: unmount it by hand", shown(path))]
    Moved {
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("{} has {what} mounted over the agent's mount; unmount that first", shown(path))]
    Covered {
        path: PathBuf,
        /// What is on top.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("{} is a mount of {what}, which the agent did not make; the agent unmounts only its own mounts", shown(path))]
    NotOurs {
        path: PathBuf,
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

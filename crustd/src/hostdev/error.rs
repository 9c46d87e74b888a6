//! What can be wrong with a host device or the path naming it: each
//! refusal with its code and its sentence, which names the device and says
//! what to do.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::io::Errno;

/// The longest path the kernel takes.
pub(super) const PATH_MAX: usize = 4096;

crust_protocols::coded_errors! {
/// Why a host device cannot be used, or cannot be looked at.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(InvalidArgument)]
    #[error("host_volume_id is empty: give the volume's block device on the host, e.g. /dev/sdx")]
    EmptyPath,
    #[code(InvalidArgument)]
    #[error("host_volume_id has {len} bytes{}: a device path has at most {PATH_MAX}, and no NUL", if *.nul { " and a NUL byte" } else { "" })]
    LongPath { len: usize, nul: bool },
    #[code(InvalidArgument)]
    #[error("host_volume_id {0:?} is not an absolute path: give the block device, e.g. /dev/sdx")]
    RelativePath(String),
    /// kubelet named something that is not a block device.
    #[code(InvalidArgument)]
    #[error("host_volume_id {id} {what}")]
    NotBlock { id: String, what: NotBlock },
    /// A recorded device, by its number, after a restart.
    #[code(FailedPrecondition)]
    #[error("host device {rdev} that crustd recorded is not on this host any more: {why}")]
    Gone { rdev: String, why: Vanished },
    #[code(FailedPrecondition)]
    #[error("cannot open host device {shown}: {errno}")]
    Open { shown: String, errno: Errno },
    #[code(Internal)]
    #[error("cannot stat host device {shown}: {errno}")]
    Stat { shown: String, errno: Errno },
    #[code(FailedPrecondition)]
    #[error("host device {shown} changed while crustd opened it: try again")]
    Changed { shown: String },
    #[code(Internal)]
    #[error("cannot resolve {shown}: {source}")]
    Resolve { shown: String, source: Arc<io::Error> },
    #[code(FailedPrecondition)]
    #[error("cannot read the size of {name}: {source}")]
    Size { name: Named, source: Arc<io::Error> },
    #[code(Internal)]
    #[error("cannot find where host device {shown} ({rdev}) lies in /sys: {source}")]
    Extent { shown: String, rdev: String, source: Arc<io::Error> },
    #[code(Internal)]
    #[error("cannot find out whether the host uses {shown} ({rdev}): {source}")]
    Users { shown: String, rdev: String, source: Arc<io::Error> },
    /// The host uses it: each user in words ("loop1 is mounted at /mnt").
    #[code(FailedPrecondition)]
    #[error("host device {name} is in use on this host: {}; {FREE_IT}", .users.join("; "))]
    InUse { name: Named, users: Vec<String> },
    /// The kernel refused the exclusive hold, and crustd cannot see why.
    #[code(FailedPrecondition)]
    #[error("host device {name} is in use on this host: the kernel reports another exclusive user (a mount in another mount namespace, swap, device-mapper or md, or a program that opened it with O_EXCL); {FREE_IT}")]
    HeldUnseen { name: Named },
    #[code(Internal)]
    #[error("host device {shown} reopened as another device")]
    Reopened { shown: String },
    #[code(Internal)]
    #[error("cannot hold host device {shown} ({rdev}) exclusively: {errno}")]
    Hold { shown: String, rdev: String, errno: Errno },
}
}

/// What a device the host uses asks of the operator.
const FREE_IT: &str =
    "free it there first (unmount it, swapoff, remove the holder) or publish another device";

/// What a path given as a volume's device is, when it is not a block device.
#[derive(Debug, Clone)]
pub enum NotBlock {
    /// Nothing there, or nothing crustd can look at.
    Missing(Arc<io::Error>),
    Directory,
    /// A regular file (an image not attached to a loop device).
    RegularFile,
    /// Anything else: a character device, a FIFO, a socket.
    Other,
}

impl fmt::Display for NotBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            NotBlock::Missing(e) => return write!(f, "is not a block device on this host: {e}"),
            NotBlock::Directory => "a directory",
            NotBlock::RegularFile => {
                "a regular file (attach it with losetup and give the /dev/loopN)"
            }
            NotBlock::Other => "not a block device",
        };
        write!(
            f,
            "is {kind}: give the block device of the volume, e.g. /dev/sdx"
        )
    }
}

/// Why a recorded device number names no device now.
#[derive(Debug, Clone)]
pub enum Vanished {
    /// The record holds no `MAJOR:MINOR`.
    NotANumber,
    /// sysfs has nothing for it.
    Sysfs(Arc<io::Error>),
    /// sysfs names no device node for it.
    NoNode,
}

impl fmt::Display for Vanished {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Vanished::NotANumber => f.write_str("not a device number"),
            Vanished::Sysfs(e) => write!(f, "{e}"),
            Vanished::NoNode => f.write_str("sysfs names no device node"),
        }
    }
}

/// A device as its caller named it, and its node: shown as
/// "/dev/disk/by-id/x (/dev/loop3)", or "/dev/loop3" when that is what was
/// given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub given: String,
    pub node: PathBuf,
}

impl Named {
    pub fn new(given: &str, node: &Path) -> Named {
        Named {
            given: given.to_string(),
            node: node.to_path_buf(),
        }
    }
}

impl fmt::Display for Named {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.node.as_os_str() == std::ffi::OsStr::new(&self.given) {
            f.write_str(&self.given)
        } else {
            write!(f, "{} ({})", self.given, self.node.display())
        }
    }
}

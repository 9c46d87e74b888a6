//! What stops an fsGroup walk as a whole (a single entry that cannot be
//! changed only counts as one of the report's `errors`), with its code.

use std::io;
use std::path::PathBuf;

use crate::cancel::Stopped;
use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;

crate::code::coded_errors! {
/// What can go wrong in the walk as a whole (single entries only count as `errors`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("the volume root {} is not a directory, so fsGroup cannot be applied to it", shown(root))]
    RootNotDirectory {
        root: PathBuf,
    },
    #[code(Internal)]
    #[error("applying fsGroup {gid} stopped: directory {} could not be read: {source}; entries changed before that keep their new group and mode; check the filesystem's health (GetVolumeStats)", shown(dir))]
    ReadDir {
        /// The fsGroup being applied.
        gid: u32,
        /// The directory, for display.
        dir: PathBuf,
        /// The errno.
        #[source]
        source: io::Error,
    },
    #[code(ResourceExhausted)]
    #[error("applying fsGroup {gid} stopped at {}: the agent ran out of file descriptors ({source}); entries changed before that keep their new group and mode, and a retry completes the walk", shown(dir))]
    OutOfFds {
        /// The fsGroup being applied.
        gid: u32,
        /// The directory being opened, for display.
        dir: PathBuf,
        /// The errno.
        #[source]
        source: io::Error,
    },
    #[code(inner)]
    #[error("{why} while {during}: stopped; entries changed before that keep their new group and mode (a chown cannot be undone safely), and a retry completes the walk", why = .0.why.text(), during = .0.during)]
    Stopped(#[from] Stopped),
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

//! Holding a mounted filesystem still, and giving its free space back: the
//! kernel's own ioctls on the mount's root directory, each wrapped once.
//! FIFREEZE flushes every dirty page, commits the journal and blocks every
//! new write until FITHAW (what qemu-ga's `guest-fsfreeze-freeze` and
//! util-linux's `fsfreeze` call); FITRIM discards the free extents of a
//! byte range (util-linux's `fstrim`), answering how many bytes it
//! discarded. Every kernel the agent runs on has all three for ext4 and
//! xfs (since 2.6.29 and 2.6.37); whether a disk takes discards is the
//! disk's to say, per call.

use std::fs::File;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::ioctl::{opcode, Opcode};

use crate::sys::beneath;
use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;

crate::code::coded_errors! {
/// What can go wrong freezing, thawing or trimming a filesystem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("the filesystem at {} is already frozen by something other than the agent (FIFREEZE says EBUSY); thaw it there first", shown(path))]
    FrozenElsewhere {
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("the filesystem at {} cannot be frozen (FIFREEZE says EOPNOTSUPP)", shown(path))]
    CannotFreeze {
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("the disk under {} does not take discards, so there is nothing to give back (FITRIM says EOPNOTSUPP); the host must attach it with discard enabled (QEMU: discard=unmap)", shown(path))]
    NoDiscard {
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("the filesystem at {} is mounted read-only; a read-only filesystem is not trimmed", shown(path))]
    ReadOnly {
        path: PathBuf,
    },
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

/// `struct fstrim_range` of <linux/fs.h>.
#[repr(C)]
struct FstrimRange {
    start: u64,
    len: u64,
    minlen: u64,
}

const _: () = assert!(std::mem::size_of::<FstrimRange>() == 24);

const FIFREEZE: Opcode = opcode::read_write::<libc::c_int>(b'X', 119);
const FITHAW: Opcode = opcode::read_write::<libc::c_int>(b'X', 120);
const FITRIM: Opcode = opcode::read_write::<FstrimRange>(b'X', 121);

/// The mount root `at` names (an O_PATH fd the caller checked is the
/// volume's own mount), opened for the ioctls.
pub fn open(at: BorrowedFd<'_>, path: &Path) -> Result<File, Error> {
    File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_DIRECTORY)
        .open(beneath::proc_path(at))
        .map_err(|e| SysError::new("open", path.display(), e).into())
}

/// Freezes the filesystem `dir` is the root of: returns once every dirty
/// page is on the disk and the journal is clean; writes block until [`thaw`].
pub fn freeze(dir: &File, path: &Path) -> Result<(), Error> {
    // SAFETY: FIFREEZE takes no argument (the kernel ignores it); `dir` is
    // an open fd for the call's length.
    let r = unsafe { rustix::ioctl::ioctl(dir, rustix::ioctl::NoArg::<FIFREEZE>::new()) };
    r.map_err(|e| match e {
        rustix::io::Errno::BUSY => Error::FrozenElsewhere {
            path: path.to_path_buf(),
        },
        rustix::io::Errno::OPNOTSUPP => Error::CannotFreeze {
            path: path.to_path_buf(),
        },
        e => SysError::new("FIFREEZE", path.display(), e).into(),
    })
}

/// Thaws the filesystem `dir` is the root of. False when it was not frozen
/// (EINVAL): thawing is idempotent.
pub fn thaw(dir: &File, path: &Path) -> Result<bool, Error> {
    // SAFETY: FITHAW takes no argument; `dir` is an open fd for the call.
    let r = unsafe { rustix::ioctl::ioctl(dir, rustix::ioctl::NoArg::<FITHAW>::new()) };
    match r {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::INVAL) => Ok(false),
        Err(e) => Err(SysError::new("FITHAW", path.display(), e).into()),
    }
}

/// Discards the free extents of at least `min_len` bytes within `len` bytes
/// from `start` of the filesystem `dir` is the root of; answers the bytes
/// the filesystem discarded.
pub fn trim(dir: &File, path: &Path, start: u64, len: u64, min_len: u64) -> Result<u64, Error> {
    let mut range = FstrimRange {
        start,
        len,
        minlen: min_len,
    };
    // SAFETY: FITRIM reads and writes one `struct fstrim_range` (24 bytes,
    // the layout above), which lives for the call.
    let r = unsafe {
        rustix::ioctl::ioctl(
            dir,
            rustix::ioctl::Updater::<FITRIM, FstrimRange>::new(&mut range),
        )
    };
    match r {
        Ok(()) => Ok(range.len),
        Err(rustix::io::Errno::OPNOTSUPP) => Err(Error::NoDiscard {
            path: path.to_path_buf(),
        }),
        Err(rustix::io::Errno::ROFS) => Err(Error::ReadOnly {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(SysError::new("FITRIM", path.display(), io::Error::from(e)).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_testkit::{needs, LoopDisk, Mounted};
    use std::os::fd::AsFd;
    use std::time::Duration;

    fn mounted(fs: &str) -> (LoopDisk, Mounted) {
        needs::loop_devices();
        let disk = LoopDisk::new(320, Some(fs));
        let m = Mounted::new(&disk.device, fs, "");
        (disk, m)
    }

    fn dir_of(m: &Mounted) -> File {
        let at = rustix::fs::open(
            &m.path,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        open(at.as_fd(), &m.path).unwrap()
    }

    /// A write into a frozen filesystem blocks until the thaw, and a second
    /// freeze is refused; thawing twice is fine.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_frozen_filesystem_holds_writes_until_thawed() {
        for fs in ["ext4", "xfs"] {
            let (_disk, m) = mounted(fs);
            let dir = dir_of(&m);
            freeze(&dir, &m.path).unwrap();
            assert!(matches!(
                freeze(&dir, &m.path),
                Err(Error::FrozenElsewhere { .. })
            ));
            let file = m.path.join("f");
            let (tx, rx) = std::sync::mpsc::channel();
            let writer = std::thread::spawn(move || {
                std::fs::write(&file, b"x").unwrap();
                tx.send(()).unwrap();
            });
            assert!(
                rx.recv_timeout(Duration::from_millis(500)).is_err(),
                "{fs}: a write went through a frozen filesystem"
            );
            assert!(thaw(&dir, &m.path).unwrap());
            rx.recv_timeout(Duration::from_secs(10))
                .expect("the write ends after the thaw");
            writer.join().unwrap();
            assert!(!thaw(&dir, &m.path).unwrap(), "{fs}: thawed twice");
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn trim_answers_bytes_or_says_the_disk_takes_no_discards() {
        for fs in ["ext4", "xfs"] {
            let (_disk, m) = mounted(fs);
            let dir = dir_of(&m);
            // A loop device over a file takes discards (it punches holes).
            let n = trim(&dir, &m.path, 0, u64::MAX, 0).unwrap();
            assert!(n > 0, "{fs}: trimmed {n} bytes of a fresh filesystem");
        }
    }
}

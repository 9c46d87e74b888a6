//! The records on disk: `ROOT/E/mountInfo.json` read through the record
//! directory's fd (a real directory and a regular file, root's and not
//! writable by others, bounded), and the sandbox-id files crustd writes and
//! removes beside it. Every syscall on the records is here; what the bytes
//! mean is `record`'s.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crust_protocols::code::Code;
use crust_protocols::names::BadName;
use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::record::{encode, parse_record, MountInfo, Record, RecordError};
use crate::files::{self, ReadError};
use crate::registry;

crust_protocols::coded_errors! {
/// Why a direct-volume record, or its sandbox-id file, was not used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(InvalidArgument)]
    #[error("volume_path is empty: give the path the CSI driver filed its direct-volume record under (its target path)")]
    EmptyPath,
    #[code(InvalidArgument)]
    #[error("volume_path {shown:?} contains a NUL byte")]
    NulInPath { shown: String },
    #[code(InvalidArgument)]
    #[error("volume_path {shown:?} is too long for a direct-volume record: its base64 name has {len} bytes, a file name at most {NAME_MAX} (Kata's package cannot file it either)")]
    LongPath { shown: String, len: usize },
    /// The rule for sandbox ids.
    #[code(InvalidArgument)]
    #[error(transparent)]
    BadId(#[from] BadName),
    #[code(NotFound)]
    #[error("no direct-volume record for volume path {shown:?}: {} does not exist (crustd looks in {}, its --direct-volumes; the CSI driver writes the record, e.g. with crustd-ctl direct-volume add)", .file.display(), .root.display())]
    NoRecord { shown: String, file: PathBuf, root: PathBuf },
    /// The record's directory is not a real directory, or not root's alone.
    #[code(InvalidArgument)]
    #[error("direct-volume record {} is refused: {why}", .dir.display())]
    BadDirectory { dir: PathBuf, why: BadDirectory },
    /// The record's file, or what it says.
    #[code(why => why.code())]
    #[error("direct-volume record {} (volume path {shown:?}) is refused: {why}", .file.display())]
    Refused { file: PathBuf, shown: String, why: Refusal },
    /// Something other than a regular file where the sandbox-id file goes:
    /// `publishing` when a publish is about to write it.
    #[code(FailedPrecondition)]
    #[error("{} is {kind}, {}", .path.display(), if *.publishing { "where crustd writes the empty sandbox-id file: remove it, then publish again" } else { "not the empty file crustd writes for the sandbox; remove it" })]
    NotAFile { path: PathBuf, kind: &'static str, publishing: bool },
    #[code(FailedPrecondition)]
    #[error("{} names more than one sandbox ({}): a direct volume is in one sandbox at a time; remove the stale files", .dir.display(), .ids.join(", "))]
    ManySandboxes { dir: PathBuf, ids: Vec<String> },
    #[code(InvalidArgument)]
    #[error("--mount-info is not a record: {0}")]
    NotARecord(RecordError),
    #[code(FailedPrecondition)]
    #[error("{} should be a directory (a symbolic link is not followed): {source}", .dir.display())]
    NotADirectory { dir: PathBuf, source: Arc<io::Error> },
    /// What could not be opened, read or written, and why.
    #[code(Internal)]
    #[error("{doing}{}: {source}", .path.display())]
    Io { doing: Doing, path: PathBuf, source: Arc<io::Error> },
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// What crustd was doing with a record's file when the system refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Doing {
    OpenRoot,
    Open,
    Stat,
    Read,
    /// Making, writing or removing: the path says which.
    Change,
}

impl fmt::Display for Doing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Doing::OpenRoot => "cannot open the direct-volume directory ",
            Doing::Open => "cannot open ",
            Doing::Stat => "cannot stat ",
            Doing::Read => "cannot read ",
            Doing::Change => "",
        })
    }
}

/// Why a record's directory is refused.
#[derive(Debug, Clone)]
pub enum BadDirectory {
    /// Not a real directory: what it is.
    Not(&'static str),
    Unsafe(Unsafe),
}

impl fmt::Display for BadDirectory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadDirectory::Not(what) => write!(
                f,
                "it is {what}, not a real directory (a symbolic link is not followed)"
            ),
            BadDirectory::Unsafe(u) => write!(f, "{u}"),
        }
    }
}

/// Why a record's file, or its bytes, are refused.
#[derive(Debug, Clone)]
pub enum Refusal {
    /// Not a file crustd reads as a record.
    File(ReadError<Unsafe>),
    /// Bytes that are no record crustd publishes.
    Record(RecordError),
}

impl Refusal {
    /// INVALID_ARGUMENT, or the record's own (UNIMPLEMENTED for encryption).
    pub fn code(&self) -> Code {
        match self {
            Refusal::File(_) => Code::InvalidArgument,
            Refusal::Record(e) => e.code(),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::File(e @ ReadError::TooLarge(_)) => {
                write!(f, "{e} (at most {MAX_RECORD} bytes)")
            }
            Refusal::File(e) => write!(f, "{e}"),
            Refusal::Record(e) => write!(f, "{e}"),
        }
    }
}

/// A record's directory or file that is not root's alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsafe {
    /// Owned by this uid.
    Owner(u32),
    /// Writable by group or others: its mode.
    Writable(u32),
}

impl fmt::Display for Unsafe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unsafe::Owner(uid) => write!(
                f,
                "it is owned by uid {uid}, not root (only root may write a record)"
            ),
            Unsafe::Writable(mode) => write!(
                f,
                "it is writable by group or others (mode {mode:04o}); a record is root's alone"
            ),
        }
    }
}

/// Where Kata's Go package and runtime-rs look for records.
pub const DEFAULT_ROOT: &str = "/run/kata-containers/shared/direct-volumes";
/// The record's file name inside its directory.
pub const MOUNT_INFO: &str = "mountInfo.json";
/// The largest record read: a device, a few options and keys need far less.
pub const MAX_RECORD: u64 = 64 << 10;
/// The longest file name (the encoded volume path is one).
const NAME_MAX: usize = 255;

/// A record found and checked.
#[derive(Debug)]
pub struct Found {
    /// `ROOT/E/mountInfo.json`, for messages.
    pub file: PathBuf,
    pub record: Record,
}

/// The record directory of one volume path under a root.
pub struct Records {
    root: PathBuf,
}

/// What a sandbox-id file search found.
#[derive(Debug, PartialEq, Eq)]
pub enum SandboxOf {
    /// No record directory at all.
    NoRecord,
    /// A record, in no sandbox.
    None,
    /// In this sandbox.
    One(String),
}

impl Records {
    pub fn new(root: impl Into<PathBuf>) -> Records {
        Records { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `E` for `volume_path`, or INVALID_ARGUMENT when it cannot name a record.
    pub fn name(&self, volume_path: &[u8]) -> Result<String> {
        let shown = || String::from_utf8_lossy(volume_path).into_owned();
        if volume_path.is_empty() {
            return Err(Error::EmptyPath);
        }
        if volume_path.contains(&0) {
            return Err(Error::NulInPath { shown: shown() });
        }
        let e = encode(volume_path);
        if e.len() > NAME_MAX {
            return Err(Error::LongPath {
                shown: shown(),
                len: e.len(),
            });
        }
        Ok(e)
    }

    /// `ROOT/E` for messages.
    pub fn dir_of(&self, volume_path: &[u8]) -> Result<PathBuf> {
        Ok(self.root.join(self.name(volume_path)?))
    }

    /// Opens ROOT (given by the operator: a symlink there is followed).
    fn open_root(&self) -> io::Result<OwnedFd> {
        files::open_dir(&self.root)
    }

    /// Opens and checks `ROOT/E`: a real directory owned by root and not
    /// writable by group or others. `Ok(None)`: it does not exist.
    fn open_record_dir(&self, volume_path: &[u8]) -> Result<Option<(PathBuf, OwnedFd)>> {
        let name = self.name(volume_path)?;
        let dir = self.root.join(&name);
        let root = match self.open_root() {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(Error::Io {
                    doing: Doing::OpenRoot,
                    path: self.root.clone(),
                    source: Arc::new(e),
                })
            }
        };
        let fd = match files::open_dir_at(root.as_fd(), &name) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) if matches!(e.raw_os_error(), Some(c) if c == Errno::LOOP.raw_os_error() || c == Errno::NOTDIR.raw_os_error()) =>
            {
                let what = rfs::statat(root.as_fd(), name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                    .map(|st| files::kind(FileType::from_raw_mode(st.st_mode)))
                    .unwrap_or("not a directory");
                return Err(Error::BadDirectory {
                    dir,
                    why: BadDirectory::Not(what),
                });
            }
            Err(e) => {
                return Err(Error::Io {
                    doing: Doing::Open,
                    path: dir,
                    source: Arc::new(e),
                })
            }
        };
        let st = match rfs::fstat(&fd) {
            Ok(st) => st,
            Err(e) => {
                return Err(Error::Io {
                    doing: Doing::Stat,
                    path: dir,
                    source: Arc::new(e.into()),
                })
            }
        };
        if let Err(u) = safe_owner(&st) {
            return Err(Error::BadDirectory {
                dir,
                why: BadDirectory::Unsafe(u),
            });
        }
        Ok(Some((dir, fd)))
    }

    /// Finds, checks and parses the record for `volume_path`. No record:
    /// NOT_FOUND naming the path and where crustd looked; a record refused:
    /// its code (INVALID_ARGUMENT, UNIMPLEMENTED for encryption) and a
    /// sentence naming the file.
    pub fn read(&self, volume_path: &[u8]) -> Result<Found> {
        let shown = String::from_utf8_lossy(volume_path).into_owned();
        let file = self.dir_of(volume_path)?.join(MOUNT_INFO);
        let missing = |file: PathBuf, shown: String| Error::NoRecord {
            shown,
            file,
            root: self.root.clone(),
        };
        let Some((_, dir)) = self.open_record_dir(volume_path)? else {
            return Err(missing(file, shown));
        };
        let refused = |file, shown, why| Error::Refused { file, shown, why };
        let bytes =
            match files::read_bounded_checked(dir.as_fd(), MOUNT_INFO, MAX_RECORD, safe_owner) {
                Ok(b) => b,
                Err(ReadError::Missing) => return Err(missing(file, shown)),
                Err(ReadError::Io(source)) => {
                    return Err(Error::Io {
                        doing: Doing::Read,
                        path: file,
                        source,
                    })
                }
                Err(e) => return Err(refused(file, shown, Refusal::File(e))),
            };
        match parse_record(&bytes) {
            Ok(record) => Ok(Found { file, record }),
            Err(e) => Err(refused(file, shown, Refusal::Record(e))),
        }
    }

    /// Writes the empty sandbox-id file `ROOT/E/S` (mode 0600) as Kata's
    /// `RecordSandboxID` does, and removes any other sandbox's (a record is
    /// in one sandbox at a time, and crustd's claims just proved no other
    /// has the device). A record gone meanwhile is left gone.
    pub fn record_sandbox(&self, volume_path: &[u8], sandbox: &str) -> Result<()> {
        registry::check_id(sandbox)?;
        let Some((dir, fd)) = self.open_record_dir(volume_path)? else {
            return Ok(());
        };
        for other in sandbox_files(fd.as_fd()).map_err(|e| io_err(&dir, e))? {
            if other != sandbox {
                remove_at(fd.as_fd(), &other).map_err(|e| io_err(&dir.join(&other), e))?;
            }
        }
        match files::create_exclusive(fd.as_fd(), sandbox) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let st = rfs::statat(fd.as_fd(), sandbox, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|e| io_err(&dir.join(sandbox), e.into()))?;
                let t = FileType::from_raw_mode(st.st_mode);
                if t == FileType::RegularFile {
                    Ok(())
                } else {
                    Err(Error::NotAFile {
                        path: dir.join(sandbox),
                        kind: files::kind(t),
                        publishing: false,
                    })
                }
            }
            Err(e) => Err(io_err(&dir.join(sandbox), e)),
        }
    }

    /// Refuses, before anything is plugged, a record directory where the
    /// sandbox-id file of `sandbox` could not be written: something other
    /// than a regular file already has its name (FAILED_PRECONDITION).
    pub fn check_sandbox_slot(&self, volume_path: &[u8], sandbox: &str) -> Result<()> {
        registry::check_id(sandbox)?;
        let Some((dir, fd)) = self.open_record_dir(volume_path)? else {
            return Ok(());
        };
        match rfs::statat(fd.as_fd(), sandbox, AtFlags::SYMLINK_NOFOLLOW) {
            Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(io_err(&dir.join(sandbox), e.into())),
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile => Ok(()),
            Ok(st) => Err(Error::NotAFile {
                path: dir.join(sandbox),
                kind: files::kind(FileType::from_raw_mode(st.st_mode)),
                publishing: true,
            }),
        }
    }

    /// Removes `ROOT/E/S`, if the record is still there.
    pub fn forget_sandbox(&self, volume_path: &[u8], sandbox: &str) -> Result<()> {
        let name = self.name(volume_path)?;
        let Ok(root) = self.open_root() else {
            return Ok(());
        };
        // Not checked as a record is: crustd only removes its own file here.
        let Ok(fd) = files::open_dir_at(root.as_fd(), &name) else {
            return Ok(());
        };
        remove_at(fd.as_fd(), sandbox).map_err(|e| io_err(&self.root.join(&name).join(sandbox), e))
    }

    /// The sandbox the record of `volume_path` is in, by its sandbox-id file.
    pub fn sandbox_of(&self, volume_path: &[u8]) -> Result<SandboxOf> {
        let Some((dir, fd)) = self.open_record_dir(volume_path)? else {
            return Ok(SandboxOf::NoRecord);
        };
        let mut ids = sandbox_files(fd.as_fd()).map_err(|e| io_err(&dir, e))?;
        match ids.len() {
            0 => Ok(SandboxOf::None),
            1 => Ok(SandboxOf::One(ids.remove(0))),
            _ => Err(Error::ManySandboxes { dir, ids }),
        }
    }

    /// `direct-volume add`, as Kata's `Add`: checks that `mount_info`
    /// parses as a record, makes `ROOT/E` (mode 0700, ROOT too if missing)
    /// and writes `mount_info` as given to `mountInfo.json` (mode 0600),
    /// replacing it atomically.
    pub fn add(&self, volume_path: &[u8], mount_info: &[u8]) -> Result<PathBuf> {
        MountInfo::from_json(mount_info).map_err(Error::NotARecord)?;
        let name = self.name(volume_path)?;
        let dir = self.root.join(&name);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .map_err(|e| io_err(&self.root, e))?;
        let root = self.open_root().map_err(|e| io_err(&self.root, e))?;
        match rfs::mkdirat(root.as_fd(), name.as_str(), Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(io_err(&dir, e.into())),
        }
        let fd = match files::open_dir_at(root.as_fd(), &name) {
            Ok(fd) => fd,
            Err(e) => {
                return Err(Error::NotADirectory {
                    dir,
                    source: Arc::new(e),
                })
            }
        };
        files::write_atomic(fd.as_fd(), MOUNT_INFO, mount_info)
            .map_err(|e| io_err(&dir.join(MOUNT_INFO), e))?;
        Ok(dir.join(MOUNT_INFO))
    }

    /// `direct-volume remove`, as Kata's `Remove`: the record directory and
    /// everything in it (no symlink followed); none is fine.
    pub fn remove(&self, volume_path: &[u8]) -> Result<()> {
        let dir = self.dir_of(volume_path)?;
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&dir, e)),
            _ => Ok(()),
        }
    }
}

/// A record's directory and file must be root's and writable by root only.
fn safe_owner(st: &rfs::Stat) -> Result<(), Unsafe> {
    if st.st_uid != 0 {
        return Err(Unsafe::Owner(st.st_uid));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(Unsafe::Writable(st.st_mode & 0o7777));
    }
    Ok(())
}

/// The sandbox-id files in a record directory: regular files whose names
/// are sandbox ids (not `mountInfo.json`, not hidden), sorted.
fn sandbox_files(dir: BorrowedFd<'_>) -> io::Result<Vec<String>> {
    let fd = rfs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut out = Vec::new();
    for entry in rfs::Dir::read_from(&fd)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().to_str() else {
            continue;
        };
        if name == MOUNT_INFO || name.starts_with('.') || registry::check_id(name).is_err() {
            continue;
        }
        let regular = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile);
        if regular {
            out.push(name.to_string());
        }
    }
    out.sort();
    Ok(out)
}

/// Unlinks `name` in `dir` (never a directory, never through a symlink); none is fine.
fn remove_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    match rfs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn io_err(path: &Path, e: io::Error) -> Error {
    Error::Io {
        doing: Doing::Change,
        path: path.to_path_buf(),
        source: Arc::new(e),
    }
}

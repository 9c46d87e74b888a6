//! Where groups are kept across crustd's restarts: one file per group,
//! `DIR/crustd+freezes/<group id>.json` in the sandbox registry, written
//! whole and atomically (`files::write_atomic`). The name holds a `+`,
//! which no sandbox id may, so no sandbox is ever looked for there.
//!
//! Whoever starts VMs can write in the registry, so the directory must be
//! crustd's own (its owner crustd's user, writable by nobody else; made
//! 0700), reached without following a symlink, and every record is read
//! as untrusted input: a regular file of bounded size, in a bounded
//! number, its JSON checked (`Group::check`) and its id its file's name.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{self as rfs, AtFlags, Mode};
use rustix::io::Errno;

use crust_protocols::freeze::{check_id, ENDED_KEPT};

use super::error::{FreezeError, Placement, Unwritten};
use super::group::{Group, Unlike, MAX_GROUPS};
use crate::files::{self, ReadError};

/// The directory's name in the registry.
pub const DIR_NAME: &str = "crustd+freezes";
/// The largest record read (64 volumes with PATH_MAX names need far less).
pub const MAX_RECORD: u64 = 4 << 20;
/// The most records a start reads: every group crustd keeps, and some
/// that were on their way out.
pub const MAX_LOADED: usize = MAX_GROUPS + ENDED_KEPT + 64;

/// The records' directory of one registry.
#[derive(Debug, Clone)]
pub struct Store {
    /// The sandbox registry it sits in.
    registry: PathBuf,
}

impl Store {
    pub fn new(registry: &Path) -> Store {
        Store {
            registry: registry.to_path_buf(),
        }
    }

    /// The directory, for messages.
    pub fn dir(&self) -> PathBuf {
        self.registry.join(DIR_NAME)
    }

    fn place(&self, why: Placement) -> FreezeError {
        FreezeError::Place {
            dir: self.dir(),
            why,
        }
    }

    /// Opens the directory (made 0700 when `create` and missing), checked
    /// to be crustd's own; `None` when it is missing and not to be made.
    fn open(&self, create: bool) -> Result<Option<OwnedFd>, FreezeError> {
        let reg = match files::open_dir(&self.registry) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound && !create => return Ok(None),
            Err(e) => return Err(self.place(Placement::Unreachable(Arc::new(e)))),
        };
        if create {
            match rfs::mkdirat(reg.as_fd(), DIR_NAME, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(self.place(Placement::Unmade(e))),
            }
        }
        let dir = match files::open_dir_at(reg.as_fd(), DIR_NAME) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound && !create => return Ok(None),
            Err(e) => return Err(self.place(Placement::NotADirectory(Arc::new(e)))),
        };
        let st = rfs::fstat(&dir).map_err(|e| self.place(Placement::Unstated(e)))?;
        let me = rustix::process::geteuid().as_raw();
        if st.st_uid != me {
            return Err(self.place(Placement::Owner(st.st_uid)));
        }
        if st.st_mode & 0o022 != 0 {
            return Err(self.place(Placement::Writable(st.st_mode & 0o7777)));
        }
        Ok(Some(dir))
    }

    /// Writes `g`'s record, replacing the one before.
    pub fn write(&self, g: &Group) -> Result<(), FreezeError> {
        let failed = |why| FreezeError::Write {
            id: g.id.clone(),
            dir: self.dir(),
            why,
        };
        let text = serde_json::to_vec(g).map_err(|e| failed(Unwritten::Encode(Arc::new(e))))?;
        if u64::try_from(text.len()).map_or(true, |n| n > MAX_RECORD) {
            return Err(failed(Unwritten::TooLarge {
                bytes: text.len(),
                max: MAX_RECORD,
            }));
        }
        let Some(dir) = self.open(true)? else {
            return Err(failed(Unwritten::RegistryGone));
        };
        files::write_atomic(dir.as_fd(), &file_name(&g.id), &text)
            .map_err(|e| failed(Unwritten::Write(Arc::new(e))))
    }

    /// Removes group `id`'s record (none is fine).
    pub fn remove(&self, id: &str) -> Result<(), FreezeError> {
        let Some(dir) = self.open(false)? else {
            return Ok(());
        };
        match rfs::unlinkat(dir.as_fd(), file_name(id).as_str(), AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(FreezeError::Write {
                id: id.to_string(),
                dir: self.dir(),
                why: Unwritten::Remove(e),
            }),
        }
    }

    /// Every record that passes the checks, at most [`MAX_LOADED`], and
    /// what was refused or left unread. A temporary left by a write that
    /// was cut short is removed.
    pub fn load(&self) -> (Vec<Group>, Vec<Unread>) {
        let mut refused = Vec::new();
        let dir = match self.open(false) {
            Ok(Some(d)) => d,
            Ok(None) => return (Vec::new(), refused),
            Err(e) => {
                refused.push(Unread::Directory(e));
                return (Vec::new(), refused);
            }
        };
        let mut names = match names(&dir) {
            Ok(n) => n,
            Err(e) => {
                refused.push(Unread::Unlisted {
                    dir: self.dir(),
                    source: Arc::new(e),
                });
                return (Vec::new(), refused);
            }
        };
        names.sort();
        if names.len() > MAX_LOADED {
            refused.push(Unread::TooMany {
                dir: self.dir(),
                count: names.len(),
            });
            names.truncate(MAX_LOADED);
        }
        let mut groups = Vec::new();
        for name in names {
            match read(&dir, &name) {
                Ok(g) => groups.push(g),
                Err(why) => refused.push(Unread::Record {
                    file: self.dir().join(&name),
                    why,
                }),
            }
        }
        (groups, refused)
    }
}

/// What a start did not read of the records, for the log.
#[derive(Debug, Clone)]
pub enum Unread {
    /// The directory is not crustd's own.
    Directory(FreezeError),
    Unlisted {
        dir: PathBuf,
        source: Arc<io::Error>,
    },
    /// More records than crustd reads: how many.
    TooMany { dir: PathBuf, count: usize },
    /// One record, refused.
    Record { file: PathBuf, why: Unused },
}

impl fmt::Display for Unread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unread::Directory(e) => write!(f, "{e}"),
            Unread::Unlisted { dir, source } => {
                write!(f, "cannot list {}: {source}", dir.display())
            }
            Unread::TooMany { dir, count } => write!(
                f,
                "{} holds {count} records, more than the {MAX_LOADED} crustd reads: the rest are left unread",
                dir.display()
            ),
            Unread::Record { file, why } => {
                write!(f, "the freeze record {} is not used: {why}", file.display())
            }
        }
    }
}

/// Why one record is not used.
#[derive(Debug, Clone)]
pub enum Unused {
    /// Not a file crustd reads as a record.
    File(ReadError),
    NotAGroup(Arc<serde_json::Error>),
    /// A group unlike any crustd writes.
    Unlike(Unlike),
    /// It names another group than its file's name does.
    NotItsFile {
        id: String,
    },
}

impl fmt::Display for Unused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unused::File(e) => write!(f, "{e}"),
            Unused::NotAGroup(e) => write!(f, "it is not a group's record ({e})"),
            Unused::Unlike(why) => write!(f, "it holds {why}"),
            Unused::NotItsFile { id } => {
                write!(f, "it names group {id}, not its own file's")
            }
        }
    }
}

/// A group's record's name.
fn file_name(id: &str) -> String {
    format!("{id}.json")
}

/// The names of the records in `dir` (a group id and `.json`); the
/// temporaries of writes cut short are removed on the way.
fn names(dir: &OwnedFd) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    let listing = rfs::Dir::read_from(dir)?;
    for entry in listing {
        let entry = entry?;
        let Ok(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if name.starts_with('.') && name.contains(".json.tmp.") {
            let _ = rfs::unlinkat(dir.as_fd(), name.as_str(), AtFlags::empty());
            continue;
        }
        if name
            .strip_suffix(".json")
            .is_some_and(|id| check_id(id).is_ok())
        {
            out.push(name);
        }
    }
    Ok(out)
}

/// One record, read and checked.
fn read(dir: &OwnedFd, name: &str) -> Result<Group, Unused> {
    let text = files::read_bounded(dir.as_fd(), name, MAX_RECORD).map_err(Unused::File)?;
    let g: Group = serde_json::from_slice(&text).map_err(|e| Unused::NotAGroup(Arc::new(e)))?;
    g.check().map_err(Unused::Unlike)?;
    if file_name(&g.id) != name {
        return Err(Unused::NotItsFile { id: g.id });
    }
    Ok(g)
}

//! How crustd touches files that others can write: a sandbox's directory,
//! its `sandbox.json` and crustd's own `crustd.json`. Whoever starts VMs
//! writes there, so every name is opened relative to a directory fd and
//! never through a symlink; a file is read only when it is a regular file
//! of bounded size, opened without blocking (a FIFO would hang the reader);
//! and a file is replaced through a temporary created exclusively under an
//! unpredictable name, then renamed, so a planted symlink redirects nothing.
//! Beneath a directory crustd was given (Kata's runtime directory), a path of
//! several components is resolved by the kernel with no symbolic link in any
//! of them (`openat2`), and must have that one name only (no hard link of it
//! elsewhere), so no link can lead into another sandbox's files.

use std::convert::Infallible;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Opens the directory `path` (given by the operator; symlinks followed).
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(rfs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens the directory `name` in `dir`, refusing a symlink there (ELOOP or
/// ENOTDIR), so a sandbox's directory cannot send crustd elsewhere.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<OwnedFd> {
    Ok(rfs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Whether `name` exists in `dir` (a symlink counts; it is not followed).
pub fn exists_at(dir: BorrowedFd<'_>, name: &str) -> bool {
    rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).is_ok()
}

/// Why a file was not read; `R`, why the caller's check refused it.
#[derive(Debug, Clone)]
pub enum ReadError<R = Infallible> {
    /// Nothing by that name.
    Missing,
    /// A symbolic link on the way beneath a directory, which is not followed.
    Linked,
    /// Beneath a directory, a file with more names than one (hard links):
    /// how many.
    Names(u64),
    /// Something that is not a regular file: what it is ("a FIFO").
    NotRegular(&'static str),
    /// A regular file larger than the bound: its size in bytes.
    TooLarge(u64),
    /// The caller's check refused the open file: why.
    Refused(R),
    /// Any other failure.
    Io(Arc<io::Error>),
}

impl<R: std::fmt::Display> std::fmt::Display for ReadError<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Missing => write!(f, "it does not exist"),
            ReadError::Linked => write!(f, "{LINKED}"),
            ReadError::Names(n) => write!(f, "{}", Counted(*n)),
            ReadError::NotRegular(what) => write!(f, "it is {what}, not a regular file"),
            ReadError::TooLarge(n) => {
                write!(f, "it holds {n} bytes or more, more than crustd reads")
            }
            ReadError::Refused(why) => write!(f, "{why}"),
            ReadError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// What a file type is, in words.
pub fn kind(t: FileType) -> &'static str {
    match t {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symbolic link",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Unknown => "of an unknown type",
    }
}

/// Reads `name` in `dir` when it is a regular file of at most `max` bytes.
/// Opened with O_NONBLOCK (a FIFO opens at once and is then refused),
/// O_NOFOLLOW (a symlink is refused) and O_NOCTTY; the size is checked on
/// the open file, and the read stops one byte past the bound whatever
/// fstat said (a file that grows while read).
pub fn read_bounded(dir: BorrowedFd<'_>, name: &str, max: u64) -> Result<Vec<u8>, ReadError> {
    read_bounded_checked(dir, name, max, |_| Ok(()))
}

/// As [`read_bounded`], and `check` judges the open file's metadata (its
/// owner and mode, say) before a byte is read: its refusal is
/// [`ReadError::Refused`].
pub fn read_bounded_checked<R>(
    dir: BorrowedFd<'_>,
    name: &str,
    max: u64,
    check: impl FnOnce(&rfs::Stat) -> Result<(), R>,
) -> Result<Vec<u8>, ReadError<R>> {
    let fd =
        rfs::openat(dir, name, READ_FLAGS | OFlags::NOFOLLOW, Mode::empty()).map_err(
            |e| match e {
                Errno::NOENT => ReadError::Missing,
                // O_NOFOLLOW on a symlink.
                Errno::LOOP => ReadError::NotRegular("a symbolic link"),
                e => ReadError::Io(Arc::new(e.into())),
            },
        )?;
    read_open(fd, max, NameRule::Any, check)
}

/// As [`read_bounded`], for `rel` beneath `root`: no component of `rel` may
/// be a symbolic link ([`ReadError::Linked`]), the last one included, and
/// the file must have no other name ([`ReadError::Names`]).
pub fn read_bounded_beneath(
    root: BorrowedFd<'_>,
    rel: &Path,
    max: u64,
) -> Result<Vec<u8>, ReadError> {
    let fd = open_beneath(root, rel, READ_FLAGS).map_err(|e| match e {
        Errno::NOENT => ReadError::Missing,
        Errno::LOOP => ReadError::Linked,
        e => ReadError::Io(Arc::new(beneath_error(e))),
    })?;
    read_open(fd, max, NameRule::One, |_| Ok(()))
}

/// A file beneath a directory crustd was given has that one name: a hard
/// link elsewhere (in another sandbox's directory, say) would make it that
/// other place's file as much as this one's. Answers how many names it has
/// otherwise.
fn one_name(st: &rfs::Stat) -> Result<(), u64> {
    // nlink_t is 32 bits wide on some architectures.
    #[allow(clippy::useless_conversion)]
    let n = u64::from(st.st_nlink);
    if n > 1 {
        return Err(n);
    }
    Ok(())
}

/// A file's count of names, in words.
struct Counted(u64);

impl std::fmt::Display for Counted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "it has {} names (hard links), and beneath that directory crustd takes only a file with one, so that no other sandbox's file can stand in for it",
            self.0
        )
    }
}

/// How a file to be read is opened: without blocking (a FIFO opens at once
/// and is then refused) and without becoming a terminal's reader.
const READ_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::NONBLOCK)
    .union(OFlags::NOCTTY)
    .union(OFlags::CLOEXEC);

/// How many names a file read may have.
#[derive(Clone, Copy)]
enum NameRule {
    Any,
    /// One: beneath a directory crustd was given ([`one_name`]).
    One,
}

/// Reads the open file `fd` when it is a regular file of at most `max`
/// bytes, with as many names as `names` allows, that `check` accepts.
fn read_open<R>(
    fd: OwnedFd,
    max: u64,
    names: NameRule,
    check: impl FnOnce(&rfs::Stat) -> Result<(), R>,
) -> Result<Vec<u8>, ReadError<R>> {
    let st = rfs::fstat(&fd).map_err(|e| ReadError::Io(Arc::new(e.into())))?;
    let t = FileType::from_raw_mode(st.st_mode);
    if t != FileType::RegularFile {
        return Err(ReadError::NotRegular(kind(t)));
    }
    if let NameRule::One = names {
        one_name(&st).map_err(ReadError::Names)?;
    }
    check(&st).map_err(ReadError::Refused)?;
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size > max {
        return Err(ReadError::TooLarge(size));
    }
    let mut buf = Vec::new();
    File::from(fd)
        .take(max.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| ReadError::Io(Arc::new(e)))?;
    let read = u64::try_from(buf.len()).unwrap_or(u64::MAX);
    if read > max {
        return Err(ReadError::TooLarge(read));
    }
    Ok(buf)
}

/// What a symbolic link beneath a directory crustd was given means.
const LINKED: &str =
    "a symbolic link lies on its path, and crustd follows none beneath that directory";

/// How a name beneath a directory crustd was given is resolved: nothing
/// outside that directory, and no symbolic link (nor /proc's magic links) in
/// any component, the last included, so a link cannot lead crustd into
/// another sandbox's files, whichever component it replaces.
const NO_LINKS_BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// Opens `rel` beneath `root` with `flags` (and O_CLOEXEC), resolved as
/// [`NO_LINKS_BENEATH`] says; a symbolic link anywhere on the way is ELOOP.
fn open_beneath(root: BorrowedFd<'_>, rel: &Path, flags: OFlags) -> Result<OwnedFd, Errno> {
    rfs::openat2(
        root,
        rel,
        flags | OFlags::CLOEXEC,
        Mode::empty(),
        NO_LINKS_BENEATH,
    )
}

/// An error of [`open_beneath`] other than ENOENT and ELOOP, as an io::Error
/// that says what a missing openat2 means.
fn beneath_error(e: Errno) -> io::Error {
    if e == Errno::NOSYS {
        return io::Error::new(
            io::ErrorKind::Unsupported,
            "this kernel has no openat2, which crustd needs to resolve a path with no symbolic link in it (Linux 5.6 or later)",
        );
    }
    e.into()
}

/// Whether something is at `rel` beneath `root` with no symbolic link on the
/// way there (a symbolic link as the last component counts, unfollowed).
pub fn exists_beneath(root: BorrowedFd<'_>, rel: &Path) -> bool {
    open_beneath(root, rel, OFlags::PATH | OFlags::NOFOLLOW).is_ok()
}

/// Why a socket beneath a directory was not opened.
#[derive(Debug, Clone)]
pub enum SocketError {
    /// Nothing by that name.
    Missing,
    /// A symbolic link on the way, which is not followed.
    Linked,
    /// A socket with more names than one (hard links): how many.
    Names(u64),
    /// Something that is not a socket: what it is ("a regular file").
    NotSocket(&'static str),
    /// Any other failure.
    Io(Arc<io::Error>),
}

impl std::fmt::Display for SocketError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SocketError::Missing => write!(f, "it does not exist"),
            SocketError::Linked => write!(f, "{LINKED}"),
            SocketError::Names(n) => write!(f, "{}", Counted(*n)),
            SocketError::NotSocket(what) => write!(f, "it is {what}, not a socket"),
            SocketError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Opens the socket `rel` beneath `root` with O_PATH, no symbolic link in
/// any component, and checks on the open file that it is a socket with no
/// other name: a descriptor to connect through (`/proc/self/fd`), so the
/// socket judged here is the one reached, whatever the path names by then.
pub fn open_socket_beneath(root: BorrowedFd<'_>, rel: &Path) -> Result<OwnedFd, SocketError> {
    let fd = open_beneath(root, rel, OFlags::PATH).map_err(|e| match e {
        Errno::NOENT => SocketError::Missing,
        Errno::LOOP => SocketError::Linked,
        e => SocketError::Io(Arc::new(beneath_error(e))),
    })?;
    let st = rfs::fstat(&fd).map_err(|e| SocketError::Io(Arc::new(e.into())))?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::Socket => one_name(&st).map(|()| fd).map_err(SocketError::Names),
        t => Err(SocketError::NotSocket(kind(t))),
    }
}

/// How many unpredictable names a write tries before giving up (each taken
/// name is someone else's file: left alone).
const TEMP_TRIES: usize = 8;

/// Replaces `name` in `dir` with `data`, atomically and durably: a
/// temporary `.NAME.tmp.RANDOM` created with O_CREAT|O_EXCL|O_NOFOLLOW (mode
/// 0600; whatever sits at a taken name, a planted symlink included, is
/// neither followed nor touched), written, fsynced, renamed over `name`
/// with renameat (which replaces a symlink at `name` rather than following
/// it), and the directory fsynced.
pub fn write_atomic(dir: BorrowedFd<'_>, name: &str, data: &[u8]) -> io::Result<()> {
    let (tmp, fd) = create_temp(dir, name)?;
    let written = (|| {
        let mut f = File::from(fd);
        f.write_all(data)?;
        f.sync_all()?;
        rfs::renameat(dir, tmp.as_str(), dir, name)?;
        rfs::fsync(dir)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = rfs::unlinkat(dir, tmp.as_str(), AtFlags::empty());
    }
    written
}

/// A new temporary file beside `name`: its name and fd.
fn create_temp(dir: BorrowedFd<'_>, name: &str) -> io::Result<(String, OwnedFd)> {
    let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
    for _ in 0..TEMP_TRIES {
        let tmp = format!(".{name}.tmp.{:016x}", random_u64()?);
        match create_exclusive(dir, &tmp) {
            Ok(fd) => return Ok((tmp, fd)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Creates `name` in `dir`, mode 0600: fails (EEXIST) if anything, a symlink
/// included, is there already.
pub fn create_exclusive(dir: BorrowedFd<'_>, name: &str) -> io::Result<OwnedFd> {
    Ok(rfs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?)
}

/// 64 bits from the kernel's random source.
pub fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    let mut filled = 0;
    while filled < b.len() {
        filled += rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    Ok(u64::from_ne_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn dir(t: &tempfile::TempDir) -> OwnedFd {
        open_dir(t.path()).unwrap()
    }

    #[test]
    fn reads_only_bounded_regular_files() {
        let t = tempfile::tempdir().unwrap();
        let d = dir(&t);
        std::fs::write(t.path().join("ok"), b"{}").unwrap();
        assert_eq!(read_bounded(d.as_fd(), "ok", 2).unwrap(), b"{}");
        assert!(matches!(
            read_bounded(d.as_fd(), "ok", 1),
            Err(ReadError::TooLarge(2))
        ));
        assert!(matches!(
            read_bounded(d.as_fd(), "none", 9),
            Err(ReadError::Missing)
        ));
        // A FIFO nobody writes: refused at once, not waited on.
        rustix::fs::mknodat(
            d.as_fd(),
            "fifo",
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(matches!(
            read_bounded(d.as_fd(), "fifo", 9),
            Err(ReadError::NotRegular("a FIFO"))
        ));
        // A symlink, even to a good file, and one to /dev/zero.
        symlink(t.path().join("ok"), t.path().join("link")).unwrap();
        symlink("/dev/zero", t.path().join("zero")).unwrap();
        for l in ["link", "zero"] {
            assert!(matches!(
                read_bounded(d.as_fd(), l, 9),
                Err(ReadError::NotRegular("a symbolic link"))
            ));
        }
        std::fs::create_dir(t.path().join("sub")).unwrap();
        assert!(matches!(
            read_bounded(d.as_fd(), "sub", 9),
            Err(ReadError::NotRegular("a directory"))
        ));
        // A sparse file far beyond the bound is refused by its size, unread.
        let big = std::fs::File::create(t.path().join("big")).unwrap();
        big.set_len(1 << 40).unwrap();
        assert!(matches!(
            read_bounded(d.as_fd(), "big", 1 << 20),
            Err(ReadError::TooLarge(n)) if n == 1 << 40
        ));
    }

    #[test]
    fn a_planted_symlink_is_neither_followed_nor_replaced_by_a_temporary() {
        let t = tempfile::tempdir().unwrap();
        let d = dir(&t);
        let victim = t.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        symlink(&victim, t.path().join("planted")).unwrap();
        let e = create_exclusive(d.as_fd(), "planted").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        // A dangling one is no different (O_CREAT alone would create its target).
        symlink(t.path().join("made"), t.path().join("dangling")).unwrap();
        assert!(create_exclusive(d.as_fd(), "dangling").is_err());
        assert!(!t.path().join("made").exists());
    }

    #[test]
    fn write_atomic_replaces_and_leaves_nothing_behind() {
        let t = tempfile::tempdir().unwrap();
        let d = dir(&t);
        write_atomic(d.as_fd(), "f", b"one").unwrap();
        write_atomic(d.as_fd(), "f", b"two").unwrap();
        assert_eq!(std::fs::read(t.path().join("f")).unwrap(), b"two");
        let mode = std::fs::metadata(t.path().join("f"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A symlink at the name itself is replaced by the file, its target untouched.
        let victim = t.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        symlink(&victim, t.path().join("g")).unwrap();
        write_atomic(d.as_fd(), "g", b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(t.path().join("g"))
            .unwrap()
            .is_file());
        // A rename that fails (a directory in the way) leaves no temporary.
        std::fs::create_dir_all(t.path().join("h/sub")).unwrap();
        assert!(write_atomic(d.as_fd(), "h", b"x").is_err());
        let mut names: Vec<_> = std::fs::read_dir(t.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["f", "g", "h", "victim"]);
    }

    /// Beneath a directory, a link in any component is refused, the last
    /// one and the directories on the way alike, and so is a file or a
    /// socket with another name (a hard link), under either name.
    #[test]
    fn beneath_a_directory_no_component_may_be_a_link() {
        let t = tempfile::tempdir().unwrap();
        let d = dir(&t);
        let p = t.path();
        std::fs::create_dir_all(p.join("a/b")).unwrap();
        std::fs::write(p.join("a/b/f"), b"{}").unwrap();
        let _l = std::os::unix::net::UnixListener::bind(p.join("a/b/s")).unwrap();
        symlink(p.join("a"), p.join("la")).unwrap();
        symlink(p.join("a/b"), p.join("a/lb")).unwrap();
        symlink(p.join("a/b/f"), p.join("a/b/lf")).unwrap();
        symlink(p.join("a/b/s"), p.join("a/b/ls")).unwrap();
        std::fs::hard_link(p.join("a/b/s"), p.join("a/b/hs")).unwrap();
        let read = |rel: &str| read_bounded_beneath(d.as_fd(), Path::new(rel), 9);
        assert_eq!(read("a/b/f").unwrap(), b"{}");
        for rel in ["la/b/f", "a/lb/f", "a/b/lf"] {
            assert!(matches!(read(rel), Err(ReadError::Linked)), "{rel}");
        }
        assert!(matches!(read("a/b/none"), Err(ReadError::Missing)));
        // A socket does not open for reading (ENXIO).
        assert!(matches!(read("a/b/s"), Err(ReadError::Io(_))));
        // Nothing outside the directory, even through `..`.
        assert!(read("../x").is_err());
        let sock = |rel: &str| open_socket_beneath(d.as_fd(), Path::new(rel));
        for rel in ["a/b/s", "a/b/hs"] {
            assert!(matches!(sock(rel), Err(SocketError::Names(2))), "{rel}");
        }
        std::fs::remove_file(p.join("a/b/hs")).unwrap();
        assert!(sock("a/b/s").is_ok());
        std::fs::hard_link(p.join("a/b/f"), p.join("hf")).unwrap();
        assert!(matches!(read("a/b/f"), Err(ReadError::Names(2))));
        assert!(read("a/b/f")
            .unwrap_err()
            .to_string()
            .contains("it has 2 names"));
        std::fs::remove_file(p.join("hf")).unwrap();
        for rel in ["la/b/s", "a/lb/s", "a/b/ls"] {
            assert!(matches!(sock(rel), Err(SocketError::Linked)), "{rel}");
        }
        assert!(matches!(sock("a/b/none"), Err(SocketError::Missing)));
        assert!(matches!(
            sock("a/b/f"),
            Err(SocketError::NotSocket("a regular file"))
        ));
        assert!(exists_beneath(d.as_fd(), Path::new("a/b/lf")));
        assert!(!exists_beneath(d.as_fd(), Path::new("a/lb/f")));
        assert!(!exists_beneath(d.as_fd(), Path::new("a/b/none")));
    }

    #[test]
    fn a_symlinked_directory_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let d = dir(&t);
        std::fs::create_dir(t.path().join("real")).unwrap();
        symlink(t.path().join("real"), t.path().join("link")).unwrap();
        assert!(open_dir_at(d.as_fd(), "real").is_ok());
        assert!(open_dir_at(d.as_fd(), "link").is_err());
        assert!(exists_at(d.as_fd(), "link"));
        assert!(!exists_at(d.as_fd(), "none"));
    }
}

//! Paths beneath the agent's root, resolved from directory fds: the root is
//! canonicalized and opened once, and every path the agent acts on is
//! resolved from it (or from a volume's root) with openat2
//! RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, one component at a time where it
//! creates, so no symlink, `..` or rename race can lead outside. Mounts are
//! told apart by what they are (statx mount id, device), not by spelling.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags};
use rustix::io::Errno;

use crate::model::MountId;
use crate::sys::error::SysError;

/// openat2 resolution beneath a directory fd: no `..` out of it, no
/// symlinks at all, no magic links.
pub fn strict() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
}

/// openat2 of `rel` beneath `dir` with `how`, retried on EAGAIN (a concurrent
/// rename made the kernel unsure). An empty `rel` reopens `dir` itself.
pub fn open_with(
    dir: BorrowedFd<'_>,
    rel: &Path,
    flags: OFlags,
    how: ResolveFlags,
) -> Result<OwnedFd, Errno> {
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let mut tries = 0;
    loop {
        match rustix::fs::openat2(dir, rel, flags | OFlags::CLOEXEC, Mode::empty(), how) {
            Err(Errno::AGAIN) if tries < 8 => tries += 1,
            r => return r,
        }
    }
}

/// An O_PATH fd of `rel` beneath `dir`, strictly (no symlinks anywhere).
pub fn open_path(dir: BorrowedFd<'_>, rel: &Path) -> Result<OwnedFd, Errno> {
    open_with(dir, rel, OFlags::PATH, strict())
}

/// The path through which the kernel reaches exactly what `fd` names
/// (`/proc/self/fd/N`): for the syscalls that take no fd (mount, umount2).
pub fn proc_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// `name` inside the directory `parent` names, as a path the kernel resolves
/// through `parent`'s magic link: only the last component is looked up.
pub fn proc_path_at(parent: BorrowedFd<'_>, name: &std::ffi::CStr) -> PathBuf {
    proc_path(parent).join(OsStr::from_bytes(name.to_bytes()))
}

/// A relative path's components, refusing anything but plain names.
fn names(rel: &Path) -> Result<Vec<CString>, Errno> {
    rel.components()
        .map(|c| match c {
            Component::Normal(n) => CString::new(n.as_bytes()).map_err(|_| Errno::INVAL),
            _ => Err(Errno::INVAL),
        })
        .collect()
}

/// The directory holding `rel`'s last component (an O_PATH fd, resolved
/// strictly beneath `dir`) and that component's name.
pub fn open_parent(dir: BorrowedFd<'_>, rel: &Path) -> Result<(OwnedFd, CString), Errno> {
    let mut parts = names(rel)?;
    let name = parts.pop().ok_or(Errno::INVAL)?;
    let parent: PathBuf = parts
        .iter()
        .map(|c| OsStr::from_bytes(c.as_bytes()))
        .collect();
    Ok((
        open_with(dir, &parent, OFlags::PATH | OFlags::DIRECTORY, strict())?,
        name,
    ))
}

/// A node a request created, to be removed if the request fails: (its
/// directory, its name, whether it is a directory).
pub type Created = (OwnedFd, CString, bool);

/// Removes what a failed request created, last first, by name relative to
/// the directory fds kept when each was made.
pub fn remove_created(created: &mut Vec<Created>) {
    while let Some((parent, name, is_dir)) = created.pop() {
        let flags = if is_dir {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        let _ = rustix::fs::unlinkat(&parent, name.as_c_str(), flags);
    }
}

/// What the last component of a path to create should be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaf {
    /// A directory (mode as given).
    Dir(u32),
    /// An empty regular file (mode as given).
    File(u32),
}

/// Resolves `rel` beneath `dir` one component at a time, creating missing
/// directories (`dir_mode`) on the way and the last component as `leaf`;
/// what it made is pushed on `created`. Returns an O_PATH fd of the last
/// component, which must be of `leaf`'s kind. No component may be a symlink.
pub fn make_path(
    dir: BorrowedFd<'_>,
    rel: &Path,
    dir_mode: u32,
    leaf: Leaf,
    created: &mut Vec<Created>,
) -> Result<OwnedFd, Errno> {
    let parts = names(rel)?;
    let mut at: OwnedFd = rustix::io::fcntl_dupfd_cloexec(dir, 0)?;
    for (i, name) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let want_dir = !last || matches!(leaf, Leaf::Dir(_));
        let kind = if want_dir {
            OFlags::DIRECTORY
        } else {
            OFlags::empty()
        };
        let one = Path::new(OsStr::from_bytes(name.as_bytes()));
        let next = match open_with(at.as_fd(), one, OFlags::PATH | kind, strict()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                let made = match (last, leaf) {
                    (true, Leaf::File(mode)) => rustix::fs::openat(
                        &at,
                        name.as_c_str(),
                        OFlags::CREATE
                            | OFlags::EXCL
                            | OFlags::WRONLY
                            | OFlags::NOFOLLOW
                            | OFlags::CLOEXEC,
                        Mode::from_raw_mode(mode),
                    )
                    .map(drop),
                    (true, Leaf::Dir(mode)) => {
                        rustix::fs::mkdirat(&at, name.as_c_str(), Mode::from_raw_mode(mode))
                    }
                    (false, _) => {
                        rustix::fs::mkdirat(&at, name.as_c_str(), Mode::from_raw_mode(dir_mode))
                    }
                };
                match made {
                    Ok(()) => {
                        let keep = rustix::io::fcntl_dupfd_cloexec(&at, 0)?;
                        created.push((keep, name.clone(), want_dir));
                    }
                    // Someone made it meanwhile: resolve it like any existing node.
                    Err(Errno::EXIST) => {}
                    Err(e) => return Err(e),
                }
                open_with(at.as_fd(), one, OFlags::PATH | kind, strict())?
            }
            Err(e) => return Err(e),
        };
        at = next;
    }
    if parts.is_empty() {
        return Err(Errno::INVAL);
    }
    let ft = file_type(at.as_fd())?;
    match leaf {
        Leaf::Dir(_) if ft != FileType::Directory => Err(Errno::NOTDIR),
        Leaf::File(_) if ft == FileType::Directory => Err(Errno::ISDIR),
        _ => Ok(at),
    }
}

/// The type of what `fd` names.
pub fn file_type(fd: BorrowedFd<'_>) -> Result<FileType, Errno> {
    Ok(FileType::from_raw_mode(rustix::fs::fstat(fd)?.st_mode))
}

/// What a path names, as far as mounts go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountPoint {
    /// The kernel's id of the mount the object is on (mountinfo's first field).
    pub mount_id: MountId,
    /// Whether the object is the root of that mount (something is mounted there).
    pub is_root: bool,
    /// The device of the filesystem (major, minor).
    pub dev: (u32, u32),
    /// Its file type.
    pub kind: FileType,
    /// The device it is the node of (major, minor), for a device node; (0, 0) otherwise.
    pub rdev: (u32, u32),
}

impl MountPoint {
    /// Whether this is the node of block device `dev`: what a bind of a
    /// block volume's device node shows (its `dev` is devtmpfs's, not the disk's).
    pub fn is_block_node(&self, dev: (u32, u32)) -> bool {
        self.kind == FileType::BlockDevice && self.rdev == dev
    }
}

fn mount_point_of(st: &rustix::fs::Statx) -> MountPoint {
    MountPoint {
        mount_id: MountId(st.stx_mnt_id),
        is_root: st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
            && st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT),
        dev: (st.stx_dev_major, st.stx_dev_minor),
        kind: FileType::from_raw_mode(u32::from(st.stx_mode)),
        rdev: (st.stx_rdev_major, st.stx_rdev_minor),
    }
}

/// statx of what `fd` names: its mount id, whether it is a mount root, its device.
pub fn mount_point(fd: BorrowedFd<'_>) -> Result<MountPoint, Errno> {
    let st = rustix::fs::statx(
        fd,
        c"",
        AtFlags::EMPTY_PATH,
        StatxFlags::MNT_ID | StatxFlags::TYPE,
    )?;
    Ok(mount_point_of(&st))
}

/// statx of `name` in `dir`, without following a symlink there.
pub fn mount_point_at(dir: BorrowedFd<'_>, name: &std::ffi::CStr) -> Result<MountPoint, Errno> {
    let st = rustix::fs::statx(
        dir,
        name,
        AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        StatxFlags::MNT_ID | StatxFlags::TYPE,
    )?;
    Ok(mount_point_of(&st))
}

/// The agent's root: canonical, opened once.
#[derive(Debug)]
pub struct Root {
    /// As configured (may run through symlinks, e.g. /var/run → /run).
    given: PathBuf,
    /// Canonical: what mountinfo shows and what the agent reports.
    path: PathBuf,
    /// O_PATH fd of the root directory.
    fd: OwnedFd,
}

impl Root {
    /// Creates `given` if missing (0755), canonicalizes it and opens it.
    pub fn open(given: &Path) -> Result<Root, SysError> {
        std::fs::create_dir_all(given).map_err(|e| SysError::new("mkdir", given.display(), e))?;
        let path = std::fs::canonicalize(given)
            .map_err(|e| SysError::new("realpath", given.display(), e))?;
        let fd = rustix::fs::open(
            &path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| SysError::new("open", path.display(), e))?;
        Ok(Root {
            given: given.to_path_buf(),
            path,
            fd,
        })
    }

    /// The canonical root.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The root's fd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The root as configured, which requests may use instead of the canonical one.
    pub fn given(&self) -> &Path {
        &self.given
    }

    /// `abs` (lexically normal, as validation leaves it) relative to the
    /// root, under either spelling of the root; None if it is not beneath.
    pub fn relative<'a>(&self, abs: &'a Path) -> Option<&'a Path> {
        [&self.path, &self.given]
            .into_iter()
            .find_map(|r| abs.strip_prefix(r).ok())
            .filter(|r| !r.as_os_str().is_empty())
    }

    /// The canonical absolute spelling of `rel`.
    pub fn join(&self, rel: &Path) -> PathBuf {
        self.path.join(rel)
    }

    /// Opens (creating it 0`mode` if missing) the directory `name` directly
    /// beneath the root, refusing a symlink there.
    pub fn own_dir(&self, name: &str, mode: u32) -> Result<OwnedFd, SysError> {
        let mut created = Vec::new();
        make_path(
            self.fd(),
            Path::new(name),
            mode,
            Leaf::Dir(mode),
            &mut created,
        )
        .map_err(|e| SysError::new("mkdir/openat2", self.path.join(name).display(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn root() -> (tempfile::TempDir, Root) {
        let d = tempfile::tempdir().unwrap();
        let r = Root::open(&d.path().join("root")).unwrap();
        (d, r)
    }

    #[test]
    fn the_root_is_canonical_and_either_spelling_is_beneath_it() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("real")).unwrap();
        symlink(d.path().join("real"), d.path().join("link")).unwrap();
        let r = Root::open(&d.path().join("link/root")).unwrap();
        let canon = std::fs::canonicalize(d.path().join("real/root")).unwrap();
        assert_eq!(r.path(), canon);
        assert_eq!(
            r.relative(&d.path().join("link/root/pods/a")),
            Some(Path::new("pods/a"))
        );
        assert_eq!(r.relative(&canon.join("x")), Some(Path::new("x")));
        assert_eq!(r.relative(&canon), None);
        assert_eq!(r.relative(Path::new("/etc/passwd")), None);
    }

    #[test]
    fn make_path_creates_and_refuses_symlinks_anywhere() {
        let (d, r) = root();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let mut created = Vec::new();
        let fd = make_path(
            r.fd(),
            Path::new("a/b/c"),
            0o750,
            Leaf::Dir(0o750),
            &mut created,
        )
        .unwrap();
        assert_eq!(file_type(fd.as_fd()).unwrap(), FileType::Directory);
        assert_eq!(created.len(), 3);
        // An existing path creates nothing.
        let mut again = Vec::new();
        make_path(
            r.fd(),
            Path::new("a/b/c"),
            0o750,
            Leaf::Dir(0o750),
            &mut again,
        )
        .unwrap();
        assert!(again.is_empty());
        // A file leaf.
        let mut files = Vec::new();
        make_path(
            r.fd(),
            Path::new("a/f"),
            0o750,
            Leaf::File(0o600),
            &mut files,
        )
        .unwrap();
        assert!(r.path().join("a/f").is_file());
        // Symlinks are refused at any position, even ones that stay inside.
        symlink(&outside, r.path().join("out")).unwrap();
        symlink("a", r.path().join("inside")).unwrap();
        for p in ["out/x", "out", "inside/b", "a/../out/x"] {
            let mut c = Vec::new();
            let e = make_path(r.fd(), Path::new(p), 0o750, Leaf::Dir(0o750), &mut c);
            assert!(e.is_err(), "{p}");
            assert!(c.is_empty(), "{p}: nothing created");
        }
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        // Kind mismatches.
        let mut c = Vec::new();
        assert_eq!(
            make_path(r.fd(), Path::new("a/f"), 0o750, Leaf::Dir(0o750), &mut c).unwrap_err(),
            Errno::NOTDIR
        );
        assert_eq!(
            make_path(r.fd(), Path::new("a/b"), 0o750, Leaf::File(0o600), &mut c).unwrap_err(),
            Errno::ISDIR
        );
        // Undo removes what was made, deepest first.
        remove_created(&mut created);
        assert!(!r.path().join("a/b").exists());
        assert!(r.path().join("a/f").exists(), "not made by that request");
    }

    #[test]
    fn parents_and_mount_points() {
        let (_d, r) = root();
        std::fs::create_dir_all(r.path().join("x/y")).unwrap();
        let (p, name) = open_parent(r.fd(), Path::new("x/y")).unwrap();
        assert_eq!(name.as_bytes(), b"y");
        let mp = mount_point_at(p.as_fd(), &name).unwrap();
        assert!(!mp.is_root);
        assert_eq!(mp.kind, FileType::Directory);
        let rootmp = mount_point(r.fd()).unwrap();
        assert_eq!(mp.mount_id, rootmp.mount_id);
        assert!(open_parent(r.fd(), Path::new("")).is_err());
        assert!(open_parent(r.fd(), Path::new("../x")).is_err());
        let pp = proc_path_at(p.as_fd(), &name);
        assert!(pp.starts_with("/proc/self/fd/"));
        assert!(std::fs::metadata(&pp).unwrap().is_dir());
    }
}

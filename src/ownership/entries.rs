//! What the walk does to one entry, by its one-component name from its
//! directory's fd: look (statx, never following a symlink or an automount),
//! chown the group (lchown semantics), chmod the mode (never through a
//! symlink, and only if it is still the entry looked at). A batch of entries
//! goes in three passes, one syscall each, in inode order.

use std::ffi::CStr;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

use super::rules::{chmod_due, wanted_mode};

/// Whose entries these are: the fsGroup they get, and the filesystem
/// (device) they must be on, so a file mounted over an entry is left alone.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner {
    /// The fsGroup.
    pub(crate) gid: u32,
    /// The volume's filesystem (st_dev).
    pub(crate) dev: u64,
}

/// The chmod of entry `name` needed a descriptor and the process had none
/// left: the walk's failure (it stops there), not the entry's.
#[derive(Debug)]
pub(crate) struct OutOfFds<'n> {
    /// The entry.
    pub(crate) name: &'n CStr,
    /// EMFILE or ENFILE.
    pub(crate) source: io::Error,
}

/// Entry names, NUL-terminated, back to back: one allocation per directory,
/// not one per entry.
#[derive(Default)]
pub(crate) struct Names {
    bytes: Vec<u8>,
    /// Each entry's inode number (from getdents) and where its name is in `bytes`.
    index: Vec<(u64, Range<usize>)>,
}

impl Names {
    pub(crate) fn push(&mut self, ino: u64, name: &CStr) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(name.to_bytes_with_nul());
        self.index.push((ino, start..self.bytes.len()));
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn get(&self, i: usize) -> Option<&CStr> {
        let (_, range) = self.index.get(i)?;
        CStr::from_bytes_with_nul(self.bytes.get(range.clone())?).ok()
    }

    /// In inode order: neighbours share inode table blocks.
    pub(crate) fn sort_by_inode(&mut self) {
        self.index.sort_unstable_by_key(|(ino, _)| *ino);
    }
}

/// What the walk needs to know of an entry.
pub(crate) struct Seen {
    mode: u32,
    gid: u32,
    dev: u64,
    ino: u64,
    /// A mount sits on the entry (a file bind-mounted over it).
    mount_root: bool,
}

/// Counters of one item, added to the shared ones once per item: shared
/// atomics bumped per entry would bounce their cache line between CPUs.
#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) visited: u64,
    pub(crate) changed: u64,
    pub(crate) errors: u64,
}

impl Counts {
    pub(crate) fn outcome(&mut self, ok: bool) {
        if ok {
            self.changed += 1;
        } else {
            self.errors += 1;
        }
    }
}

/// Fixes directory `fd` (of `mode` and group `has_gid`) for fsGroup `gid`
/// through its own fd: immune to renames.
pub(crate) fn fix_dir(fd: &OwnedFd, mode: u32, has_gid: u32, gid: u32, counts: &mut Counts) {
    let want = wanted_mode(mode, true);
    let chown = has_gid != gid;
    let mut ok = true;
    if chown {
        ok &= rustix::fs::fchown(fd, None, Some(Gid::from_raw(gid))).is_ok();
    }
    if ok && chmod_due(mode, want, chown) {
        ok &= rustix::fs::fchmod(fd, Mode::from_raw_mode(want)).is_ok();
    } else if !chown {
        return;
    }
    counts.outcome(ok);
}

/// Non-directory entries `range` of `names` in `dir`, in three passes:
/// look at each, chown those of another group (symlinks included, with
/// lchown semantics), chmod those short of their mode (never a symlink).
/// A pass runs one syscall over and over, hot in the CPU's caches, over
/// entries in inode order (neighbours share an inode table block).
/// Directories among them (filesystems without d_type) go to `subdirs`,
/// entries with a file mounted over them to `mounts`; what was done is
/// added to `counts`.
pub(crate) fn fix_entries<'n>(
    dir: BorrowedFd<'_>,
    names: &'n Names,
    range: Range<usize>,
    owner: Owner,
    subdirs: &mut Vec<Box<CStr>>,
    counts: &mut Counts,
    mounts: &mut Vec<&'n CStr>,
) -> Result<(), OutOfFds<'n>> {
    let mut todo = Vec::with_capacity(range.len());
    for i in range {
        let Some(name) = names.get(i) else {
            counts.errors += 1;
            continue;
        };
        let seen = match look(dir, name) {
            Ok(seen) => seen,
            // Removed since it was listed: nothing left to fix.
            Err(Errno::NOENT) => continue,
            Err(_) => {
                counts.errors += 1;
                continue;
            }
        };
        if seen.mount_root || seen.dev != owner.dev {
            mounts.push(name); // a file mounted over the entry: not this volume's
            continue;
        }
        if FileType::from_raw_mode(seen.mode) == FileType::Directory {
            // d_type was unknown; the directory gets its turn like any other.
            subdirs.push(name.into());
            continue;
        }
        counts.visited += 1;
        let chown = seen.gid != owner.gid;
        todo.push(Todo {
            name,
            seen,
            chown,
            ok: true,
        });
    }
    for t in todo.iter_mut().filter(|t| t.chown) {
        let gid = Some(Gid::from_raw(owner.gid));
        t.ok = rustix::fs::chownat(dir, t.name, None, gid, AtFlags::SYMLINK_NOFOLLOW).is_ok();
    }
    let mut out = Ok(());
    for t in &todo {
        let mode = t.seen.mode;
        let want = wanted_mode(mode, false);
        // A symlink gets lchown and nothing more: its mode means nothing.
        if t.ok
            && FileType::from_raw_mode(mode) != FileType::Symlink
            && chmod_due(mode, want, t.chown)
        {
            match chmod_nofollow(dir, t.name, &t.seen, want) {
                Ok(()) => counts.changed += 1,
                // The pre-6.6 way needs an fd: out of them is the walk's failure, not the entry's.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    out = Err(OutOfFds {
                        name: t.name,
                        source: e,
                    });
                    break;
                }
                Err(_) => counts.errors += 1,
            }
        } else if t.chown {
            counts.outcome(t.ok);
        }
    }
    out
}

/// A non-directory entry of a batch, between the passes of `entries`.
struct Todo<'a> {
    name: &'a CStr,
    seen: Seen,
    /// Its group is not the fsGroup yet.
    chown: bool,
    /// No syscall on it failed so far.
    ok: bool,
}

/// The stat of `name` in `dir`, not following a symlink nor an automount.
fn look(dir: BorrowedFd<'_>, name: &CStr) -> Result<Seen, Errno> {
    let want = StatxFlags::TYPE | StatxFlags::MODE | StatxFlags::GID | StatxFlags::INO;
    let st = rustix::fs::statx(
        dir,
        name,
        AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        want,
    )?;
    Ok(Seen {
        mode: u32::from(st.stx_mode),
        gid: st.stx_gid,
        dev: rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor),
        ino: st.stx_ino,
        mount_root: st
            .stx_attributes
            .contains(rustix::fs::StatxAttributes::MOUNT_ROOT),
    })
}

/// Whether fchmodat2 is known to be missing (Linux < 6.6).
pub(crate) static NO_FCHMODAT2: AtomicBool = AtomicBool::new(false);

/// chmod of `name` in `dir` without following a symlink, and only if it is
/// still the entry `seen` (looked at just before). fchmodat2 with
/// AT_SYMLINK_NOFOLLOW where the kernel has it (Linux 6.6+). On older
/// kernels (the Debian 6.1 guest) the inode is pinned with an O_PATH,
/// O_NOFOLLOW fd, checked against `seen`, and changed through its
/// /proc/self/fd link, which names that inode and nothing else: a symlink
/// swapped in meanwhile can never redirect the chmod.
fn chmod_nofollow(dir: BorrowedFd<'_>, name: &CStr, seen: &Seen, mode: u32) -> io::Result<()> {
    if !NO_FCHMODAT2.load(Ordering::Relaxed) {
        // SAFETY: `name` is a valid NUL-terminated string borrowed for the
        // call, `dir` a live directory fd; the kernel only reads them.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fchmodat2,
                dir.as_raw_fd(),
                name.as_ptr(),
                mode as libc::c_uint,
                libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOSYS) {
            return Err(e);
        }
        NO_FCHMODAT2.store(true, Ordering::Relaxed);
    }
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let now = rustix::fs::fstat(&fd)?;
    if (now.st_dev, now.st_ino) != (seen.dev, seen.ino)
        || FileType::from_raw_mode(now.st_mode) == FileType::Symlink
    {
        return Err(io::Error::from_raw_os_error(libc::ESTALE));
    }
    rustix::fs::chmod(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        Mode::from_raw_mode(mode),
    )
    .map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};

    use super::*;

    #[test]
    fn chmod_without_fchmodat2_pins_the_inode() {
        // What the walk does on kernels before 6.6 (the guest's 6.1).
        let d = tempfile::tempdir().unwrap();
        let dir =
            rustix::fs::open(d.path(), OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::fs::set_permissions(outside.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(d.path().join("f"), b"x").unwrap();
        std::fs::set_permissions(d.path().join("f"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        symlink(outside.path(), d.path().join("l")).unwrap();
        NO_FCHMODAT2.store(true, Ordering::Relaxed);
        let lst = |n: &CStr| look(dir.as_fd(), n).unwrap();
        let f_seen = lst(c"f");
        chmod_nofollow(dir.as_fd(), c"f", &f_seen, 0o660).unwrap();
        assert_eq!(
            fs::metadata(d.path().join("f")).unwrap().mode() & 0o7777,
            0o660
        );
        // A symlink is never followed, even when it is what was seen.
        let l_seen = lst(c"l");
        assert!(chmod_nofollow(dir.as_fd(), c"l", &l_seen, 0o666).is_err());
        // An entry swapped for a symlink after it was examined is left alone.
        fs::remove_file(d.path().join("f")).unwrap();
        symlink(outside.path(), d.path().join("f")).unwrap();
        let e = chmod_nofollow(dir.as_fd(), c"f", &f_seen, 0o666).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESTALE));
        assert_eq!(fs::metadata(outside.path()).unwrap().mode() & 0o7777, 0o600);
    }
}

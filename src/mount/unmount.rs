//! Unmounting by identity: the mount to take off is found from a directory
//! fd (strictly beneath it, no symlinks), checked to be the very mount the
//! caller recorded (statx mount id, or its device), and unmounted through
//! its parent's fd; whatever is mounted below it comes off first, each
//! checked the same way. A path swapped for a symlink, or a mount that is not
//! the one expected, is refused: the agent never unmounts what is not its own.

use std::ffi::CStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::fs::{AtFlags, FileType, OFlags};
use rustix::io::Errno;
use rustix::mount::UnmountFlags;

use super::error::Error;
use crate::model::MountId;
use crate::sys::beneath::{self, MountPoint};
use crate::sys::error::SysError;
use crate::sys::mountinfo::{self, MountEntry};

/// Which mount the caller means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// The mount with this id (recorded when it was made) of this disk
    /// (major, minor): its filesystem, or a bind of its node. The kernel
    /// recycles mount ids, so an id alone does not name a mount for ever.
    Mount(MountId, u32, u32),
    /// A mount of the filesystem on this device (major, minor), or a bind
    /// of its node (a block volume): for mounts of the agent's own making
    /// whose id was not recorded.
    Device(u32, u32),
}

/// Whether the listed mount `id` still is the expected one: a mount of the
/// disk, or a bind of a node on devtmpfs (a block volume's; its entry shows
/// devtmpfs's numbers, not the disk's). None when it is gone or recycled.
pub fn listed(table: &[MountEntry], expect: Expect) -> Option<&MountEntry> {
    let Expect::Mount(id, ma, mi) = expect else {
        return None;
    };
    mountinfo::by_id(table, id).filter(|m| {
        (m.major, m.minor) == (ma, mi)
            || (m.fs_type == "devtmpfs" && is_node_of(&m.mount_point, (ma, mi)))
    })
}

/// Whether `path` is (a bind of) the block device node of `dev`: a recycled
/// id on devtmpfs may be another disk's bind, or another agent's.
fn is_node_of(path: &Path, dev: (u32, u32)) -> bool {
    rustix::fs::stat(path).is_ok_and(|st| {
        FileType::from_raw_mode(st.st_mode) == FileType::BlockDevice
            && (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)) == dev
    })
}

impl Expect {
    fn matches(self, mp: &MountPoint) -> bool {
        match self {
            Expect::Mount(id, ma, mi) => {
                mp.mount_id == id && (mp.dev == (ma, mi) || mp.is_block_node((ma, mi)))
            }
            Expect::Device(ma, mi) => mp.dev == (ma, mi) || mp.is_block_node((ma, mi)),
        }
    }
}

/// How often a busy mount is retried, and how long between tries.
const UNMOUNT_ATTEMPTS: u32 = 5;
const UNMOUNT_PAUSE: Duration = Duration::from_millis(100);
/// Passes over the mounts below a target (a mount over an ancestor can hide
/// a deeper one until it is gone).
const PASSES: u32 = 8;

/// Unmounts the mount at `rel` beneath `base` and everything mounted below
/// it, children first. `base_path` names `base` in messages. Returns whether
/// the expected mount was there: false when nothing is mounted at `rel`, or
/// the expected mount is gone from the system. A different mount in its
/// place, or one stacked over it, is an error and nothing is unmounted.
pub fn unmount_tree(
    base: BorrowedFd<'_>,
    base_path: &Path,
    rel: &Path,
    expect: Expect,
) -> Result<bool, Error> {
    let shown = base_path.join(rel);
    // Nothing at `rel` (any more). If the expected mount still exists
    // somewhere, it was moved (its parent renamed, say): the caller may look
    // for it by its id; otherwise it is gone.
    let absent = || match expect {
        Expect::Mount(..) if listed(&read_table()?, expect).is_some() => Err(Error::Moved {
            path: shown.to_path_buf(),
        }),
        _ => Ok(false),
    };
    let (parent, name) = match beneath::open_parent(base, rel) {
        Ok(p) => p,
        Err(Errno::NOENT | Errno::NOTDIR) => return absent(),
        Err(Errno::LOOP | Errno::XDEV) => {
            return Err(Error::Unsafe {
                path: shown.to_path_buf(),
            })
        }
        Err(e) => return Err(SysError::new("openat2", mountinfo::shown(&shown), e).into()),
    };
    let mp = match beneath::mount_point_at(parent.as_fd(), &name) {
        Ok(mp) => mp,
        Err(Errno::NOENT) => return absent(),
        Err(e) => return Err(SysError::new("statx", mountinfo::shown(&shown), e).into()),
    };
    if mp.kind == FileType::Symlink || !mp.is_root {
        // Not a mount point (any more): moved, hidden, or gone.
        return absent();
    }
    if !expect.matches(&mp) {
        let table = read_table()?;
        let what = mountinfo::by_id(&table, mp.mount_id)
            .map(|m| format!("{} ({})", m.source, m.fs_type))
            .unwrap_or_else(|| format!("mount {}", mp.mount_id));
        return match expect {
            // Ours is gone and something else is there now: not ours to touch.
            Expect::Mount(..) if listed(&table, expect).is_none() => Ok(false),
            Expect::Mount(..) => Err(Error::Covered {
                path: shown.to_path_buf(),
                what,
            }),
            Expect::Device(..) => Err(Error::NotOurs {
                path: shown.to_path_buf(),
                what,
            }),
        };
    }
    unmount_children(&parent, &name, &mp, &shown)?;
    // Checked again right before: the mount to take off is still the one examined.
    match beneath::mount_point_at(parent.as_fd(), &name) {
        Ok(now) if now.mount_id == mp.mount_id && now.is_root => {}
        Ok(_) | Err(Errno::NOENT) => return Ok(true),
        Err(e) => return Err(SysError::new("statx", mountinfo::shown(&shown), e).into()),
    }
    unmount_one(parent.as_fd(), &name, &shown)?;
    Ok(true)
}

fn read_table() -> Result<Vec<MountEntry>, Error> {
    Ok(mountinfo::read()?)
}

/// Unmounts every mount below the mount `top` (at `name` in `parent`),
/// deepest first. Each is reached from an fd of `top`'s root, strictly, and
/// unmounted only if it is still the mount mountinfo listed.
fn unmount_children(
    parent: &OwnedFd,
    name: &CStr,
    top: &MountPoint,
    shown: &Path,
) -> Result<(), Error> {
    for _ in 0..PASSES {
        let table = read_table()?;
        let Some(top_entry) = mountinfo::by_id(&table, top.mount_id) else {
            return Ok(());
        };
        let below = mountinfo::descendants(&table, top_entry.mount_id);
        if below.is_empty() {
            return Ok(());
        }
        // An fd of the top mount's root pins it; it is closed before the top comes off.
        let top_root = beneath::open_with(
            parent.as_fd(),
            Path::new(std::ffi::OsStr::from_bytes(name.to_bytes())),
            OFlags::PATH | OFlags::DIRECTORY,
            beneath::strict(),
        )
        .map_err(|e| SysError::new("openat2", mountinfo::shown(shown), e))?;
        let mut progress = false;
        // Leaves first: a mount with no descendant left in the set.
        for m in below
            .iter()
            .filter(|m| !below.iter().any(|c| c.parent_id == m.mount_id))
        {
            let Ok(rel) = m.mount_point.strip_prefix(&top_entry.mount_point) else {
                continue;
            };
            let Ok((cp, cname)) = beneath::open_parent(top_root.as_fd(), rel) else {
                continue;
            };
            match beneath::mount_point_at(cp.as_fd(), &cname) {
                Ok(now) if now.is_root && now.mount_id == m.mount_id => {
                    unmount_one(cp.as_fd(), &cname, &shown.join(rel))?;
                    progress = true;
                }
                // Hidden under a mount over it or over an ancestor: a later pass.
                _ => {}
            }
        }
        if !progress {
            break;
        }
    }
    let table = read_table()?;
    match mountinfo::by_id(&table, top.mount_id) {
        Some(t) if !mountinfo::descendants(&table, t.mount_id).is_empty() => Err(Error::Busy {
            path: shown.to_path_buf(),
            attempts: PASSES,
        }),
        _ => Ok(()),
    }
}

/// umount2 of `name` in `parent`, through the parent's fd (the last
/// component is not followed); EBUSY is retried a few times, then reported.
fn unmount_one(parent: BorrowedFd<'_>, name: &CStr, shown: &Path) -> Result<(), Error> {
    let path: PathBuf = beneath::proc_path_at(parent, name);
    let mut attempt = 1;
    loop {
        match rustix::mount::unmount(&path, UnmountFlags::NOFOLLOW) {
            // Already gone (someone else unmounted it, or a parent took it along).
            Ok(()) | Err(Errno::INVAL) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::BUSY) if attempt < UNMOUNT_ATTEMPTS => {
                attempt += 1;
                std::thread::sleep(UNMOUNT_PAUSE);
            }
            Err(Errno::BUSY) => {
                return Err(Error::Busy {
                    path: shown.to_path_buf(),
                    attempts: attempt,
                });
            }
            Err(e) => return Err(SysError::new("umount", mountinfo::shown(shown), e).into()),
        }
    }
}

/// Removes the empty directory or empty file at `rel` beneath `base` that a
/// bind or publish created, once nothing is mounted there. Best effort: a
/// node that is not empty, is a mount point, or is not there is left alone.
pub fn remove_node(base: BorrowedFd<'_>, rel: &Path) {
    let Ok((parent, name)) = beneath::open_parent(base, rel) else {
        return;
    };
    let Ok(mp) = beneath::mount_point_at(parent.as_fd(), &name) else {
        return;
    };
    if mp.is_root {
        return;
    }
    match mp.kind {
        FileType::Directory => {
            let _ = rustix::fs::unlinkat(&parent, name.as_c_str(), AtFlags::REMOVEDIR);
        }
        FileType::RegularFile => {
            let empty = rustix::fs::statat(&parent, name.as_c_str(), AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| st.st_size == 0);
            if empty {
                let _ = rustix::fs::unlinkat(&parent, name.as_c_str(), AtFlags::empty());
            }
        }
        _ => {}
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::fd::AsFd;
    use std::path::PathBuf;

    use rustix::mount::MountFlags;

    use super::*;
    use crate::code::Code;
    use crate::model::MountId;
    use crate::mount::filesystem::mount_filesystem;
    use crate::mount::options::parse_options;
    use crate::mount::testkit::{dir_fd, entry, loop_disk, mounted_under};
    use crust_testkit::{needs, LoopDisk};

    /// Mounts the disk's filesystem on a fresh scratch directory `name`.
    pub(crate) fn mount_at(disk: &LoopDisk, name: &str, fs: &str) -> PathBuf {
        let p = disk.scratch(name);
        mount_filesystem(
            &disk.device,
            dir_fd(&p).as_fd(),
            &p,
            fs,
            &parse_options(&[], false).unwrap(),
        )
        .unwrap();
        p
    }

    /// Unmounts the mount at `path` (absolute) expecting the device `dev`.
    pub(crate) fn unmount_dev(path: &Path, disk: &LoopDisk) -> Result<bool, Error> {
        let st = rustix::fs::stat(&disk.device).unwrap();
        let (ma, mi) = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
        let parent = path.parent().unwrap();
        unmount_tree(
            dir_fd(parent).as_fd(),
            parent,
            Path::new(path.file_name().unwrap()),
            Expect::Device(ma, mi),
        )
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn unmount_tree_takes_submounts_and_is_idempotent() {
        needs::loop_devices();
        let disk = loop_disk("ext4");
        let vol = mount_at(&disk, "vol", "ext4");
        std::fs::create_dir_all(vol.join("a/b")).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a/b"), "tmpfs", MountFlags::empty(), None).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a"), "tmpfs", MountFlags::empty(), None).unwrap();
        std::fs::create_dir_all(vol.join("a/c")).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a/c"), "tmpfs", MountFlags::empty(), None).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a/c"), "tmpfs", MountFlags::empty(), None).unwrap();
        assert_eq!(mounted_under(&vol), 5);
        crate::mount::filesystem::sync_filesystem(dir_fd(&vol).as_fd(), &vol).unwrap();
        assert!(unmount_dev(&vol, &disk).unwrap());
        assert_eq!(mounted_under(&vol), 0);
        assert!(!unmount_dev(&vol, &disk).unwrap());
        let base = disk.scratch("x");
        let missing = unmount_tree(
            dir_fd(&base).as_fd(),
            &base,
            Path::new("never/there"),
            Expect::Device(0, 0),
        );
        assert!(!missing.unwrap(), "nothing there: nothing to do");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn unmount_refuses_what_is_not_the_expected_mount() {
        needs::loop_devices();
        let disk = loop_disk("ext4");
        let t = disk.scratch("t");
        rustix::mount::mount("tmpfs", &t, "tmpfs", MountFlags::empty(), None).unwrap();
        // A mount of another device: not ours, left mounted.
        let e = unmount_dev(&t, &disk).unwrap_err();
        assert!(matches!(e, Error::NotOurs { .. }), "{e}");
        assert!(entry(&t).is_some());
        // By id: a mount id that no longer exists means ours is gone: nothing to do.
        let parent = t.parent().unwrap();
        let gone = unmount_tree(
            dir_fd(parent).as_fd(),
            parent,
            Path::new(t.file_name().unwrap()),
            Expect::Mount(MountId(u64::MAX), 0, 0),
        )
        .unwrap();
        assert!(!gone);
        assert!(entry(&t).is_some(), "the tmpfs stays");
        // A mount over ours: refused, both stay.
        let vol = mount_at(&disk, "vol", "ext4");
        let here = beneath::mount_point(dir_fd(&vol).as_fd()).unwrap();
        let (id, (ma, mi)) = (here.mount_id, here.dev);
        rustix::mount::mount("tmpfs", &vol, "tmpfs", MountFlags::empty(), None).unwrap();
        let vparent = vol.parent().unwrap();
        let e = unmount_tree(
            dir_fd(vparent).as_fd(),
            vparent,
            Path::new(vol.file_name().unwrap()),
            Expect::Mount(id, ma, mi),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Covered { .. }), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition);
        rustix::mount::unmount(&vol, rustix::mount::UnmountFlags::empty()).unwrap();
        rustix::mount::unmount(&t, rustix::mount::UnmountFlags::empty()).unwrap();
        assert!(unmount_tree(
            dir_fd(vparent).as_fd(),
            vparent,
            Path::new(vol.file_name().unwrap()),
            Expect::Mount(id, ma, mi),
        )
        .unwrap());
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn unmount_never_follows_a_symlink_swapped_in_on_the_way() {
        needs::loop_devices();
        let disk = loop_disk("ext4");
        // base/dir/vol is ours; then base/dir is swapped for a symlink to a
        // directory holding a mount of the same device elsewhere.
        let base = disk.scratch("base");
        std::fs::create_dir_all(base.join("dir/vol")).unwrap();
        let outside = disk.scratch("outside");
        std::fs::create_dir_all(outside.join("vol")).unwrap();
        mount_filesystem(
            &disk.device,
            dir_fd(&outside.join("vol")).as_fd(),
            &outside.join("vol"),
            "ext4",
            &parse_options(&[], false).unwrap(),
        )
        .unwrap();
        std::fs::rename(base.join("dir"), base.join("old")).unwrap();
        std::os::unix::fs::symlink(&outside, base.join("dir")).unwrap();
        let st = rustix::fs::stat(&disk.device).unwrap();
        let e = unmount_tree(
            dir_fd(&base).as_fd(),
            &base,
            Path::new("dir/vol"),
            Expect::Device(rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unsafe { .. }), "{e}");
        assert!(
            entry(&outside.join("vol")).is_some(),
            "outside left mounted"
        );
        remove_node(dir_fd(&base).as_fd(), Path::new("dir/vol"));
        assert!(outside.join("vol").exists(), "nothing removed outside");
        assert!(unmount_dev(&outside.join("vol"), &disk).unwrap());
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn unmount_of_a_busy_mount_fails_precondition() {
        needs::loop_devices();
        let disk = loop_disk("ext4");
        let vol = mount_at(&disk, "vol", "ext4");
        let open = std::fs::File::open(&vol).unwrap();
        let err = unmount_dev(&vol, &disk).unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
        assert!(err.to_string().contains(vol.to_str().unwrap()));
        drop(open);
        assert!(unmount_dev(&vol, &disk).unwrap());
    }

    /// A mountinfo entry of mount `id`, of `fs_type` with device numbers `dev`, at `at`.
    fn listing(id: u64, fs_type: &str, dev: (u32, u32), at: &Path) -> MountEntry {
        MountEntry {
            mount_id: MountId(id),
            parent_id: MountId(1),
            major: dev.0,
            minor: dev.1,
            root: PathBuf::from("/x"),
            mount_point: at.to_path_buf(),
            mount_options: "rw".into(),
            fs_type: fs_type.into(),
            source: "x".into(),
            super_options: "rw".into(),
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_recycled_id_on_devtmpfs_is_another_disks_bind_not_ours() {
        needs::loop_devices();
        let ours = LoopDisk::new(8, None);
        let theirs = LoopDisk::new(8, None);
        let dev = |d: &LoopDisk| {
            let st = rustix::fs::stat(&d.device).unwrap();
            (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev))
        };
        let (ma, mi) = dev(&ours);
        let expect = Expect::Mount(MountId(41), ma, mi);
        // Id 41 now names a devtmpfs bind of another disk's node (the kernel
        // gave our freed id to another agent's block volume): not ours.
        let table = vec![listing(41, "devtmpfs", (0, 5), &theirs.device)];
        assert!(listed(&table, expect).is_none());
        // A devtmpfs bind of our node is ours, and so is our filesystem.
        let table = vec![listing(41, "devtmpfs", (0, 5), &ours.device)];
        assert!(listed(&table, expect).is_some());
        let table = vec![listing(41, "ext4", (ma, mi), Path::new("/nonexistent"))];
        assert!(listed(&table, expect).is_some());
        // Gone, or a character device, is not.
        let table = vec![listing(41, "devtmpfs", (0, 5), Path::new("/dev/null"))];
        assert!(listed(&table, expect).is_none());
    }
}

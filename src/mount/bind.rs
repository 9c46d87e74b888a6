//! Binds of a volume (or a subpath of it) at a target beneath the agent's
//! root: the source is resolved from the volume root's fd (symlinks may not
//! leave the volume), the target from the agent root's fd with no symlinks at
//! all, created as needed; the tree is cloned detached (open_tree), made
//! read-only while detached (mount_setattr) and only then moved into place,
//! so the target is never writable when it should not be.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;

use rustix::fs::{FileType, OFlags, ResolveFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, MoveMountFlags, OpenTreeFlags};

use super::Error;
use crate::beneath::{self, Created, Leaf};
use crate::errors::SysError;
use crate::validate;

/// KEP-3857's recursive read-only modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecursiveReadOnly {
    /// Only the top mount is read-only; submounts stay writable.
    Disabled,
    /// Recursive where the kernel can (mount_setattr), else plain read-only.
    IfPossible,
    /// Recursive, or fail with nothing mounted.
    Enabled,
}

/// What to bind where.
#[derive(Clone, Copy, Debug)]
pub struct BindSpec<'a> {
    /// An fd of the volume's mount root (the caller checked it is the volume's mount).
    pub source_root: BorrowedFd<'a>,
    /// The volume's guest path, for messages.
    pub source_path: &'a Path,
    /// Relative to the volume root; empty for the root.
    pub subpath: &'a Path,
    /// An fd of the agent's root: the target is resolved beneath it.
    pub target_base: BorrowedFd<'a>,
    /// The target relative to the agent's root.
    pub target_rel: &'a Path,
    /// The target as the request gave it, for messages.
    pub target_path: &'a Path,
    /// Make the bind read-only.
    pub read_only: bool,
    /// And its submounts too.
    pub recursive_read_only: RecursiveReadOnly,
}

/// What a bind did.
#[derive(Debug)]
pub struct BindOutcome {
    /// Submounts were made read-only too (the KEP's VolumeMountStatus).
    pub recursive_read_only_applied: bool,
    /// The id of the new mount (statx mount id), to unmount exactly it later.
    pub mount_id: u64,
    /// The nodes the bind created for its target (removed if the caller undoes it).
    pub created: Vec<Created>,
}

/// Binds `spec.subpath` of the volume at `spec.target_rel`.
pub fn bind(spec: &BindSpec) -> Result<BindOutcome, Error> {
    let f = crate::system::features();
    bind_with(spec, f.mount_setattr && f.open_tree)
}

/// `bind`, with the kernel's mount_setattr support given (false forces the
/// classic mount(2) path, which tests exercise).
pub(crate) fn bind_with(spec: &BindSpec, have_setattr: bool) -> Result<BindOutcome, Error> {
    validate::recursive_read_only(spec.read_only, spec.recursive_read_only)?;
    if spec.recursive_read_only == RecursiveReadOnly::Enabled && !have_setattr {
        return Err(Error::RecursiveUnsupported {
            target: spec.target_path.display().to_string(),
        });
    }
    let source = open_source(spec)?;
    let source_kind = beneath::file_type(source.as_fd())
        .map_err(|e| SysError::new("fstat", spec.source_path.join(spec.subpath).display(), e))?;

    let mut created = Vec::new();
    let result = open_target(spec, source_kind, &mut created)
        .and_then(|target| attach(spec, &source, &target, have_setattr));
    match result {
        Ok((recursive_read_only_applied, mount_id)) => Ok(BindOutcome {
            recursive_read_only_applied,
            mount_id,
            created,
        }),
        Err(e) => {
            // A failed request changes nothing: take back the nodes we made.
            beneath::remove_created(&mut created);
            Err(e)
        }
    }
}

/// Binds the device node `spec.source_root` names (an O_PATH fd the caller
/// checked is the disk's node) onto the empty file `target` (an O_PATH fd
/// of `spec.target_rel`), read-only if `spec.read_only`: a block volume's
/// guest path. Returns the new mount's id.
pub fn bind_node(spec: &BindSpec, target: &OwnedFd) -> Result<u64, Error> {
    let f = crate::system::features();
    let source = rustix::io::fcntl_dupfd_cloexec(spec.source_root, 0)
        .map_err(|e| SysError::new("dup", spec.source_path.display(), e))?;
    Ok(attach(spec, &source, target, f.mount_setattr && f.open_tree)?.1)
}

/// The source: the volume root, or the subpath resolved beneath it (symlinks
/// inside the volume are followed only while they stay inside). The root
/// itself is the fd given (a block volume's root is a device node, which
/// has no "." to resolve).
fn open_source(spec: &BindSpec) -> Result<OwnedFd, Error> {
    if spec.subpath.as_os_str().is_empty() {
        return rustix::io::fcntl_dupfd_cloexec(spec.source_root, 0)
            .map_err(|e| SysError::new("dup", spec.source_path.display(), e).into());
    }
    let how = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    beneath::open_with(spec.source_root, spec.subpath, OFlags::PATH, how).map_err(|e| {
        let subpath = spec.subpath.display().to_string();
        let root = spec.source_path.display().to_string();
        match e {
            Errno::XDEV | Errno::LOOP => Error::SubpathEscapes { subpath, root },
            Errno::NOENT | Errno::NOTDIR => Error::SubpathNotFound { subpath, root },
            Errno::NOSYS => Error::NoOpenat2 {
                path: spec.source_path.join(spec.subpath).display().to_string(),
            },
            _ => SysError::new("openat2", spec.source_path.join(spec.subpath).display(), e).into(),
        }
    })
}

/// The target, created where missing (0750 directories; the last component
/// a directory, an empty 0640 file when the source is a file, or an empty
/// 0600 file when it is a block volume's device node).
fn open_target(
    spec: &BindSpec,
    source_kind: FileType,
    created: &mut Vec<Created>,
) -> Result<OwnedFd, Error> {
    let target = spec.target_path.display().to_string();
    let bad = |why: String| Error::BadTarget {
        target: target.clone(),
        why,
    };
    let source_is_dir = source_kind == FileType::Directory;
    let leaf = match source_kind {
        FileType::Directory => Leaf::Dir(0o750),
        FileType::BlockDevice => Leaf::File(0o600),
        _ => Leaf::File(0o640),
    };
    beneath::make_path(spec.target_base, spec.target_rel, 0o750, leaf, created).map_err(|e| match e {
        Errno::XDEV | Errno::LOOP => bad(
            "it runs through a symlink; bind targets are resolved beneath the agent's root with no symlinks"
                .into(),
        ),
        Errno::NOTDIR if source_is_dir => {
            bad("it, or a directory on the way, exists and is not a directory, but the source is one".into())
        }
        Errno::NOTDIR => bad("a directory on the way exists and is not a directory".into()),
        Errno::ISDIR if source_kind == FileType::BlockDevice => bad(
            "it exists and is a directory, but the volume is a block device: a block volume binds onto a file"
                .into(),
        ),
        Errno::ISDIR => bad("it exists and is a directory, but the source is a file".into()),
        Errno::NOSYS => Error::NoOpenat2 {
            path: target.clone(),
        },
        Errno::INVAL => bad("it is not a plain path beneath the agent's root".into()),
        e => SysError::new("mkdir/openat2", &target, e).into(),
    })
}

/// Mounts the source at the target: the new mount API where the kernel has
/// mount_setattr, else mount(2) through /proc/self/fd (older kernels).
/// Returns whether recursive read-only was applied and the new mount's id.
fn attach(
    spec: &BindSpec,
    source: &OwnedFd,
    target: &OwnedFd,
    have_setattr: bool,
) -> Result<(bool, u64), Error> {
    let tname = spec.target_path.display();
    if have_setattr {
        let tree = rustix::mount::open_tree(
            source,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::AT_RECURSIVE
                | OpenTreeFlags::AT_EMPTY_PATH
                | OpenTreeFlags::OPEN_TREE_CLOEXEC,
        )
        .map_err(|e| {
            SysError::new(
                "open_tree",
                spec.source_path.join(spec.subpath).display(),
                e,
            )
        })?;
        let recursive = spec.recursive_read_only != RecursiveReadOnly::Disabled;
        if spec.read_only {
            let (flags, propagation) = if recursive {
                (
                    libc::AT_EMPTY_PATH as u32 | libc::AT_RECURSIVE as u32,
                    MS_PRIVATE,
                )
            } else {
                (libc::AT_EMPTY_PATH as u32, 0)
            };
            let attr = MountAttr {
                attr_set: MOUNT_ATTR_RDONLY,
                attr_clr: 0,
                propagation,
                userns_fd: 0,
            };
            mount_setattr(tree.as_raw_fd(), c"", flags, &attr).map_err(|e| {
                SysError::new(
                    "mount_setattr",
                    format!("the detached clone for {tname}"),
                    e,
                )
            })?;
        }
        rustix::mount::move_mount(
            &tree,
            "",
            target,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e| SysError::new("move_mount", &tname, e))?;
        // The tree fd now names the attached mount's root.
        let id = beneath::mount_point(tree.as_fd())
            .map_err(|e| SysError::new("statx", &tname, e))?
            .mount_id;
        return Ok((spec.read_only && recursive, id));
    }

    // Classic path: bind through the fds' magic links, so nothing is
    // re-resolved by name; then remount the new mount read-only through an
    // fd of its root. There is a short window in which the target is
    // writable here; only kernels older than 5.12 take this path.
    let src = beneath::proc_path(source.as_fd());
    let dst = beneath::proc_path(target.as_fd());
    rustix::mount::mount_bind_recursive(&src, &dst)
        .map_err(|e| SysError::new("mount(MS_BIND|MS_REC)", &tname, e))?;
    let undo = |id: u64, (ma, mi): (u32, u32)| {
        let _ = super::unmount_tree(
            spec.target_base,
            Path::new("/"),
            spec.target_rel,
            super::Expect::Mount(id, ma, mi),
        );
    };
    let mounted = beneath::open_path(spec.target_base, spec.target_rel)
        .and_then(|fd| beneath::mount_point(fd.as_fd()).map(|mp| (fd, mp)));
    let (fd, mp) = match mounted {
        Ok(x) if x.1.is_root => x,
        Ok(_) => {
            return Err(SysError::new(
                "statx",
                &tname,
                io::Error::other("the new bind is not where it was mounted"),
            )
            .into())
        }
        Err(e) => return Err(SysError::new("openat2", &tname, e).into()),
    };
    if spec.read_only {
        if let Err(e) = rustix::mount::mount_remount(
            beneath::proc_path(fd.as_fd()),
            MountFlags::BIND | MountFlags::RDONLY,
            "",
        ) {
            drop(fd);
            undo(mp.mount_id, mp.dev);
            return Err(SysError::new("mount(MS_REMOUNT|MS_BIND|MS_RDONLY)", &tname, e).into());
        }
    }
    Ok((false, mp.mount_id))
}

#[allow(clippy::unnecessary_cast)]
const MS_PRIVATE: u64 = libc::MS_PRIVATE as u64;

/// MOUNT_ATTR_RDONLY of <linux/mount.h>.
const MOUNT_ATTR_RDONLY: u64 = 0x1;

/// `struct mount_attr` of <linux/mount.h> (MOUNT_ATTR_SIZE_VER0).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// mount_setattr(2), which neither rustix nor libc wraps.
fn mount_setattr(dir: RawFd, path: &CStr, flags: u32, attr: &MountAttr) -> io::Result<()> {
    // SAFETY: `path` is a valid NUL-terminated string and `attr` a valid
    // mount_attr of the size passed, both borrowed for the duration of the
    // call; the kernel only reads them. A `dir` that is not a live fd makes
    // the kernel answer EBADF; it touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dir,
            path.as_ptr(),
            flags as libc::c_uint,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

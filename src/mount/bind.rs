//! Binds of a volume (or a subpath of it) at a target beneath the agent's
//! root: the source is resolved from the volume root's fd (symlinks may not
//! leave the volume), the target from the agent root's fd with no symlinks at
//! all, created as needed; the tree is cloned detached (open_tree), made
//! read-only while detached (mount_setattr) and only then moved into place,
//! so the target is never writable when it should not be. An idmapped bind
//! is idmapped the same way, while detached, with a user namespace made for
//! it (`sys::userns`) and closed once the bind is made.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;

use rustix::fs::{FileType, OFlags, ResolveFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, MoveMountFlags, OpenTreeFlags};

use super::error::Error;
use super::unmount::{unmount_tree, Expect};
use crate::model::{IdMap, MountId, RecursiveReadOnly};
use crate::sys::beneath::{self, Created, Leaf};
use crate::sys::error::SysError;
use crate::sys::features::features;
use crate::sys::userns;
use crate::validate;

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
    /// Idmap the bind (and its submounts) with these mappings (the table
    /// refuses them for a block volume's node).
    pub idmap: Option<&'a IdMap>,
}

/// What a bind did.
#[derive(Debug)]
pub struct Bound {
    /// Submounts were made read-only too (the KEP's VolumeMountStatus).
    pub recursive_read_only_applied: bool,
    /// The id of the new mount (statx mount id), to unmount exactly it later.
    pub mount_id: MountId,
    /// The nodes the bind created for its target (removed if the caller undoes it).
    pub created: Vec<Created>,
}

/// Binds `spec.subpath` of the volume at `spec.target_rel`.
pub fn bind(spec: &BindSpec) -> Result<Bound, Error> {
    let f = features();
    bind_with(spec, f.mount_setattr && f.open_tree)
}

/// `bind`, with the kernel's mount_setattr support given (false forces the
/// classic mount(2) path, which tests exercise).
pub(crate) fn bind_with(spec: &BindSpec, have_setattr: bool) -> Result<Bound, Error> {
    validate::recursive_read_only(spec.read_only, spec.recursive_read_only)?;
    if spec.recursive_read_only == RecursiveReadOnly::Enabled && !have_setattr {
        return Err(Error::RecursiveUnsupported {
            target: spec.target_path.to_path_buf(),
        });
    }
    if spec.idmap.is_some() && !have_setattr {
        return Err(Error::IdmapUnsupported {
            target: spec.target_path.to_path_buf(),
        });
    }
    let source = open_source(spec)?;
    let source_kind = beneath::file_type(source.as_fd())
        .map_err(|e| SysError::new("fstat", spec.source_path.join(spec.subpath).display(), e))?;

    let mut created = Vec::new();
    let result = open_target(spec, source_kind, &mut created)
        .and_then(|target| attach(spec, &source, &target, have_setattr));
    match result {
        Ok((recursive_read_only_applied, mount_id)) => Ok(Bound {
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
pub fn bind_node(spec: &BindSpec, target: &OwnedFd) -> Result<MountId, Error> {
    let f = features();
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
        let subpath = spec.subpath.to_path_buf();
        let root = spec.source_path.to_path_buf();
        match e {
            Errno::XDEV | Errno::LOOP => Error::SubpathEscapes { subpath, root },
            Errno::NOENT | Errno::NOTDIR => Error::SubpathNotFound { subpath, root },
            Errno::NOSYS => Error::NoOpenat2 {
                path: spec.source_path.join(spec.subpath),
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
    let target = spec.target_path;
    let bad = |why: String| Error::BadTarget {
        target: target.to_path_buf(),
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
            path: target.to_path_buf(),
        },
        Errno::INVAL => bad("it is not a plain path beneath the agent's root".into()),
        e => SysError::new("mkdir/openat2", target.display(), e).into(),
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
) -> Result<(bool, MountId), Error> {
    if have_setattr {
        attach_detached(spec, source, target)
    } else {
        attach_classic(spec, source, target).map(|id| (false, id))
    }
}

/// The new mount API: a detached clone of the source, made read-only
/// (recursively where asked) before anyone can see it, then moved onto the
/// target. Whether recursive read-only was applied, and the mount's id.
fn attach_detached(
    spec: &BindSpec,
    source: &OwnedFd,
    target: &OwnedFd,
) -> Result<(bool, MountId), Error> {
    let tname = spec.target_path.display();
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
    if let Some(map) = spec.idmap {
        set_idmap(spec, &tree, map)?;
    }
    let recursive = spec.recursive_read_only != RecursiveReadOnly::Disabled;
    if spec.read_only {
        set_read_only(&tree, recursive).map_err(|e| {
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
    Ok((spec.read_only && recursive, id))
}

/// Makes the detached `tree` read-only: its top mount, or, `recursive`,
/// every mount in it (and private, so that no propagation adds a writable one).
fn set_read_only(tree: &OwnedFd, recursive: bool) -> io::Result<()> {
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
    mount_setattr(tree.as_raw_fd(), c"", flags, &attr)
}

/// Idmaps the detached `tree`, every mount in it (a pod sees no mount of
/// its volume with ids it cannot map), with a user namespace of `map`'s,
/// closed on return (the mounts keep it). A filesystem the kernel cannot
/// idmap, the volume's or one mounted inside it, is FAILED_PRECONDITION,
/// saying which.
fn set_idmap(spec: &BindSpec, tree: &OwnedFd, map: &IdMap) -> Result<(), Error> {
    let target = || spec.target_path.to_path_buf();
    let ns = userns::make(map).map_err(|e| match e {
        e if e.unavailable() => Error::NoUserNamespaces {
            target: target(),
            source: e.into_io(),
        },
        e => SysError::new(
            "user namespace",
            spec.target_path.display(),
            io::Error::other(e),
        )
        .into(),
    })?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: ns.as_raw_fd() as u64,
    };
    let flags = libc::AT_EMPTY_PATH as u32;
    let source = spec.source_path.join(spec.subpath);
    let e = match mount_setattr(
        tree.as_raw_fd(),
        c"",
        flags | libc::AT_RECURSIVE as u32,
        &attr,
    ) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    if e.raw_os_error() != Some(libc::EINVAL) {
        let what = format!("the detached clone for {}", spec.target_path.display());
        return Err(SysError::new("mount_setattr(MOUNT_ATTR_IDMAP)", what, e).into());
    }
    // A change of a tree is all or nothing: say whose filesystem it was by
    // trying the top mount alone (the tree is dropped either way).
    let what = match mount_setattr(tree.as_raw_fd(), c"", flags, &attr) {
        Ok(()) => format!(
            "a filesystem mounted inside {}",
            crate::sys::mountinfo::shown(&source)
        ),
        Err(_) => format!(
            "the filesystem of {}",
            crate::sys::mountinfo::shown(&source)
        ),
    };
    Err(Error::FilesystemNotIdmappable {
        target: target(),
        what,
        source: e,
    })
}

/// Classic path: bind through the fds' magic links, so nothing is
/// re-resolved by name; then remount the new mount read-only through an
/// fd of its root. There is a short window in which the target is
/// writable here; only kernels older than 5.12 take this path. The
/// mount's id.
fn attach_classic(spec: &BindSpec, source: &OwnedFd, target: &OwnedFd) -> Result<MountId, Error> {
    let tname = spec.target_path.display();
    let src = beneath::proc_path(source.as_fd());
    let dst = beneath::proc_path(target.as_fd());
    rustix::mount::mount_bind_recursive(&src, &dst)
        .map_err(|e| SysError::new("mount(MS_BIND|MS_REC)", &tname, e))?;
    let undo = |id: MountId, (ma, mi): (u32, u32)| {
        let _ = unmount_tree(
            spec.target_base,
            Path::new("/"),
            spec.target_rel,
            Expect::Mount(id, ma, mi),
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
    Ok(mp.mount_id)
}

#[allow(clippy::unnecessary_cast)]
const MS_PRIVATE: u64 = libc::MS_PRIVATE as u64;

/// MOUNT_ATTR_RDONLY of <linux/mount.h>.
const MOUNT_ATTR_RDONLY: u64 = 0x1;
/// MOUNT_ATTR_IDMAP of <linux/mount.h>: idmap to `userns_fd`'s namespace.
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

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

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::path::PathBuf;

    use rustix::mount::MountFlags;

    use super::*;
    use crate::code::Code;
    use crate::model::MountId;
    use crate::mount::testkit::{dir_fd, entry, is_erofs, loop_disk, mounted_under, write};
    use crate::mount::unmount::tests::mount_at;
    use crate::mount::unmount::{remove_node, unmount_tree, Expect};
    use crust_testkit::needs;
    use crust_testkit::LoopDisk;

    /// A mounted ext4 volume with files, a tmpfs submount at `sub`, and an agent root.
    struct Fixture {
        disk: LoopDisk,
        vol: PathBuf,
        vol_fd: OwnedFd,
        root: PathBuf,
        root_fd: OwnedFd,
    }

    fn fixture() -> Fixture {
        let disk = loop_disk("ext4");
        let vol = mount_at(&disk, "vol", "ext4");
        std::fs::create_dir_all(vol.join("data/deep")).unwrap();
        std::fs::write(vol.join("data/file"), b"hello").unwrap();
        std::fs::create_dir(vol.join("sub")).unwrap();
        rustix::mount::mount("tmpfs", vol.join("sub"), "tmpfs", MountFlags::empty(), None).unwrap();
        let root = disk.scratch("agent");
        let (vol_fd, root_fd) = (dir_fd(&vol), dir_fd(&root));
        Fixture {
            disk,
            vol,
            vol_fd,
            root,
            root_fd,
        }
    }

    impl Fixture {
        fn bind(
            &self,
            subpath: &str,
            target: &str,
            ro: bool,
            rro: RecursiveReadOnly,
            setattr: bool,
        ) -> Result<Bound, Error> {
            self.bind_mapped(subpath, target, (ro, rro), setattr, None)
        }

        /// `bind`, with mappings; `ro` is read-only and the RRO mode.
        fn bind_mapped(
            &self,
            subpath: &str,
            target: &str,
            (ro, rro): (bool, RecursiveReadOnly),
            setattr: bool,
            idmap: Option<&IdMap>,
        ) -> Result<Bound, Error> {
            let t = self.root.join(target);
            bind_with(
                &BindSpec {
                    source_root: self.vol_fd.as_fd(),
                    source_path: &self.vol,
                    subpath: Path::new(subpath),
                    target_base: self.root_fd.as_fd(),
                    target_rel: Path::new(target),
                    target_path: &t,
                    read_only: ro,
                    recursive_read_only: rro,
                    idmap,
                },
                setattr,
            )
        }

        fn unbind(&self, target: &str, id: MountId) -> bool {
            unmount_tree(self.root_fd.as_fd(), &self.root, Path::new(target), {
                let (ma, mi) = beneath::mount_point(self.vol_fd.as_fd()).unwrap().dev;
                Expect::Mount(id, ma, mi)
            })
            .unwrap()
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn binds_root_and_subpath_writable_and_read_only() {
        needs::loop_devices();
        let f = fixture();
        let t1 = f.root.join("binds/one");
        let out = f
            .bind("", "binds/one", false, RecursiveReadOnly::Disabled, true)
            .unwrap();
        assert!(!out.recursive_read_only_applied);
        assert_eq!(out.created.len(), 2, "binds/ and binds/one");
        assert_eq!(std::fs::read(t1.join("data/file")).unwrap(), b"hello");
        write(&t1.join("new")).unwrap();
        assert!(f.vol.join("new").exists());
        let e = entry(&t1).unwrap();
        assert_eq!(e.mount_id, out.mount_id);
        assert_eq!(e.root, PathBuf::from("/"));
        assert!(!e.read_only());
        // The bind is recursive: the submount came along.
        assert!(entry(&t1.join("sub")).is_some());
        // Created directories are 0750.
        let mode = std::fs::metadata(f.root.join("binds")).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o750
        );

        let t2 = f.root.join("binds/two");
        let out2 = f
            .bind("data", "binds/two", true, RecursiveReadOnly::Disabled, true)
            .unwrap();
        let e = entry(&t2).unwrap();
        assert_eq!(e.root, PathBuf::from("/data"));
        assert!(e.read_only());
        assert_eq!(std::fs::read(t2.join("file")).unwrap(), b"hello");
        assert!(is_erofs(write(&t2.join("x"))));
        assert!(is_erofs(std::fs::create_dir(t2.join("deep/x"))));

        assert!(f.unbind("binds/one", out.mount_id));
        assert!(f.unbind("binds/two", out2.mount_id));
        assert!(!f.unbind("binds/two", out2.mount_id));
        assert_eq!(mounted_under(&f.root), 0);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn recursive_read_only_makes_the_difference() {
        needs::loop_devices();
        let f = fixture();
        let t = f.root.join("rro");

        // Disabled: the top refuses writes, the submount does not.
        let out = f
            .bind("", "rro", true, RecursiveReadOnly::Disabled, true)
            .unwrap();
        assert!(!out.recursive_read_only_applied);
        assert!(is_erofs(write(&t.join("top"))));
        write(&t.join("sub/x")).unwrap();
        assert!(!entry(&t.join("sub")).unwrap().read_only());
        f.unbind("rro", out.mount_id);

        // Enabled: the submount refuses too.
        let out = f
            .bind("", "rro", true, RecursiveReadOnly::Enabled, true)
            .unwrap();
        assert!(out.recursive_read_only_applied);
        assert!(is_erofs(write(&t.join("top"))));
        assert!(is_erofs(write(&t.join("sub/y"))));
        assert!(entry(&t.join("sub")).unwrap().read_only());
        // The source submount itself stays writable.
        write(&f.vol.join("sub/z")).unwrap();
        f.unbind("rro", out.mount_id);

        // IfPossible, on this kernel: applied.
        let out = f
            .bind("", "rro", true, RecursiveReadOnly::IfPossible, true)
            .unwrap();
        assert!(out.recursive_read_only_applied);
        assert!(is_erofs(write(&t.join("sub/y"))));
        f.unbind("rro", out.mount_id);

        // RRO without read_only is refused, nothing mounted.
        for rro in [RecursiveReadOnly::IfPossible, RecursiveReadOnly::Enabled] {
            let err = f.bind("", "rro", false, rro, true).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument);
        }
        assert_eq!(mounted_under(&t), 0);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn classic_path_without_mount_setattr() {
        needs::loop_devices();
        let f = fixture();
        let t = f.root.join("classic");
        // Enabled needs mount_setattr: refused, nothing mounted, nothing created.
        let err = f
            .bind("", "classic", true, RecursiveReadOnly::Enabled, false)
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert!(!t.exists());
        // IfPossible falls back to plain read-only.
        let out = f
            .bind("", "classic", true, RecursiveReadOnly::IfPossible, false)
            .unwrap();
        assert!(!out.recursive_read_only_applied);
        assert_eq!(entry(&t).unwrap().mount_id, out.mount_id);
        assert!(is_erofs(write(&t.join("top"))));
        write(&t.join("sub/x")).unwrap();
        f.unbind("classic", out.mount_id);
        // Writable binds work too.
        let out = f
            .bind("data", "classic", false, RecursiveReadOnly::Disabled, false)
            .unwrap();
        write(&t.join("w")).unwrap();
        assert!(f.vol.join("data/w").exists());
        f.unbind("classic", out.mount_id);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn subpath_escapes_are_refused() {
        needs::loop_devices();
        let f = fixture();
        std::os::unix::fs::symlink("../../etc", f.vol.join("data/up")).unwrap();
        std::os::unix::fs::symlink("/etc", f.vol.join("abs")).unwrap();
        std::os::unix::fs::symlink("/proc/self/root/etc", f.vol.join("magic")).unwrap();
        std::os::unix::fs::symlink("deep", f.vol.join("data/inside")).unwrap();
        let t = f.root.join("esc");
        for sub in ["data/up", "abs", "abs/passwd", "magic"] {
            let err = f
                .bind(sub, "esc", true, RecursiveReadOnly::Disabled, true)
                .unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{sub}: {err}");
            assert_eq!(mounted_under(&t), 0, "{sub}");
            assert!(!t.exists(), "{sub}: target left behind");
        }
        for sub in ["data/missing", "data/file/x"] {
            let err = f
                .bind(sub, "esc", true, RecursiveReadOnly::Disabled, true)
                .unwrap_err();
            assert_eq!(err.code(), Code::NotFound, "{sub}");
        }
        assert_eq!(mounted_under(&f.root), 0);
        // A symlink that stays inside the volume is fine.
        let out = f
            .bind(
                "data/inside",
                "esc",
                true,
                RecursiveReadOnly::Disabled,
                true,
            )
            .unwrap();
        assert_eq!(entry(&t).unwrap().root, PathBuf::from("/data/deep"));
        f.unbind("esc", out.mount_id);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn target_escapes_are_refused() {
        needs::loop_devices();
        let f = fixture();
        let outside = f.disk.scratch("outside");
        std::os::unix::fs::symlink(&outside, f.root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../outside", f.root.join("rel")).unwrap();
        std::fs::create_dir(f.root.join("real")).unwrap();
        std::os::unix::fs::symlink("real", f.root.join("inside")).unwrap();
        for t in ["abs/t", "rel/t", "rel", "inside/t"] {
            let err = f
                .bind("", t, true, RecursiveReadOnly::Disabled, true)
                .unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{t}: {err}");
        }
        assert_eq!(mounted_under(&outside), 0);
        assert_eq!(
            std::fs::read_dir(&outside).unwrap().count(),
            0,
            "nothing created outside"
        );
        assert_eq!(mounted_under(&f.root), 0);
        // A file where a directory is needed.
        std::fs::write(f.root.join("afile"), b"").unwrap();
        let err = f
            .bind("", "afile", true, RecursiveReadOnly::Disabled, true)
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(mounted_under(&f.root), 0);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn binds_a_file_onto_a_new_file() {
        needs::loop_devices();
        let f = fixture();
        let t = f.root.join("files/f");
        let out = f
            .bind(
                "data/file",
                "files/f",
                true,
                RecursiveReadOnly::Disabled,
                true,
            )
            .unwrap();
        assert!(std::fs::symlink_metadata(&t).unwrap().is_file());
        assert_eq!(std::fs::read(&t).unwrap(), b"hello");
        assert!(is_erofs(write(&t)));
        let e = entry(&t).unwrap();
        assert_eq!(e.root, PathBuf::from("/data/file"));
        assert!(f.unbind("files/f", out.mount_id));
        // The target file stays (an empty placeholder) until removed.
        assert_eq!(std::fs::read(&t).unwrap(), b"");
        remove_node(f.root_fd.as_fd(), Path::new("files/f"));
        assert!(!t.exists());
        // A directory source onto an existing file target is refused.
        std::fs::write(&t, b"").unwrap();
        let err = f
            .bind("data", "files/f", true, RecursiveReadOnly::Disabled, true)
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(mounted_under(&f.root), 0);
    }

    /// Container 0 is host 100000, for 65536 ids, uids and gids alike.
    fn pod_map() -> IdMap {
        let r = vec![crate::model::IdRange {
            container_id: 0,
            host_id: 100000,
            length: 65536,
        }];
        IdMap {
            uids: r.clone(),
            gids: r,
        }
    }

    /// The fixture without its tmpfs submount (whether tmpfs can be
    /// idmapped depends on the kernel: 6.3+), with a file and a directory
    /// owned on disk by 1000.
    fn plain_fixture() -> Fixture {
        let f = fixture();
        rustix::mount::unmount(f.vol.join("sub"), rustix::mount::UnmountFlags::empty()).unwrap();
        std::fs::write(f.vol.join("data/mine"), b"1000's").unwrap();
        std::os::unix::fs::chown(f.vol.join("data/mine"), Some(1000), Some(1000)).unwrap();
        std::fs::create_dir(f.vol.join("pod")).unwrap();
        std::os::unix::fs::chown(f.vol.join("pod"), Some(1000), Some(1000)).unwrap();
        f
    }

    /// A file owned on disk by 1000 is seen through the bind as 101000, and
    /// one made through it by 101000 lands on disk as 1000; an id the map
    /// leaves out cannot make anything there.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn an_idmapped_bind_maps_ids_both_ways() {
        use crust_testkit::ids::{as_ids, owner};
        needs::loop_devices();
        let f = plain_fixture();
        let map = pod_map();
        let plain = (false, RecursiveReadOnly::Disabled);
        let out = f.bind_mapped("", "idm", plain, true, Some(&map)).unwrap();
        let t = f.root.join("idm");
        assert!(entry(&t).unwrap().idmapped());
        assert_eq!(entry(&t).unwrap().mount_id, out.mount_id);
        assert_eq!(owner(&t.join("data/mine")), (101000, 101000));
        assert_eq!(owner(&t), (100000, 100000), "the root, 0 on disk");
        let made = t.join("pod/made");
        as_ids(101000, 101000, move || std::fs::write(made, b"x")).unwrap();
        assert_eq!(owner(&f.vol.join("pod/made")), (1000, 1000));
        let stray = t.join("pod/stray");
        let e = as_ids(5, 5, move || std::fs::write(stray, b"x")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EOVERFLOW), "{e}");
        // The volume itself is not idmapped.
        assert_eq!(owner(&f.vol.join("data/mine")), (1000, 1000));
        assert!(!entry(&f.vol).unwrap().idmapped());
        assert!(f.unbind("idm", out.mount_id));
        assert_eq!(mounted_under(&f.root), 0);
    }

    /// Idmapped with a subpath, read-only and recursively so.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn idmap_with_a_subpath_and_recursive_read_only() {
        needs::loop_devices();
        let f = plain_fixture();
        let map = pod_map();
        let rro = (true, RecursiveReadOnly::Enabled);
        let out = f.bind_mapped("data", "rro", rro, true, Some(&map)).unwrap();
        assert!(out.recursive_read_only_applied);
        let t = f.root.join("rro");
        let e = entry(&t).unwrap();
        assert!(e.idmapped() && e.read_only(), "{e:?}");
        assert_eq!(e.root, PathBuf::from("/data"));
        assert_eq!(crust_testkit::ids::owner(&t.join("mine")), (101000, 101000));
        assert!(is_erofs(write(&t.join("x"))));
        assert!(f.unbind("rro", out.mount_id));
    }

    /// What cannot be idmapped is refused with FAILED_PRECONDITION saying
    /// which, nothing mounted and nothing made: a submount on a filesystem
    /// that cannot be (ramfs), a volume on one, a kernel without mount_setattr.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn what_cannot_be_idmapped_is_refused() {
        needs::loop_devices();
        let f = plain_fixture();
        let map = pod_map();
        let plain = (false, RecursiveReadOnly::Disabled);
        rustix::mount::mount(
            "ramfs",
            f.vol.join("sub"),
            "ramfs",
            MountFlags::empty(),
            None,
        )
        .unwrap();
        let e = f
            .bind_mapped("", "inside", plain, true, Some(&map))
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains("a filesystem mounted inside"), "{e}");
        assert!(!f.root.join("inside").exists());
        // Its subpath alone has no submount: that works.
        let out = f
            .bind_mapped("data", "inside", plain, true, Some(&map))
            .unwrap();
        assert!(f.unbind("inside", out.mount_id));
        // The source's own filesystem.
        let ramfs = Fixture {
            vol: f.vol.join("sub"),
            vol_fd: dir_fd(&f.vol.join("sub")),
            ..f
        };
        let e = ramfs
            .bind_mapped("", "own", plain, true, Some(&map))
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(
            e.to_string().contains("cannot idmap the filesystem of"),
            "{e}"
        );
        let e = ramfs
            .bind_mapped("", "old", plain, false, Some(&map))
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains("mount_setattr"), "{e}");
        assert_eq!(mounted_under(&ramfs.root), 0);
        assert!(!ramfs.root.join("own").exists() && !ramfs.root.join("old").exists());
        rustix::mount::unmount(&ramfs.vol, rustix::mount::UnmountFlags::DETACH).unwrap();
    }
}

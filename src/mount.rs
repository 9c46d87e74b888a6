//! Mounting: the runc option table, mount(2) of a volume, unmounting a tree,
//! and bind mounts of a volume or a subpath (open_tree → mount_setattr →
//! move_mount), read-only or recursively read-only. Paths supplied by users
//! are resolved with openat2 beneath their roots, never by string.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags};

use crate::errors::{Code, SysError};
use crate::validate;

/// What can go wrong while mounting, binding or unmounting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option publishing forbids, or a malformed option list.
    #[error("mount option {option:?} is not accepted: {why}")]
    BadOption {
        /// The offending option, as given.
        option: String,
        /// Why it is refused and what to do instead.
        why: &'static str,
    },
    /// mount(2) said EINVAL to a data string: the filesystem refused an option.
    #[error("the kernel refused the mount options {data:?} for {fs_type} on {device} (mounting at {target}): {source}; check them against the {fs_type} documentation")]
    KernelRefusedOptions {
        /// The data string passed to mount(2).
        data: String,
        /// ext4 or xfs.
        fs_type: String,
        /// The device.
        device: String,
        /// The mount point.
        target: String,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// mount(2) said EBUSY: the device is mounted already (or held open exclusively).
    #[error("{device} is busy and cannot be mounted at {target}: it is probably mounted elsewhere already; unmount it there first")]
    DeviceBusy {
        /// The device.
        device: String,
        /// The mount point asked for.
        target: String,
    },
    /// Something keeps a mount busy.
    #[error("{path} is still busy after {attempts} attempts to unmount it: a process has files open there; stop it and retry (the agent does not detach a volume with data in flight)")]
    Busy {
        /// The busy mount point.
        path: String,
        /// How many plain unmounts were tried.
        attempts: u32,
    },
    /// A malformed subpath, target or read-only combination (validate.rs says which).
    #[error(transparent)]
    Invalid(#[from] crate::validate::Invalid),
    /// A subpath that resolves outside the volume (through a symlink).
    #[error("subpath {subpath:?} leaves the volume at {root} (through a symlink or a magic link); use a path that stays inside the volume")]
    SubpathEscapes {
        /// The subpath as given.
        subpath: String,
        /// The volume root.
        root: String,
    },
    /// The subpath does not exist.
    #[error("subpath {subpath:?} does not exist in the volume at {root}; create it first")]
    SubpathNotFound {
        /// The subpath as given.
        subpath: String,
        /// The volume root.
        root: String,
    },
    /// A bind target that is relative, outside the agent's root, leaves it
    /// through a symlink, or is of the wrong kind.
    #[error("bind target {target} is not usable: {why}")]
    BadTarget {
        /// The target as given.
        target: String,
        /// What is wrong with it.
        why: String,
    },
    /// RRO ENABLED on a kernel without mount_setattr.
    #[error("recursive read-only was required (ENABLED) for {target}, but this kernel lacks mount_setattr (Linux 5.12+); use IF_POSSIBLE or a newer guest kernel")]
    RecursiveUnsupported {
        /// The target asked for.
        target: String,
    },
    /// The kernel lacks openat2, which safe path resolution needs.
    #[error("this kernel lacks openat2 (Linux 5.6+), which the agent needs to resolve {path} safely; use a newer guest kernel")]
    NoOpenat2 {
        /// The path that was being resolved.
        path: String,
    },
    /// An unexpected syscall failure.
    #[error(transparent)]
    Sys(#[from] SysError),
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::BadOption { .. }
            | Error::KernelRefusedOptions { .. }
            | Error::Invalid(_)
            | Error::SubpathEscapes { .. }
            | Error::BadTarget { .. } => Code::InvalidArgument,
            Error::SubpathNotFound { .. } => Code::NotFound,
            Error::DeviceBusy { .. }
            | Error::Busy { .. }
            | Error::RecursiveUnsupported { .. }
            | Error::NoOpenat2 { .. } => Code::FailedPrecondition,
            Error::Sys(_) => Code::Internal,
        }
    }
}

// ---------------------------------------------------------------------------
// Options

/// Mount flags and the filesystem-specific data string, ready for mount(2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// MS_* bits.
    pub flags: u64,
    /// Comma-separated options the filesystem itself interprets ("discard,nouuid").
    pub data: String,
}

/// Bits of mount(2)'s flags, as u64 (libc spells them c_ulong, 32 bits on
/// 32-bit targets, hence the casts).
#[allow(clippy::unnecessary_cast)]
const MS_RDONLY: u64 = libc::MS_RDONLY as u64;
#[allow(clippy::unnecessary_cast)]
const MS_PRIVATE: u64 = libc::MS_PRIVATE as u64;

/// The runc table: option name, MS_* flag, and whether the option sets (true)
/// or clears (false) it. Later options override earlier ones.
#[allow(clippy::unnecessary_cast)]
const FLAG_TABLE: &[(&str, u64, bool)] = &[
    ("ro", libc::MS_RDONLY as u64, true),
    ("rw", libc::MS_RDONLY as u64, false),
    ("nosuid", libc::MS_NOSUID as u64, true),
    ("suid", libc::MS_NOSUID as u64, false),
    ("nodev", libc::MS_NODEV as u64, true),
    ("dev", libc::MS_NODEV as u64, false),
    ("noexec", libc::MS_NOEXEC as u64, true),
    ("exec", libc::MS_NOEXEC as u64, false),
    ("sync", libc::MS_SYNCHRONOUS as u64, true),
    ("async", libc::MS_SYNCHRONOUS as u64, false),
    ("dirsync", libc::MS_DIRSYNC as u64, true),
    ("noatime", libc::MS_NOATIME as u64, true),
    ("atime", libc::MS_NOATIME as u64, false),
    ("nodiratime", libc::MS_NODIRATIME as u64, true),
    ("diratime", libc::MS_NODIRATIME as u64, false),
    ("relatime", libc::MS_RELATIME as u64, true),
    ("norelatime", libc::MS_RELATIME as u64, false),
    ("strictatime", libc::MS_STRICTATIME as u64, true),
    ("nostrictatime", libc::MS_STRICTATIME as u64, false),
    ("lazytime", libc::MS_LAZYTIME as u64, true),
    ("nolazytime", libc::MS_LAZYTIME as u64, false),
    ("iversion", libc::MS_I_VERSION as u64, true),
    ("noiversion", libc::MS_I_VERSION as u64, false),
    ("mand", libc::MS_MANDLOCK as u64, true),
    ("nomand", libc::MS_MANDLOCK as u64, false),
    ("silent", libc::MS_SILENT as u64, true),
    ("loud", libc::MS_SILENT as u64, false),
    ("nosymfollow", libc::MS_NOSYMFOLLOW as u64, true),
];

/// Options that change what kind of mount this is; publishing mounts a block
/// filesystem and nothing else.
const FORBIDDEN: &[(&str, &str)] = &[
    (
        "bind",
        "publishing mounts a filesystem, not a bind; use BindMount for binds",
    ),
    (
        "rbind",
        "publishing mounts a filesystem, not a bind; use BindMount for binds",
    ),
    (
        "remount",
        "publishing never remounts; unpublish and publish again",
    ),
    ("move", "publishing never moves mounts"),
    ("loop", "the agent mounts block devices, not image files"),
    (
        "shared",
        "propagation is the agent's business, not an option",
    ),
    (
        "rshared",
        "propagation is the agent's business, not an option",
    ),
    (
        "private",
        "propagation is the agent's business, not an option",
    ),
    (
        "rprivate",
        "propagation is the agent's business, not an option",
    ),
    (
        "slave",
        "propagation is the agent's business, not an option",
    ),
    (
        "rslave",
        "propagation is the agent's business, not an option",
    ),
    (
        "unbindable",
        "propagation is the agent's business, not an option",
    ),
    (
        "runbindable",
        "propagation is the agent's business, not an option",
    ),
];

/// Longest single option, and longest data string: mount(2) copies at most a page.
const MAX_OPTION_LEN: usize = 1024;
const MAX_DATA_LEN: usize = 4000;

/// The start of an overlong option, for the message (cut on a char boundary).
fn head(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Turns fstab-style options into flags and a data string. Pure.
pub fn parse_options(options: &[String], read_only: bool) -> Result<MountOptions, Error> {
    let bad = |option: &str, why| Error::BadOption {
        option: option.to_string(),
        why,
    };
    let mut flags = 0u64;
    let mut data: Vec<&str> = Vec::new();
    for element in options {
        if element.len() > MAX_OPTION_LEN {
            return Err(bad(
                head(element),
                "it is unreasonably long (over 1024 bytes)",
            ));
        }
        if element.contains('\0') {
            return Err(bad(element, "it contains a NUL byte"));
        }
        for opt in element.split(',') {
            if opt.is_empty() {
                return Err(bad(
                    element,
                    "it is empty or has an empty item between commas",
                ));
            }
            if opt == "defaults" {
                continue;
            }
            if opt.starts_with("loop=") {
                return Err(bad(opt, "the agent mounts block devices, not image files"));
            }
            if let Some((_, why)) = FORBIDDEN.iter().find(|(n, _)| *n == opt) {
                return Err(bad(opt, why));
            }
            match FLAG_TABLE.iter().find(|(n, _, _)| *n == opt) {
                Some((_, flag, true)) => flags |= flag,
                Some((_, flag, false)) => flags &= !flag,
                None => data.push(opt),
            }
        }
    }
    if read_only {
        flags |= MS_RDONLY;
    }
    let data = data.join(",");
    if data.len() > MAX_DATA_LEN {
        return Err(bad(
            head(&data),
            "the filesystem options together are unreasonably long (over 4000 bytes)",
        ));
    }
    Ok(MountOptions { flags, data })
}

// ---------------------------------------------------------------------------
// Mount, unmount, sync

/// Mounts `device` (ext4 or xfs) at `target` with `opts`.
pub fn mount_filesystem(
    device: &Path,
    target: &Path,
    fs_type: &str,
    opts: &MountOptions,
) -> Result<(), Error> {
    let flags = u32::try_from(opts.flags).map_err(|_| Error::BadOption {
        option: format!("{:#x}", opts.flags),
        why: "the flags do not fit mount(2)",
    })?;
    let data = CString::new(opts.data.as_str()).map_err(|_| Error::BadOption {
        option: opts.data.clone(),
        why: "it contains a NUL byte",
    })?;
    let data_arg: Option<&CStr> = if opts.data.is_empty() {
        None
    } else {
        Some(&data)
    };
    rustix::mount::mount(
        device,
        target,
        fs_type,
        MountFlags::from_bits_retain(flags),
        data_arg,
    )
    .map_err(|e| match e {
        Errno::INVAL if !opts.data.is_empty() => Error::KernelRefusedOptions {
            data: opts.data.clone(),
            fs_type: fs_type.to_string(),
            device: device.display().to_string(),
            target: target.display().to_string(),
            source: e.into(),
        },
        Errno::BUSY => Error::DeviceBusy {
            device: device.display().to_string(),
            target: target.display().to_string(),
        },
        _ => SysError::new(
            "mount",
            format!("{} at {}", device.display(), target.display()),
            e,
        )
        .into(),
    })
}

/// How often a busy mount is retried, and how long between tries.
const UNMOUNT_ATTEMPTS: u32 = 5;
const UNMOUNT_PAUSE: Duration = Duration::from_millis(100);

/// Unmounts everything at or below `target`, children before parents.
/// Returns whether anything was mounted there. Plain unmounts only: a busy
/// mount fails the call rather than being detached with data in flight.
pub fn unmount_tree(target: &Path) -> Result<bool, Error> {
    let mut found = false;
    // A mount over an ancestor can hide a deeper one from its path until the
    // upper one is gone; another pass catches whatever a pass could not reach.
    for _ in 0..4 {
        let table = crate::mountinfo::read()?;
        let under = crate::mountinfo::mounts_under(&table, target);
        if under.is_empty() {
            return Ok(found);
        }
        found = true;
        for path in unmount_order(&table, &under) {
            unmount_one(&path)?;
        }
    }
    Err(Error::Busy {
        path: target.display().to_string(),
        attempts: 4,
    })
}

/// The order to unmount `under` in: a mount comes off once none of its
/// children is left and no later mount over it or an ancestor path (which
/// hides it from its path) is left; so stacked and shadowing mounts come
/// off in the reverse of the order they went on. Table order is mount order.
fn unmount_order(
    table: &[crate::mountinfo::MountEntry],
    under: &[&crate::mountinfo::MountEntry],
) -> Vec<PathBuf> {
    let mut left: Vec<&crate::mountinfo::MountEntry> = table
        .iter()
        .filter(|m| under.iter().any(|u| u.mount_id == m.mount_id))
        .collect();
    let mut order = Vec::new();
    while !left.is_empty() {
        let ready = |i: usize, m: &crate::mountinfo::MountEntry| {
            !left.iter().any(|c| c.parent_id == m.mount_id)
                && !left[i + 1..]
                    .iter()
                    .any(|n| m.mount_point.starts_with(&n.mount_point))
        };
        let next: Vec<usize> = (0..left.len())
            .rev()
            .filter(|&i| ready(i, left[i]))
            .collect();
        if next.is_empty() {
            // Cannot happen in a consistent table; take the rest in reverse.
            order.extend(left.iter().rev().map(|m| m.mount_point.clone()));
            break;
        }
        for &i in &next {
            order.push(left[i].mount_point.clone());
        }
        let mut i = 0;
        left.retain(|_| {
            i += 1;
            !next.contains(&(i - 1))
        });
    }
    order
}

fn unmount_one(path: &Path) -> Result<(), Error> {
    let mut attempt = 1;
    loop {
        match rustix::mount::unmount(path, UnmountFlags::NOFOLLOW) {
            // Already gone (someone else unmounted it, or a parent took it along).
            Ok(()) | Err(Errno::INVAL) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::BUSY) if attempt < UNMOUNT_ATTEMPTS => {
                attempt += 1;
                std::thread::sleep(UNMOUNT_PAUSE);
            }
            Err(Errno::BUSY) => {
                return Err(Error::Busy {
                    path: path.display().to_string(),
                    attempts: attempt,
                });
            }
            Err(e) => return Err(SysError::new("umount", path.display(), e).into()),
        }
    }
}

/// Flushes the filesystem holding `path` to disk (syncfs).
pub fn sync_filesystem(path: &Path) -> Result<(), Error> {
    let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| SysError::new("open", path.display(), e))?;
    rustix::fs::syncfs(&fd).map_err(|e| SysError::new("syncfs", path.display(), e))?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Bind

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
#[derive(Clone, Debug)]
pub struct BindSpec<'a> {
    /// The volume's mount point.
    pub volume_root: &'a Path,
    /// Relative to the volume root; "" is the root.
    pub subpath: &'a str,
    /// The agent's root: targets must lie beneath it.
    pub agent_root: &'a Path,
    /// Where the bind goes; absolute.
    pub target: &'a Path,
    /// Make the bind read-only.
    pub read_only: bool,
    /// And its submounts too.
    pub recursive_read_only: RecursiveReadOnly,
}

/// What a bind did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindOutcome {
    /// Submounts were made read-only too (the KEP's VolumeMountStatus).
    pub recursive_read_only_applied: bool,
}

/// Binds `spec.subpath` of the volume at `spec.target`. The tree is cloned
/// detached, made read-only while detached, and only then moved into place,
/// so the target is never writable when it should not be.
pub fn bind(spec: &BindSpec) -> Result<BindOutcome, Error> {
    let f = crate::system::features();
    bind_with(spec, f.mount_setattr && f.open_tree)
}

/// `bind`, with the kernel's mount_setattr support given (false forces the
/// classic mount(2) path, which tests exercise).
fn bind_with(spec: &BindSpec, have_setattr: bool) -> Result<BindOutcome, Error> {
    // The same lexical rules as every request, before any syscall.
    validate::recursive_read_only(spec.read_only, spec.recursive_read_only)?;
    validate::subpath(spec.subpath)?;
    let target = validate::target(spec.agent_root, &spec.target.to_string_lossy())?;
    let rel = target
        .strip_prefix(spec.agent_root)
        .map(Path::to_path_buf)
        .map_err(|_| Error::BadTarget {
            target: target.display().to_string(),
            why: format!("it is not beneath {}", spec.agent_root.display()),
        })?;
    if spec.recursive_read_only == RecursiveReadOnly::Enabled && !have_setattr {
        return Err(Error::RecursiveUnsupported {
            target: spec.target.display().to_string(),
        });
    }

    let source = open_source(spec)?;
    let source_is_dir = FileType::from_raw_mode(
        rustix::fs::fstat(&source)
            .map_err(|e| SysError::new("fstat", spec.volume_root.join(spec.subpath).display(), e))?
            .st_mode,
    ) == FileType::Directory;

    let mut created = Vec::new();
    let result = open_target(spec, &rel, source_is_dir, &mut created)
        .and_then(|target_fd| attach(spec, &source, &target_fd, have_setattr));
    if result.is_err() {
        // A failed request changes nothing: take back the nodes we made.
        for (parent, name, is_dir) in created.iter().rev() {
            let flags = if *is_dir {
                AtFlags::REMOVEDIR
            } else {
                AtFlags::empty()
            };
            let _ = rustix::fs::unlinkat(parent, name.as_c_str(), flags);
        }
    }
    result
}

/// Resolution beneath a root: no escape through `..` or symlinks, no magic links.
fn beneath() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS
}

/// openat2, retried on EAGAIN (a concurrent rename made the kernel unsure).
fn openat2_beneath(dir: BorrowedFd<'_>, path: &Path, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    let mut tries = 0;
    loop {
        match rustix::fs::openat2(dir, path, flags | OFlags::CLOEXEC, Mode::empty(), beneath()) {
            Err(Errno::AGAIN) if tries < 8 => tries += 1,
            r => return r,
        }
    }
}

fn open_source(spec: &BindSpec) -> Result<OwnedFd, Error> {
    let root = rustix::fs::open(
        spec.volume_root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SysError::new("open", spec.volume_root.display(), e))?;
    let sub = Path::new(spec.subpath);
    if sub.components().all(|c| c == Component::CurDir) {
        return Ok(root);
    }
    openat2_beneath(root.as_fd(), sub, OFlags::PATH).map_err(|e| {
        let subpath = spec.subpath.to_string();
        let root = spec.volume_root.display().to_string();
        match e {
            Errno::XDEV | Errno::LOOP => Error::SubpathEscapes { subpath, root },
            Errno::NOENT | Errno::NOTDIR => Error::SubpathNotFound { subpath, root },
            Errno::NOSYS => Error::NoOpenat2 {
                path: spec.volume_root.join(sub).display().to_string(),
            },
            _ => SysError::new("openat2", spec.volume_root.join(sub).display(), e).into(),
        }
    })
}

/// A node the bind created, to be removed if the bind fails: (parent, name, is a directory).
type Created = (OwnedFd, CString, bool);

/// Resolves `rel` beneath the agent's root, creating what is missing: 0750
/// directories on the way, and the final node as a directory, or an empty
/// file when the source is a file. Returns an O_PATH fd of the target.
fn open_target(
    spec: &BindSpec,
    rel: &Path,
    source_is_dir: bool,
    created: &mut Vec<Created>,
) -> Result<OwnedFd, Error> {
    let target = spec.target.display().to_string();
    let bad = |why: String| Error::BadTarget {
        target: target.clone(),
        why,
    };
    let root = rustix::fs::open(
        spec.agent_root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SysError::new("open", spec.agent_root.display(), e))?;
    let comps: Vec<&std::ffi::OsStr> = rel.iter().collect();
    let mut parent: Option<OwnedFd> = None;
    let mut prefix = PathBuf::new();
    for (i, name) in comps.iter().enumerate() {
        let last = i + 1 == comps.len();
        prefix.push(name);
        let makes_file = last && !source_is_dir;
        let dir_flag = if makes_file {
            OFlags::empty()
        } else {
            OFlags::DIRECTORY
        };
        let mut attempt = 0;
        let fd = loop {
            match openat2_beneath(root.as_fd(), &prefix, OFlags::PATH | dir_flag) {
                Ok(fd) => break fd,
                Err(Errno::NOENT) if attempt == 0 => {
                    attempt += 1;
                    let at = parent.as_ref().map(|p| p.as_fd()).unwrap_or(root.as_fd());
                    let cname = CString::new(name.as_encoded_bytes())
                        .map_err(|_| bad("it contains a NUL byte".into()))?;
                    let made = if makes_file {
                        rustix::fs::openat(
                            at,
                            cname.as_c_str(),
                            OFlags::CREATE
                                | OFlags::EXCL
                                | OFlags::WRONLY
                                | OFlags::NOFOLLOW
                                | OFlags::CLOEXEC,
                            Mode::from_raw_mode(0o640),
                        )
                        .map(drop)
                    } else {
                        rustix::fs::mkdirat(at, cname.as_c_str(), Mode::from_raw_mode(0o750))
                    };
                    match made {
                        Ok(()) => {
                            let dup = rustix::io::fcntl_dupfd_cloexec(at, 0).map_err(|e| {
                                SysError::new("dup", spec.agent_root.join(&prefix).display(), e)
                            })?;
                            created.push((dup, cname, !makes_file));
                        }
                        // Someone made it meanwhile: resolve it like any existing node.
                        Err(Errno::EXIST) => {}
                        Err(e) => {
                            let call = if makes_file {
                                "open(O_CREAT)"
                            } else {
                                "mkdirat"
                            };
                            return Err(SysError::new(
                                call,
                                spec.agent_root.join(&prefix).display(),
                                e,
                            )
                            .into());
                        }
                    }
                }
                Err(Errno::XDEV | Errno::LOOP) => {
                    return Err(bad(format!(
                        "{} leaves the agent's root {} through a symlink",
                        spec.agent_root.join(&prefix).display(),
                        spec.agent_root.display()
                    )))
                }
                Err(Errno::NOTDIR) => {
                    return Err(bad(format!(
                        "{} is not a directory{}",
                        spec.agent_root.join(&prefix).display(),
                        if last { ", but the source is one" } else { "" }
                    )))
                }
                Err(Errno::NOSYS) => {
                    return Err(Error::NoOpenat2 {
                        path: target.clone(),
                    })
                }
                Err(e) => {
                    return Err(SysError::new(
                        "openat2",
                        spec.agent_root.join(&prefix).display(),
                        e,
                    )
                    .into())
                }
            }
        };
        parent = Some(fd);
    }
    let fd = parent.ok_or_else(|| bad("it is the agent's root itself".into()))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| SysError::new("fstat", &target, e))?;
    let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
    if source_is_dir != is_dir {
        return Err(bad(if source_is_dir {
            "it exists and is not a directory, but the source is one".into()
        } else {
            "it exists and is a directory, but the source is a file".into()
        }));
    }
    Ok(fd)
}

/// Mounts the source at the target: the new mount API where the kernel has
/// mount_setattr, else mount(2) through /proc/self/fd (older kernels).
fn attach(
    spec: &BindSpec,
    source: &OwnedFd,
    target: &OwnedFd,
    have_setattr: bool,
) -> Result<BindOutcome, Error> {
    let tname = spec.target.display();
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
                spec.volume_root.join(spec.subpath).display(),
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
        return Ok(BindOutcome {
            recursive_read_only_applied: spec.read_only && recursive,
        });
    }

    // Classic path: bind through the fds' magic links, so nothing is
    // re-resolved by name; then remount the top read-only where asked.
    // There is a short window in which the target is writable here; only
    // kernels older than 5.12 take this path.
    let src = format!("/proc/self/fd/{}", source.as_raw_fd());
    let dst = format!("/proc/self/fd/{}", target.as_raw_fd());
    rustix::mount::mount_bind_recursive(src.as_str(), dst.as_str())
        .map_err(|e| SysError::new("mount(MS_BIND|MS_REC)", &tname, e))?;
    if spec.read_only {
        if let Err(e) =
            rustix::mount::mount_remount(spec.target, MountFlags::BIND | MountFlags::RDONLY, "")
        {
            let _ = unmount_tree(spec.target);
            return Err(SysError::new("mount(MS_REMOUNT|MS_BIND|MS_RDONLY)", &tname, e).into());
        }
    }
    Ok(BindOutcome {
        recursive_read_only_applied: false,
    })
}

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

#[cfg(test)]
#[allow(clippy::unnecessary_cast)]
mod tests {
    use super::*;
    use crate::testutil::{root_or_skip, LoopDisk};

    fn opts(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    const RO: u64 = libc::MS_RDONLY as u64;
    const NOSUID: u64 = libc::MS_NOSUID as u64;
    const NOATIME: u64 = libc::MS_NOATIME as u64;
    const NODEV: u64 = libc::MS_NODEV as u64;

    #[test]
    fn parses_good_options() {
        let table: &[(&[&str], bool, u64, &str)] = &[
            (&[], false, 0, ""),
            (&[], true, RO, ""),
            (&["defaults"], false, 0, ""),
            (&["ro"], false, RO, ""),
            (&["ro", "rw"], false, 0, ""),
            (&["rw"], true, RO, ""),
            (&["rw", "ro"], false, RO, ""),
            (&["noatime,nosuid"], false, NOATIME | NOSUID, ""),
            (&["nosuid", "suid"], false, 0, ""),
            (&["nodev", "discard"], false, NODEV, "discard"),
            (
                &["discard", "nouuid", "data=ordered"],
                false,
                0,
                "discard,nouuid,data=ordered",
            ),
            (
                &["errors=remount-ro,noatime,defaults"],
                false,
                NOATIME,
                "errors=remount-ro",
            ),
            (&["atime", "noatime", "atime"], false, 0, ""),
            (&["nosymfollow"], false, libc::MS_NOSYMFOLLOW as u64, ""),
            (
                &["lazytime", "iversion", "dirsync", "sync"],
                false,
                (libc::MS_LAZYTIME | libc::MS_I_VERSION | libc::MS_DIRSYNC | libc::MS_SYNCHRONOUS)
                    as u64,
                "",
            ),
            (&["sync", "async"], false, 0, ""),
            (
                &["relatime", "strictatime", "norelatime"],
                false,
                libc::MS_STRICTATIME as u64,
                "",
            ),
            (
                &["silent", "mand", "nomand"],
                false,
                libc::MS_SILENT as u64,
                "",
            ),
            (
                &["noexec", "exec", "noexec"],
                false,
                libc::MS_NOEXEC as u64,
                "",
            ),
        ];
        for (input, ro, flags, data) in table {
            let got = parse_options(&opts(input), *ro).unwrap_or_else(|e| panic!("{input:?}: {e}"));
            assert_eq!(
                got,
                MountOptions {
                    flags: *flags,
                    data: data.to_string()
                },
                "{input:?} ro={ro}"
            );
        }
    }

    #[test]
    fn refuses_bad_options() {
        let long = "x".repeat(2000);
        let long_utf8 = "é".repeat(1000);
        let many_utf8: Vec<String> = (0..500).map(|i| format!("o{i}=ééééé")).collect();
        let many: Vec<String> = (0..500).map(|i| format!("opt{i}=abcdef")).collect();
        let table: Vec<Vec<String>> = vec![
            opts(&["bind"]),
            opts(&["rbind"]),
            opts(&["noatime,remount"]),
            opts(&["move"]),
            opts(&["loop"]),
            opts(&["loop=/dev/loop0"]),
            opts(&["shared"]),
            opts(&["rshared"]),
            opts(&["private"]),
            opts(&["rprivate"]),
            opts(&["slave"]),
            opts(&["rslave"]),
            opts(&["unbindable"]),
            opts(&["runbindable"]),
            opts(&[""]),
            opts(&["noatime,,nosuid"]),
            opts(&["noatime,"]),
            opts(&["disc\0ard"]),
            vec![long],
            vec![long_utf8],
            many,
            many_utf8,
        ];
        for input in table {
            let err =
                parse_options(&input, false).expect_err(&format!("{input:?} must be refused"));
            assert_eq!(err.code(), Code::InvalidArgument, "{input:?}");
        }
    }

    #[test]
    fn bind_refuses_malformed_requests_before_any_syscall() {
        // Roots that do not exist: a syscall would fail INTERNAL, so
        // INVALID_ARGUMENT shows the lexical rules ran first.
        let root = Path::new("/nonexistent/crust");
        let cases = [
            (
                "../up",
                "/nonexistent/crust/t",
                true,
                RecursiveReadOnly::Disabled,
            ),
            (
                "/abs",
                "/nonexistent/crust/t",
                true,
                RecursiveReadOnly::Disabled,
            ),
            ("", "relative/t", true, RecursiveReadOnly::Disabled),
            ("", "/elsewhere/t", true, RecursiveReadOnly::Disabled),
            (
                "",
                "/nonexistent/crust/volumes/v",
                true,
                RecursiveReadOnly::Disabled,
            ),
            (
                "",
                "/nonexistent/crust/t",
                false,
                RecursiveReadOnly::Enabled,
            ),
        ];
        for (subpath, target, read_only, rro) in cases {
            let spec = BindSpec {
                volume_root: Path::new("/nonexistent/vol"),
                subpath,
                agent_root: root,
                target: Path::new(target),
                read_only,
                recursive_read_only: rro,
            };
            let e = bind_with(&spec, true).unwrap_err();
            assert!(matches!(e, Error::Invalid(_)), "{subpath:?} {target}: {e}");
        }
    }

    #[test]
    fn orders_unmounts_children_and_shadows_first() {
        // vol; a/b on vol; a on vol (hides a/b); c twice on a (stacked); x elsewhere.
        let text = "\
42 27 7:1 / /v rw - ext4 /dev/loop1 rw
43 42 0:50 / /v/a/b rw - tmpfs tmpfs rw
44 42 0:51 / /v/a rw - tmpfs tmpfs rw
45 44 0:52 / /v/a/c rw - tmpfs tmpfs rw
46 45 0:53 / /v/a/c rw - tmpfs tmpfs rw
47 27 0:54 / /x rw - tmpfs tmpfs rw
";
        let t = crate::mountinfo::parse(text);
        let under = crate::mountinfo::mounts_under(&t, Path::new("/v"));
        let order: Vec<String> = unmount_order(&t, &under)
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert_eq!(order, ["/v/a/c", "/v/a/c", "/v/a", "/v/a/b", "/v"]);
    }

    // -----------------------------------------------------------------------
    // Tests on real kernel objects (root only).

    /// A loop device with a fresh `fs` (xfs wants 300 MiB at least).
    fn loop_disk(fs: &str) -> LoopDisk {
        LoopDisk::new(if fs == "xfs" { 320 } else { 64 }, Some(fs))
    }

    /// Mounts the disk's filesystem on a fresh scratch directory `name`.
    fn mount_at(disk: &LoopDisk, name: &str, fs: &str) -> PathBuf {
        let p = disk.scratch(name);
        mount_filesystem(&disk.device, &p, fs, &parse_options(&[], false).unwrap()).unwrap();
        p
    }

    fn entry(path: &Path) -> Option<crate::mountinfo::MountEntry> {
        let t = crate::mountinfo::read().unwrap();
        crate::mountinfo::mount_at(&t, path).cloned()
    }

    fn mounted_under(path: &Path) -> usize {
        let t = crate::mountinfo::read().unwrap();
        crate::mountinfo::mounts_under(&t, path).len()
    }

    fn write(path: &Path) -> io::Result<()> {
        std::fs::write(path, b"data")
    }

    fn is_erofs(r: io::Result<()>) -> bool {
        matches!(r, Err(e) if e.raw_os_error() == Some(libc::EROFS))
    }

    fn check_mount_options(fs: &str, data_opt: &str) {
        let disk = loop_disk(fs);
        let target = disk.scratch("mnt");
        let o = parse_options(&opts(&["noatime,nosuid", data_opt]), true).unwrap();
        mount_filesystem(&disk.device, &target, fs, &o).unwrap();
        let e = entry(&target).expect("mounted");
        assert_eq!(e.fs_type, fs);
        for want in ["ro", "noatime", "nosuid"] {
            assert!(
                e.mount_options.split(',').any(|o| o == want),
                "{want} in {}",
                e.mount_options
            );
        }
        assert!(
            e.super_options.split(',').any(|o| o == data_opt),
            "{data_opt} in {}",
            e.super_options
        );
        assert!(is_erofs(write(&target.join("f"))));

        // The same device again elsewhere: the kernel allows a second mount of the
        // same superblock with the same flags, so only the table catches that;
        // but a bad data option is the kernel's to refuse.
        let other = disk.scratch("other");
        let bad = parse_options(&opts(&["no_such_option_here"]), false).unwrap();
        let err = mount_filesystem(&disk.device, &other, fs, &bad).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        assert!(entry(&other).is_none());

        assert!(unmount_tree(&target).unwrap());
        assert!(entry(&target).is_none());
        assert!(!unmount_tree(&target).unwrap());
    }

    #[test]
    fn mounts_ext4_with_options() {
        if root_or_skip("mounts_ext4_with_options") {
            check_mount_options("ext4", "errors=remount-ro");
        }
    }

    #[test]
    fn mounts_xfs_with_options() {
        if root_or_skip("mounts_xfs_with_options") {
            check_mount_options("xfs", "nouuid");
        }
    }

    #[test]
    fn mount_maps_busy_and_wrong_type() {
        if !root_or_skip("mount_maps_busy_and_wrong_type") {
            return;
        }
        let disk = loop_disk("ext4");
        let a = mount_at(&disk, "a", "ext4");
        // The device as xfs while ext4 holds it: EBUSY, FAILED_PRECONDITION.
        let b = disk.scratch("b");
        let err = mount_filesystem(&disk.device, &b, "xfs", &parse_options(&[], false).unwrap())
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
        assert!(entry(&b).is_none());
        assert!(unmount_tree(&a).unwrap());
    }

    #[test]
    fn unmount_tree_takes_submounts_and_is_idempotent() {
        if !root_or_skip("unmount_tree_takes_submounts_and_is_idempotent") {
            return;
        }
        let disk = loop_disk("ext4");
        let vol = mount_at(&disk, "vol", "ext4");
        std::fs::create_dir_all(vol.join("a/b")).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a/b"), "tmpfs", MountFlags::empty(), None).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a"), "tmpfs", MountFlags::empty(), None).unwrap();
        std::fs::create_dir_all(vol.join("a/c")).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a/c"), "tmpfs", MountFlags::empty(), None).unwrap();
        rustix::mount::mount("tmpfs", vol.join("a/c"), "tmpfs", MountFlags::empty(), None).unwrap();
        assert_eq!(mounted_under(&vol), 5);
        sync_filesystem(&vol).unwrap();
        assert!(unmount_tree(&vol).unwrap());
        assert_eq!(mounted_under(&vol), 0);
        assert!(!unmount_tree(&vol).unwrap());
        assert!(!unmount_tree(&vol.join("never/there")).unwrap());
    }

    #[test]
    fn unmount_of_a_busy_mount_fails_precondition() {
        if !root_or_skip("unmount_of_a_busy_mount_fails_precondition") {
            return;
        }
        let disk = loop_disk("ext4");
        let vol = mount_at(&disk, "vol", "ext4");
        let open = std::fs::File::open(&vol).unwrap();
        let err = unmount_tree(&vol).unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
        assert!(err.to_string().contains(vol.to_str().unwrap()));
        drop(open);
        assert!(unmount_tree(&vol).unwrap());
    }

    /// A mounted ext4 volume with files, a tmpfs submount at `sub`, and an agent root.
    struct Fixture {
        disk: LoopDisk,
        vol: PathBuf,
        root: PathBuf,
    }

    fn fixture() -> Fixture {
        let disk = loop_disk("ext4");
        let vol = mount_at(&disk, "vol", "ext4");
        std::fs::create_dir_all(vol.join("data/deep")).unwrap();
        std::fs::write(vol.join("data/file"), b"hello").unwrap();
        std::fs::create_dir(vol.join("sub")).unwrap();
        rustix::mount::mount("tmpfs", vol.join("sub"), "tmpfs", MountFlags::empty(), None).unwrap();
        let root = disk.scratch("agent");
        Fixture { disk, vol, root }
    }

    fn spec<'a>(
        f: &'a Fixture,
        subpath: &'a str,
        target: &'a Path,
        ro: bool,
        rro: RecursiveReadOnly,
    ) -> BindSpec<'a> {
        BindSpec {
            volume_root: &f.vol,
            subpath,
            agent_root: &f.root,
            target,
            read_only: ro,
            recursive_read_only: rro,
        }
    }

    #[test]
    fn binds_root_and_subpath_writable_and_read_only() {
        if !root_or_skip("binds_root_and_subpath_writable_and_read_only") {
            return;
        }
        let f = fixture();
        let t1 = f.root.join("binds/one");
        let out = bind(&spec(&f, "", &t1, false, RecursiveReadOnly::Disabled)).unwrap();
        assert!(!out.recursive_read_only_applied);
        assert_eq!(std::fs::read(t1.join("data/file")).unwrap(), b"hello");
        write(&t1.join("new")).unwrap();
        assert!(f.vol.join("new").exists());
        let e = entry(&t1).unwrap();
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
        bind(&spec(&f, "data", &t2, true, RecursiveReadOnly::Disabled)).unwrap();
        let e = entry(&t2).unwrap();
        assert_eq!(e.root, PathBuf::from("/data"));
        assert!(e.read_only());
        assert_eq!(std::fs::read(t2.join("file")).unwrap(), b"hello");
        assert!(is_erofs(write(&t2.join("x"))));
        assert!(is_erofs(std::fs::create_dir(t2.join("deep/x"))));

        assert!(unmount_tree(&t1).unwrap());
        assert!(unmount_tree(&t2).unwrap());
        assert!(!unmount_tree(&t2).unwrap());
        assert_eq!(mounted_under(&f.root), 0);
    }

    #[test]
    fn recursive_read_only_makes_the_difference() {
        if !root_or_skip("recursive_read_only_makes_the_difference") {
            return;
        }
        let f = fixture();
        let t = f.root.join("rro");

        // Disabled: the top refuses writes, the submount does not.
        let out = bind(&spec(&f, "", &t, true, RecursiveReadOnly::Disabled)).unwrap();
        assert!(!out.recursive_read_only_applied);
        assert!(is_erofs(write(&t.join("top"))));
        write(&t.join("sub/x")).unwrap();
        assert!(!entry(&t.join("sub")).unwrap().read_only());
        unmount_tree(&t).unwrap();

        // Enabled: the submount refuses too.
        let out = bind(&spec(&f, "", &t, true, RecursiveReadOnly::Enabled)).unwrap();
        assert!(out.recursive_read_only_applied);
        assert!(is_erofs(write(&t.join("top"))));
        assert!(is_erofs(write(&t.join("sub/y"))));
        assert!(entry(&t.join("sub")).unwrap().read_only());
        // The source submount itself stays writable.
        write(&f.vol.join("sub/z")).unwrap();
        unmount_tree(&t).unwrap();

        // IfPossible, on this kernel: applied.
        let out = bind(&spec(&f, "", &t, true, RecursiveReadOnly::IfPossible)).unwrap();
        assert!(out.recursive_read_only_applied);
        assert!(is_erofs(write(&t.join("sub/y"))));
        unmount_tree(&t).unwrap();

        // RRO without read_only is refused, nothing mounted.
        for rro in [RecursiveReadOnly::IfPossible, RecursiveReadOnly::Enabled] {
            let err = bind(&spec(&f, "", &t, false, rro)).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument);
        }
        assert_eq!(mounted_under(&t), 0);
    }

    #[test]
    fn classic_path_without_mount_setattr() {
        if !root_or_skip("classic_path_without_mount_setattr") {
            return;
        }
        let f = fixture();
        let t = f.root.join("classic");
        // Enabled needs mount_setattr: refused, nothing mounted, nothing created.
        let err =
            bind_with(&spec(&f, "", &t, true, RecursiveReadOnly::Enabled), false).unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert!(!t.exists());
        // IfPossible falls back to plain read-only.
        let out = bind_with(
            &spec(&f, "", &t, true, RecursiveReadOnly::IfPossible),
            false,
        )
        .unwrap();
        assert!(!out.recursive_read_only_applied);
        assert!(is_erofs(write(&t.join("top"))));
        write(&t.join("sub/x")).unwrap();
        unmount_tree(&t).unwrap();
        // Writable binds work too.
        bind_with(
            &spec(&f, "data", &t, false, RecursiveReadOnly::Disabled),
            false,
        )
        .unwrap();
        write(&t.join("w")).unwrap();
        assert!(f.vol.join("data/w").exists());
        unmount_tree(&t).unwrap();
    }

    #[test]
    fn subpath_escapes_are_refused() {
        if !root_or_skip("subpath_escapes_are_refused") {
            return;
        }
        let f = fixture();
        std::os::unix::fs::symlink("../../etc", f.vol.join("data/up")).unwrap();
        std::os::unix::fs::symlink("/etc", f.vol.join("abs")).unwrap();
        std::os::unix::fs::symlink("/proc/self/root/etc", f.vol.join("magic")).unwrap();
        std::os::unix::fs::symlink("deep", f.vol.join("data/inside")).unwrap();
        let t = f.root.join("esc");
        for sub in ["data/up", "abs", "abs/passwd", "magic"] {
            let err = bind(&spec(&f, sub, &t, true, RecursiveReadOnly::Disabled)).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{sub}: {err}");
            assert_eq!(mounted_under(&t), 0, "{sub}");
            assert!(!t.exists(), "{sub}: target left behind");
        }
        for sub in ["/etc", "../vol", "data/../../x"] {
            let err = bind(&spec(&f, sub, &t, true, RecursiveReadOnly::Disabled)).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{sub}");
        }
        let err = bind(&spec(
            &f,
            "data/missing",
            &t,
            true,
            RecursiveReadOnly::Disabled,
        ))
        .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        let err = bind(&spec(
            &f,
            "data/file/x",
            &t,
            true,
            RecursiveReadOnly::Disabled,
        ))
        .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert_eq!(mounted_under(&f.root), 0);
        // A symlink that stays inside the volume is fine.
        bind(&spec(
            &f,
            "data/inside",
            &t,
            true,
            RecursiveReadOnly::Disabled,
        ))
        .unwrap();
        assert_eq!(entry(&t).unwrap().root, PathBuf::from("/data/deep"));
        unmount_tree(&t).unwrap();
    }

    #[test]
    fn target_escapes_are_refused() {
        if !root_or_skip("target_escapes_are_refused") {
            return;
        }
        let f = fixture();
        let outside = f.disk.scratch("outside");
        std::os::unix::fs::symlink(&outside, f.root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../outside", f.root.join("rel")).unwrap();
        for t in [
            f.root.join("abs/t"),
            f.root.join("rel/t"),
            f.root.join("rel"),
            f.disk.scratch("elsewhere"),
        ] {
            let err = bind(&spec(&f, "", &t, true, RecursiveReadOnly::Disabled)).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{}: {err}", t.display());
        }
        assert_eq!(mounted_under(&outside), 0);
        assert_eq!(
            std::fs::read_dir(&outside).unwrap().count(),
            0,
            "nothing created outside"
        );
        assert_eq!(mounted_under(&f.root), 0);
        let err = bind(&spec(
            &f,
            "",
            Path::new("relative/t"),
            true,
            RecursiveReadOnly::Disabled,
        ))
        .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        // A file where a directory is needed.
        std::fs::write(f.root.join("afile"), b"").unwrap();
        let err = bind(&spec(
            &f,
            "",
            &f.root.join("afile"),
            true,
            RecursiveReadOnly::Disabled,
        ))
        .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(mounted_under(&f.root), 0);
    }

    #[test]
    fn binds_a_file_onto_a_new_file() {
        if !root_or_skip("binds_a_file_onto_a_new_file") {
            return;
        }
        let f = fixture();
        let t = f.root.join("files/f");
        bind(&spec(
            &f,
            "data/file",
            &t,
            true,
            RecursiveReadOnly::Disabled,
        ))
        .unwrap();
        assert!(std::fs::symlink_metadata(&t).unwrap().is_file());
        assert_eq!(std::fs::read(&t).unwrap(), b"hello");
        assert!(is_erofs(write(&t)));
        let e = entry(&t).unwrap();
        assert_eq!(e.root, PathBuf::from("/data/file"));
        assert!(unmount_tree(&t).unwrap());
        // The target file stays (an empty placeholder), like kubelet's.
        assert_eq!(std::fs::read(&t).unwrap(), b"");
        // A directory source onto an existing file target is refused.
        let err = bind(&spec(&f, "data", &t, true, RecursiveReadOnly::Disabled)).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(mounted_under(&f.root), 0);
    }
}

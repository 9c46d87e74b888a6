//! Mounting a volume's filesystem on a directory fd, and the pieces around
//! it, one idea a file: the option table (`options`), binds (`bind`), and
//! unmounting by identity (`unmount`). Paths are resolved from directory fds
//! beneath their roots (`crate::beneath`), never trusted as strings.

mod bind;
mod options;
pub mod selinux;
mod unmount;

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use rustix::io::Errno;
use rustix::mount::MountFlags;

pub use bind::{bind, bind_node, BindOutcome, BindSpec, RecursiveReadOnly};
pub use options::{parse_options, MountOptions};
pub use unmount::{listed, remove_node, unmount_tree, Expect};

use crate::beneath;
use crate::errors::{Code, SysError};

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
    /// The kernel's own parser of `fs_type` refused one option (asked before
    /// mounting, with fsopen and fsconfig, so the option is known).
    #[error("the kernel refused the mount option {option:?} for {fs_type} on {device}: {why}; check it against the {fs_type} documentation")]
    KernelRefusedOption {
        /// The option, as it went to the kernel.
        option: String,
        /// ext4 or xfs.
        fs_type: String,
        /// The device.
        device: String,
        /// The kernel's own words when it gave any, else the errno.
        why: String,
    },
    /// mount(2) refused the disk's filesystem itself: EINVAL once every
    /// option passed the kernel's parser (or none was given), EFBIG, EUCLEAN
    /// (corrupt), EBADMSG (bad checksum), EIO (a read failed, past the
    /// disk's end for an xfs larger than it). The disk is at fault, not the request.
    #[error("the kernel refused to mount the {fs_type} on {device} at {target} ({source}){with}: the filesystem is inconsistent, larger than its device, unreadable, or uses a feature this kernel lacks, and the guest kernel's log says which; check the disk on the host (e2fsck -fn, xfs_repair -n)")]
    FilesystemRefused {
        /// ext4 or xfs.
        fs_type: String,
        /// The device.
        device: String,
        /// The mount point.
        target: String,
        /// ", with the options …" when the request gave any.
        with: String,
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
    /// A path the agent was to act on now runs through a symlink (swapped in
    /// after it was made): the agent acts only beneath its root, so it stops.
    #[error("{path} now runs through a symlink or leaves the agent's root; the agent leaves it alone (something changed it behind the agent's back: inspect and remove it by hand)")]
    Unsafe {
        /// The path.
        path: String,
    },
    /// The expected mount still exists but is no longer at its path.
    #[error("the mount the agent made at {path} is no longer there but still exists elsewhere (moved behind the agent's back); the agent does not guess where: unmount it by hand")]
    Moved {
        /// The path.
        path: String,
    },
    /// Something was mounted over the agent's mount.
    #[error("{path} has {what} mounted over the agent's mount; unmount that first")]
    Covered {
        /// The path.
        path: String,
        /// What is on top.
        what: String,
    },
    /// The mount at a path is not one the agent made.
    #[error("{path} is a mount of {what}, which the agent did not make; the agent unmounts only its own mounts")]
    NotOurs {
        /// The path.
        path: String,
        /// What is mounted there.
        what: String,
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
            | Error::KernelRefusedOption { .. }
            | Error::Invalid(_)
            | Error::SubpathEscapes { .. }
            | Error::BadTarget { .. } => Code::InvalidArgument,
            Error::SubpathNotFound { .. } => Code::NotFound,
            Error::DeviceBusy { .. }
            | Error::FilesystemRefused { .. }
            | Error::Busy { .. }
            | Error::Unsafe { .. }
            | Error::Moved { .. }
            | Error::Covered { .. }
            | Error::NotOurs { .. }
            | Error::RecursiveUnsupported { .. }
            | Error::NoOpenat2 { .. } => Code::FailedPrecondition,
            Error::Sys(_) => Code::Internal,
        }
    }
}

/// Mounts `device` (ext4 or xfs) on the directory `target` names, through
/// its fd (the kernel follows /proc/self/fd/N to exactly that directory, so
/// no rename or symlink can move the mount elsewhere). `target_path` is for
/// messages. The caller checks afterwards that the new mount is the device's.
///
/// The data string is the request's, with the agent's error behaviour for
/// ext4 (`MountOptions::kernel_data`). Each option is put to the kernel's
/// parser first (`parser_accepts`), so that a refusal of the mount itself
/// is the disk's (FAILED_PRECONDITION), not the request's.
pub fn mount_filesystem(
    device: &Path,
    target: BorrowedFd<'_>,
    target_path: &Path,
    fs_type: &str,
    opts: &MountOptions,
) -> Result<(), Error> {
    let flags = u32::try_from(opts.flags).map_err(|_| Error::BadOption {
        option: format!("{:#x}", opts.flags),
        why: "the flags do not fit mount(2)",
    })?;
    let kernel_data = opts.kernel_data(fs_type);
    let data = CString::new(kernel_data.as_str()).map_err(|_| Error::BadOption {
        option: opts.data.clone(),
        why: "it contains a NUL byte",
    })?;
    let data_arg: Option<&CStr> = if kernel_data.is_empty() {
        None
    } else {
        Some(&data)
    };
    let parsed = parser_accepts(fs_type, &kernel_data, device)?;
    rustix::mount::mount(
        device,
        beneath::proc_path(target),
        fs_type,
        MountFlags::from_bits_retain(flags),
        data_arg,
    )
    .map_err(|e| match e {
        Errno::BUSY => Error::DeviceBusy {
            device: device.display().to_string(),
            target: target_path.display().to_string(),
        },
        // The options were not checked (no fsopen) and some were given:
        // they may be at fault as much as the disk.
        Errno::INVAL if !parsed && !opts.data.is_empty() => Error::KernelRefusedOptions {
            data: opts.data.clone(),
            fs_type: fs_type.to_string(),
            device: device.display().to_string(),
            target: target_path.display().to_string(),
            source: e.into(),
        },
        Errno::INVAL | Errno::FBIG | Errno::UCLEAN | Errno::BADMSG | Errno::IO => {
            Error::FilesystemRefused {
                fs_type: fs_type.to_string(),
                device: device.display().to_string(),
                target: target_path.display().to_string(),
                with: if opts.data.is_empty() {
                    String::new()
                } else {
                    format!(", with the options {:?}", opts.data)
                },
                source: e.into(),
            }
        }
        _ => SysError::new(
            "mount",
            format!("{} at {}", device.display(), target_path.display()),
            e,
        )
        .into(),
    })
}

/// The longest key or value fsconfig(2) copies (256 bytes with the NUL).
const FSCONFIG_MAX: usize = 255;

/// Puts each option of `data` to the kernel's parser of `fs_type` without
/// mounting anything: fsopen, then one fsconfig per option, never
/// FSCONFIG_CMD_CREATE, so no disk is read. mount(2) parses the data string
/// with the same functions (vfs_parse_fs_param). Ok(true) when every option
/// passed; Ok(false) when the kernel cannot be asked (no fsopen, an option
/// too long for fsconfig, an error that is not the parser's EINVAL); an
/// error naming the first option refused.
fn parser_accepts(fs_type: &str, data: &str, device: &Path) -> Result<bool, Error> {
    use rustix::mount::{fsconfig_set_flag, fsconfig_set_string, fsopen, FsOpenFlags};
    if data.is_empty() {
        return Ok(true);
    }
    let too_long = |o: &str| {
        let (key, value) = o.split_once('=').unwrap_or((o, ""));
        key.len() > FSCONFIG_MAX || value.len() > FSCONFIG_MAX
    };
    if data.split(',').any(too_long) {
        return Ok(false);
    }
    let Ok(fc) = fsopen(fs_type, FsOpenFlags::FSOPEN_CLOEXEC) else {
        return Ok(false);
    };
    for opt in data.split(',') {
        let r = match opt.split_once('=') {
            Some((key, value)) => fsconfig_set_string(&fc, key, value),
            None => fsconfig_set_flag(&fc, opt),
        };
        // Only EINVAL is the parser's "no"; ENOMEM or an interrupted wait
        // for the context's lock say nothing about the option.
        if let Err(e) = r {
            if e != Errno::INVAL {
                return Ok(false);
            }
            let why = kernel_says(&fc).unwrap_or_else(|| io::Error::from(e).to_string());
            return Err(Error::KernelRefusedOption {
                option: opt.to_string(),
                fs_type: fs_type.to_string(),
                device: device.display().to_string(),
                why,
            });
        }
    }
    Ok(true)
}

/// The last error an fs_context logged ("e ext4: Unknown parameter 'x'"),
/// without its severity prefix. The log holds at most 8 messages, one per read.
fn kernel_says(fc: &impl std::os::fd::AsFd) -> Option<String> {
    let mut last = None;
    let mut buf = [0u8; 1024];
    for _ in 0..8 {
        match rustix::io::read(fc, &mut buf) {
            Ok(n) if n > 0 => {
                let msg = String::from_utf8_lossy(buf.get(..n)?).trim().to_string();
                if let Some(e) = msg.strip_prefix("e ") {
                    last = Some(e.to_string());
                }
            }
            _ => break,
        }
    }
    last
}

/// Flushes the filesystem `fd` is on to disk (syncfs). `path` is for messages.
pub fn sync_filesystem(fd: BorrowedFd<'_>, path: &Path) -> Result<(), Error> {
    // syncfs needs a real open file, not an O_PATH fd: reopen what fd names.
    let file = rustix::fs::open(
        beneath::proc_path(fd),
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| SysError::new("open", path.display(), e))?;
    rustix::fs::syncfs(&file).map_err(|e| SysError::new("syncfs", path.display(), e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, OwnedFd};
    use std::path::PathBuf;

    use rustix::fs::{Mode, OFlags};

    use super::*;
    use crate::testutil::{root_or_skip, run, LoopDisk};

    fn opts(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn dir_fd(p: &Path) -> OwnedFd {
        rustix::fs::open(
            p,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
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

    /// A loop device with a fresh `fs` (xfs wants 300 MiB at least).
    fn loop_disk(fs: &str) -> LoopDisk {
        LoopDisk::new(if fs == "xfs" { 320 } else { 64 }, Some(fs))
    }

    /// Mounts the disk's filesystem on a fresh scratch directory `name`.
    fn mount_at(disk: &LoopDisk, name: &str, fs: &str) -> PathBuf {
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
    fn unmount_dev(path: &Path, disk: &LoopDisk) -> Result<bool, Error> {
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

    fn check_mount_options(fs: &str, data_opt: &str) {
        let disk = loop_disk(fs);
        let target = disk.scratch("mnt");
        let o = parse_options(&opts(&["noatime,nosuid", data_opt]), true).unwrap();
        mount_filesystem(&disk.device, dir_fd(&target).as_fd(), &target, fs, &o).unwrap();
        let e = entry(&target).expect("mounted");
        assert_eq!(e.fs_type, fs);
        assert_eq!(e.source, disk.device.display().to_string());
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

        // A bad data option is the kernel's to refuse, and it is named.
        let other = disk.scratch("other");
        let bad = parse_options(&opts(&["noatime,no_such_option_here"]), false).unwrap();
        let err =
            mount_filesystem(&disk.device, dir_fd(&other).as_fd(), &other, fs, &bad).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        assert!(
            matches!(&err, Error::KernelRefusedOption { option, .. } if option == "no_such_option_here"),
            "{err}"
        );
        assert!(err.to_string().contains("Unknown parameter"), "{err}");
        assert!(entry(&other).is_none());

        assert!(unmount_dev(&target, &disk).unwrap());
        assert!(entry(&target).is_none());
        assert!(!unmount_dev(&target, &disk).unwrap());
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

    /// The ext4 driver's full list of the options in force on `disk`
    /// (/proc/fs/ext4/<dev>/options), whatever the superblock's defaults.
    fn ext4_options(disk: &LoopDisk) -> Vec<String> {
        std::fs::read_to_string(format!("/proc/fs/ext4/{}/options", disk.name()))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn ext4_errors_are_the_agents_whatever_the_superblock_says() {
        if !root_or_skip("ext4_errors_are_the_agents_whatever_the_superblock_says") {
            return;
        }
        // No corruption anywhere: the host kernel never meets an error here.
        // (mkfs, how the superblock is set, the request's options, what must be in force)
        let cases: &[(&str, &[&str], &[&str], &str)] = &[
            ("mkfs.ext4", &["-e", "panic"], &[], "errors=remount-ro"),
            ("mkfs.ext4", &["-e", "remount-ro"], &[], "errors=remount-ro"),
            ("mkfs.ext3", &["-e", "panic"], &[], "errors=remount-ro"),
            (
                "mkfs.ext2",
                &["-e", "panic"],
                &["noatime"],
                "errors=remount-ro",
            ),
            (
                "mkfs.ext4",
                &["-e", "panic"],
                &["errors=continue"],
                "errors=continue",
            ),
            (
                "mkfs.ext4",
                &[],
                &["errors=remount-ro"],
                "errors=remount-ro",
            ),
        ];
        for (mkfs, tune, req, want) in cases {
            for planted in [false, true] {
                let what = format!("{mkfs} tune2fs {tune:?} planted={planted} request {req:?}");
                let disk = LoopDisk::new(64, None);
                run(mkfs, &["-q", "-F", &disk.path()]);
                if !tune.is_empty() {
                    let mut args = tune.to_vec();
                    let dev = disk.path();
                    args.push(&dev);
                    run("tune2fs", &args);
                }
                if planted {
                    run(
                        "debugfs",
                        &["-w", "-R", "ssv mount_opts errors=panic", &disk.path()],
                    );
                }
                let target = disk.scratch("mnt");
                let o = parse_options(&opts(req), false).unwrap();
                mount_filesystem(&disk.device, dir_fd(&target).as_fd(), &target, "ext4", &o)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let in_force = ext4_options(&disk);
                assert!(in_force.iter().any(|o| o == want), "{what}: {in_force:?}");
                assert!(
                    !in_force.iter().any(|o| o == "errors=panic"),
                    "{what}: {in_force:?}"
                );
                // mountinfo shows errors= only where it differs from s_errors.
                let e = entry(&target).unwrap();
                assert!(
                    !e.super_options.contains("errors=panic"),
                    "{what}: {}",
                    e.super_options
                );
                if tune.contains(&"panic") {
                    assert!(
                        e.super_options.split(',').any(|o| o == *want),
                        "{what}: {}",
                        e.super_options
                    );
                }
                assert!(unmount_dev(&target, &disk).unwrap());
            }
        }
    }

    #[test]
    fn a_filesystem_the_kernel_refuses_is_the_disks_fault() {
        if !root_or_skip("a_filesystem_the_kernel_refuses_is_the_disks_fault") {
            return;
        }
        // Larger than its device (what the probe catches first, when it is called).
        for (fs, mb) in [("ext4", 64u64), ("xfs", 320)] {
            let disk = loop_disk(fs);
            disk.resize(mb - 16);
            for req in [&[][..], &["noatime", "discard"]] {
                let target = disk.scratch("mnt");
                let o = parse_options(&opts(req), false).unwrap();
                let err = mount_filesystem(&disk.device, dir_fd(&target).as_fd(), &target, fs, &o)
                    .unwrap_err();
                assert_eq!(err.code(), Code::FailedPrecondition, "{fs} {req:?}: {err}");
                assert!(
                    matches!(err, Error::FilesystemRefused { .. }),
                    "{fs} {req:?}: {err}"
                );
                assert!(err.to_string().contains(&disk.path()), "{err}");
                assert!(entry(&target).is_none());
            }
        }
    }

    #[test]
    fn mount_lands_on_the_directory_the_fd_names_even_if_renamed() {
        if !root_or_skip("mount_lands_on_the_directory_the_fd_names_even_if_renamed") {
            return;
        }
        let disk = loop_disk("ext4");
        let a = disk.scratch("a");
        let fd = dir_fd(&a);
        // The name is swapped for a symlink to elsewhere after the fd was taken.
        let moved = disk.scratch("moved");
        std::fs::remove_dir(&moved).unwrap();
        std::fs::rename(&a, &moved).unwrap();
        let elsewhere = disk.scratch("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, &a).unwrap();
        mount_filesystem(
            &disk.device,
            fd.as_fd(),
            &a,
            "ext4",
            &parse_options(&[], false).unwrap(),
        )
        .unwrap();
        assert!(entry(&moved).is_some(), "mounted on the directory itself");
        assert!(entry(&elsewhere).is_none(), "not where the name now points");
        drop(fd);
        assert!(unmount_dev(&moved, &disk).unwrap());
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
        let err = mount_filesystem(
            &disk.device,
            dir_fd(&b).as_fd(),
            &b,
            "xfs",
            &parse_options(&[], false).unwrap(),
        )
        .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
        assert!(entry(&b).is_none());
        assert!(unmount_dev(&a, &disk).unwrap());
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
        sync_filesystem(dir_fd(&vol).as_fd(), &vol).unwrap();
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
    fn unmount_refuses_what_is_not_the_expected_mount() {
        if !root_or_skip("unmount_refuses_what_is_not_the_expected_mount") {
            return;
        }
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
            Expect::Mount(u64::MAX, 0, 0),
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
    fn unmount_never_follows_a_symlink_swapped_in_on_the_way() {
        if !root_or_skip("unmount_never_follows_a_symlink_swapped_in_on_the_way") {
            return;
        }
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
    fn unmount_of_a_busy_mount_fails_precondition() {
        if !root_or_skip("unmount_of_a_busy_mount_fails_precondition") {
            return;
        }
        let disk = loop_disk("ext4");
        let vol = mount_at(&disk, "vol", "ext4");
        let open = std::fs::File::open(&vol).unwrap();
        let err = unmount_dev(&vol, &disk).unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
        assert!(err.to_string().contains(vol.to_str().unwrap()));
        drop(open);
        assert!(unmount_dev(&vol, &disk).unwrap());
    }

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
        ) -> Result<BindOutcome, Error> {
            let t = self.root.join(target);
            bind::bind_with(
                &BindSpec {
                    source_root: self.vol_fd.as_fd(),
                    source_path: &self.vol,
                    subpath: Path::new(subpath),
                    target_base: self.root_fd.as_fd(),
                    target_rel: Path::new(target),
                    target_path: &t,
                    read_only: ro,
                    recursive_read_only: rro,
                },
                setattr,
            )
        }

        fn unbind(&self, target: &str, id: u64) -> bool {
            unmount_tree(self.root_fd.as_fd(), &self.root, Path::new(target), {
                let (ma, mi) = beneath::mount_point(self.vol_fd.as_fd()).unwrap().dev;
                Expect::Mount(id, ma, mi)
            })
            .unwrap()
        }
    }

    #[test]
    fn binds_root_and_subpath_writable_and_read_only() {
        if !root_or_skip("binds_root_and_subpath_writable_and_read_only") {
            return;
        }
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
        assert_eq!(u64::from(e.mount_id), out.mount_id);
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
    fn recursive_read_only_makes_the_difference() {
        if !root_or_skip("recursive_read_only_makes_the_difference") {
            return;
        }
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
    fn classic_path_without_mount_setattr() {
        if !root_or_skip("classic_path_without_mount_setattr") {
            return;
        }
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
        assert_eq!(u64::from(entry(&t).unwrap().mount_id), out.mount_id);
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
    fn target_escapes_are_refused() {
        if !root_or_skip("target_escapes_are_refused") {
            return;
        }
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
    fn binds_a_file_onto_a_new_file() {
        if !root_or_skip("binds_a_file_onto_a_new_file") {
            return;
        }
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
}

//! Mounting a volume's filesystem (ext4 or xfs) on a directory fd, with
//! the request's options put to the kernel's own parser first, and flushing
//! it before it comes off.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use rustix::io::Errno;
use rustix::mount::MountFlags;

use super::error::Error;
use super::options::BadOption;
use super::options::MountOptions;
use crate::sys::beneath;
use crate::sys::error::SysError;

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
    let flags = u32::try_from(opts.flags).map_err(|_| BadOption {
        option: format!("{:#x}", opts.flags),
        why: "the flags do not fit mount(2)",
    })?;
    let kernel_data = opts.kernel_data(fs_type);
    let data = CString::new(kernel_data.as_str()).map_err(|_| BadOption {
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
            device: device.to_path_buf(),
            target: target_path.to_path_buf(),
        },
        // The options were not checked (no fsopen) and some were given:
        // they may be at fault as much as the disk.
        Errno::INVAL if !parsed && !opts.data.is_empty() => Error::KernelRefusedOptions {
            data: opts.data.clone(),
            fs_type: fs_type.to_string(),
            device: device.to_path_buf(),
            target: target_path.to_path_buf(),
            source: e.into(),
        },
        Errno::INVAL | Errno::FBIG | Errno::UCLEAN | Errno::BADMSG | Errno::IO => {
            Error::FilesystemRefused {
                fs_type: fs_type.to_string(),
                device: device.to_path_buf(),
                target: target_path.to_path_buf(),
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
                device: device.to_path_buf(),
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
    use std::os::fd::AsFd;

    use super::*;
    use crate::code::Code;
    use crate::mount::options::parse_options;
    use crate::mount::testkit::{dir_fd, entry, is_erofs, loop_disk, opts, write};
    use crust_testkit::{needs, run, LoopDisk};

    /// Takes the test's mount at `path` off (unmounting by identity is
    /// `unmount`'s, tested there).
    fn umount(path: &Path) {
        rustix::mount::unmount(path, rustix::mount::UnmountFlags::empty()).unwrap();
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

        umount(&target);
        assert!(entry(&target).is_none());
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn mounts_ext4_with_options() {
        needs::loop_devices();
        check_mount_options("ext4", "errors=remount-ro");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn mounts_xfs_with_options() {
        needs::loop_devices();
        check_mount_options("xfs", "nouuid");
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
    #[ignore = "needs root: make test runs it"]
    fn ext4_errors_are_the_agents_whatever_the_superblock_says() {
        needs::loop_devices();
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
                umount(&target);
            }
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_filesystem_the_kernel_refuses_is_the_disks_fault() {
        needs::loop_devices();
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
    #[ignore = "needs root: make test runs it"]
    fn mount_lands_on_the_directory_the_fd_names_even_if_renamed() {
        needs::loop_devices();
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
        umount(&moved);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn mount_maps_busy_and_wrong_type() {
        needs::loop_devices();
        let disk = loop_disk("ext4");
        let a = disk.scratch("a");
        mount_filesystem(
            &disk.device,
            dir_fd(&a).as_fd(),
            &a,
            "ext4",
            &parse_options(&[], false).unwrap(),
        )
        .unwrap();
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
        umount(&a);
    }
}

//! Usage and health of a published volume: statfs for the numbers, and the
//! checks that tell kubelet a volume is abnormal (semantics.md §5). Reads only;
//! a failing check becomes a message, never an error, so usage still flows.

// Sizes come from disks and superblocks the agent does not control: every
// sum and product of them is checked.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;

use rustix::fs::AtFlags;
use rustix::io::Errno;

pub mod judge;
pub mod problem;

use judge::{DeviceFacts, DiskFacts, MountFacts, TableFacts};
use problem::Problem;

use crate::model::{Device, FsType, MountId};
use crate::sys::beneath::{self, MountPoint};
use crate::sys::blockdev;
use crate::sys::error::SysError;
use crate::sys::mountinfo::{self, MountEntry};
use crate::sys::sysfs::Sysfs;

/// Bytes and inodes of a mounted filesystem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// f_blocks × f_frsize.
    pub bytes_total: u64,
    /// f_bavail × f_frsize: what an unprivileged writer can still use.
    pub bytes_available: u64,
    /// (f_blocks − f_bfree) × f_frsize.
    pub bytes_used: u64,
    /// f_files.
    pub inodes_total: u64,
    /// f_ffree.
    pub inodes_available: u64,
    /// f_files − f_ffree.
    pub inodes_used: u64,
}

/// What a published volume should look like, and where to look.
#[derive(Clone, Copy)]
pub struct Expected<'a> {
    /// The volume as published (what the checks hold the facts against).
    pub volume: judge::Volume<'a>,
    /// The directory the mount point is resolved beneath, strictly.
    pub base: BorrowedFd<'a>,
    /// The mount point relative to `base`.
    pub rel: &'a Path,
    /// The filesystem's own size (not statfs's total, which leaves out
    /// metadata), measured through an fd of its mount root: held against
    /// the disk's. How to read it is growth's business; the caller says.
    pub fs_bytes: &'a dyn Fn(BorrowedFd<'_>) -> Option<u64>,
}

/// What a block volume should look like, and where to look.
#[derive(Clone, Copy)]
pub struct BlockExpected<'a> {
    /// The volume as published.
    pub volume: judge::BlockVolume<'a>,
    /// The directory the guest path is resolved beneath, strictly.
    pub base: BorrowedFd<'a>,
    /// The guest path relative to `base`.
    pub rel: &'a Path,
}

/// The size GetVolumeStats reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measured {
    /// A filesystem's bytes and inodes.
    Filesystem(Usage),
    /// A block volume: the device's size (BLKGETSIZE64); nothing is "used".
    Block {
        /// The device's size in bytes.
        device_bytes: u64,
    },
}

/// The CSI VolumeCondition: abnormal or not, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// True when any check failed.
    pub abnormal: bool,
    /// "ok", or every failed check, separated by "; ".
    pub message: String,
    /// Every failed check (GetVolumeHealth says each).
    pub problems: Vec<Problem>,
}

crate::code::coded_errors! {
/// What can go wrong reading usage.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

fn usage_of(st: &rustix::fs::StatVfs) -> Usage {
    // f_frsize is the unit of the block counts; very old kernels left it 0.
    let unit = if st.f_frsize != 0 {
        st.f_frsize
    } else {
        st.f_bsize
    };
    Usage {
        bytes_total: st.f_blocks.saturating_mul(unit),
        bytes_available: st.f_bavail.saturating_mul(unit),
        bytes_used: st.f_blocks.saturating_sub(st.f_bfree).saturating_mul(unit),
        inodes_total: st.f_files,
        inodes_available: st.f_ffree,
        inodes_used: st.f_files.saturating_sub(st.f_ffree),
    }
}

/// The usage of the filesystem mounted at `path`.
pub fn usage(path: &Path) -> Result<Usage, Error> {
    let st = rustix::fs::statvfs(path).map_err(|e| SysError::new("statfs", path.display(), e))?;
    Ok(usage_of(&st))
}

/// The mountinfo entry of the mount `fd` is on (its id from
/// /proc/self/fdinfo, which does not touch the filesystem).
fn mount_of_fd(fd: BorrowedFd<'_>) -> Option<MountEntry> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    let id = MountId(
        info.lines()
            .find_map(|l| l.strip_prefix("mnt_id:"))?
            .trim()
            .parse()
            .ok()?,
    );
    let table = mountinfo::read().ok()?;
    mountinfo::by_id(&table, id).cloned()
}

/// What the guest path's mount root shows (`fd`), and its statfs for the usage.
fn look_at_mount(fd: BorrowedFd<'_>) -> (MountFacts, Option<rustix::fs::StatVfs>) {
    let mount_point = beneath::mount_point(fd);
    let fd_mount = mount_point.is_err().then(|| mount_of_fd(fd)).flatten();
    let st = rustix::fs::fstatvfs(fd);
    let facts = MountFacts {
        mount_point,
        fd_mount,
        statfs: st
            .as_ref()
            .map(|s| s.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY))
            .map_err(|e| *e),
        stat: rustix::fs::statat(fd, c".", AtFlags::empty()).err(),
    };
    (facts, st.ok())
}

/// The entry of the mount at `mp` in the mount table.
fn look_up(mp: &Result<MountPoint, Errno>) -> TableFacts {
    match (mountinfo::read(), mp) {
        (Ok(table), Ok(mp)) => Ok(mountinfo::by_id(&table, mp.mount_id).cloned()),
        (Err(err), _) => Err(err.to_string()),
        _ => Ok(None),
    }
}

/// What sysfs says of the disk (`ext4`: whether to read ext4's error count).
fn look_at_disk(sysfs: &Sysfs, dev: &Device, ext4: bool, fs_bytes: Option<u64>) -> DiskFacts {
    DiskFacts {
        ext4_errors: ext4.then(|| sysfs.ext4_errors_count(&dev.name)).flatten(),
        ext4_errors_file: if ext4 {
            sysfs
                .ext4_errors_count_file(&dev.name)
                .display()
                .to_string()
        } else {
            String::new()
        },
        state: sysfs.disk_state(dev),
        dev_block: sysfs.dev_block.clone(),
        fs_bytes,
    }
}

/// Checks everything semantics.md §5 lists (judge.rs has the checks). The
/// mount point is resolved beneath `e.base` (no symlinks) and judged by
/// what it is (mount id, device), not by its spelling. Usage comes back
/// whenever statfs works on the volume's own filesystem (not on whatever
/// replaced its mount).
pub fn check(sysfs: &Sysfs, e: &Expected) -> (Option<Usage>, Condition) {
    let v = e.volume;
    let (mut usage, mut fs_bytes, mut table) = (None, None, None);
    let mount = beneath::open_path(e.base, e.rel).map(|fd| {
        let (facts, st) = look_at_mount(fd.as_fd());
        if judge::ours(&v, &facts).0 {
            usage = st.as_ref().map(usage_of);
            // The filesystem's own size (not statfs's, which leaves out
            // metadata), to hold against the disk's.
            fs_bytes = (e.fs_bytes)(fd.as_fd());
            table = Some(look_up(&facts.mount_point));
        }
        facts
    });
    let disk = look_at_disk(sysfs, v.device, v.fs == FsType::Ext4, fs_bytes);
    let problems = judge::filesystem(&v, &mount, table.as_ref(), &disk);
    (usage, condition_of(&problems))
}

/// The condition of a block volume (semantics.md §5) and its device's size:
/// abnormal when the guest path is no longer the bind of the device's node
/// the agent made (removed or replaced behind its back), when the disk is
/// gone or its node is another device now, or when the kernel's read-only
/// flag disagrees with how it was published. Reads nothing of the disk.
pub fn check_block(sysfs: &Sysfs, e: &BlockExpected) -> (Option<u64>, Condition) {
    let v = e.volume;
    let here = beneath::open_parent(e.base, e.rel)
        .and_then(|(parent, name)| beneath::mount_point_at(parent.as_fd(), &name));
    let dev = blockdev::open(v.device)
        .map(|f| DeviceFacts {
            size: blockdev::size(&f, v.device).map_err(|err| err.to_string()),
            read_only: blockdev::read_only(&f, v.device).map_err(|err| err.to_string()),
        })
        .map_err(|err| err.to_string());
    let bytes = dev.as_ref().ok().and_then(|d| d.size.clone().ok());
    let disk = look_at_disk(sysfs, v.device, false, None);
    (bytes, condition_of(&judge::block(&v, &here, &dev, &disk)))
}

fn condition_of(problems: &[Problem]) -> Condition {
    if problems.is_empty() {
        Condition {
            abnormal: false,
            message: "ok".to_string(),
            problems: Vec::new(),
        }
    } else {
        let said: Vec<String> = problems.iter().map(Problem::to_string).collect();
        Condition {
            abnormal: true,
            message: said.join("; "),
            problems: problems.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testdisk::{AgentDevice, MountedDisk};
    use crust_testkit::{needs, run, LoopDisk};
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    /// `check` of the mount at `m`, resolved from its parent's fd, with a
    /// filesystem that fills its disk as mkfs made it (`fs_bytes`, where
    /// the test says; growth reads the real size, tests/hostile.rs the whole).
    fn check_sized(
        sysfs: &Sysfs,
        s: &MountedDisk,
        fs: FsType,
        read_only: bool,
        fs_bytes: Option<u64>,
    ) -> (Option<Usage>, Condition) {
        let m = &s.m;
        let parent = m.path.parent().unwrap();
        let fd = rustix::fs::open(
            parent,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        check(
            sysfs,
            &Expected {
                volume: judge::Volume {
                    path: &m.path,
                    mount_id: None,
                    device: &s.dev,
                    read_only,
                    fs,
                },
                base: fd.as_fd(),
                rel: Path::new(m.path.file_name().unwrap()),
                fs_bytes: &|_| fs_bytes,
            },
        )
    }

    /// `check_sized` with no filesystem size to hold against the disk's.
    fn check_m(
        sysfs: &Sysfs,
        s: &MountedDisk,
        fs: FsType,
        read_only: bool,
    ) -> (Option<Usage>, Condition) {
        check_sized(sysfs, s, fs, read_only, None)
    }

    fn assert_ok(cond: &Condition) {
        assert_eq!(
            cond,
            &Condition {
                abnormal: false,
                message: "ok".into(),
                problems: Vec::new(),
            }
        );
    }

    fn assert_abnormal(cond: &Condition, says: &str) {
        assert!(cond.abnormal, "expected abnormal ({says}), got {cond:?}");
        assert!(
            cond.message.contains(says),
            "{:?} does not say {says:?}",
            cond.message
        );
    }

    #[test]
    fn computes_usage_from_statfs_fields() {
        // SAFETY: StatVfs is plain integers and a bitflags integer; all zeroes is valid.
        let mut st: rustix::fs::StatVfs = unsafe { std::mem::zeroed() };
        st.f_frsize = 4096;
        st.f_bsize = 1 << 20;
        st.f_blocks = 1000;
        st.f_bfree = 300;
        st.f_bavail = 250;
        st.f_files = 64;
        st.f_ffree = 60;
        let u = usage_of(&st);
        assert_eq!(
            u,
            Usage {
                bytes_total: 4096 * 1000,
                bytes_available: 4096 * 250,
                bytes_used: 4096 * 700,
                inodes_total: 64,
                inodes_available: 60,
                inodes_used: 4,
            }
        );
        st.f_frsize = 0;
        assert_eq!(usage_of(&st).bytes_total, 1000 << 20);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn healthy_volumes_are_ok_and_usage_follows_writes() {
        needs::loop_devices();
        for fs in [FsType::Ext4, FsType::Xfs] {
            let s = MountedDisk::new(320, fs.name(), "");
            let (before, cond) = check_m(&Sysfs::system(), &s, fs, false);
            assert_ok(&cond);
            let before = before.unwrap();
            let raw = rustix::fs::statvfs(&s.m.path).unwrap();
            assert_eq!(before.bytes_total, raw.f_blocks * raw.f_frsize);
            assert_eq!(before.bytes_available, raw.f_bavail * raw.f_frsize);
            assert!(
                before.bytes_available < before.bytes_total - before.bytes_used
                    || fs == FsType::Xfs
            );
            std::fs::write(s.m.path.join("data"), vec![7u8; 16 << 20]).unwrap();
            run("sync", &["-f", s.m.path.join("data").to_str().unwrap()]);
            let after = usage(&s.m.path).unwrap();
            assert_eq!(after.bytes_total, before.bytes_total, "{fs}");
            assert!(
                after.bytes_used >= before.bytes_used + (16 << 20),
                "{fs}: {before:?} → {after:?}"
            );
            assert!(
                after.bytes_available + (16 << 20) <= before.bytes_available,
                "{fs}"
            );
            assert_eq!(after.inodes_used, before.inodes_used + 1, "{fs}");
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn notices_an_unmount_behind_the_agents_back() {
        needs::loop_devices();
        let s = MountedDisk::new(64, "ext4", "");
        run("umount", &[s.m.path.to_str().unwrap()]);
        let (usage, cond) = check_m(&Sysfs::system(), &s, FsType::Ext4, false);
        assert_abnormal(&cond, "no longer a mount point");
        assert_eq!(
            usage, None,
            "the bare directory's usage is another filesystem's"
        );
        // Another disk mounted in its place.
        let other = LoopDisk::new(64, Some("ext4"));
        run(
            "mount",
            &[other.device.to_str().unwrap(), s.m.path.to_str().unwrap()],
        );
        let (usage, cond) = check_m(&Sysfs::system(), &s, FsType::Ext4, false);
        assert_eq!(usage, None);
        assert_abnormal(
            &cond,
            &format!("is now a mount of device 7:{}", other.agent_device().minor),
        );
        run("umount", &[s.m.path.to_str().unwrap()]);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn notices_a_read_only_remount() {
        needs::loop_devices();
        let s = MountedDisk::new(320, "xfs", "");
        run("mount", &["-o", "remount,ro", s.m.path.to_str().unwrap()]);
        let (usage, cond) = check_m(&Sysfs::system(), &s, FsType::Xfs, false);
        assert_abnormal(&cond, "published read-write but is now read-only");
        assert!(usage.is_some());
        // Published read-only, read-only is what it should be.
        let (_, cond) = check_m(&Sysfs::system(), &s, FsType::Xfs, true);
        assert_ok(&cond);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn notices_ext4_errors() {
        needs::loop_devices();
        let s = MountedDisk::new(64, "ext4", "errors=remount-ro");
        assert_ok(&check_m(&Sysfs::system(), &s, FsType::Ext4, false).1);
        std::fs::write(format!("/sys/fs/ext4/{}/trigger_fs_error", s.dev.name), "1").unwrap();
        // The error count is bumped by a work item: give it a moment.
        let started = Instant::now();
        let cond = loop {
            let (_, cond) = check_m(&Sysfs::system(), &s, FsType::Ext4, false);
            if cond.abnormal || started.elapsed() > Duration::from_secs(5) {
                break cond;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_abnormal(
            &cond,
            &format!("ext4 on {} has recorded 1 error(s)", s.dev.name),
        );
        // Kernels since 6.12 make the fs refuse writes without flagging the mount
        // read-only (EXT4_FLAGS_EMERGENCY_RO): the errors_count check is what sees it.
        let write = std::fs::write(s.m.path.join("after-error"), b"x");
        assert!(
            write.is_err(),
            "ext4 accepted a write after an error under errors=remount-ro"
        );
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn notices_a_disk_that_shrank_under_its_filesystem() {
        needs::loop_devices();
        for (fs, mb) in [(FsType::Ext4, 64u64), (FsType::Xfs, 320)] {
            let s = MountedDisk::as_the_agent(mb, fs.name());
            let size = Some(mb << 20);
            let check = || check_sized(&Sysfs::system(), &s, fs, false, size);
            assert_ok(&check().1);
            s.disk.resize(mb - 16);
            let (usage, cond) = check();
            assert_abnormal(&cond, "the filesystem is larger than its device");
            assert_abnormal(&cond, &format!("only {} bytes", (mb - 16) << 20));
            assert!(usage.is_some(), "{fs}: usage still flows");
            // Given back its size, it is fine again.
            s.disk.resize(mb);
            assert_ok(&check().1);
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn notices_a_shut_down_xfs() {
        needs::loop_devices();
        let s = MountedDisk::new(320, "xfs", "");
        run(
            "xfs_io",
            &["-x", "-c", "shutdown", s.m.path.to_str().unwrap()],
        );
        let (usage, cond) = check_m(&Sysfs::system(), &s, FsType::Xfs, false);
        assert_abnormal(&cond, "stat on");
        assert_abnormal(&cond, "fails with EIO");
        assert!(usage.is_some(), "xfs still answers statfs after a shutdown");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn notices_a_detached_disk() {
        needs::loop_devices();
        let s = MountedDisk::new(64, "ext4", "");
        // Detach while mounted (the loop driver defers it), then lose the backing storage.
        run("losetup", &["-d", s.disk.device.to_str().unwrap()]);
        s.disk.resize(0);
        let (_, cond) = check_m(&Sysfs::system(), &s, FsType::Ext4, false);
        assert_abnormal(
            &cond,
            &format!("disk {} (7:{}) reports size 0", s.dev.name, s.dev.minor),
        );
        // Unplugged altogether: /sys/block no longer lists it.
        let empty = tempfile::tempdir().unwrap();
        let gone = Sysfs {
            sys_block: empty.path().join("block"),
            dev_dir: "/dev".into(),
            dev_block: empty.path().join("dev/block"),
        };
        let (_, cond) = check_m(&gone, &s, FsType::Ext4, false);
        assert_abnormal(&cond, "is gone from");
    }
}

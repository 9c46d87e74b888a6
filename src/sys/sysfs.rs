//! The kernel's sysfs as the agent reads it, in one place and through one
//! seam: [`Sysfs`] names the directories (tests point it at a fake tree),
//! and every read of /sys the agent makes goes through it: the disks and
//! their serials, where a device's sectors lie, whether a disk is still
//! attached, ext4's live error count, SELinux, loaded modules.
//!
//! Attributes are read as text the kernel wrote; a missing one is None,
//! never an error: sysfs entries come and go with hot-plug.

// Sizes come from disks the agent does not control: every sum and product
// of them is checked.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::fs;
use std::path::{Path, PathBuf};

use crate::model::{Device, DiskState, Extent};

/// Where block devices are listed and where their nodes live; tests point it at a fake tree.
#[derive(Clone, Debug)]
pub struct Sysfs {
    /// `/sys/block`: one directory per whole disk, with `serial`, `dev` and `size`.
    pub sys_block: PathBuf,
    /// `/dev`: the device nodes (devtmpfs in the guest).
    pub dev_dir: PathBuf,
    /// `/sys/dev/block`: one link per block device, disks and partitions
    /// alike, named by its numbers ("253:16").
    pub dev_block: PathBuf,
}

impl Sysfs {
    /// The real system's /sys/block and /dev.
    pub fn system() -> Sysfs {
        Sysfs {
            sys_block: PathBuf::from("/sys/block"),
            dev_dir: PathBuf::from("/dev"),
            dev_block: PathBuf::from("/sys/dev/block"),
        }
    }

    /// Where ext4 publishes the live error count of the filesystem on disk
    /// `name`: `/sys/fs/ext4/<name>/errors_count`, beside `sys_block`.
    pub fn ext4_errors_count_file(&self, name: &str) -> PathBuf {
        self.sys_root()
            .join("fs/ext4")
            .join(name)
            .join("errors_count")
    }

    /// Where the sectors of block device `dev` (major, minor) lie, from
    /// `dev_block/<major>:<minor>`: a partition (it has a `partition`
    /// attribute) is `start` and `size` of the disk its directory sits in;
    /// anything else is a whole disk, all of itself. A device sysfs does not
    /// list (gone, or not a block device) counts as a whole disk of its own.
    pub fn extent(&self, dev: (u32, u32)) -> Extent {
        let whole = Extent {
            disk: dev,
            start: 0,
            sectors: u64::MAX,
            partition: false,
        };
        let dir = self.dev_dir_of(dev);
        let number = |p: PathBuf| read_attr(&p).and_then(|s| s.parse::<u64>().ok());
        if !dir.join("partition").exists() {
            return match number(dir.join("size")) {
                Some(sectors) => Extent { sectors, ..whole },
                None => whole,
            };
        }
        // `<partition>/..` is its disk's directory (the kernel resolves the
        // link first, then goes up).
        let disk = read_attr(&dir.join("../dev")).and_then(|s| parse_devnum(&s));
        match (disk, number(dir.join("start")), number(dir.join("size"))) {
            (Some(disk), Some(start), Some(sectors)) => Extent {
                disk,
                start,
                sectors,
                partition: true,
            },
            // A partition whose disk or range cannot be read: held against
            // all of its disk if that is known, so it is never let through.
            (Some(disk), _, _) => Extent {
                disk,
                partition: true,
                ..whole
            },
            _ => whole,
        }
    }

    /// The errors the ext4 on disk `name` has recorded since it was mounted;
    /// None when it is not a mounted ext4 (no such file).
    pub fn ext4_errors_count(&self, name: &str) -> Option<u64> {
        read_attr(&self.ext4_errors_count_file(name)).and_then(|s| s.parse().ok())
    }

    /// Whether `dev` is still attached: `/sys/dev/block/<major>:<minor>`, which
    /// lists partitions as well as whole disks, must still be the device of that
    /// kernel name, with a size above zero.
    pub fn disk_state(&self, dev: &Device) -> DiskState {
        let dir = self.dev_block.join(format!("{}:{}", dev.major, dev.minor));
        // The numbers may since have gone to another disk: the name must still match.
        let named = fs::read_link(&dir)
            .ok()
            .is_some_and(|l| l.file_name() == Some(std::ffi::OsStr::new(&dev.name)));
        let numbered = read_attr(&dir.join("dev")).and_then(|s| parse_devnum(&s))
            == Some((dev.major, dev.minor));
        if !named || !numbered {
            return DiskState::Gone;
        }
        match read_attr(&dir.join("size")).and_then(|s| s.parse::<u64>().ok()) {
            None => DiskState::Gone,
            Some(0) => DiskState::ZeroSize,
            Some(sectors) => DiskState::Present {
                size_bytes: sectors.saturating_mul(512),
            },
        }
    }

    /// `dev_block/<major>:<minor>`: a block device's directory, disk or partition.
    fn dev_dir_of(&self, (major, minor): (u32, u32)) -> PathBuf {
        self.dev_block.join(format!("{major}:{minor}"))
    }

    /// The kernel's name of block device `dev` ("vdb", "loop3p1"): where
    /// its `dev_block` link leads. None when sysfs does not list it.
    pub fn name_of(&self, dev: (u32, u32)) -> Option<String> {
        let link = fs::read_link(self.dev_dir_of(dev)).ok()?;
        link.file_name().map(|n| n.to_string_lossy().into_owned())
    }

    /// The virtio-blk serial of block device `dev`, if it has a non-empty one.
    pub fn serial_of(&self, dev: (u32, u32)) -> Option<String> {
        read_attr(&self.dev_dir_of(dev).join("serial")).filter(|s| !s.is_empty())
    }

    /// Whether the kernel has SELinux enabled: its filesystem's mount point,
    /// `/sys/fs/selinux` beside `sys_block`, exists only then.
    pub fn selinux_enabled(&self) -> bool {
        self.sys_root().join("fs/selinux").exists()
    }

    /// Whether kernel module `name` is loaded (built in or inserted):
    /// `/sys/module/<name>/initstate` beside `sys_block`.
    pub fn module_loaded(&self, name: &str) -> bool {
        self.sys_root()
            .join("module")
            .join(name)
            .join("initstate")
            .exists()
    }

    /// `/sys`: the parent of `sys_block`.
    fn sys_root(&self) -> &Path {
        self.sys_block.parent().unwrap_or(Path::new("/sys"))
    }
}

/// Reads a sysfs attribute without its trailing newline, spaces or NULs.
pub fn read_attr(path: &Path) -> Option<String> {
    let raw = fs::read(path).ok()?;
    let s = String::from_utf8_lossy(&raw);
    Some(
        s.trim_end_matches(|c: char| c.is_whitespace() || c == '\0')
            .to_string(),
    )
}

/// Parses a sysfs `dev` attribute ("253:16").
pub fn parse_devnum(s: &str) -> Option<(u32, u32)> {
    let (maj, min) = s.trim().split_once(':')?;
    Some((maj.parse().ok()?, min.parse().ok()?))
}

//! The shared domain types: what the capabilities, the table and the wire
//! all speak of (a filesystem type, a disk, a mount's id, the fsGroup policy,
//! recursive read-only), with no behaviour beyond naming and comparing them.
//! A leaf: it imports nothing of the agent's.

use std::path::PathBuf;

/// The filesystems the agent mounts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FsType {
    /// ext4 (the kernel's ext4 driver also mounts ext2/ext3, which share the magic).
    Ext4,
    Xfs,
}

impl FsType {
    /// The name the API and the kernel use ("ext4", "xfs").
    pub fn name(self) -> &'static str {
        match self {
            FsType::Ext4 => "ext4",
            FsType::Xfs => "xfs",
        }
    }

    /// Parses an API `fs_type`; None for anything but "ext4" and "xfs".
    pub fn parse(s: &str) -> Option<FsType> {
        match s {
            "ext4" => Some(FsType::Ext4),
            "xfs" => Some(FsType::Xfs),
            _ => None,
        }
    }
}

impl std::fmt::Display for FsType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Kubernetes' fsGroupChangePolicy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Walk every time.
    Always,
    /// Walk only when the root is not already right.
    OnRootMismatch,
}

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

/// One range of a user namespace's ids (CRI's IDMapping): `length` ids
/// from `container_id` inside are `host_id`… outside. On an idmapped bind,
/// a file owned on disk by `container_id + k` is seen from outside as
/// `host_id + k`, and a file made by `host_id + k` lands as `container_id + k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdRange {
    pub container_id: u32,
    pub host_id: u32,
    pub length: u32,
}

/// An idmapped bind's mappings, uids and gids (validate::id_map's rules).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdMap {
    pub uids: Vec<IdRange>,
    pub gids: Vec<IdRange>,
}

/// What a volume is published as (KEP-565's volumeMode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeMode {
    /// The disk's filesystem, mounted on a directory.
    Filesystem(FsType),
    /// The disk itself: its node bound onto an empty file. The agent never
    /// reads or writes its contents.
    Block,
}

impl VolumeMode {
    /// "ext4", "xfs", or "block".
    pub fn name(self) -> &'static str {
        match self {
            VolumeMode::Filesystem(fs) => fs.name(),
            VolumeMode::Block => "block",
        }
    }
}

/// A mount's id, as statx (`STATX_MNT_ID`) and /proc/self/mountinfo give
/// it. The kernel recycles ids, so an id names a mount only together with
/// the disk it is of (`mount::unmount::Expect`). Where none is known (a
/// record written before ids were kept), the type is `Option<MountId>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MountId(pub u64);

impl std::fmt::Display for MountId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a block device's sectors lie: the whole disk they are on and the
/// range there, from sysfs. A whole disk is all of itself; a partition is
/// `start`..`start + sectors` of its disk. Two devices share sectors when
/// they are on one disk and their ranges meet ("one disk, one volume" is
/// about sectors, not device numbers: a partition table, hostile or not,
/// can make a whole disk and its partitions, or two partitions, overlap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// The whole disk (major, minor).
    pub disk: (u32, u32),
    /// The first sector on that disk (512-byte units, as sysfs counts).
    pub start: u64,
    /// How many sectors; u64::MAX where sysfs did not say (all of the disk).
    pub sectors: u64,
    /// Whether the device is a partition (not the whole disk itself).
    pub partition: bool,
}

impl Extent {
    /// Whether the two share a sector. An empty range shares none.
    pub fn overlaps(&self, other: &Extent) -> bool {
        let end = |e: &Extent| e.start.saturating_add(e.sectors);
        self.disk == other.disk
            && self.sectors > 0
            && other.sectors > 0
            && self.start < end(other)
            && other.start < end(self)
    }

    /// How the two lie on their disk, for a message: "sectors 2048..65536
    /// of disk 7:0 against 0..65536".
    pub fn describe(&self, other: &Extent) -> String {
        let range = |e: &Extent| match e.sectors {
            u64::MAX => format!("{}..end", e.start),
            n => format!("{}..{}", e.start, e.start.saturating_add(n)),
        };
        format!(
            "sectors {} of disk {}:{} against {}",
            range(self),
            self.disk.0,
            self.disk.1,
            range(other)
        )
    }
}

/// A whole disk (or, from a path, any block device) the agent may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// Kernel name ("vdb", "loop3").
    pub name: String,
    /// Its node ("/dev/vdb").
    pub path: PathBuf,
    /// Device major number.
    pub major: u32,
    /// Device minor number.
    pub minor: u32,
    /// The virtio-blk serial, when the disk has one.
    pub serial: Option<String>,
}

/// What became of a disk the agent found earlier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskState {
    /// Still listed, with this many bytes.
    Present {
        /// The size sysfs reports, in bytes.
        size_bytes: u64,
    },
    /// No longer in /sys/block (unplugged), or its name now belongs to another disk.
    Gone,
    /// Listed, but with size 0 (its backing went away).
    ZeroSize,
}

/// crust-testkit's loop disks as the agent knows a disk (the kit links
/// neither the agent nor crustd, so that both can use it in their tests).
#[cfg(test)]
pub(crate) mod testdisk {
    /// A loop disk as the agent's [`super::Device`].
    pub(crate) trait AgentDevice {
        /// Its node, kernel name and numbers (a loop device has no serial).
        fn agent_device(&self) -> super::Device;
    }

    impl AgentDevice for crust_testkit::LoopDisk {
        fn agent_device(&self) -> super::Device {
            use std::os::unix::fs::MetadataExt;
            let rdev = std::fs::metadata(&self.device).unwrap().rdev();
            super::Device {
                name: self.name(),
                path: self.device.clone(),
                major: rustix::fs::major(rdev),
                minor: rustix::fs::minor(rdev),
                serial: None,
            }
        }
    }

    /// A loop disk with a new filesystem, mounted, and the agent's view of
    /// the disk. Its fields drop in this order: the mount before the disk.
    pub(crate) struct MountedDisk {
        pub(crate) m: crust_testkit::Mounted,
        pub(crate) disk: crust_testkit::LoopDisk,
        pub(crate) dev: super::Device,
    }

    impl MountedDisk {
        /// A disk of `mb` MiB with a new `fs`, mounted with `options`.
        pub(crate) fn new(mb: u64, fs: &str, options: &str) -> MountedDisk {
            let disk = crust_testkit::LoopDisk::new(mb, Some(fs));
            let m = crust_testkit::Mounted::new(&disk.device, fs, options);
            MountedDisk::of(disk, m)
        }

        /// A disk of `mb` MiB with a new `fs`, mounted as the agent mounts it.
        pub(crate) fn as_the_agent(mb: u64, fs: &str) -> MountedDisk {
            let disk = crust_testkit::LoopDisk::new(mb, Some(fs));
            let m = crust_testkit::Mounted::as_the_agent(&disk.device, fs);
            MountedDisk::of(disk, m)
        }

        fn of(disk: crust_testkit::LoopDisk, m: crust_testkit::Mounted) -> MountedDisk {
            let dev = disk.agent_device();
            MountedDisk { m, disk, dev }
        }
    }
}

//! The kernel as the volume table uses it: every effect the table's logic
//! decides on (finding and checking a disk, mounting, binding and
//! unmounting by identity, flushing, freezing, thawing, trimming, a block
//! device's read-only flag) and every look it takes at the mounts (the
//! mount table, statx of a mount point). The table and its operations are
//! generic over it, so that their logic runs against a fake in tests,
//! without root (`fake.rs`), while the agent instantiates only [`Linux`]:
//! static dispatch, no cost in the binary.
//!
//! The syscalls themselves stay in their capability modules (`mount/`,
//! `quiesce`, `probe/`, `device`) and leaves (`sys::blockdev`,
//! `sys::mountinfo`, `sys::beneath`); [`Linux`] only calls them. What the
//! table reads or makes beneath its root with openat2 (directories, files)
//! is not here: that works without root, on a temporary directory. Nor
//! are a volume's usage, condition and growth (`stats`, `grow`, a device's
//! size as it grows): those capabilities gather what they judge themselves,
//! and their logic has its own seam (`stats::judge`).

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::io::Errno;
use zeroize::Zeroizing;

use super::lease::Thaw;
use super::request::Source;
use crate::cancel::Cancel;
use crate::device;
use crate::error::Result;
use crate::luks2;
use crate::luks2::format::Mac;
use crate::luks2::made::{self, Found};
use crate::luks2::mapping::{self, Live, Mapping};
use crate::mkfs;
use crate::model::{Device, FsType, MountId};
use crate::mount::bind::{BindSpec, Bound};
use crate::mount::error::Error as MountError;
use crate::mount::options::MountOptions;
use crate::mount::unmount::Expect;
use crate::mount::{bind, filesystem, unmount};
use crate::probe::judge;
use crate::quiesce;
use crate::sys::beneath::{self, MountPoint};
use crate::sys::blockdev;
use crate::sys::error::SysError;
use crate::sys::mountinfo::{self, MountEntry};
use crate::sys::sysfs::Sysfs;

/// The kernel's effects and looks the table needs (the module doc).
pub trait Kernel: Send + Sync + 'static {
    /// A frozen filesystem, held until the lease room thaws it.
    type Hold: Thaw;
    /// A block device opened for its ioctls.
    type Disk;
    /// A mounted filesystem's root, opened for its ioctls.
    type Fs;

    /// The disk `source` names: by serial, waited for up to `timeout`
    /// (device.rs), or by its node.
    fn find_disk(
        &self,
        sysfs: &Sysfs,
        source: &Source,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Device>;
    /// Refuses a disk that does not hold `fs` as the agent accepts it (probe/).
    fn check_filesystem(&self, device: &Device, fs: FsType) -> Result<()>;
    /// The filesystem (or other signature) `device` holds, if any (probe/).
    fn identify(&self, device: &Device) -> Result<Option<&'static str>>;

    /// Mounts `device`'s filesystem on the directory `target` names.
    fn mount_filesystem(
        &self,
        device: &Path,
        target: BorrowedFd<'_>,
        target_path: &Path,
        fs: FsType,
        options: &MountOptions,
    ) -> std::result::Result<(), MountError>;
    /// Binds a volume (or a subpath) at a target, made where missing.
    fn bind(&self, spec: &BindSpec<'_>) -> std::result::Result<Bound, MountError>;
    /// Binds a block device's node onto the file `target`.
    fn bind_node(
        &self,
        spec: &BindSpec<'_>,
        target: &OwnedFd,
    ) -> std::result::Result<MountId, MountError>;
    /// Unmounts the mount `expect` names at `rel` beneath `base`, and what
    /// is mounted below it; false when it is not there.
    fn unmount_tree(
        &self,
        base: BorrowedFd<'_>,
        base_path: &Path,
        rel: &Path,
        expect: Expect,
    ) -> std::result::Result<bool, MountError>;
    /// Removes the empty node at `rel` a publish or a bind made, unless
    /// something is mounted there.
    fn remove_node(&self, base: BorrowedFd<'_>, rel: &Path);
    /// Flushes the filesystem `at` is on.
    fn sync_filesystem(
        &self,
        at: BorrowedFd<'_>,
        path: &Path,
    ) -> std::result::Result<(), MountError>;

    /// The mount table (mountinfo).
    fn mountinfo(&self) -> std::result::Result<Vec<MountEntry>, SysError>;
    /// statx of what `fd` names, as far as mounts go.
    fn mount_point(&self, fd: BorrowedFd<'_>) -> std::result::Result<MountPoint, Errno>;
    /// statx of `name` in `dir`, not following a symlink there.
    fn mount_point_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &CStr,
    ) -> std::result::Result<MountPoint, Errno>;
    /// fstat of what `fd` names: its owner as `fd`'s mount shows it (an
    /// idmapped mount maps it).
    fn stat(&self, fd: BorrowedFd<'_>) -> std::result::Result<rustix::fs::Stat, Errno>;

    /// FIFREEZE on the mount root `at` names.
    fn freeze(&self, at: BorrowedFd<'_>, path: &Path) -> Result<Self::Hold>;
    /// FITHAW on the mount root `at` names; false when it was not frozen.
    fn thaw(&self, at: BorrowedFd<'_>, path: &Path) -> Result<bool>;
    /// The size in bytes of the filesystem `fs` whose mount root `at`
    /// names, checked to be on `dev` (grow.rs).
    fn fs_bytes(&self, at: BorrowedFd<'_>, path: &Path, dev: &Device, fs: FsType) -> Result<u64>;
    /// The filesystem whose mount root `at` names, opened for FITRIM.
    fn open_fs(
        &self,
        at: BorrowedFd<'_>,
        path: &Path,
    ) -> std::result::Result<Self::Fs, quiesce::Error>;
    /// FITRIM of `len` bytes from `start` of `fs`; the bytes it discarded.
    fn trim(
        &self,
        fs: &Self::Fs,
        path: &Path,
        start: u64,
        len: u64,
        min_len: u64,
    ) -> std::result::Result<u64, quiesce::Error>;

    /// An O_PATH fd of a block device's node, checked to be that device.
    fn open_node(&self, dev: &Device) -> std::result::Result<OwnedFd, blockdev::Error>;
    /// The block device, opened for its ioctls, checked to be that device.
    fn open_disk(&self, dev: &Device) -> std::result::Result<Self::Disk, blockdev::Error>;
    /// BLKROGET.
    fn read_only(
        &self,
        disk: &Self::Disk,
        dev: &Device,
    ) -> std::result::Result<bool, blockdev::Error>;
    /// BLKROSET.
    fn set_read_only(
        &self,
        disk: &Self::Disk,
        dev: &Device,
        ro: bool,
    ) -> std::result::Result<(), blockdev::Error>;
    /// What was written to the device, flushed.
    fn flush(&self, disk: &Self::Disk, dev: &Device) -> std::result::Result<(), blockdev::Error>;
    /// BLKGETSIZE64.
    fn size(&self, disk: &Self::Disk, dev: &Device) -> std::result::Result<u64, blockdev::Error>;

    /// Opens the LUKS2 volume on `disk` with `passphrase` as the dm-crypt
    /// mapping `name` (luks2::mapping); nothing is left when it fails.
    fn open_mapping(
        &self,
        disk: &Device,
        name: &str,
        allow_discards: bool,
        passphrase: &Zeroizing<Vec<u8>>,
    ) -> std::result::Result<Mapping, luks2::error::Error>;
    /// Makes `disk` a LUKS2 volume opened by `passphrase` if it is
    /// provably blank, with `integrity` if asked (luks2::made; `name` is
    /// its mapping's, which names its dm-integrity device); says what it
    /// found, refusing a volume whose integrity is not the one asked.
    fn format_if_blank(
        &self,
        disk: &Device,
        name: &str,
        passphrase: &Zeroizing<Vec<u8>>,
        integrity: Option<Mac>,
    ) -> std::result::Result<Found, luks2::error::Error>;
    /// Wipes the new volume on `disk` through its mapping `mapped` from
    /// where its wipe has reached (luks2::wipe), within `cancel`; the
    /// bytes of the mapping it wrote, or None when no wipe is under way.
    fn wipe_mapping(
        &self,
        disk: &Device,
        mapped: &Device,
        cancel: &Cancel,
    ) -> Result<Option<std::ops::Range<u64>>>;
    /// Marks the volume the agent made on `disk` finished.
    fn finish_format(&self, disk: &Device) -> std::result::Result<(), luks2::error::Error>;
    /// Makes filesystem `fs` on `device` (a new mapping): the one program
    /// the agent runs (mkfs).
    fn make_filesystem(&self, device: &Device, fs: FsType, cancel: &Cancel) -> Result<()>;
    /// Removes mapping `name` and forgets its key; false when it was not there.
    fn close_mapping(&self, name: &str) -> std::result::Result<bool, luks2::error::Error>;
    /// Whether `m` is still there, live, as made.
    fn mapping_live(&self, m: &Mapping) -> std::result::Result<Live, luks2::error::Error>;
    /// Grows mapping `name` to its disk's end (`disk_bytes`); its size after.
    fn grow_mapping(
        &self,
        name: &str,
        disk_bytes: u64,
    ) -> std::result::Result<u64, luks2::error::Error>;
    /// The names of agents' mappings in the guest, this agent's and any
    /// other's (`mapping::agents_mappings`): whose each is, its name says.
    fn agents_mappings(&self) -> std::result::Result<Vec<String>, luks2::error::Error>;
    /// How many sectors of `m` (a mapping with integrity) the kernel
    /// refused as tampered since it was opened; 0 without integrity.
    fn mapping_tampered(&self, m: &Mapping) -> std::result::Result<u64, luks2::error::Error>;
}

/// The guest's free memory in bytes (with its buffers), which bounds what
/// an Argon2 keyslot may take.
fn free_memory() -> u64 {
    let s = rustix::system::sysinfo();
    s.freeram
        .saturating_add(s.bufferram)
        .saturating_mul(u64::from(s.mem_unit.max(1)))
}

/// The running kernel: each method calls the capability that owns the
/// syscall.
#[derive(Clone, Copy, Debug, Default)]
pub struct Linux;

/// A filesystem the kernel froze: its root, open since the freeze, so the
/// thaw needs no path and no lock.
pub struct Hold {
    dir: File,
    /// For messages.
    path: PathBuf,
}

impl Thaw for Hold {
    fn thaw(&self) -> std::result::Result<bool, quiesce::Error> {
        quiesce::thaw(&self.dir, &self.path)
    }
}

impl Kernel for Linux {
    type Hold = Hold;
    type Disk = File;
    type Fs = File;

    fn find_disk(
        &self,
        sysfs: &Sysfs,
        source: &Source,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Device> {
        Ok(match source {
            Source::Serial(s) => device::find_by_serial(sysfs, s, timeout, cancel)?,
            Source::Path(p) => device::from_path(sysfs, p)?,
        })
    }

    fn check_filesystem(&self, device: &Device, fs: FsType) -> Result<()> {
        Ok(judge::check(&device.path, fs)?)
    }

    fn identify(&self, device: &Device) -> Result<Option<&'static str>> {
        Ok(judge::identify(&device.path)?)
    }

    fn mount_filesystem(
        &self,
        device: &Path,
        target: BorrowedFd<'_>,
        target_path: &Path,
        fs: FsType,
        options: &MountOptions,
    ) -> std::result::Result<(), MountError> {
        filesystem::mount_filesystem(device, target, target_path, fs.name(), options)
    }

    fn bind(&self, spec: &BindSpec<'_>) -> std::result::Result<Bound, MountError> {
        bind::bind(spec)
    }

    fn bind_node(
        &self,
        spec: &BindSpec<'_>,
        target: &OwnedFd,
    ) -> std::result::Result<MountId, MountError> {
        bind::bind_node(spec, target)
    }

    fn unmount_tree(
        &self,
        base: BorrowedFd<'_>,
        base_path: &Path,
        rel: &Path,
        expect: Expect,
    ) -> std::result::Result<bool, MountError> {
        unmount::unmount_tree(base, base_path, rel, expect)
    }

    fn remove_node(&self, base: BorrowedFd<'_>, rel: &Path) {
        unmount::remove_node(base, rel)
    }

    fn sync_filesystem(
        &self,
        at: BorrowedFd<'_>,
        path: &Path,
    ) -> std::result::Result<(), MountError> {
        filesystem::sync_filesystem(at, path)
    }

    fn mountinfo(&self) -> std::result::Result<Vec<MountEntry>, SysError> {
        mountinfo::read()
    }

    fn mount_point(&self, fd: BorrowedFd<'_>) -> std::result::Result<MountPoint, Errno> {
        beneath::mount_point(fd)
    }

    fn mount_point_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &CStr,
    ) -> std::result::Result<MountPoint, Errno> {
        beneath::mount_point_at(dir, name)
    }

    fn stat(&self, fd: BorrowedFd<'_>) -> std::result::Result<rustix::fs::Stat, Errno> {
        rustix::fs::fstat(fd)
    }

    fn freeze(&self, at: BorrowedFd<'_>, path: &Path) -> Result<Hold> {
        let dir = quiesce::open(at, path)?;
        quiesce::freeze(&dir, path)?;
        Ok(Hold {
            dir,
            path: path.to_path_buf(),
        })
    }

    fn thaw(&self, at: BorrowedFd<'_>, path: &Path) -> Result<bool> {
        let dir = quiesce::open(at, path)?;
        Ok(quiesce::thaw(&dir, path)?)
    }

    fn fs_bytes(&self, at: BorrowedFd<'_>, path: &Path, dev: &Device, fs: FsType) -> Result<u64> {
        Ok(crate::grow::fs_size_bytes(at, path, dev, fs)?)
    }

    fn open_fs(
        &self,
        at: BorrowedFd<'_>,
        path: &Path,
    ) -> std::result::Result<File, quiesce::Error> {
        quiesce::open(at, path)
    }

    fn trim(
        &self,
        fs: &File,
        path: &Path,
        start: u64,
        len: u64,
        min_len: u64,
    ) -> std::result::Result<u64, quiesce::Error> {
        quiesce::trim(fs, path, start, len, min_len)
    }

    fn open_node(&self, dev: &Device) -> std::result::Result<OwnedFd, blockdev::Error> {
        blockdev::open_node(dev)
    }

    fn open_disk(&self, dev: &Device) -> std::result::Result<File, blockdev::Error> {
        blockdev::open(dev)
    }

    fn read_only(&self, disk: &File, dev: &Device) -> std::result::Result<bool, blockdev::Error> {
        blockdev::read_only(disk, dev)
    }

    fn set_read_only(
        &self,
        disk: &File,
        dev: &Device,
        ro: bool,
    ) -> std::result::Result<(), blockdev::Error> {
        blockdev::set_read_only(disk, dev, ro)
    }

    fn flush(&self, disk: &File, dev: &Device) -> std::result::Result<(), blockdev::Error> {
        blockdev::flush(disk, dev)
    }

    fn size(&self, disk: &File, dev: &Device) -> std::result::Result<u64, blockdev::Error> {
        blockdev::size(disk, dev)
    }

    fn open_mapping(
        &self,
        disk: &Device,
        name: &str,
        allow_discards: bool,
        passphrase: &Zeroizing<Vec<u8>>,
    ) -> std::result::Result<Mapping, luks2::error::Error> {
        let free = free_memory();
        let open = mapping::Open {
            disk: &disk.path,
            disk_dev: (disk.major, disk.minor),
            name,
            read_only: false,
            allow_discards,
            limits: mapping::guest_limits(free),
        };
        mapping::open(&open, passphrase)
    }

    fn format_if_blank(
        &self,
        disk: &Device,
        name: &str,
        passphrase: &Zeroizing<Vec<u8>>,
        integrity: Option<Mac>,
    ) -> std::result::Result<Found, luks2::error::Error> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpus = u32::try_from(cpus).unwrap_or(4);
        let options = made::guest_options(free_memory(), cpus, integrity);
        let on = made::Disk {
            path: &disk.path,
            dev: (disk.major, disk.minor),
            name,
        };
        made::format_if_blank(&on, passphrase, &options)
    }

    fn wipe_mapping(
        &self,
        disk: &Device,
        mapped: &Device,
        cancel: &Cancel,
    ) -> Result<Option<std::ops::Range<u64>>> {
        Ok(luks2::wipe::wipe(&disk.path, &mapped.path, cancel)?)
    }

    fn finish_format(&self, disk: &Device) -> std::result::Result<(), luks2::error::Error> {
        made::finish(&disk.path)
    }

    fn make_filesystem(&self, device: &Device, fs: FsType, cancel: &Cancel) -> Result<()> {
        Ok(mkfs::make(fs, &device.path, &mkfs::Tools::find(), cancel)?)
    }

    fn close_mapping(&self, name: &str) -> std::result::Result<bool, luks2::error::Error> {
        mapping::close(name)
    }

    fn mapping_live(&self, m: &Mapping) -> std::result::Result<Live, luks2::error::Error> {
        mapping::live(&m.name, &m.dm_uuid)
    }

    fn grow_mapping(
        &self,
        name: &str,
        disk_bytes: u64,
    ) -> std::result::Result<u64, luks2::error::Error> {
        mapping::grow(name, disk_bytes)
    }

    fn agents_mappings(&self) -> std::result::Result<Vec<String>, luks2::error::Error> {
        mapping::agents_mappings()
    }

    fn mapping_tampered(&self, m: &Mapping) -> std::result::Result<u64, luks2::error::Error> {
        mapping::tampered_now(m)
    }
}

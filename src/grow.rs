//! Online growth of a mounted ext4 or xfs to fill its (already grown) disk, by
//! the kernel's own resize ioctls: no resize2fs or xfs_growfs. Growth is only
//! reported once the filesystem's size, read back afterwards, shows it.
//! Growth is one skeleton (`grow_with`: measure, check, ioctl, measure
//! again); each filesystem says only how it does each step (`Resize`).

// Sizes come from disks and superblocks the agent does not control: every
// sum and product of them is checked.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::fs::File;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::ioctl::{opcode, Opcode};

use crate::model::{Device, FsType};
use crate::superblock;
use crate::sys::beneath;
use crate::sys::error::SysError;
use crate::sys::features::has_sys_resource;
use crate::sys::mountinfo::shown;
use crate::sys::sysfs::Sysfs;

crate::code::coded_errors! {
/// What can go wrong growing a filesystem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("{} is mounted read-only; a read-only filesystem cannot be grown", shown(path))]
    ReadOnly {
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("{} is not an {expected} filesystem (statfs type {found:#x}); refusing to grow it", shown(path))]
    WrongFs {
        path: PathBuf,
        /// The volume's filesystem.
        expected: FsType,
        /// The statfs magic found instead.
        found: u64,
    },
    #[code(FailedPrecondition)]
    #[error("growing ext4 online at {} needs CAP_SYS_RESOURCE, which the agent does not have; run the agent with that capability (as PID 1 it has it), or grow the filesystem offline", shown(path))]
    NeedsCapSysResource {
        path: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("the ext4 filesystem at {} ({}) has errors recorded; the kernel refuses online growth until e2fsck has repaired it on the host", shown(path), shown(device))]
    HasErrors {
        path: PathBuf,
        device: PathBuf,
    },
    #[code(FailedPrecondition)]
    #[error("the kernel refused to grow {fs} at {}: {call} failed with {source}", shown(path))]
    Refused {
        path: PathBuf,
        /// The filesystem.
        fs: FsType,
        /// The ioctl.
        call: &'static str,
        /// The errno.
        #[source]
        source: io::Error,
    },
    #[code(Internal)]
    #[error("growing {fs} at {} to fill {wanted} bytes was accepted, but the filesystem is {after} bytes (it was {before}); not reporting a growth that did not happen", shown(path))]
    NotGrown {
        path: PathBuf,
        /// The filesystem.
        fs: FsType,
        /// Size before, bytes.
        before: u64,
        /// Size after, bytes.
        after: u64,
        /// The device size it should have filled, bytes.
        wanted: u64,
    },
    #[code(FailedPrecondition)]
    #[error("{} is not mounted from {} ({major}:{minor}); refusing to grow what is there", shown(path), shown(device))]
    NotOnDevice {
        path: PathBuf,
        /// The volume's device node.
        device: PathBuf,
        major: u32,
        minor: u32,
    },
    #[code(OutOfRange)]
    #[error("the {fs} at {} is {fs_bytes} bytes but its disk {} now holds only {device_bytes} bytes: the disk shrank under the mounted filesystem, which cannot shrink, and reads past the disk's end fail; give the disk back at least {fs_bytes} bytes", shown(path), shown(device))]
    LargerThanDevice {
        path: PathBuf,
        /// The filesystem.
        fs: FsType,
        /// The volume's device node.
        device: PathBuf,
        /// The filesystem's size, bytes.
        fs_bytes: u64,
        /// The device's size now, bytes.
        device_bytes: u64,
    },
    #[code(Internal)]
    #[error("the filesystem at {} claims {blocks} blocks of {block_size} bytes, more than 2^64 bytes; its superblock is corrupt: check it on the host", shown(path))]
    Overflow {
        path: PathBuf,
        /// The block count.
        blocks: u64,
        block_size: u64,
    },
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

// ---- the skeleton ----

/// A filesystem's size as one measure reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Size {
    blocks: u64,
    block_size: u64,
}

/// A mounted filesystem growth works on: its mount directory (opened and
/// checked by [`open_checked`]), its path for messages, and its device.
struct At<'a> {
    dir: File,
    path: &'a Path,
    dev: &'a Device,
}

/// What growth asks of one filesystem. [`grow_with`] is the rest, the same
/// for every filesystem: measure, refuse a disk smaller than the
/// filesystem, the ioctl, and the measure again that alone says it grew.
trait Resize {
    const FS: FsType;
    /// The resize ioctl, for messages.
    const CALL: &'static str;
    /// What one measure reads: the size, and what the other steps need of it.
    type Measure;
    fn measure(at: &At<'_>) -> Result<Self::Measure, Error>;
    fn size(m: &Self::Measure) -> Size;
    /// The block count the filesystem can reach on a disk of `blocks`.
    fn reachable(_m: &Self::Measure, blocks: u64) -> u64 {
        blocks
    }
    /// Refuses growth the kernel would refuse less clearly (nothing, unless
    /// the filesystem says).
    fn ready(_at: &At<'_>, _m: &Self::Measure, _sysfs: &Sysfs) -> Result<(), Error> {
        Ok(())
    }
    /// The ioctl, asking for `target` blocks.
    fn resize(at: &At<'_>, m: &Self::Measure, target: u64) -> io::Result<()>;
    /// Whether `after` is the growth from `before` to `target` asked for.
    fn reached(before: &Self::Measure, after: &Self::Measure, target: u64) -> bool;
}

/// The filesystem's own size in bytes.
fn size_with<R: Resize>(at: &At<'_>) -> Result<u64, Error> {
    let s = R::size(&R::measure(at)?);
    bytes(s.blocks, s.block_size, at.path)
}

/// Grows the filesystem at `at` to fill `device_bytes`: its new size, or its
/// size unchanged when it fills them already.
fn grow_with<R: Resize>(at: &At<'_>, device_bytes: u64, sysfs: &Sysfs) -> Result<u64, Error> {
    let before = R::measure(at)?;
    let Size { blocks, block_size } = R::size(&before);
    let before_bytes = bytes(blocks, block_size, at.path)?;
    fits(at.path, R::FS, at.dev, before_bytes, device_bytes)?;
    let target = R::reachable(&before, blocks_in(device_bytes, block_size));
    if target <= blocks {
        return Ok(before_bytes);
    }
    R::ready(at, &before, sysfs)?;
    R::resize(at, &before, target).map_err(|e| refused_or_sys(at.path, R::FS, R::CALL, e))?;
    let after = R::measure(at)?;
    let now = R::size(&after);
    if !R::reached(&before, &after, target) {
        return Err(Error::NotGrown {
            path: at.path.to_path_buf(),
            fs: R::FS,
            before: before_bytes,
            after: now.blocks.saturating_mul(now.block_size),
            wanted: device_bytes,
        });
    }
    bytes(now.blocks, now.block_size, at.path)
}

// ---- xfs ----

/// `struct xfs_fsop_geom` (v5, 256 bytes); v4 is its first 112 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct XfsGeom {
    blocksize: u32,
    rtextsize: u32,
    agblocks: u32,
    agcount: u32,
    logblocks: u32,
    sectsize: u32,
    inodesize: u32,
    imaxpct: u32,
    datablocks: u64,
    rtblocks: u64,
    rtextents: u64,
    logstart: u64,
    uuid: [u8; 16],
    sunit: u32,
    swidth: u32,
    version: i32,
    flags: u32,
    logsectsize: u32,
    rtsectsize: u32,
    dirblocksize: u32,
    logsunit: u32,
    sick: u32,
    checked: u32,
    reserved: [u64; 17],
}

/// `struct xfs_growfs_data`.
#[repr(C)]
struct XfsGrowfsData {
    newblocks: u64,
    imaxpct: u32,
}

const XFS_IOC_FSGEOMETRY: Opcode = opcode::read::<XfsGeom>(b'X', 126);
const XFS_IOC_FSGEOMETRY_V4: Opcode = opcode::read::<[u8; 112]>(b'X', 124);
const XFS_IOC_FSGROWFSDATA: Opcode = opcode::write::<XfsGrowfsData>(b'X', 110);
/// The smallest allocation group xfs adds when growing (XFS_MIN_AG_BLOCKS).
const XFS_MIN_AG_BLOCKS: u64 = 64;

const _: () = assert!(std::mem::size_of::<XfsGeom>() == 256);
const _: () = assert!(std::mem::size_of::<XfsGrowfsData>() == 16);

fn xfs_geometry_call<const OP: Opcode>(dir: &File) -> io::Result<XfsGeom> {
    // SAFETY: all-zero bytes are a valid XfsGeom (integers and arrays of them).
    let mut geom: XfsGeom = unsafe { std::mem::zeroed() };
    // SAFETY: OP is one of the two FSGEOMETRY opcodes; the kernel writes its
    // answer into the live XfsGeom of 256 bytes (the v5 call all of it, the v4
    // call its first 112), which starts initialized, so a shorter answer
    // leaves nothing undefined.
    unsafe { rustix::ioctl::ioctl(dir, rustix::ioctl::Updater::<OP, XfsGeom>::new(&mut geom)) }?;
    // Every size below divides by it.
    if geom.blocksize == 0 {
        return Err(io::Error::other("the kernel reported block size 0"));
    }
    Ok(geom)
}

fn xfs_geometry(dir: &File, path: &Path) -> Result<XfsGeom, Error> {
    match xfs_geometry_call::<XFS_IOC_FSGEOMETRY>(dir) {
        Ok(g) => Ok(g),
        // An older kernel without the v5 call: the v4 layout is its prefix.
        Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => {
            xfs_geometry_call::<XFS_IOC_FSGEOMETRY_V4>(dir)
                .map_err(|e| SysError::new("XFS_IOC_FSGEOMETRY_V4", path.display(), e).into())
        }
        Err(e) => Err(SysError::new("XFS_IOC_FSGEOMETRY", path.display(), e).into()),
    }
}

/// The data size xfs will actually reach for `newblocks`: a trailing piece
/// smaller than a minimum allocation group is left out (xfs_growfs_data_private).
fn xfs_reachable_blocks(newblocks: u64, agblocks: u64) -> u64 {
    if agblocks == 0 {
        return newblocks;
    }
    let rem = newblocks.checked_rem(agblocks).unwrap_or(0);
    if rem != 0 && rem < XFS_MIN_AG_BLOCKS {
        newblocks.saturating_sub(rem)
    } else {
        newblocks
    }
}

/// xfs: its geometry from the mount directory, FSGROWFSDATA to grow.
enum Xfs {}

impl Resize for Xfs {
    const FS: FsType = FsType::Xfs;
    const CALL: &'static str = "XFS_IOC_FSGROWFSDATA";
    type Measure = XfsGeom;

    fn measure(at: &At<'_>) -> Result<XfsGeom, Error> {
        xfs_geometry(&at.dir, at.path)
    }

    fn size(g: &XfsGeom) -> Size {
        Size {
            blocks: g.datablocks,
            block_size: u64::from(g.blocksize),
        }
    }

    fn reachable(g: &XfsGeom, blocks: u64) -> u64 {
        xfs_reachable_blocks(blocks, u64::from(g.agblocks))
    }

    fn resize(at: &At<'_>, g: &XfsGeom, target: u64) -> io::Result<()> {
        let arg = XfsGrowfsData {
            newblocks: target,
            imaxpct: g.imaxpct,
        };
        // SAFETY: XFS_IOC_FSGROWFSDATA reads one xfs_growfs_data, which `arg` is.
        unsafe {
            rustix::ioctl::ioctl(
                &at.dir,
                rustix::ioctl::Setter::<XFS_IOC_FSGROWFSDATA, XfsGrowfsData>::new(arg),
            )
        }
        .map_err(io::Error::from)
    }

    fn reached(_before: &XfsGeom, after: &XfsGeom, target: u64) -> bool {
        after.datablocks == target
    }
}

// ---- ext4 ----

/// The fields of the ext4 superblock that growth needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ext4Super {
    blocks_count: u64,
    block_size: u64,
    blocks_per_group: u64,
    /// s_state has EXT4_ERROR_FS, or s_error_count > 0.
    has_errors: bool,
}

/// Parses the 1024-byte ext4 superblock (`superblock::Ext4Super`); None if
/// the magic is wrong or the block size is beyond what a kernel mounts.
fn parse_ext4_super(sb: &[u8; 1024]) -> Option<Ext4Super> {
    let p = superblock::Ext4Super::parse_block(sb)?;
    Some(Ext4Super {
        blocks_count: p.blocks_count,
        block_size: p.block_size()?,
        blocks_per_group: u64::from(p.blocks_per_group),
        has_errors: p.has_errors,
    })
}

/// Reads the superblock of the ext4 on `dev` (mounted: through the page
/// cache, which the mounted ext4 keeps current).
fn ext4_super(dev: &Device) -> Result<Ext4Super, Error> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&dev.path)
        .map_err(|e| SysError::new("open", dev.path.display(), e))?;
    let mut sb = [0u8; 1024];
    file.read_exact_at(&mut sb, 1024)
        .map_err(|e| SysError::new("pread", dev.path.display(), e))?;
    parse_ext4_super(&sb).ok_or_else(|| {
        SysError::new(
            "read ext4 superblock",
            dev.path.display(),
            io::Error::other("no ext4 magic"),
        )
        .into()
    })
}

/// An ext4's recorded errors: the superblock, and the live sysfs counter.
fn ext4_has_errors(sup: &Ext4Super, dev: &Device, sysfs: &Sysfs) -> bool {
    sup.has_errors || sysfs.ext4_errors_count(&dev.name) > Some(0)
}

/// EXT4_IOC_RESIZE_FS: `_IOW('f', 16, __u64)`.
const EXT4_IOC_RESIZE_FS: Opcode = opcode::write::<u64>(b'f', 16);

/// ext4: its superblock from the device, RESIZE_FS to grow.
enum Ext4 {}

impl Resize for Ext4 {
    const FS: FsType = FsType::Ext4;
    const CALL: &'static str = "EXT4_IOC_RESIZE_FS";
    type Measure = Ext4Super;

    fn measure(at: &At<'_>) -> Result<Ext4Super, Error> {
        ext4_super(at.dev)
    }

    fn size(s: &Ext4Super) -> Size {
        Size {
            blocks: s.blocks_count,
            block_size: s.block_size,
        }
    }

    fn ready(at: &At<'_>, sup: &Ext4Super, sysfs: &Sysfs) -> Result<(), Error> {
        let path = at.path.to_path_buf();
        if ext4_has_errors(sup, at.dev, sysfs) {
            return Err(Error::HasErrors {
                path,
                device: at.dev.path.to_path_buf(),
            });
        }
        // Without the capability the kernel answers a bare EPERM; say what is missing.
        if !has_sys_resource() {
            return Err(Error::NeedsCapSysResource { path });
        }
        Ok(())
    }

    fn resize(at: &At<'_>, _sup: &Ext4Super, target: u64) -> io::Result<()> {
        // SAFETY: EXT4_IOC_RESIZE_FS reads one u64 block count.
        unsafe {
            rustix::ioctl::ioctl(
                &at.dir,
                rustix::ioctl::Setter::<EXT4_IOC_RESIZE_FS, u64>::new(target),
            )
        }
        .map_err(io::Error::from)
    }

    /// The kernel leaves out a last group too small for its metadata, so
    /// "full" means within one group of the target (and no smaller than before).
    fn reached(before: &Ext4Super, after: &Ext4Super, target: u64) -> bool {
        after.blocks_count >= before.blocks_count
            && after.blocks_count <= target
            && target.saturating_sub(after.blocks_count) < after.blocks_per_group.max(1)
    }
}

// ---- both ----

/// EPERM, EOPNOTSUPP, EROFS and the like are the filesystem saying no; the rest is unexpected.
fn refused_or_sys(path: &Path, fs: FsType, call: &'static str, err: io::Error) -> Error {
    let refusals = [
        libc::EPERM,
        libc::EOPNOTSUPP,
        libc::EROFS,
        libc::ENOTTY,
        libc::EBUSY,
    ];
    if err.raw_os_error().is_some_and(|e| refusals.contains(&e)) {
        Error::Refused {
            path: path.to_path_buf(),
            fs,
            call,
            source: err,
        }
    } else {
        SysError::new(call, path.display(), err).into()
    }
}

/// Opens the mount directory `at` names (an O_PATH fd resolved by the
/// caller; reopened for the ioctls) and checks it is `fs`, mounted from `dev`.
/// `path` is for messages.
fn open_checked(at: BorrowedFd<'_>, path: &Path, dev: &Device, fs: FsType) -> Result<File, Error> {
    let dir = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_DIRECTORY)
        .open(beneath::proc_path(at))
        .map_err(|e| SysError::new("open", path.display(), e))?;
    let st = rustix::fs::fstat(&dir).map_err(|e| SysError::new("stat", path.display(), e))?;
    if (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev)) != (dev.major, dev.minor) {
        return Err(Error::NotOnDevice {
            path: path.to_path_buf(),
            device: dev.path.to_path_buf(),
            major: dev.major,
            minor: dev.minor,
        });
    }
    let st = rustix::fs::fstatfs(&dir).map_err(|e| SysError::new("statfs", path.display(), e))?;
    let magic = st.f_type as u64 & 0xffff_ffff;
    let want: u64 = match fs {
        FsType::Ext4 => 0xEF53,
        FsType::Xfs => 0x5846_5342,
    };
    if magic != want {
        return Err(Error::WrongFs {
            path: path.to_path_buf(),
            expected: fs,
            found: magic,
        });
    }
    Ok(dir)
}

fn is_read_only(dir: &File, path: &Path) -> Result<bool, Error> {
    let st = rustix::fs::fstatvfs(dir).map_err(|e| SysError::new("statvfs", path.display(), e))?;
    Ok(st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY))
}

/// The size in bytes of the `fs` on `dev`, mounted at the directory `at`
/// names (`mount_path` in messages): the filesystem's own, not the device's,
/// nor statfs's total, which leaves out metadata.
pub fn fs_size_bytes(
    at: BorrowedFd<'_>,
    mount_path: &Path,
    dev: &Device,
    fs: FsType,
) -> Result<u64, Error> {
    let at = At {
        dir: open_checked(at, mount_path, dev, fs)?,
        path: mount_path,
        dev,
    };
    match fs {
        FsType::Xfs => size_with::<Xfs>(&at),
        FsType::Ext4 => size_with::<Ext4>(&at),
    }
}

/// Refuses (OUT_OF_RANGE) a filesystem of `fs_bytes` on a device of only
/// `device_bytes`: the disk shrank under it. Growth never hides that, and
/// neither does an ExpandVolume that asks for no more than the filesystem has.
pub fn fits(
    mount_path: &Path,
    fs: FsType,
    dev: &Device,
    fs_bytes: u64,
    device_bytes: u64,
) -> Result<(), Error> {
    if fs_bytes > device_bytes {
        return Err(Error::LargerThanDevice {
            path: mount_path.to_path_buf(),
            fs,
            device: dev.path.to_path_buf(),
            fs_bytes,
            device_bytes,
        });
    }
    Ok(())
}

/// `blocks × block_size`, refusing a product that does not fit in 64 bits
/// (a corrupt superblock, not a real filesystem).
fn bytes(blocks: u64, block_size: u64, path: &Path) -> Result<u64, Error> {
    blocks
        .checked_mul(block_size)
        .ok_or_else(|| Error::Overflow {
            path: path.to_path_buf(),
            blocks,
            block_size,
        })
}

/// How many whole blocks of `block_size` fit in `bytes` (none for a
/// block size of 0, which no real superblock has).
fn blocks_in(bytes: u64, block_size: u64) -> u64 {
    bytes.checked_div(block_size).unwrap_or(0)
}

/// Grows the `fs` on `dev`, mounted at the directory `at` names
/// (`mount_path` in messages), to fill `device_bytes` and returns its new
/// size; when it already does, returns its size unchanged. `sysfs` tells
/// whether an ext4 has recorded errors since it was mounted.
pub fn grow(
    at: BorrowedFd<'_>,
    mount_path: &Path,
    dev: &Device,
    fs: FsType,
    device_bytes: u64,
    sysfs: &Sysfs,
) -> Result<u64, Error> {
    let at = At {
        dir: open_checked(at, mount_path, dev, fs)?,
        path: mount_path,
        dev,
    };
    if is_read_only(&at.dir, mount_path)? {
        return Err(Error::ReadOnly {
            path: mount_path.to_path_buf(),
        });
    }
    match fs {
        FsType::Xfs => grow_with::<Xfs>(&at, device_bytes, sysfs),
        FsType::Ext4 => grow_with::<Ext4>(&at, device_bytes, sysfs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;
    use crate::model::testdisk::MountedDisk;
    use crate::sys::blockdev;
    use crust_testkit::{needs, run};
    use std::os::fd::{AsFd, OwnedFd};
    use std::time::Duration;

    /// The disk's size now (BLKGETSIZE64): `losetup -c` sets it at once.
    fn size_bytes(disk: &Path) -> Result<u64, SysError> {
        blockdev::size_of(&File::open(disk).unwrap(), disk)
    }

    fn fd(p: &Path) -> OwnedFd {
        rustix::fs::open(
            p,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap()
    }

    #[test]
    fn sizes_that_do_not_fit_64_bits_are_refused() {
        let p = Path::new("/v");
        assert_eq!(bytes(1 << 20, 4096, p).unwrap(), 1 << 32);
        let e = bytes(u64::MAX / 2, 4096, p).unwrap_err();
        assert!(matches!(e, Error::Overflow { .. }), "{e}");
        assert_eq!(blocks_in(10_000, 0), 0, "a zero block size divides nothing");
    }

    #[test]
    fn rounds_like_xfs() {
        for (newblocks, agblocks, want) in [
            (1000, 100, 1000),
            (1010, 100, 1000), // a 10-block tail cannot be an AG
            (1064, 100, 1064),
            (1063, 100, 1000),
            (500, 0, 500),
        ] {
            assert_eq!(
                xfs_reachable_blocks(newblocks, agblocks),
                want,
                "{newblocks}/{agblocks}"
            );
        }
    }

    #[test]
    fn parses_ext4_superblocks() {
        let mut sb = [0u8; 1024];
        sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[0x04..0x08].copy_from_slice(&65536u32.to_le_bytes());
        sb[0x18..0x1C].copy_from_slice(&2u32.to_le_bytes());
        sb[0x20..0x24].copy_from_slice(&32768u32.to_le_bytes());
        sb[0x150..0x154].copy_from_slice(&1u32.to_le_bytes());
        let s = parse_ext4_super(&sb).unwrap();
        // The high word only counts with the 64bit feature.
        assert_eq!(
            s,
            Ext4Super {
                blocks_count: 65536,
                block_size: 4096,
                blocks_per_group: 32768,
                has_errors: false
            }
        );
        sb[0x60] = 0x80;
        assert_eq!(
            parse_ext4_super(&sb).unwrap().blocks_count,
            (1 << 32) + 65536
        );
        sb[0x3A] = 0x02;
        assert!(parse_ext4_super(&sb).unwrap().has_errors);
        sb[0x3A] = 0;
        sb[0x194] = 3;
        assert!(parse_ext4_super(&sb).unwrap().has_errors);
        sb[0x38] = 0;
        assert_eq!(parse_ext4_super(&sb), None);
    }

    /// The grow and size calls on a mounted disk.
    trait Sizes {
        /// The filesystem's size, read as `fs`.
        fn size(&self, fs: FsType) -> Result<u64, Error>;
        /// Grows the filesystem, as `fs`, to a device of `bytes`.
        fn grow(&self, fs: FsType, bytes: u64) -> Result<u64, Error>;
        /// [`Sizes::grow`] told the filesystem is on `dev`.
        fn grow_on(&self, dev: &Device, fs: FsType, bytes: u64) -> Result<u64, Error>;
    }

    impl Sizes for MountedDisk {
        fn size(&self, fs: FsType) -> Result<u64, Error> {
            fs_size_bytes(fd(&self.m.path).as_fd(), &self.m.path, &self.dev, fs)
        }

        fn grow(&self, fs: FsType, bytes: u64) -> Result<u64, Error> {
            self.grow_on(&self.dev, fs, bytes)
        }

        fn grow_on(&self, dev: &Device, fs: FsType, bytes: u64) -> Result<u64, Error> {
            grow(
                fd(&self.m.path).as_fd(),
                &self.m.path,
                dev,
                fs,
                bytes,
                &Sysfs::system(),
            )
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn grows_xfs_online() {
        needs::loop_devices();
        let s = MountedDisk::new(300, "xfs", "");
        let before = s.size(FsType::Xfs).unwrap();
        let total_before = rustix::fs::statvfs(&s.m.path).unwrap();
        assert!(before <= 300 << 20 && before > 290 << 20, "{before}");
        // Not grown yet: a no-op that reports the current size.
        assert_eq!(
            s.grow(FsType::Xfs, size_bytes(&s.disk.device).unwrap())
                .unwrap(),
            before
        );
        // Never shrinks: a device smaller than the filesystem is refused.
        let e = s.grow(FsType::Xfs, 100 << 20).unwrap_err();
        assert!(matches!(e, Error::LargerThanDevice { .. }), "{e}");
        s.disk.resize(1024);
        let dev_bytes = size_bytes(&s.disk.device).unwrap();
        assert_eq!(dev_bytes, 1 << 30);
        let after = s.grow(FsType::Xfs, dev_bytes).unwrap();
        assert!(
            after > (1 << 30) - (16 << 20) && after <= 1 << 30,
            "{after}"
        );
        assert_eq!(s.size(FsType::Xfs).unwrap(), after);
        let total_after = rustix::fs::statvfs(&s.m.path).unwrap();
        let grew = (total_after.f_blocks - total_before.f_blocks) * total_after.f_frsize;
        assert!(
            grew >= after - before - (8 << 20) && grew <= after - before,
            "statfs grew by {grew}"
        );
        // Again: already there.
        assert_eq!(s.grow(FsType::Xfs, dev_bytes).unwrap(), after);
        // What xfs_growfs (the reference tool) thinks, as a cross-check.
        let info = run("xfs_info", &[s.m.path.to_str().unwrap()]);
        let blocks = after / 4096;
        assert!(info.contains(&format!("blocks={blocks}")), "{info}");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_disk_that_shrank_under_its_filesystem_is_out_of_range() {
        needs::loop_devices();
        for (fs, mb) in [(FsType::Ext4, 64u64), (FsType::Xfs, 320)] {
            let s = MountedDisk::as_the_agent(mb, fs.name());
            let before = s.size(fs).unwrap();
            s.disk.resize(mb - 16);
            let now = size_bytes(&s.disk.device).unwrap();
            assert_eq!(now, (mb - 16) << 20);
            // No growth can fix this; never an OK that hides it.
            let e = s.grow(fs, now).unwrap_err();
            assert!(matches!(e, Error::LargerThanDevice { .. }), "{fs}: {e}");
            assert_eq!(e.code(), Code::OutOfRange, "{fs}");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("{before} bytes"))
                    && msg.contains(&format!("only {now} bytes")),
                "{fs}: {msg}"
            );
            assert_eq!(s.size(fs).unwrap(), before, "{fs}: nothing changed");
            fits(&s.m.path, fs, &s.dev, before, before).unwrap();
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn refuses_read_only_and_wrong_filesystems() {
        needs::loop_devices();
        let s = MountedDisk::new(300, "xfs", "ro");
        s.disk.resize(600);
        let e = s.grow(FsType::Xfs, 600 << 20).unwrap_err();
        assert!(matches!(e, Error::ReadOnly { .. }), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(s.size(FsType::Xfs).unwrap() <= 300 << 20, "nothing grew");
        let e = s.grow(FsType::Ext4, 600 << 20).unwrap_err();
        assert!(matches!(e, Error::WrongFs { .. }), "{e}");
        assert!(e.to_string().contains("not an ext4 filesystem"), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        // Another device than the one mounted there: refused before any ioctl.
        let elsewhere = Device {
            minor: s.dev.minor + 1000,
            ..s.dev.clone()
        };
        let e = s.grow_on(&elsewhere, FsType::Xfs, 600 << 20).unwrap_err();
        assert!(matches!(e, Error::NotOnDevice { .. }), "{e}");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn grows_ext4_or_says_which_capability_is_missing() {
        needs::loop_devices();
        let s = MountedDisk::new(64, "ext4", "");
        let before = s.size(FsType::Ext4).unwrap();
        assert_eq!(before, 64 << 20);
        // Nothing to do needs no capability.
        assert_eq!(s.grow(FsType::Ext4, 64 << 20).unwrap(), before);
        s.disk.resize(256);
        let has_cap = caps::has_cap(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_SYS_RESOURCE,
        )
        .unwrap();
        let r = s.grow(FsType::Ext4, 256 << 20);
        if has_cap {
            let after = r.unwrap();
            assert!(after > 250 << 20 && after <= 256 << 20, "{after}");
            assert_eq!(s.size(FsType::Ext4).unwrap(), after);
            let st = rustix::fs::statvfs(&s.m.path).unwrap();
            assert!(st.f_blocks * st.f_frsize > 200 << 20, "statfs did not grow");
        } else {
            let e = r.unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition);
            assert!(e.to_string().contains("needs CAP_SYS_RESOURCE"), "{e}");
            assert_eq!(s.size(FsType::Ext4).unwrap(), before, "nothing grew");
        }
    }

    /// Block count × block size as e2fsprogs reads them.
    fn dumpe2fs_bytes(device: &Path) -> u64 {
        let out = run("dumpe2fs", &["-h", device.to_str().unwrap()]);
        let field = |name: &str| -> u64 {
            let line = out.lines().find(|l| l.starts_with(name)).unwrap();
            line[name.len()..].trim().parse().unwrap()
        };
        field("Block count:") * field("Block size:")
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn reads_ext4_sizes_like_e2fsprogs() {
        needs::loop_devices();
        // 1 KiB blocks below 512 MiB, 4 KiB above; the 64bit feature on both.
        for mb in [100, 700] {
            let s = MountedDisk::new(mb, "ext4", "");
            let got = s.size(FsType::Ext4).unwrap();
            assert_eq!(got, dumpe2fs_bytes(&s.disk.device), "{mb} MiB");
            assert_eq!(got, mb << 20);
            let e = s.size(FsType::Xfs).unwrap_err();
            assert!(matches!(e, Error::WrongFs { .. }), "{e}");
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn refuses_an_ext4_with_errors() {
        needs::loop_devices();
        let s = MountedDisk::new(64, "ext4", "errors=continue");
        std::fs::write(
            format!("/sys/fs/ext4/{}/trigger_fs_error", s.disk.name()),
            "1",
        )
        .unwrap();
        s.disk.resize(256);
        // The error is recorded by a work item: give it a moment.
        let mut e = None;
        for _ in 0..100 {
            match s.grow(FsType::Ext4, 256 << 20) {
                Err(err @ Error::HasErrors { .. }) => {
                    e = Some(err);
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        let e = e.expect("grow did not notice the ext4 errors");
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("e2fsck"), "{e}");
    }
}

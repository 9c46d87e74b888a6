//! Filesystem identification from on-disk superblocks, before anything else
//! touches a disk, and the judgement of what a superblock asks the kernel to
//! do. Opens the device read-only and only reads: the agent never formats,
//! and never mounts a disk whose filesystem is not the requested one, is
//! larger than its device, leans on another device (an external journal or
//! log), would hold the mount in the kernel for minutes (ext4 MMP), or
//! plants mount options the agent does not let a disk choose (s_mount_opts).
//! The parsers are total: every offset is checked, every read bounded.

// Every offset and size here comes from a disk the agent does not control.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::errors::{Code, SysError};

mod ext4;
mod xfs;

pub use ext4::{
    judge_ext4, judge_mmp, mmp_wait_secs, planted_option, Ext4Super, Mmp, MmpAt, MAX_MMP_WAIT_SECS,
};
pub use xfs::{judge_xfs, XfsSuper};

/// The filesystems the agent mounts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FsType {
    /// ext4 (the kernel's ext4 driver also mounts ext2/ext3, which share the magic).
    Ext4,
    /// xfs.
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

/// What can go wrong when identifying a disk's filesystem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The disk holds another filesystem than the requested one.
    #[error("{device} holds {found}, not the requested {expected}; the agent never formats or mounts a mismatched disk")]
    Mismatch {
        /// The device path.
        device: String,
        /// What the superblocks say it holds.
        found: &'static str,
        /// What the request asked for.
        expected: FsType,
    },
    /// No recognisable filesystem at all.
    #[error("{device} holds no filesystem the agent recognises (it looks unformatted), not the requested {expected}; the agent never formats a disk: create the filesystem on the host first")]
    Unformatted {
        /// The device path.
        device: String,
        /// What the request asked for.
        expected: FsType,
    },
    /// Several superblock signatures at once: the disk carries stale signatures.
    #[error("{device} carries the signatures of several filesystems ({found}); the agent will not guess which one is real: wipe the stale signatures on the host (wipefs)")]
    Ambiguous {
        /// The device path.
        device: String,
        /// The signatures found, comma-separated.
        found: String,
    },
    /// The superblock says the filesystem is larger than the device holding it.
    #[error("the {fs} on {device} is {fs_bytes} bytes ({blocks} blocks of {block_size}) but the device holds only {device_bytes} bytes: the image was cut short or the disk shrank, and the kernel would refuse it; give the disk back at least {fs_bytes} bytes, or restore the image")]
    LargerThanDevice {
        /// The device path.
        device: String,
        /// The filesystem.
        fs: FsType,
        /// Blocks × block size, from the superblock (beyond 64 bits when corrupt).
        fs_bytes: u128,
        /// The block count.
        blocks: u64,
        /// The block size.
        block_size: u64,
        /// The device's size.
        device_bytes: u64,
    },
    /// A superblock field no kernel mounts, or a structure it points to that is not there.
    #[error("the {fs} superblock on {device} is corrupt: {what}; check the disk on the host (e2fsck -fn, xfs_repair -n)")]
    Corrupt {
        /// The device path.
        device: String,
        /// The filesystem.
        fs: FsType,
        /// What is wrong.
        what: String,
    },
    /// The filesystem needs another device than the disk: an external journal, log or realtime section.
    #[error("the {fs} on {device} {what}, which lives on another device; the agent publishes a volume from its one disk and will not let the kernel open another: use a filesystem that is whole on the disk")]
    NeedsAnotherDevice {
        /// The device path.
        device: String,
        /// The filesystem.
        fs: FsType,
        /// "has an external journal", ….
        what: &'static str,
    },
    /// ext4 multi-mount protection that would hold the mount in the kernel, or says the disk is in use.
    #[error("the ext4 on {device} has multi-mount protection (MMP) and {what}; MMP is for disks shared between machines, not a sandbox's disk: turn it off on the host (tune2fs -O ^mmp), or if no other machine uses the disk, reset it (tune2fs -f -E clear_mmp)")]
    Mmp {
        /// The device path.
        device: String,
        /// What the superblock and the MMP block say.
        what: String,
    },
    /// s_mount_opts plants a mount option the agent does not let a disk choose.
    #[error("the ext4 superblock on {device} carries the mount option {option:?} (s_mount_opts), which the agent does not let a disk choose: {why}; clear them on the host (tune2fs -E mount_opts= {device}) and give options in the request instead")]
    PlantedOption {
        /// The device path.
        device: String,
        /// The option, as the superblock has it.
        option: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// Opening or reading the device failed.
    #[error(transparent)]
    Sys(#[from] SysError),
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::Mismatch { .. }
            | Error::Unformatted { .. }
            | Error::Ambiguous { .. }
            | Error::LargerThanDevice { .. }
            | Error::Corrupt { .. }
            | Error::NeedsAnotherDevice { .. }
            | Error::Mmp { .. }
            | Error::PlantedOption { .. } => Code::FailedPrecondition,
            Error::Sys(_) => Code::Internal,
        }
    }
}

/// How much of the disk the probe reads: enough for btrfs's superblock at 64 KiB.
pub(crate) const PROBE_BYTES: usize = 65536 + 4096;

/// Does `buf` hold `magic` at `offset`? (False when the disk is shorter than that.)
pub(crate) fn at(buf: &[u8], offset: usize, magic: &[u8]) -> bool {
    offset
        .checked_add(magic.len())
        .and_then(|end| buf.get(offset..end))
        == Some(magic)
}

/// `N` bytes of `buf` at `offset`, if the buffer is that long.
pub(crate) fn bytes_at<const N: usize>(buf: &[u8], offset: usize) -> Option<[u8; N]> {
    buf.get(offset..offset.checked_add(N)?)?.try_into().ok()
}

pub(crate) fn le16(buf: &[u8], offset: usize) -> Option<u16> {
    bytes_at(buf, offset).map(u16::from_le_bytes)
}

pub(crate) fn le32(buf: &[u8], offset: usize) -> Option<u32> {
    bytes_at(buf, offset).map(u32::from_le_bytes)
}

pub(crate) fn le64(buf: &[u8], offset: usize) -> Option<u64> {
    bytes_at(buf, offset).map(u64::from_le_bytes)
}

pub(crate) fn be32(buf: &[u8], offset: usize) -> Option<u32> {
    bytes_at(buf, offset).map(u32::from_be_bytes)
}

pub(crate) fn be64(buf: &[u8], offset: usize) -> Option<u64> {
    bytes_at(buf, offset).map(u64::from_be_bytes)
}

/// Every signature found in the first bytes of a disk, most specific first.
/// Pure, so that the table of layouts can be tested without disks.
pub fn signatures(buf: &[u8]) -> Vec<&'static str> {
    let mut found = Vec::new();
    if at(buf, 0, b"LUKS\xba\xbe") {
        found.push("crypto_LUKS");
    }
    if at(buf, 0, b"XFSB") {
        found.push("xfs");
    }
    // ext2/3/4 share s_magic 0xEF53 (little endian) at 1024 + 0x38.
    if at(buf, 1080, &[0x53, 0xEF]) {
        found.push("ext4");
    }
    if at(buf, 65600, b"_BHRfS_M") {
        found.push("btrfs");
    }
    // The swap signature ends the first page, whatever the page size was.
    if [4086usize, 8182, 16374, 65526]
        .iter()
        .any(|&end| at(buf, end, b"SWAPSPACE2") || at(buf, end, b"SWAP-SPACE"))
    {
        found.push("swap");
    }
    if at(buf, 510, &[0x55, 0xAA])
        && (at(buf, 54, b"FAT12") || at(buf, 54, b"FAT16") || at(buf, 82, b"FAT32"))
    {
        found.push("vfat");
    }
    if at(buf, 32769, b"CD001") {
        found.push("iso9660");
    }
    found
}

/// Refuses a filesystem of `blocks` × `block_size` bytes larger than the device.
pub(crate) fn fits(
    fs: FsType,
    blocks: u64,
    block_size: u64,
    device_bytes: u64,
    device: &str,
) -> Result<(), Error> {
    // At most 2^64 × 2^16: a u128 holds it.
    let fs_bytes = u128::from(blocks).saturating_mul(u128::from(block_size));
    if fs_bytes > u128::from(device_bytes) {
        return Err(Error::LargerThanDevice {
            device: device.to_string(),
            fs,
            fs_bytes,
            blocks,
            block_size,
            device_bytes,
        });
    }
    Ok(())
}

/// Opens a device without ever opening it for writing.
fn open_ro(device: &Path) -> Result<File, Error> {
    Ok(File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(device)
        .map_err(|e| SysError::new("open", device.display(), e))?)
}

/// Reads up to `len` bytes at `offset`; fewer when the device ends first.
fn read_at(file: &File, device: &Path, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; len];
    let mut got = 0usize;
    while let Some(rest) = buf.get_mut(got..).filter(|r| !r.is_empty()) {
        let pos = offset.saturating_add(u64::try_from(got).unwrap_or(u64::MAX));
        match file.read_at(rest, pos) {
            Ok(0) => break, // the device ends here: the rest is absent, not zero
            Ok(n) => got = got.saturating_add(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(SysError::new("pread", device.display(), e).into()),
        }
    }
    buf.truncate(got);
    Ok(buf)
}

/// Reads the first bytes of a device.
fn read_head(device: &Path) -> Result<Vec<u8>, Error> {
    read_at(&open_ro(device)?, device, 0, PROBE_BYTES)
}

/// The filesystem on `device` ("ext4", "xfs", "btrfs", "swap", …), or None if
/// nothing is recognised. With several signatures, the most specific one.
pub fn identify(device: &Path) -> Result<Option<&'static str>, Error> {
    Ok(signatures(&read_head(device)?).first().copied())
}

/// Succeeds only when `device` holds exactly the `expected` filesystem and
/// its superblock passes the agent's judgement (`judge_ext4`, `judge_mmp`,
/// `judge_xfs`): the kernel can mount it from this disk alone, promptly, on
/// the agent's terms.
pub fn check(device: &Path, expected: FsType) -> Result<(), Error> {
    let file = open_ro(device)?;
    let head = read_at(&file, device, 0, PROBE_BYTES)?;
    judge(
        &head,
        expected,
        &device.display().to_string(),
        // A block device's size is where a seek to its end lands (as for a file).
        || {
            (&file)
                .seek(SeekFrom::End(0))
                .map_err(|e| SysError::new("lseek", device.display(), e).into())
        },
        |offset, len| read_at(&file, device, offset, len),
    )
}

/// `check`'s judgement of a disk from its first bytes (`head`), its size
/// and the block it reads at an offset the superblock names (ext4's MMP),
/// the last two through the closures. Pure, so that the fuzz target
/// (`crate::fuzz::superblock`) judges exactly what a publish judges.
pub(crate) fn judge(
    head: &[u8],
    expected: FsType,
    dev: &str,
    device_bytes: impl FnOnce() -> Result<u64, Error>,
    read: impl FnOnce(u64, usize) -> Result<Vec<u8>, Error>,
) -> Result<(), Error> {
    let found = signatures(head);
    let dev = dev.to_string();
    match found.as_slice() {
        [] => {
            return Err(Error::Unformatted {
                device: dev,
                expected,
            })
        }
        [one] if *one == expected.name() => {}
        [one] => {
            return Err(Error::Mismatch {
                device: dev,
                found: one,
                expected,
            })
        }
        many if many.contains(&expected.name()) => {
            return Err(Error::Ambiguous {
                device: dev,
                found: many.join(", "),
            })
        }
        many => {
            return Err(Error::Mismatch {
                device: dev,
                found: many[0],
                expected,
            })
        }
    }
    let device_bytes = device_bytes()?;
    let short = || Error::Corrupt {
        device: dev.clone(),
        fs: expected,
        what: "the device ends inside it".to_string(),
    };
    match expected {
        FsType::Xfs => judge_xfs(
            &XfsSuper::parse(head).ok_or_else(short)?,
            device_bytes,
            &dev,
        ),
        FsType::Ext4 => {
            let sb = Ext4Super::parse(head).ok_or_else(short)?;
            let Some(at) = judge_ext4(&sb, device_bytes, &dev)? else {
                return Ok(());
            };
            let block = read(at.offset, Mmp::LEN)?;
            let mmp = Mmp::parse(&block).ok_or_else(|| Error::Corrupt {
                device: dev.clone(),
                fs: expected,
                what: format!(
                    "its MMP block at byte {} is past the device's end",
                    at.offset
                ),
            })?;
            judge_mmp(at, &mmp, &dev)
        }
    }
}

/// A disk's first bytes, zero but for `patches`, for the tests' tables.
#[cfg(test)]
pub(crate) fn with(patches: &[(usize, &[u8])]) -> Vec<u8> {
    let mut b = vec![0u8; PROBE_BYTES];
    for (off, bytes) in patches {
        b[*off..*off + bytes.len()].copy_from_slice(bytes);
    }
    b
}

/// The variant name of a judgement, for the tables of the tests.
#[cfg(test)]
pub(crate) fn verdict<T>(r: Result<T, Error>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(Error::LargerThanDevice { .. }) => "too large",
        Err(Error::Corrupt { .. }) => "corrupt",
        Err(Error::NeedsAnotherDevice { .. }) => "another device",
        Err(Error::Mismatch { .. }) => "mismatch",
        Err(Error::Mmp { .. }) => "mmp",
        Err(Error::PlantedOption { .. }) => "planted",
        Err(e) => panic!("unexpected {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{root_or_skip, run, LoopDisk};

    #[test]
    fn recognises_each_layout() {
        let fat16 = with(&[(54, b"FAT16   "), (510, &[0x55, 0xAA])]);
        let fat32 = with(&[(82, b"FAT32   "), (510, &[0x55, 0xAA])]);
        let table: Vec<(Vec<u8>, Vec<&str>)> = vec![
            (with(&[]), vec![]),
            (with(&[(1080, &[0x53, 0xEF])]), vec!["ext4"]),
            (with(&[(1080, &[0xEF, 0x53])]), vec![]),
            (with(&[(0, b"XFSB")]), vec!["xfs"]),
            (with(&[(1, b"XFSB")]), vec![]),
            (with(&[(65600, b"_BHRfS_M")]), vec!["btrfs"]),
            (with(&[(4086, b"SWAPSPACE2")]), vec!["swap"]),
            (with(&[(65526, b"SWAPSPACE2")]), vec!["swap"]),
            (with(&[(0, b"LUKS\xba\xbe")]), vec!["crypto_LUKS"]),
            (with(&[(32769, b"CD001")]), vec!["iso9660"]),
            (fat16, vec!["vfat"]),
            (fat32, vec!["vfat"]),
            (with(&[(54, b"FAT16   ")]), vec![]), // no boot signature
            (
                with(&[(0, b"XFSB"), (1080, &[0x53, 0xEF])]),
                vec!["xfs", "ext4"],
            ),
            (vec![0x53; 100], vec![]), // shorter than any superblock
        ];
        for (buf, want) in table {
            assert_eq!(signatures(&buf), want);
        }
    }

    #[test]
    fn names_round_trip() {
        for fs in [FsType::Ext4, FsType::Xfs] {
            assert_eq!(FsType::parse(fs.name()), Some(fs));
        }
        for bad in ["", "EXT4", "ext3", "btrfs", "xfs "] {
            assert_eq!(FsType::parse(bad), None);
        }
    }

    fn sha(path: &Path) -> String {
        run("sha256sum", &[path.to_str().unwrap()])
    }

    #[test]
    fn identifies_real_disks_without_writing() {
        if !root_or_skip("identifies_real_disks_without_writing") {
            return;
        }
        let cases: [(Option<&str>, Option<&str>); 4] = [
            (Some("ext4"), Some("ext4")),
            (Some("xfs"), Some("xfs")),
            (Some("swap"), Some("swap")),
            (None, None),
        ];
        for (mkfs, want) in cases {
            let disk = LoopDisk::new(320, mkfs);
            let before = sha(&disk.image);
            assert_eq!(identify(&disk.device).unwrap(), want, "{mkfs:?}");
            for fs in [FsType::Ext4, FsType::Xfs] {
                let r = check(&disk.device, fs);
                if want == Some(fs.name()) {
                    r.unwrap();
                } else {
                    let e = r.unwrap_err();
                    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
                    let msg = e.to_string();
                    assert!(msg.contains(&disk.device.display().to_string()), "{msg}");
                    match want {
                        Some(other) => assert!(
                            msg.contains(&format!("holds {other}, not the requested {fs}")),
                            "{msg}"
                        ),
                        None => assert!(msg.contains("unformatted"), "{msg}"),
                    }
                }
            }
            assert_eq!(
                sha(&disk.image),
                before,
                "probing {mkfs:?} changed the disk"
            );
        }
    }

    #[test]
    fn refuses_a_disk_with_two_signatures() {
        if !root_or_skip("refuses_a_disk_with_two_signatures") {
            return;
        }
        let disk = LoopDisk::new(64, Some("ext4"));
        // A stale xfs magic in the boot block an ext4 does not use.
        run(
            "sh",
            &[
                "-c",
                &format!(
                    "printf XFSB | dd of={} conv=notrunc status=none",
                    disk.device.display()
                ),
            ],
        );
        let e = check(&disk.device, FsType::Ext4).unwrap_err();
        assert!(matches!(e, Error::Ambiguous { .. }), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("xfs, ext4"), "{e}");
    }

    #[test]
    fn parsers_are_total_on_any_input() {
        // Every length of a real-looking head, and garbage: no panic, no overflow.
        let mut head = with(&[(0, b"XFSB"), (1080, &[0x53, 0xEF])]);
        head[1024 + 0x18] = 6;
        for len in 0..head.len().min(2200) {
            let h = &head[..len];
            let _ = signatures(h);
            if let Some(sb) = Ext4Super::parse(h) {
                let _ = judge_ext4(&sb, u64::MAX, "/dev/x");
            }
            if let Some(sb) = XfsSuper::parse(h) {
                let _ = judge_xfs(&sb, 0, "/dev/x");
            }
            let _ = Mmp::parse(h);
        }
        let mut rng = fastrand::Rng::with_seed(15);
        let mut buf = vec![0u8; 2048];
        for _ in 0..20_000 {
            rng.fill(&mut buf);
            buf[1080] = 0x53;
            buf[1081] = 0xEF;
            buf[..4].copy_from_slice(b"XFSB");
            let dev = rng.u64(..);
            let sb = Ext4Super::parse(&buf).unwrap();
            if let Ok(Some(at)) = judge_ext4(&sb, dev, "/dev/x") {
                let _ = judge_mmp(at, &Mmp::parse(&buf).unwrap(), "/dev/x");
            }
            let _ = judge_xfs(&XfsSuper::parse(&buf).unwrap(), dev, "/dev/x");
            let mut field = [0u8; 64];
            field.copy_from_slice(&buf[..64]);
            let _ = planted_option(&field);
        }
    }

    #[test]
    fn refuses_real_disks_larger_than_their_device() {
        if !root_or_skip("refuses_real_disks_larger_than_their_device") {
            return;
        }
        for (fs, mb) in [(FsType::Ext4, 64u64), (FsType::Xfs, 320)] {
            let disk = LoopDisk::new(mb, Some(fs.name()));
            check(&disk.device, fs).unwrap();
            // The image cut short, as a truncated copy or a shrunk disk would be.
            disk.resize(mb - 16);
            let e = check(&disk.device, fs).unwrap_err();
            assert!(matches!(e, Error::LargerThanDevice { .. }), "{fs}: {e}");
            assert_eq!(e.code(), Code::FailedPrecondition);
            let m = e.to_string();
            assert!(
                m.contains(&format!("{} bytes", mb << 20))
                    && m.contains(&format!("only {} bytes", (mb - 16) << 20)),
                "{fs}: {m}"
            );
        }
    }

    #[test]
    fn missing_device_is_internal() {
        let e = check(Path::new("/dev/crust-no-such-disk"), FsType::Ext4).unwrap_err();
        assert_eq!(e.code(), Code::Internal);
        assert!(e.to_string().contains("/dev/crust-no-such-disk"), "{e}");
    }
}

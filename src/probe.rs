//! Filesystem identification from on-disk superblocks, before anything else
//! touches a disk. Opens the device read-only and only reads: the agent never
//! formats, and never mounts a disk whose filesystem is not the requested one.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::errors::{Code, SysError};

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
    /// Opening or reading the device failed.
    #[error(transparent)]
    Sys(#[from] SysError),
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::Mismatch { .. } | Error::Unformatted { .. } | Error::Ambiguous { .. } => {
                Code::FailedPrecondition
            }
            Error::Sys(_) => Code::Internal,
        }
    }
}

/// How much of the disk the probe reads: enough for btrfs's superblock at 64 KiB.
const PROBE_BYTES: usize = 65536 + 4096;

/// Does `buf` hold `magic` at `offset`? (False when the disk is shorter than that.)
fn at(buf: &[u8], offset: usize, magic: &[u8]) -> bool {
    buf.get(offset..offset + magic.len()) == Some(magic)
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
    if at(buf, 65536 + 64, b"_BHRfS_M") {
        found.push("btrfs");
    }
    // The swap signature ends the first page, whatever the page size was.
    if [4096usize, 8192, 16384, 65536]
        .iter()
        .any(|ps| at(buf, ps - 10, b"SWAPSPACE2") || at(buf, ps - 10, b"SWAP-SPACE"))
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

/// Reads the first bytes of a device without ever opening it for writing.
fn read_head(device: &Path) -> Result<Vec<u8>, Error> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(device)
        .map_err(|e| SysError::new("open", device.display(), e))?;
    let mut buf = vec![0u8; PROBE_BYTES];
    let mut len = 0;
    while len < buf.len() {
        match file.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break, // a disk smaller than the probe: the rest is absent, not zero
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(SysError::new("pread", device.display(), e).into()),
        }
    }
    buf.truncate(len);
    Ok(buf)
}

/// The filesystem on `device` ("ext4", "xfs", "btrfs", "swap", …), or None if
/// nothing is recognised. With several signatures, the most specific one.
pub fn identify(device: &Path) -> Result<Option<&'static str>, Error> {
    Ok(signatures(&read_head(device)?).first().copied())
}

/// Succeeds only when `device` holds exactly the `expected` filesystem.
pub fn check(device: &Path, expected: FsType) -> Result<(), Error> {
    let found = signatures(&read_head(device)?);
    let dev = device.display().to_string();
    match found.as_slice() {
        [] => Err(Error::Unformatted {
            device: dev,
            expected,
        }),
        [one] if *one == expected.name() => Ok(()),
        [one] => Err(Error::Mismatch {
            device: dev,
            found: one,
            expected,
        }),
        many if many.contains(&expected.name()) => Err(Error::Ambiguous {
            device: dev,
            found: many.join(", "),
        }),
        many => Err(Error::Mismatch {
            device: dev,
            found: many[0],
            expected,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{root_or_skip, run, LoopDisk};

    fn with(patches: &[(usize, &[u8])]) -> Vec<u8> {
        let mut b = vec![0u8; PROBE_BYTES];
        for (off, bytes) in patches {
            b[*off..*off + bytes.len()].copy_from_slice(bytes);
        }
        b
    }

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
    fn missing_device_is_internal() {
        let e = check(Path::new("/dev/crust-no-such-disk"), FsType::Ext4).unwrap_err();
        assert_eq!(e.code(), Code::Internal);
        assert!(e.to_string().contains("/dev/crust-no-such-disk"), "{e}");
    }
}

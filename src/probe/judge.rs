//! A disk as the probe reads it before anything else touches it: its first
//! bytes (opened read-only, only read), the signatures they carry, and the
//! judgement of the requested filesystem's superblock (`ext4`, `xfs`).

// Every offset and size here comes from a disk the agent does not control.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::error::Error;
use super::ext4::{judge_ext4, judge_mmp};
use super::xfs::judge_xfs;
use crate::model::FsType;
use crate::superblock::{at, Ext4Super, Mmp, XfsSuper};
use crate::sys::error::SysError;

/// How much of the disk the probe reads: enough for btrfs's superblock at 64 KiB.
pub const PROBE_BYTES: usize = 65536 + 4096;

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
        device,
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
pub fn judge(
    head: &[u8],
    expected: FsType,
    dev: &Path,
    device_bytes: impl FnOnce() -> Result<u64, Error>,
    read: impl FnOnce(u64, usize) -> Result<Vec<u8>, Error>,
) -> Result<(), Error> {
    let found = signatures(head);
    let dev = dev.to_path_buf();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;
    use crate::probe::ext4::{planted_option, EXT4_MMP_SEQ_CLEAN, EXT4_MMP_SEQ_FSCK};
    use crate::superblock::with;
    use crust_testkit::{needs, run, LoopDisk};

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
    #[ignore = "needs root: make test runs it"]
    fn identifies_real_disks_without_writing() {
        needs::loop_devices();
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
    #[ignore = "needs root: make test runs it"]
    fn refuses_a_disk_with_two_signatures() {
        needs::loop_devices();
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
                let _ = judge_ext4(&sb, u64::MAX, Path::new("/dev/x"));
            }
            if let Some(sb) = XfsSuper::parse(h) {
                let _ = judge_xfs(&sb, 0, Path::new("/dev/x"));
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
            if let Ok(Some(at)) = judge_ext4(&sb, dev, Path::new("/dev/x")) {
                let _ = judge_mmp(at, &Mmp::parse(&buf).unwrap(), Path::new("/dev/x"));
            }
            let _ = judge_xfs(&XfsSuper::parse(&buf).unwrap(), dev, Path::new("/dev/x"));
            let mut field = [0u8; 64];
            field.copy_from_slice(&buf[..64]);
            let _ = planted_option(&field);
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn refuses_real_disks_larger_than_their_device() {
        needs::loop_devices();
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

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn refuses_a_real_xfs_whose_log_is_another_device() {
        needs::loop_devices();
        // An xfs whose log is another device.
        let log = LoopDisk::new(64, None);
        let disk = LoopDisk::new(320, None);
        run(
            "mkfs.xfs",
            &[
                "-q",
                "-f",
                "-l",
                &format!("logdev={}", log.path()),
                &disk.path(),
            ],
        );
        let e = check(&disk.device, FsType::Xfs).unwrap_err();
        assert!(matches!(e, Error::NeedsAnotherDevice { .. }), "{e}");
        assert!(e.to_string().contains("external log"), "{e}");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn refuses_real_disks_that_need_another_device_or_plant_options() {
        needs::loop_devices();
        // An ext4 whose journal is another device, and that device itself.
        let journal = LoopDisk::new(16, None);
        run(
            "mke2fs",
            &[
                "-q",
                "-F",
                "-O",
                "journal_dev",
                "-b",
                "4096",
                &journal.path(),
            ],
        );
        let disk = LoopDisk::new(64, None);
        run(
            "mkfs.ext4",
            &[
                "-q",
                "-F",
                "-b",
                "4096",
                "-J",
                &format!("device={}", journal.path()),
                &disk.path(),
            ],
        );
        let e = check(&disk.device, FsType::Ext4).unwrap_err();
        assert!(matches!(e, Error::NeedsAnotherDevice { .. }), "{e}");
        assert!(e.to_string().contains("external journal"), "{e}");
        let e = check(&journal.device, FsType::Ext4).unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        // Options planted in the superblock.
        let disk = LoopDisk::new(64, Some("ext4"));
        run(
            "debugfs",
            &["-w", "-R", "ssv mount_opts errors=panic,acl", &disk.path()],
        );
        check(&disk.device, FsType::Ext4).unwrap();
        run(
            "debugfs",
            &["-w", "-R", "ssv mount_opts acl,commit=86400", &disk.path()],
        );
        let e = check(&disk.device, FsType::Ext4).unwrap_err();
        assert!(matches!(e, Error::PlantedOption { .. }), "{e}");
        assert!(e.to_string().contains("\"commit=86400\""), "{e}");
    }

    /// Writes `bytes` at `offset` of the device through its node (so the
    /// probe's reads, through the same page cache, see them).
    fn poke(disk: &LoopDisk, offset: u64, bytes: &[u8]) {
        use std::io::{Seek, Write};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&disk.device)
            .unwrap();
        f.seek(SeekFrom::Start(offset)).unwrap();
        f.write_all(bytes).unwrap();
        f.sync_all().unwrap();
    }

    /// A field of `dumpe2fs -h`.
    fn dumpe2fs(disk: &LoopDisk, field: &str) -> u64 {
        let out = run("dumpe2fs", &["-h", &disk.path()]);
        let line = out.lines().find(|l| l.starts_with(field)).unwrap();
        line[field.len()..].trim().parse().unwrap()
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn judges_real_mmp_disks() {
        needs::loop_devices();
        // (e2fsprogs run MMP's own wait when they open an MMP disk read-write,
        // so everything is set at mkfs time or written with dd.)
        // The longest interval mke2fs allows: after a crash the kernel would
        // sleep 720 s in mount(2).
        let slow = LoopDisk::with_mkfs(
            64,
            Some("ext4"),
            &["-O", "mmp", "-E", "mmp_update_interval=300"],
        );
        let e = check(&slow.device, FsType::Ext4).unwrap_err();
        assert!(matches!(e, Error::Mmp { .. }), "{e}");
        assert!(e.to_string().contains("720 s"), "{e}");
        // As mke2fs makes it: clean, 5 s.
        let disk = LoopDisk::with_mkfs(64, Some("ext4"), &["-O", "mmp"]);
        check(&disk.device, FsType::Ext4).unwrap();
        let at = dumpe2fs(&disk, "MMP block number:") * dumpe2fs(&disk, "Block size:");
        let seq = |seq: u32, check_interval: u16| {
            poke(&disk, at + 4, &seq.to_le_bytes());
            poke(&disk, at + 0x70, &check_interval.to_le_bytes());
            check(&disk.device, FsType::Ext4)
        };
        // e2fsck at work.
        let e = seq(EXT4_MMP_SEQ_FSCK, 10).unwrap_err();
        assert!(e.to_string().contains("e2fsck is running"), "{e}");
        // Left so by a crash, with the interval the kernel writes: a 42 s wait, allowed.
        seq(42, 10).unwrap();
        // Another node that writes it every 100 s: 320 s, refused.
        let e = seq(42, 100).unwrap_err();
        assert!(e.to_string().contains("320 s"), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition);
        seq(EXT4_MMP_SEQ_CLEAN, 100).unwrap();
    }
}

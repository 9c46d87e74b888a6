//! createFilesystem's blank check and format on loop devices (root).

use std::io::{Seek, SeekFrom, Write};
use std::time::Duration;

use super::*;
use crate::hostdev;
use crust_protocols::code::Code;
use crust_testkit::disks::{self, LoopDisk};
use crust_testkit::needs;

const T: Duration = Duration::from_secs(120);

fn image(d: &LoopDisk) -> Vec<u8> {
    std::fs::read(&d.image).unwrap()
}

/// Writes `bytes` at `at` of the disk's device, and flushes.
fn write_at(d: &LoopDisk, at: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&d.device)
        .unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

/// Zeros `len` bytes at `at` (a lost partition table, a wiped header).
fn zero(d: &LoopDisk, at: u64, len: usize) {
    write_at(d, at, &vec![0u8; len]);
}

/// A filesystem `fs` made at byte `offset` of the disk's image (what a
/// partition there would hold), with the first and last MiB then zeroed.
fn fs_at(d: &LoopDisk, fs: &str, offset: u64, size_mib: u64) {
    let img = d.image.to_str().unwrap();
    match fs {
        "ext4" => disks::run(
            "mkfs.ext4",
            &[
                "-q",
                "-F",
                "-E",
                &format!("offset={offset}"),
                img,
                &format!("{}M", size_mib),
            ],
        ),
        _ => {
            // mkfs.xfs has no offset: make it in a file, then copy it in.
            let part = d.scratch("xfs-part").join("p.img");
            disks::run(
                "truncate",
                &["-s", &format!("{size_mib}M"), part.to_str().unwrap()],
            );
            disks::run("mkfs.xfs", &["-q", "-f", part.to_str().unwrap()]);
            let bytes = std::fs::read(&part).unwrap();
            write_at(d, offset, &bytes);
            String::new()
        }
    };
    let size = std::fs::metadata(&d.image).unwrap().len();
    if offset >= 1 << 20 {
        zero(d, 0, 1 << 20);
    }
    zero(d, size - (1 << 20), 1 << 20);
}

fn refused(d: &LoopDisk, fs: &str) -> Error {
    let dev = hostdev::resolve(&d.path()).unwrap();
    let e = inspect(&dev, fs, T).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    e
}

/// An ext4 (or xfs) at 1 MiB, the usual first partition, on a disk whose
/// partition table sector was lost: its first and last MiB are zeros and
/// `blkid -p` finds nothing at offset 0, so a check of offset 0 and both
/// ends alone would format it.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_file_system_at_one_mib_behind_zeros_is_refused_and_left_as_it_is() {
    needs::loop_devices();
    for fs in ["ext4", "xfs"] {
        let d = LoopDisk::new(400, None);
        fs_at(&d, fs, 1 << 20, 320);
        let before = image(&d);
        // What a check of offset 0 and both ends sees: nothing, and zeros.
        let blkid = std::process::Command::new("blkid")
            .args(["-p", &d.path()])
            .output()
            .unwrap();
        assert_eq!(blkid.status.code(), Some(2), "blkid found something at 0");
        for want in ["ext4", "xfs"] {
            let e = refused(&d, want);
            assert!(e.to_string().contains("at byte 1048576"), "{fs}: {e}");
            assert!(
                e.to_string().contains(fs)
                    || e.to_string().contains("XFS")
                    || e.to_string().contains("ext2/3/4"),
                "{fs}: {e}"
            );
        }
        assert!(image(&d) == before, "{fs}: a byte changed");
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn file_systems_at_odd_offsets_and_labels_at_either_end_are_refused() {
    needs::loop_devices();
    let mib: u64 = 1 << 20;
    // ext4 at 63 sectors (DOS era) and at 3 MiB + 512 (no alignment at all).
    for (offset, says) in [
        (63 * 512, "at byte 32256"),
        (3 * mib + 512, "at byte 3146240"),
    ] {
        let d = LoopDisk::new(64, None);
        fs_at(&d, "ext4", offset, 32);
        if offset < mib {
            // Its own start is in the first MiB: zero only what is before it.
            zero(&d, 0, usize::try_from(offset).unwrap());
        }
        let before = image(&d);
        let e = refused(&d, "ext4");
        assert!(e.to_string().contains(says), "{e}");
        assert!(image(&d) == before);
    }
    // Labels written by hand where each format puts them, the rest zeros.
    let size: u64 = 64 * mib;
    let cases: Vec<(u64, Vec<u8>, &str)> = vec![
        // A GPT whose primary header was wiped but whose backup remains.
        (size - 512, b"EFI PART".to_vec(), "GPT"),
        // LVM2 on a partition at 2 MiB.
        (2 * mib + 512, b"LABELONE".to_vec(), "LVM2"),
        // MD 0.90 and 1.0 near the end, 1.2 at 4 KiB of a partition at 8 MiB.
        (size - 65536, vec![0xfc, 0x4e, 0x2b, 0xa9], "MD RAID"),
        (size - 8192, vec![0xfc, 0x4e, 0x2b, 0xa9], "MD RAID"),
        (8 * mib + 4096, vec![0xfc, 0x4e, 0x2b, 0xa9], "MD RAID"),
        // LUKS at a partition at 16 MiB.
        (16 * mib, b"LUKS\xba\xbe".to_vec(), "LUKS"),
        // bcache on a partition at 4 MiB: its superblock at 4 KiB, magic 24 in.
        (
            4 * mib + 4096 + 24,
            vec![
                0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba,
                0x6d, 0x81,
            ],
            "bcache",
        ),
    ];
    for (at, magic, says) in cases {
        let d = LoopDisk::new(64, None);
        write_at(&d, at, &magic);
        let before = image(&d);
        let e = refused(&d, "ext4");
        // Named by blkid (linux_raid_member, crypto_LUKS, LVM2_member,
        // gpt) or, where blkid sees nothing, by crustd's own scan.
        let blkid_name = match says {
            "MD RAID" => "linux_raid_member",
            "LUKS" => "crypto_LUKS",
            "LVM2" => "LVM2_member",
            "GPT" => "gpt",
            other => other,
        };
        assert!(
            e.to_string().contains(says) || e.to_string().contains(blkid_name),
            "{says}: {e}"
        );
        assert!(image(&d) == before, "{says}");
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_blank_device_is_formatted_while_held_and_verified_and_no_loop_device_is_left() {
    needs::loop_devices();
    // The loop devices whose backing is `dev` (`losetup -j`, by device and
    // inode): the format's own. Counting every loop device on the machine
    // failed under load, when other tests or programs made their own.
    let loops = |dev: &str| disks::run("losetup", &["-j", dev]).lines().count();
    for fs in ["ext4", "xfs"] {
        let d = LoopDisk::new(320, None);
        let dev = hostdev::resolve(&d.path()).unwrap();
        assert_eq!(inspect(&dev, fs, T).unwrap(), Content::Blank);
        assert_eq!(loops(&d.path()), 0);
        // crustd's exclusive hold, kept all the while: mkfs never needs the
        // device's own exclusive open.
        let held = dev.hold().unwrap();
        format(&dev, fs, T).unwrap();
        assert!(dev.hold().is_err(), "still held by us");
        assert_eq!(inspect(&dev, fs, T).unwrap(), Content::Same, "{fs}");
        assert_eq!(loops(&d.path()), 0, "{fs}: a loop device was left behind");
        drop(held);
        // What the host's own tools say of it.
        let out = disks::run("blkid", &["-p", "-o", "value", "-s", "TYPE", &d.path()]);
        assert_eq!(out.trim(), fs);
        // Formatted: now it is not blank for the other filesystem.
        let other = if fs == "ext4" { "xfs" } else { "ext4" };
        assert_eq!(refused(&d, other).code(), Code::FailedPrecondition);
    }
    // mkfs failing (here: a device too small for any ext4) leaves no loop device.
    let d = LoopDisk::new(1, None);
    let dev = hostdev::resolve(&d.path()).unwrap();
    let held = dev.hold().unwrap();
    let e = format(&dev, "xfs", T).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(!e.to_string().contains("Usage"), "{e}");
    assert_eq!(loops(&d.path()), 0);
    drop(held);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn an_xfs_below_mkfs_xfs_minimum_is_refused_in_one_sentence() {
    needs::loop_devices();
    let d = LoopDisk::new(299, None);
    let dev = hostdev::resolve(&d.path()).unwrap();
    let e = inspect(&dev, "xfs", T).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.to_string()
            .contains(&format!("has {} bytes", 299u64 << 20))
            && e.to_string().contains("314572800"),
        "{e}"
    );
    assert!(!e.to_string().contains('\n'), "{e}");
    // ext4 fits there.
    assert_eq!(inspect(&dev, "ext4", T).unwrap(), Content::Blank);
}

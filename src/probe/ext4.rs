//! ext4's superblock as the agent judges it before mounting: its size
//! against the device, an external journal, the mount options it plants
//! (s_mount_opts), and multi-mount protection (MMP), whose wait the kernel
//! sleeps inside mount(2) where nothing can cancel it.

use super::error::{fits, Error};
use std::path::Path;

use crate::model::FsType;
use crate::superblock::{
    Ext4Super, Mmp, EXT4_COMPAT_HAS_JOURNAL, EXT4_INCOMPAT_JOURNAL_DEV, EXT4_INCOMPAT_MMP,
};

/// The wait ext4_multi_mount_protect sleeps, in seconds, for an MMP block
/// that is not clean, checked at `interval` seconds: twice (before and after
/// writing its own sequence) min(2i+1, i+60), i at least 5 (fs/ext4/mmp.c).
pub fn mmp_wait_secs(interval: u64) -> u64 {
    let i = interval.max(EXT4_MMP_MIN_CHECK_INTERVAL);
    i.saturating_mul(2)
        .saturating_add(1)
        .min(i.saturating_add(60))
        .saturating_mul(2)
}

/// EXT4_MMP_MIN_CHECK_INTERVAL.
const EXT4_MMP_MIN_CHECK_INTERVAL: u64 = 5;
/// The longest MMP wait the agent lets a mount sleep (a publish is held that
/// long and cannot be cancelled): what a disk mke2fs made (update interval 5
/// s, which the kernel turns into a check interval of about 10 s) needs after
/// a crash left its MMP block unclean, with room for a slow host.
pub const MAX_MMP_WAIT_SECS: u64 = 60;
pub(crate) const EXT4_MMP_MAGIC: u32 = 0x004D_4D50;
pub(crate) const EXT4_MMP_SEQ_CLEAN: u32 = 0xFF4D_4D50;
pub(crate) const EXT4_MMP_SEQ_FSCK: u32 = 0xE24D_4D50;

/// The options a superblock may plant in s_mount_opts: each only chooses
/// among behaviours of this filesystem on this disk (ACLs, barriers,
/// journalling mode, allocation, quotas), and names no other device, stalls
/// nothing, and is no debugging switch. `errors=` may say anything: the
/// agent's own errors= overrides it (mount::options::MountOptions::kernel_data).
const PLANTABLE_FLAGS: &[&str] = &[
    "acl",
    "user_xattr",
    "barrier",
    "nobarrier",
    "discard",
    "nodiscard",
    "delalloc",
    "nodelalloc",
    "auto_da_alloc",
    "noauto_da_alloc",
    "journal_checksum",
    "nojournal_checksum",
    "journal_async_commit",
    "block_validity",
    "noblock_validity",
    "dioread_nolock",
    "nodioread_nolock",
    "dioread_lock",
    "grpid",
    "bsdgroups",
    "nogrpid",
    "sysvgroups",
    "bsddf",
    "minixdf",
    "nouid32",
    "quota",
    "noquota",
    "usrquota",
    "grpquota",
    "prjquota",
    "init_itable",
    "noinit_itable",
    "nombcache",
    "no_mbcache",
];
const PLANTABLE_VALUES: &[(&str, &[&str])] = &[
    ("errors", &["continue", "remount-ro", "panic"]),
    ("data", &["journal", "ordered", "writeback"]),
    ("data_err", &["abort", "ignore"]),
];
/// Why some options are refused, for the message; the rest are simply not on the list.
const PLANTED_WHY: &[(&str, &str)] = &[
    ("journal_dev", "it names another device as the journal"),
    ("journal_path", "it names another device as the journal"),
    ("commit", "it sets how long metadata may wait for the disk"),
    (
        "min_batch_time",
        "it makes every synchronous write sleep (uninterruptibly) as long as it says",
    ),
    (
        "max_batch_time",
        "it makes every synchronous write sleep (uninterruptibly) as long as it says",
    ),
    ("noload", "it skips the journal's recovery"),
    ("norecovery", "it skips the journal's recovery"),
    ("abort", "it is a debugging switch"),
    ("debug", "it is a debugging switch"),
    (
        "warn_on_error",
        "it is a debugging switch (a kernel warning on every error)",
    ),
    ("debug_want_extra_isize", "it is a debugging switch"),
    ("test_dummy_encryption", "it is a debugging switch"),
];
const PLANTED_OTHER: &str =
    "it is not among the options a disk may carry (ACLs, barriers, data=, discard, delalloc, quotas and the like)";

/// The first option of an s_mount_opts field the agent refuses, with why.
/// The kernel reads the field up to its NUL (all 64 bytes without one is an
/// error it fails the mount on), splits it at commas, skips empty items and
/// items that start with '=', and takes the key up to the first '='.
pub fn planted_option(field: &[u8; 64]) -> Option<(String, &'static str)> {
    let Some(end) = field.iter().position(|&c| c == 0) else {
        return Some((
            String::from_utf8_lossy(field).into_owned(),
            "it fills the whole field without an end, which the kernel refuses",
        ));
    };
    for item in field.get(..end)?.split(|&c| c == b',') {
        if item.is_empty() || item.first() == Some(&b'=') {
            continue;
        }
        let text = String::from_utf8_lossy(item).into_owned();
        let (key, value) = match text.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (text.as_str(), None),
        };
        let allowed = match value {
            None => PLANTABLE_FLAGS.contains(&key),
            Some(v) => PLANTABLE_VALUES
                .iter()
                .any(|(k, vs)| *k == key && vs.contains(&v)),
        };
        if !allowed {
            let why = PLANTED_WHY
                .iter()
                .find(|(k, _)| *k == key)
                .map_or(PLANTED_OTHER, |(_, why)| why);
            return Some((text, why));
        }
    }
    None
}

/// What must still be read to judge an ext4: its MMP block, at this byte offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmpAt {
    /// Byte offset of the MMP block on the device.
    pub offset: u64,
    /// s_mmp_update_interval.
    pub update_interval: u16,
}

/// Judges an ext4 superblock against a device of `device_bytes`, from the
/// superblock alone; Ok(Some) when its MMP block must be read and judged
/// too (`judge_mmp`). Pure.
pub fn judge_ext4(
    sb: &Ext4Super,
    device_bytes: u64,
    device: &Path,
) -> Result<Option<MmpAt>, Error> {
    let corrupt = |what: String| Error::Corrupt {
        device: device.to_path_buf(),
        fs: FsType::Ext4,
        what,
    };
    let another = |what| Error::NeedsAnotherDevice {
        device: device.to_path_buf(),
        fs: FsType::Ext4,
        what,
    };
    if sb.incompat & EXT4_INCOMPAT_JOURNAL_DEV != 0 {
        return Err(Error::Mismatch {
            device: device.to_path_buf(),
            found: "an ext4 external journal",
            expected: FsType::Ext4,
        });
    }
    let Some(block_size) = sb.block_size() else {
        return Err(corrupt(format!(
            "its block size is 1024 << {}, beyond the 64 KiB any kernel mounts",
            sb.log_block_size
        )));
    };
    fits(
        FsType::Ext4,
        sb.blocks_count,
        block_size,
        device_bytes,
        device,
    )?;
    if sb.compat & EXT4_COMPAT_HAS_JOURNAL != 0 && sb.journal_inum == 0 {
        return Err(another("has an external journal"));
    }
    if let Some((option, why)) = planted_option(&sb.mount_opts) {
        return Err(Error::PlantedOption {
            device: device.to_path_buf(),
            option,
            why,
        });
    }
    if sb.incompat & EXT4_INCOMPAT_MMP == 0 {
        return Ok(None);
    }
    let mmp = |what: String| Error::Mmp {
        device: device.to_path_buf(),
        what,
    };
    if sb.mmp_update_interval == 0 {
        return Err(mmp(
            "an update interval of 0 s: the kernel would rewrite the MMP block without pause for as long as it is mounted".to_string(),
        ));
    }
    let wait = mmp_wait_secs(u64::from(sb.mmp_update_interval));
    if wait > MAX_MMP_WAIT_SECS {
        return Err(mmp(format!(
            "an update interval of {} s: after any unclean stop the kernel would hold the next mount for {wait} s, a wait no request can cancel (the agent allows {MAX_MMP_WAIT_SECS} s)",
            sb.mmp_update_interval
        )));
    }
    // The kernel refuses an MMP block outside the filesystem (EINVAL); so
    // does the agent, before reading anything there.
    if sb.mmp_block < u64::from(sb.first_data_block) || sb.mmp_block >= sb.blocks_count {
        return Err(corrupt(format!(
            "its MMP block {} lies outside the filesystem's {} blocks",
            sb.mmp_block, sb.blocks_count
        )));
    }
    let offset = sb.mmp_block.checked_mul(block_size).ok_or_else(|| {
        corrupt(format!(
            "its MMP block {} is beyond 2^64 bytes",
            sb.mmp_block
        ))
    })?;
    Ok(Some(MmpAt {
        offset,
        update_interval: sb.mmp_update_interval,
    }))
}

/// Judges what the kernel would do with an MMP block at mount: refuse it
/// (bad magic, e2fsck running), go ahead at once (clean), or sleep
/// `mmp_wait_secs` (in use, or left so by a crash), which the agent allows
/// up to MAX_MMP_WAIT_SECS. Pure.
pub fn judge_mmp(at: MmpAt, mmp: &Mmp, device: &Path) -> Result<(), Error> {
    let refuse = |what: String| Error::Mmp {
        device: device.to_path_buf(),
        what,
    };
    if mmp.magic != EXT4_MMP_MAGIC {
        return Err(refuse(format!(
            "its MMP block at byte {} has no MMP magic ({:#x}), which the kernel refuses",
            at.offset, mmp.magic
        )));
    }
    match mmp.seq {
        EXT4_MMP_SEQ_CLEAN => Ok(()),
        EXT4_MMP_SEQ_FSCK => Err(refuse(format!(
            "its MMP block says e2fsck is running on it (written by node {:?})",
            mmp.nodename
        ))),
        seq => {
            let interval = u64::from(at.update_interval).max(u64::from(mmp.check_interval));
            let wait = mmp_wait_secs(interval);
            if wait > MAX_MMP_WAIT_SECS {
                Err(refuse(format!(
                    "its MMP block is in use (sequence {seq:#x}, last written by node {:?}, check interval {} s): the kernel would hold the mount for {wait} s, a wait no request can cancel, to see whether another machine writes it (the agent allows {MAX_MMP_WAIT_SECS} s)",
                    mmp.nodename, mmp.check_interval
                )))
            } else {
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;
    use crate::probe::error::verdict;
    use crate::superblock::EXT4_INCOMPAT_64BIT;

    /// A healthy ext4 superblock: `blocks` of 4 KiB, internal journal, no MMP.
    fn ext4_sb(blocks: u64) -> Ext4Super {
        Ext4Super {
            blocks_count: blocks,
            first_data_block: 0,
            log_block_size: 2,
            blocks_per_group: 32768,
            has_errors: false,
            compat: EXT4_COMPAT_HAS_JOURNAL,
            incompat: EXT4_INCOMPAT_64BIT,
            journal_inum: 8,
            journal_dev: 0,
            mmp_update_interval: 0,
            mmp_block: 0,
            mount_opts: [0; 64],
        }
    }

    fn opts_field(s: &[u8]) -> [u8; 64] {
        let mut f = [0u8; 64];
        f[..s.len()].copy_from_slice(s);
        f
    }

    #[test]
    fn judges_ext4_superblocks() {
        let dev = 1u64 << 30; // 262144 blocks of 4 KiB
        let mut cases: Vec<(&str, Ext4Super, u64, &str)> = vec![
            ("healthy", ext4_sb(262144), dev, "ok"),
            ("smaller than the device", ext4_sb(1000), dev, "ok"),
            ("one block too many", ext4_sb(262145), dev, "too large"),
            ("no device at all", ext4_sb(1), 0, "too large"),
            (
                "2^64 blocks of 64 KiB",
                ext4_sb(u64::MAX),
                u64::MAX,
                "too large",
            ),
        ];
        let mut sb = ext4_sb(1000);
        sb.log_block_size = 7;
        cases.push(("128 KiB blocks", sb, dev, "corrupt"));
        let mut sb = ext4_sb(1000);
        sb.log_block_size = u32::MAX;
        cases.push(("absurd block size", sb, dev, "corrupt"));
        let mut sb = ext4_sb(1000);
        sb.journal_inum = 0;
        cases.push(("external journal", sb, dev, "another device"));
        let mut sb = ext4_sb(1000);
        sb.compat = 0;
        sb.journal_inum = 0;
        cases.push(("no journal (ext2)", sb, dev, "ok"));
        let mut sb = ext4_sb(1000);
        sb.incompat |= EXT4_INCOMPAT_JOURNAL_DEV;
        cases.push(("a journal device itself", sb, dev, "mismatch"));
        let mut sb = ext4_sb(1000);
        sb.mount_opts = opts_field(b"journal_dev=2049");
        cases.push(("planted journal_dev", sb, dev, "planted"));
        let mut sb = ext4_sb(1000);
        sb.mount_opts = opts_field(b"errors=panic");
        cases.push(("planted errors=panic (overridden)", sb, dev, "ok"));
        let mmp = |interval: u16, block: u64| {
            let mut sb = ext4_sb(1000);
            sb.incompat |= EXT4_INCOMPAT_MMP;
            sb.mmp_update_interval = interval;
            sb.mmp_block = block;
            sb
        };
        cases.push(("mmp as mke2fs makes it", mmp(5, 500), dev, "ok"));
        cases.push(("mmp interval 14", mmp(14, 500), dev, "ok"));
        cases.push(("mmp interval 15", mmp(15, 500), dev, "mmp"));
        cases.push(("mmp interval 0", mmp(0, 500), dev, "mmp"));
        cases.push(("mmp interval 65535", mmp(65535, 500), dev, "mmp"));
        cases.push(("mmp block past the end", mmp(5, 1000), dev, "corrupt"));
        cases.push(("mmp block huge", mmp(5, u64::MAX), dev, "corrupt"));
        let mut sb = mmp(5, 0);
        sb.first_data_block = 1;
        cases.push(("mmp block before the data", sb, dev, "corrupt"));
        for (what, sb, dev, want) in cases {
            assert_eq!(
                verdict(judge_ext4(&sb, dev, Path::new("/dev/vdb"))),
                want,
                "{what}"
            );
        }
        assert_eq!(
            judge_ext4(&mmp(5, 500), dev, Path::new("/dev/vdb")).unwrap(),
            Some(MmpAt {
                offset: 500 * 4096,
                update_interval: 5
            })
        );
        // The message names both sizes.
        let e = judge_ext4(&ext4_sb(262145), dev, Path::new("/dev/vdb")).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("1073745920 bytes") && m.contains("1073741824 bytes"),
            "{m}"
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
    }

    #[test]
    fn judges_planted_options_as_the_kernel_reads_them() {
        let table: &[(&[u8], Option<&str>)] = &[
            (b"", None),
            (b"acl,user_xattr", None),
            (b",,acl,,", None),
            (b"=whatever,acl", None), // the kernel skips an item with no key
            (b"data=journal,data_err=abort,nobarrier", None),
            (b"errors=panic", None),
            (b"errors=remount-ro", None),
            (b"journal_dev=2049", Some("journal_dev=2049")),
            (b"acl,journal_path=/dev/vdc", Some("journal_path=/dev/vdc")),
            (b"commit=86400", Some("commit=86400")),
            (
                b"max_batch_time=4000000000",
                Some("max_batch_time=4000000000"),
            ),
            (b"norecovery", Some("norecovery")),
            (
                b"debug_want_extra_isize=128",
                Some("debug_want_extra_isize=128"),
            ),
            (b"warn_on_error", Some("warn_on_error")),
            (b"data=bogus", Some("data=bogus")),
            (b"acl=1", Some("acl=1")),
            (b"errors=sometimes", Some("errors=sometimes")),
            (b"\xff\xfe", Some("\u{fffd}\u{fffd}")),
            (b"sb=8193", Some("sb=8193")),
        ];
        for (field, want) in table {
            let got = planted_option(&opts_field(field));
            assert_eq!(
                got.as_ref().map(|(o, _)| o.as_str()),
                *want,
                "{:?}",
                String::from_utf8_lossy(field)
            );
        }
        // Why, for the ones that have a reason.
        assert!(planted_option(&opts_field(b"journal_dev=1"))
            .unwrap()
            .1
            .contains("another device"));
        assert!(planted_option(&opts_field(b"min_batch_time=9"))
            .unwrap()
            .1
            .contains("sleep"));
        // All 64 bytes without an end: the kernel fails the mount on it.
        let full = [b'a'; 64];
        assert!(planted_option(&full).unwrap().1.contains("without an end"));
        // The last byte may be the end.
        let mut acl = [b','; 64];
        acl[..3].copy_from_slice(b"acl");
        acl[63] = 0;
        assert_eq!(planted_option(&acl), None);
    }

    #[test]
    fn computes_the_kernels_mmp_wait() {
        for (interval, want) in [
            (0, 22),
            (5, 22),
            (10, 42),
            (14, 58),
            (15, 62),
            (60, 240),
            (300, 720),
            (65535, 131_190),
            (u64::MAX, u64::MAX),
        ] {
            assert_eq!(mmp_wait_secs(interval), want, "{interval}");
        }
    }

    #[test]
    fn judges_mmp_blocks() {
        let at = MmpAt {
            offset: 4096,
            update_interval: 5,
        };
        let block = |magic: u32, seq: u32, check: u16| Mmp {
            magic,
            seq,
            nodename: "node-a".into(),
            check_interval: check,
        };
        let table = [
            ("clean", block(EXT4_MMP_MAGIC, EXT4_MMP_SEQ_CLEAN, 10), "ok"),
            (
                "clean, long check interval",
                block(EXT4_MMP_MAGIC, EXT4_MMP_SEQ_CLEAN, 65535),
                "ok",
            ),
            (
                "crashed, as the kernel leaves it",
                block(EXT4_MMP_MAGIC, 42, 10),
                "ok",
            ),
            (
                "crashed under a slow host",
                block(EXT4_MMP_MAGIC, 42, 14),
                "ok",
            ),
            (
                "in use, check interval 15",
                block(EXT4_MMP_MAGIC, 42, 15),
                "mmp",
            ),
            (
                "in use, hostile interval",
                block(EXT4_MMP_MAGIC, 42, 65535),
                "mmp",
            ),
            (
                "e2fsck running",
                block(EXT4_MMP_MAGIC, EXT4_MMP_SEQ_FSCK, 10),
                "mmp",
            ),
            ("no magic", block(0, EXT4_MMP_SEQ_CLEAN, 10), "mmp"),
        ];
        for (what, mmp, want) in table {
            assert_eq!(
                verdict(judge_mmp(at, &mmp, Path::new("/dev/vdb"))),
                want,
                "{what}"
            );
        }
        let e = judge_mmp(at, &block(EXT4_MMP_MAGIC, 42, 100), Path::new("/dev/vdb")).unwrap_err();
        assert!(e.to_string().contains("320 s"), "{e}");
        assert!(e.to_string().contains("node-a"), "{e}");
        // The superblock's interval counts when it is the longer one.
        let long = MmpAt {
            offset: 4096,
            update_interval: 14,
        };
        assert_eq!(
            verdict(judge_mmp(
                long,
                &block(EXT4_MMP_MAGIC, 42, 5),
                Path::new("/dev/vdb")
            )),
            "ok"
        );
        let mut b = vec![0u8; 1024];
        b[..4].copy_from_slice(&EXT4_MMP_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&7u32.to_le_bytes());
        b[16..22].copy_from_slice(b"host-1");
        b[0x70..0x72].copy_from_slice(&12u16.to_le_bytes());
        assert_eq!(
            Mmp::parse(&b).unwrap(),
            Mmp {
                magic: EXT4_MMP_MAGIC,
                seq: 7,
                nodename: "host-1".into(),
                check_interval: 12
            }
        );
        assert_eq!(Mmp::parse(&b[..0x71]), None);
    }
}

//! xfs's superblock as the agent judges it before mounting: its size
//! against the device, and a log or realtime section on another device.

use super::{at, be32, be64, fits, Error, FsType};

/// The fields of an xfs superblock the agent reads (struct xfs_dsb, big endian).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XfsSuper {
    /// sb_blocksize.
    pub blocksize: u32,
    /// sb_dblocks: the data section's blocks.
    pub dblocks: u64,
    /// sb_rblocks: the realtime section's blocks (on another device).
    pub rblocks: u64,
    /// sb_logstart: 0 when the log is on another device.
    pub logstart: u64,
}

impl XfsSuper {
    /// Parses the superblock at the start of a disk; None without the magic
    /// or when `head` is too short.
    pub fn parse(head: &[u8]) -> Option<XfsSuper> {
        if !at(head, 0, b"XFSB") {
            return None;
        }
        Some(XfsSuper {
            blocksize: be32(head, 4)?,
            dblocks: be64(head, 8)?,
            rblocks: be64(head, 16)?,
            logstart: be64(head, 48)?,
        })
    }
}

/// Judges an xfs superblock against a device of `device_bytes`. Pure.
pub fn judge_xfs(sb: &XfsSuper, device_bytes: u64, device: &str) -> Result<(), Error> {
    // xfs_validate_sb_common: a power of two from 512 bytes to 64 KiB.
    if !(512..=65536).contains(&sb.blocksize) || !sb.blocksize.is_power_of_two() {
        return Err(Error::Corrupt {
            device: device.to_string(),
            fs: FsType::Xfs,
            what: format!(
                "its block size {} is not one any kernel mounts",
                sb.blocksize
            ),
        });
    }
    fits(
        FsType::Xfs,
        sb.dblocks,
        u64::from(sb.blocksize),
        device_bytes,
        device,
    )?;
    let another = |what| Error::NeedsAnotherDevice {
        device: device.to_string(),
        fs: FsType::Xfs,
        what,
    };
    if sb.logstart == 0 {
        return Err(another("has an external log"));
    }
    if sb.rblocks != 0 {
        return Err(another("has a realtime section"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::{check, verdict, with};
    use crate::testutil::{root_or_skip, run, LoopDisk};

    #[test]
    fn judges_xfs_superblocks() {
        let sb = |blocksize: u32, dblocks: u64, rblocks: u64, logstart: u64| XfsSuper {
            blocksize,
            dblocks,
            rblocks,
            logstart,
        };
        let dev = 300u64 << 20;
        let table = [
            ("healthy", sb(4096, 76800, 0, 65540), "ok"),
            ("one block too many", sb(4096, 76801, 0, 65540), "too large"),
            ("huge", sb(65536, u64::MAX, 0, 65540), "too large"),
            ("block size 0", sb(0, 1, 0, 65540), "corrupt"),
            ("block size 1000", sb(1000, 1, 0, 65540), "corrupt"),
            ("block size 128 KiB", sb(131072, 1, 0, 65540), "corrupt"),
            ("external log", sb(4096, 1000, 0, 0), "another device"),
            (
                "realtime section",
                sb(4096, 1000, 5000, 65540),
                "another device",
            ),
        ];
        for (what, sb, want) in table {
            assert_eq!(verdict(judge_xfs(&sb, dev, "/dev/vdc")), want, "{what}");
        }
        let head = with(&[
            (0, b"XFSB"),
            (4, &4096u32.to_be_bytes()),
            (8, &76800u64.to_be_bytes()),
            (48, &65540u64.to_be_bytes()),
        ]);
        assert_eq!(XfsSuper::parse(&head).unwrap(), sb(4096, 76800, 0, 65540));
        assert_eq!(XfsSuper::parse(&head[..55]), None);
    }

    #[test]
    fn refuses_a_real_xfs_whose_log_is_another_device() {
        if !root_or_skip("refuses_a_real_xfs_whose_log_is_another_device") {
            return;
        }
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
}

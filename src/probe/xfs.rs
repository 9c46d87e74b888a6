//! xfs's superblock as the agent judges it before mounting: its size
//! against the device, and a log or realtime section on another device.

use super::error::{fits, Error};
use std::path::Path;

use crate::model::FsType;
use crate::superblock::XfsSuper;

/// Judges an xfs superblock against a device of `device_bytes`. Pure.
pub fn judge_xfs(sb: &XfsSuper, device_bytes: u64, device: &Path) -> Result<(), Error> {
    // xfs_validate_sb_common: a power of two from 512 bytes to 64 KiB.
    if !(512..=65536).contains(&sb.blocksize) || !sb.blocksize.is_power_of_two() {
        return Err(Error::Corrupt {
            device: device.to_path_buf(),
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
        device: device.to_path_buf(),
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
    use crate::probe::error::verdict;

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
            assert_eq!(
                verdict(judge_xfs(&sb, dev, Path::new("/dev/vdc"))),
                want,
                "{what}"
            );
        }
    }
}

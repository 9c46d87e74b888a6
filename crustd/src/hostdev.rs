//! The host side of a volume: `host_volume_id` must be an absolute path to a
//! block device (a symlink to one is fine), and the names crustd gives it in
//! QEMU and in the guest are derived from that path, so that every call, and
//! every crustd after a restart, picks the same ones.

use std::fs::{self, File};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A host block device, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevice {
    /// The device node, symlinks resolved (what QEMU opens).
    pub path: PathBuf,
    /// `MAJOR:MINOR`.
    pub rdev: String,
}

/// Resolves `host_volume_id` to a block device; anything else is INVALID_ARGUMENT.
pub fn resolve(host_volume_id: &str) -> Result<HostDevice> {
    check_path(host_volume_id)?;
    let md = fs::metadata(host_volume_id).map_err(|e| {
        Error::invalid(format!(
            "host_volume_id {host_volume_id} is not a block device on this host: {e}"
        ))
    })?;
    if !md.file_type().is_block_device() {
        let kind = if md.is_dir() {
            "a directory"
        } else if md.is_file() {
            "a regular file (attach it with losetup and give the /dev/loopN)"
        } else {
            "not a block device"
        };
        return Err(Error::invalid(format!(
            "host_volume_id {host_volume_id} is {kind}: give the block device of the volume, e.g. /dev/sdx"
        )));
    }
    let path = fs::canonicalize(host_volume_id)
        .map_err(|e| Error::internal(format!("cannot resolve {host_volume_id}: {e}")))?;
    let rdev = md.rdev();
    Ok(HostDevice {
        path,
        rdev: format!("{}:{}", major(rdev), minor(rdev)),
    })
}

/// `host_volume_id` must be a non-empty absolute path.
pub fn check_path(host_volume_id: &str) -> Result<()> {
    if host_volume_id.is_empty() {
        return Err(Error::invalid(
            "host_volume_id is empty: give the volume's block device on the host, e.g. /dev/sdx",
        ));
    }
    if !host_volume_id.starts_with('/') {
        return Err(Error::invalid(format!(
            "host_volume_id {host_volume_id:?} is not an absolute path: give the block device, e.g. /dev/sdx"
        )));
    }
    Ok(())
}

/// The device's size in bytes as the host kernel sees it now (what
/// BLKGETSIZE64 answers; seeking to the end of a block device gives the same
/// without an ioctl).
pub fn size(path: &Path) -> Result<u64> {
    let sized = File::open(path).and_then(|mut f| f.seek(SeekFrom::End(0)));
    sized.map_err(|e: io::Error| {
        Error::precondition(format!("cannot read the size of {}: {e}", path.display()))
    })
}

fn major(rdev: u64) -> u64 {
    ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0xfff)
}

fn minor(rdev: u64) -> u64 {
    ((rdev >> 12) & 0xffff_ff00) | (rdev & 0xff)
}

/// The names one host volume gets, all derived from `host_volume_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// The agent's volume id: `crustd-<hash>`.
    pub volume_id: String,
    /// The virtio-blk serial: `cr-<hash>` (19 bytes; virtio-blk holds 20).
    pub serial: String,
    /// QEMU's block node: `crustd-<hash>` (QEMU allows 31 characters).
    pub node: String,
    /// QEMU's device id: `crustd-dev-<hash>`.
    pub device: String,
}

impl Names {
    pub fn derive(host_volume_id: &str) -> Names {
        let h = format!("{:016x}", fnv1a64(host_volume_id.as_bytes()));
        Names {
            volume_id: format!("crustd-{h}"),
            serial: format!("cr-{h}"),
            node: format!("crustd-{h}"),
            device: format!("crustd-dev-{h}"),
        }
    }
}

/// FNV-1a, 64 bits: stable across releases and platforms, unlike std's hasher.
fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    #[test]
    fn names_are_stable_and_fit() {
        // Pinned: changing the derivation would orphan every published volume.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        let n = Names::derive("/dev/loop3");
        assert_eq!(n, Names::derive("/dev/loop3"));
        assert_ne!(n.serial, Names::derive("/dev/loop4").serial);
        assert_eq!(n.serial.len(), 19);
        assert!(n.node.len() <= 31 && n.device.len() <= 31);
        assert!(n
            .serial
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    }

    #[test]
    fn only_block_devices() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("img");
        fs::write(&f, b"x").unwrap();
        for (p, what) in [
            ("", "empty"),
            ("dev/loop0", "absolute"),
            ("/nonexistent/x", "No such file"),
            (t.path().to_str().unwrap(), "a directory"),
            (f.to_str().unwrap(), "regular file"),
            ("/dev/null", "not a block device"),
        ] {
            let e = resolve(p).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{p}");
            assert!(e.message.contains(what), "{p}: {e}");
        }
    }

    #[test]
    fn device_numbers() {
        // makedev(7, 3) and makedev(259, 1048577) in glibc's encoding.
        assert_eq!((major(0x703), minor(0x703)), (7, 3));
        let big: u64 = (259 << 8) | ((1_048_577 & 0xff) | ((1_048_577 & !0xff) << 12));
        assert_eq!((major(big), minor(big)), (259, 1_048_577));
    }
}

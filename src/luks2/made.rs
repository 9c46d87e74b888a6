//! A LUKS2 volume made in the guest, with a key the host never sees: a
//! disk that is provably blank (`blank`) gets a new header (`format`),
//! then the caller maps it and makes the filesystem inside, then marks it
//! finished. Until then both binary headers carry the label
//! [`UNFINISHED`]: a publish killed between the header and the end of
//! mkfs leaves a volume that the next publish with `format_if_blank`
//! recognises, unlocks with its key (which proves it is the one it made),
//! and finishes, instead of a LUKS2 volume with no filesystem that nothing
//! would ever format again. cryptsetup opens such a volume all the same
//! (the label is free text, shown by luksDump).
//!
//! The disk is opened exclusively (O_EXCL) while it is checked and
//! written, so nothing mounts or maps it meanwhile, and closed before the
//! mapping, which claims it in turn.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::blank;
use super::error::Error;
use super::format::{self, KdfCost, Options, OsRandom, SectorSize};
use super::header;
use crate::sys::error::SysError;

/// The label of a volume whose making has not finished.
pub const UNFINISHED: &str = "crust-unfinished";

/// The label field of a binary header, and its checksum.
const LABEL: std::ops::Range<usize> = 24..72;
const SEQID: std::ops::Range<usize> = 16..24;
const CSUM: std::ops::Range<usize> = 448..512;

/// What `format_if_blank` found on the disk, and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// A LUKS2 volume, finished: opened as it is.
    Luks,
    /// A volume the agent began to make and did not finish: its filesystem
    /// is to be made again.
    Unfinished,
    /// A blank disk, now a LUKS2 volume: its filesystem is to be made.
    Formatted,
}

/// How the agent makes a keyslot in a guest with `free_bytes` of free
/// memory and `cpus` CPUs: Argon2id with an eighth of that memory, between
/// cryptsetup's 32 MiB floor for a new keyslot and its 1 GiB default
/// ceiling, 4 passes (cryptsetup's least), a lane per CPU up to 4 (as
/// cryptsetup chooses); 512-byte sectors.
pub fn guest_options(free_bytes: u64, cpus: u32) -> Options {
    let kib = (free_bytes / 8 / 1024).clamp(32 << 10, 1 << 20);
    Options {
        kdf: KdfCost::Argon2id {
            memory_kib: u32::try_from(kib).unwrap_or(1 << 20),
            passes: 4,
            lanes: cpus.clamp(1, 4),
        },
        sector_size: SectorSize::Bytes512,
    }
}

/// Makes `disk` a LUKS2 volume opened by `passphrase` if it is provably
/// blank; a LUKS2 volume already there is left as it is (finished or not:
/// see [`Found`]); anything else is refused, and not a byte is written.
pub fn format_if_blank(
    disk: &Path,
    passphrase: &Zeroizing<Vec<u8>>,
    options: &Options,
) -> Result<Found, Error> {
    let f = open(disk, true)?;
    let size = crate::sys::blockdev::size_of(&f, disk)?;
    match header::read(&f, size) {
        Ok(h) if h.label == UNFINISHED => return Ok(Found::Unfinished),
        Ok(_) => return Ok(Found::Luks),
        Err(Error::NotLuks) => {}
        Err(e) => return Err(e),
    }
    blank::check_blank(&f, size)?;
    let made = format::format(size, passphrase, options, &mut OsRandom)?;
    for w in &made.writes {
        let mut bytes = w.bytes.clone();
        if w.offset != format::KEYSLOTS_OFFSET {
            relabel(&mut bytes, UNFINISHED, 1);
        }
        f.write_all_at(&bytes, w.offset)
            .map_err(|e| SysError::new("write", disk.display(), e))?;
    }
    f.sync_all()
        .map_err(|e| SysError::new("fsync", disk.display(), e))?;
    Ok(Found::Formatted)
}

/// Marks the volume on `disk` finished: both binary headers lose the
/// [`UNFINISHED`] label, with their sequence number one higher: the
/// secondary first, so that a crash between the two leaves the secondary
/// newer and finished, which readers (the agent's and cryptsetup's) prefer.
pub fn finish(disk: &Path) -> Result<(), Error> {
    let f = open(disk, false)?;
    let size = crate::sys::blockdev::size_of(&f, disk)?;
    let h = header::read(&f, size)?;
    if h.label != UNFINISHED {
        return Ok(());
    }
    let len = usize::try_from(h.hdr_size).map_err(|_| Error::corrupt("its header size"))?;
    for at in [h.hdr_size, 0] {
        let mut bytes = vec![0u8; len];
        f.read_exact_at(&mut bytes, at)
            .map_err(|e| SysError::new("read", disk.display(), e))?;
        let seqid = u64::from_be_bytes(bytes[SEQID].try_into().unwrap_or_default());
        relabel(&mut bytes, "", seqid.saturating_add(1));
        f.write_all_at(&bytes, at)
            .map_err(|e| SysError::new("write", disk.display(), e))?;
        f.sync_all()
            .map_err(|e| SysError::new("fsync", disk.display(), e))?;
    }
    Ok(())
}

/// Gives a binary header (with its JSON area) `label` and `seqid`, and its
/// checksum again.
fn relabel(h: &mut [u8], label: &str, seqid: u64) {
    h[LABEL].fill(0);
    h[LABEL][..label.len()].copy_from_slice(label.as_bytes());
    h[SEQID].copy_from_slice(&seqid.to_be_bytes());
    h[CSUM].fill(0);
    let sum = Sha256::digest(&*h);
    h[CSUM][..32].copy_from_slice(&sum);
}

/// `disk` opened for reading and writing; exclusively when `exclusive`.
fn open(disk: &Path, exclusive: bool) -> Result<File, Error> {
    let flags = libc::O_CLOEXEC | if exclusive { libc::O_EXCL } else { 0 };
    File::options()
        .read(true)
        .write(true)
        .custom_flags(flags)
        .open(disk)
        .map_err(|e| SysError::new("open", disk.display(), e).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;

    const PASS: &[u8] = b"made in the guest";

    fn pbkdf2() -> Options {
        Options {
            kdf: KdfCost::Pbkdf2Sha256 { iterations: 1000 },
            sector_size: SectorSize::Bytes512,
        }
    }

    fn dump(dev: &Path) -> String {
        crust_testkit::run("cryptsetup", &["luksDump", dev.to_str().unwrap()])
    }

    /// A blank disk is formatted unfinished, found unfinished until it is
    /// finished, then found a LUKS2 volume; cryptsetup opens it at every step.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_blank_disk_is_made_unfinished_then_finished() {
        crust_testkit::needs::loop_devices();
        let d = crust_testkit::LoopDisk::new(40, None);
        let pass = Zeroizing::new(PASS.to_vec());
        assert_eq!(
            format_if_blank(&d.device, &pass, &pbkdf2()).unwrap(),
            Found::Formatted
        );
        assert!(dump(&d.device).contains(UNFINISHED));
        let tmp = tempfile::tempdir().unwrap();
        let key = tmp.path().join("pass");
        std::fs::write(&key, PASS).unwrap();
        let k = key.to_str().unwrap();
        let dev = d.device.to_str().unwrap();
        crust_testkit::run(
            "cryptsetup",
            &["open", "--test-passphrase", "--key-file", k, dev],
        );
        assert_eq!(
            format_if_blank(&d.device, &pass, &pbkdf2()).unwrap(),
            Found::Unfinished
        );
        finish(&d.device).unwrap();
        let said = dump(&d.device);
        assert!(
            !said.contains(UNFINISHED) && said.contains("Epoch:"),
            "{said}"
        );
        crust_testkit::run(
            "cryptsetup",
            &["open", "--test-passphrase", "--key-file", k, dev],
        );
        crust_testkit::run("cryptsetup", &["repair", "-q", dev]);
        assert_eq!(
            format_if_blank(&d.device, &pass, &pbkdf2()).unwrap(),
            Found::Luks
        );
        finish(&d.device).unwrap();
    }

    /// A disk holding anything is refused, named, and left byte for byte.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_disk_that_is_not_blank_is_refused_and_left_as_it_is() {
        crust_testkit::needs::loop_devices_and_mkfs();
        let d = crust_testkit::LoopDisk::new(40, Some("ext4"));
        let before = std::fs::read(&d.device).unwrap();
        let pass = Zeroizing::new(PASS.to_vec());
        let e = format_if_blank(&d.device, &pass, &pbkdf2()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("ext2/3/4"), "{e}");
        assert!(
            std::fs::read(&d.device).unwrap() == before,
            "not a byte written"
        );
    }

    #[test]
    fn a_guests_keyslot_cost_follows_its_memory() {
        let o = guest_options(512 << 20, 2);
        assert_eq!(
            o.kdf,
            KdfCost::Argon2id {
                memory_kib: 64 << 10,
                passes: 4,
                lanes: 2
            }
        );
        let small = guest_options(64 << 20, 16);
        assert_eq!(
            small.kdf,
            KdfCost::Argon2id {
                memory_kib: 32 << 10,
                passes: 4,
                lanes: 4
            }
        );
        let big = guest_options(64 << 30, 1);
        assert!(matches!(big.kdf, KdfCost::Argon2id { memory_kib, .. } if memory_kib == 1 << 20));
    }
}

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
//!
//! A volume with integrity is also labelled in its subsystem field with
//! how far its wipe has gone ([`WIPED`]`<bytes>`, from 0) until every
//! sector of its data has a tag (`wipe`): a publish stopped
//! mid-wipe leaves it there, and the next one goes on from it. Its
//! dm-integrity superblock is written right after the header (the kernel
//! writes it, `made_integrity`); a volume found unfinished with its wipe
//! not begun and no superblock gets one then.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::blank;
pub use super::disk::Disk;
use super::error::Error;
use super::format::{self, KdfCost, Mac, Options, OsRandom, SectorSize};
use super::header::{self, Header};
use super::made_integrity;
use crate::sys::error::SysError;

/// The label of a volume whose making has not finished.
pub const UNFINISHED: &str = "crust-unfinished";
/// The start of the subsystem field of a volume with integrity whose wipe
/// has not finished; the bytes wiped so far follow, in decimal.
pub const WIPED: &str = "crust-wiped:";

/// The label and subsystem fields of a binary header, and its checksum.
const LABEL: std::ops::Range<usize> = 24..72;
const SUBSYSTEM: std::ops::Range<usize> = 208..256;
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
/// cryptsetup chooses); 512-byte sectors, or with `integrity` 4096-byte
/// ones (`--sector-size 4096`: a tag, and a MAC to compute, per 4 KiB
/// instead of per 512 bytes; cryptsetup picks 4096 itself on a disk with
/// 4 KiB physical blocks).
pub fn guest_options(free_bytes: u64, cpus: u32, integrity: Option<Mac>) -> Options {
    let kib = (free_bytes / 8 / 1024).clamp(32 << 10, 1 << 20);
    Options {
        kdf: KdfCost::Argon2id {
            memory_kib: u32::try_from(kib).unwrap_or(1 << 20),
            passes: 4,
            lanes: cpus.clamp(1, 4),
        },
        sector_size: match integrity {
            Some(_) => SectorSize::Bytes4096,
            None => SectorSize::Bytes512,
        },
        integrity,
    }
}

/// Makes `disk` a LUKS2 volume opened by `passphrase` if it is provably
/// blank; a LUKS2 volume already there is left as it is (finished or not:
/// see [`Found`]) if its integrity is the one asked, and refused if not;
/// anything else is refused, and not a byte is written.
pub fn format_if_blank(
    disk: &Disk<'_>,
    passphrase: &Zeroizing<Vec<u8>>,
    options: &Options,
) -> Result<Found, Error> {
    let path = disk.path;
    let f = open(path, true)?;
    let size = crate::sys::blockdev::size_of(&f, path)?;
    match header::read(&f, size) {
        Ok(h) => {
            drop(f);
            return found(disk, &h, options.integrity);
        }
        Err(Error::NotLuks) => {}
        Err(e) => return Err(e),
    }
    blank::check_blank(&f, size)?;
    let made = format::format(size, passphrase, options, &mut OsRandom)?;
    let subsystem = match options.integrity {
        Some(_) => format!("{WIPED}0"),
        None => String::new(),
    };
    for w in &made.writes {
        let mut bytes = w.bytes.clone();
        if w.offset != format::KEYSLOTS_OFFSET {
            relabel(&mut bytes, UNFINISHED, Some(&subsystem), 1);
        }
        f.write_all_at(&bytes, w.offset)
            .map_err(|e| SysError::new("write", path.display(), e))?;
    }
    f.sync_all()
        .map_err(|e| SysError::new("fsync", path.display(), e))?;
    drop(f);
    if options.integrity.is_some() {
        made_integrity::format_superblock(disk, &made.uuid, &made.segment)?;
    }
    Ok(Found::Formatted)
}

/// What a LUKS2 header `h` already on `disk` is to a publish that asks
/// `asked`: refused when its integrity is another; unfinished with its
/// wipe not begun, given the superblock a publish stopped before it.
fn found(disk: &Disk<'_>, h: &Header, asked: Option<Mac>) -> Result<Found, Error> {
    let has = h
        .metadata
        .segments
        .iter()
        .find_map(|(_, s)| s.integrity.as_ref().map(|i| i.kind.clone()));
    if has.as_deref() != asked.map(Mac::kind) {
        return Err(Error::IntegrityDiffers {
            asked: asked.map_or("none".into(), |m| format!("{} ({})", m.flag(), m.kind())),
            has: has.unwrap_or_else(|| "none".into()),
        });
    }
    if h.label != UNFINISHED {
        return Ok(Found::Luks);
    }
    if wiped(h) == Some(0) {
        if let Some((_, seg)) = h.metadata.segments.first() {
            made_integrity::superblock_if_missing(disk, &h.uuid, seg)?;
        }
    }
    Ok(Found::Unfinished)
}

/// How far the wipe of a volume with integrity has gone, from its header's
/// subsystem field; None when no wipe is under way.
pub fn wiped(h: &Header) -> Option<u64> {
    h.subsystem.strip_prefix(WIPED)?.parse().ok()
}

/// Marks the volume on `disk` finished: both binary headers lose the
/// [`UNFINISHED`] label (and the subsystem field a wipe set), with their
/// sequence number one higher: the secondary first, so that a crash
/// between the two leaves the secondary newer and finished, which readers
/// (the agent's and cryptsetup's) prefer.
pub fn finish(disk: &Path) -> Result<(), Error> {
    rewrite(disk, |h| {
        let wiping = h.subsystem.starts_with(WIPED);
        (h.label == UNFINISHED).then(|| ("", wiping.then(String::new)))
    })
}

/// Records in the header of unfinished volume `disk` that its wipe has
/// reached `bytes` (None: that it is done), as [`finish`] writes.
pub fn record_wipe(disk: &Path, bytes: Option<u64>) -> Result<(), Error> {
    rewrite(disk, |h| {
        (h.label == UNFINISHED).then(|| {
            let subsystem = bytes.map_or(String::new(), |b| format!("{WIPED}{b}"));
            (UNFINISHED, Some(subsystem))
        })
    })
}

/// Gives both binary headers of `disk` the label and subsystem (None: as
/// it is) that `change` answers for its header (nothing when None), as
/// [`finish`] says.
fn rewrite(
    disk: &Path,
    change: impl FnOnce(&Header) -> Option<(&'static str, Option<String>)>,
) -> Result<(), Error> {
    let f = open(disk, false)?;
    let size = crate::sys::blockdev::size_of(&f, disk)?;
    let h = header::read(&f, size)?;
    let Some((label, subsystem)) = change(&h) else {
        return Ok(());
    };
    let len = usize::try_from(h.hdr_size).map_err(|_| Error::corrupt("its header size"))?;
    for at in [h.hdr_size, 0] {
        let mut bytes = vec![0u8; len];
        f.read_exact_at(&mut bytes, at)
            .map_err(|e| SysError::new("read", disk.display(), e))?;
        let seqid = u64::from_be_bytes(bytes[SEQID].try_into().unwrap_or_default());
        relabel(
            &mut bytes,
            label,
            subsystem.as_deref(),
            seqid.saturating_add(1),
        );
        f.write_all_at(&bytes, at)
            .map_err(|e| SysError::new("write", disk.display(), e))?;
        f.sync_all()
            .map_err(|e| SysError::new("fsync", disk.display(), e))?;
    }
    Ok(())
}

/// Gives a binary header (with its JSON area) `label`, `subsystem` (None:
/// left as it is) and `seqid`, and its checksum again. The agent's values
/// are far shorter than their 48-byte fields.
fn relabel(h: &mut [u8], label: &str, subsystem: Option<&str>, seqid: u64) {
    h[LABEL].fill(0);
    h[LABEL][..label.len()].copy_from_slice(label.as_bytes());
    if let Some(subsystem) = subsystem {
        h[SUBSYSTEM].fill(0);
        h[SUBSYSTEM][..subsystem.len()].copy_from_slice(subsystem.as_bytes());
    }
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
            integrity: None,
        }
    }

    /// The loop device `dev` as a disk to make a volume on.
    fn on(dev: &Path) -> Disk<'_> {
        use std::os::unix::fs::MetadataExt;
        let rdev = std::fs::metadata(dev).unwrap().rdev();
        Disk {
            path: dev,
            dev: (libc::major(rdev), libc::minor(rdev)),
            name: "crust-made-test",
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
            format_if_blank(&on(&d.device), &pass, &pbkdf2()).unwrap(),
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
            format_if_blank(&on(&d.device), &pass, &pbkdf2()).unwrap(),
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
            format_if_blank(&on(&d.device), &pass, &pbkdf2()).unwrap(),
            Found::Luks
        );
        finish(&d.device).unwrap();
    }

    /// A wipe's progress lives in the subsystem field of an unfinished
    /// volume's headers, cryptsetup shows it, and finishing clears it (a
    /// subsystem of anyone else's stays).
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_wipes_progress_is_recorded_in_the_header_until_finished() {
        crust_testkit::needs::loop_devices();
        let d = crust_testkit::LoopDisk::new(40, None);
        let pass = Zeroizing::new(PASS.to_vec());
        format_if_blank(&on(&d.device), &pass, &pbkdf2()).unwrap();
        let read = || {
            let f = File::open(&d.device).unwrap();
            header::read(&f, crate::sys::blockdev::size_of(&f, &d.device).unwrap()).unwrap()
        };
        assert_eq!(wiped(&read()), None, "no integrity: no wipe");
        record_wipe(&d.device, Some(0)).unwrap();
        assert_eq!(wiped(&read()), Some(0));
        record_wipe(&d.device, Some(7 << 20)).unwrap();
        let h = read();
        assert_eq!((wiped(&h), h.label.as_str()), (Some(7 << 20), UNFINISHED));
        assert!(dump(&d.device).contains("crust-wiped:7340032"));
        record_wipe(&d.device, None).unwrap();
        assert_eq!(wiped(&read()), None);
        record_wipe(&d.device, Some(1)).unwrap();
        finish(&d.device).unwrap();
        let h = read();
        assert_eq!((h.label.as_str(), h.subsystem.as_str()), ("", ""));
        // A finished volume records no wipe, and keeps what it was given.
        record_wipe(&d.device, Some(5)).unwrap();
        assert_eq!(wiped(&read()), None);
        crust_testkit::run("cryptsetup", &["repair", "-q", d.device.to_str().unwrap()]);
    }

    /// A volume already there whose integrity is not the one asked is
    /// refused before anything is read past its header, and left as it is.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_volume_without_the_integrity_asked_is_refused() {
        crust_testkit::needs::loop_devices();
        let d = crust_testkit::LoopDisk::new(40, None);
        let pass = Zeroizing::new(PASS.to_vec());
        format_if_blank(&on(&d.device), &pass, &pbkdf2()).unwrap();
        let before = std::fs::read(&d.device).unwrap();
        let asks = Options {
            integrity: Some(Mac::HmacSha256),
            ..pbkdf2()
        };
        let e = format_if_blank(&on(&d.device), &pass, &asks).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.to_string().starts_with(
                "the disk's LUKS2 volume has integrity none where the request asks hmac-sha256 (hmac(sha256))"
            ),
            "{e}"
        );
        assert!(std::fs::read(&d.device).unwrap() == before);
    }

    /// A disk holding anything is refused, named, and left byte for byte.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_disk_that_is_not_blank_is_refused_and_left_as_it_is() {
        crust_testkit::needs::loop_devices_and_mkfs();
        let d = crust_testkit::LoopDisk::new(40, Some("ext4"));
        let before = std::fs::read(&d.device).unwrap();
        let pass = Zeroizing::new(PASS.to_vec());
        let e = format_if_blank(&on(&d.device), &pass, &pbkdf2()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("ext2/3/4"), "{e}");
        assert!(
            std::fs::read(&d.device).unwrap() == before,
            "not a byte written"
        );
    }

    #[test]
    fn a_guests_keyslot_cost_follows_its_memory() {
        let o = guest_options(512 << 20, 2, None);
        assert_eq!((o.sector_size, o.integrity), (SectorSize::Bytes512, None));
        let i = guest_options(512 << 20, 2, Some(Mac::HmacSha256));
        assert_eq!((i.sector_size, i.kdf), (SectorSize::Bytes4096, o.kdf));
        assert_eq!(
            o.kdf,
            KdfCost::Argon2id {
                memory_kib: 64 << 10,
                passes: 4,
                lanes: 2
            }
        );
        let small = guest_options(64 << 20, 16, None);
        assert_eq!(
            small.kdf,
            KdfCost::Argon2id {
                memory_kib: 32 << 10,
                passes: 4,
                lanes: 4
            }
        );
        let big = guest_options(64 << 30, 1, None);
        assert!(matches!(big.kdf, KdfCost::Argon2id { memory_kib, .. } if memory_kib == 1 << 20));
    }
}

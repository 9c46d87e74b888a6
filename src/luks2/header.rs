//! The two binary headers and the choice between them, as cryptsetup reads
//! them (`LUKS2_disk_hdr_read`): the primary at byte 0, the secondary at the
//! primary's size, or, when the primary is unusable, at each offset a
//! secondary can have. A copy counts only if its magic, version, offset and
//! size are right, its SHA-256 checksum (over the whole header with the
//! checksum field zeroed) matches, and its JSON area reads and checks; of
//! two that count, the higher sequence id wins (the primary on a tie).
//! The size is checked against cryptsetup's nine before anything of that
//! size is read, and against the device.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use sha2::{Digest as _, Sha256};

use super::error::Error;
use super::json;
use super::metadata::{self, Metadata, BINARY_HEADER};
use crate::sys::error::SysError;

/// The primary header's magic.
pub const MAGIC_PRIMARY: &[u8; 6] = b"LUKS\xba\xbe";
/// The secondary header's magic.
pub const MAGIC_SECONDARY: &[u8; 6] = b"SKUL\xba\xbe";

/// The sizes a LUKS2 header (binary header and JSON area) can have, and so
/// the offsets of a secondary header: 16 KiB to 4 MiB in powers of two.
pub const SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];

pub use super::disk::ReadAt;

/// A disk known by its first bytes, zeros after them (the fuzz target's
/// disk, and the tests'): reads past the bytes are zeros, to any offset.
pub struct Head<'a>(pub &'a [u8]);

impl ReadAt for Head<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        buf.fill(0);
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        if let Some(rest) = self.0.get(start..) {
            let n = rest.len().min(buf.len());
            buf[..n].copy_from_slice(&rest[..n]);
        }
        Ok(())
    }
}

/// Reads `len` bytes at `offset`, an error naming what was read.
pub(crate) fn read_bytes(
    disk: &(impl ReadAt + ?Sized),
    offset: u64,
    len: usize,
    what: &str,
) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0; len];
    disk.read_exact_at(&mut buf, offset)
        .map_err(|e| SysError::new("pread", format_args!("{what} at byte {offset}"), e))?;
    Ok(buf)
}

/// Which copy of the header is in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copy {
    Primary,
    Secondary,
}

/// A LUKS2 header as read and checked: the copy chosen, what its binary
/// part says, and its JSON area typed.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    pub copy: Copy,
    /// The header's size (binary header and JSON area).
    pub hdr_size: u64,
    pub seqid: u64,
    pub label: String,
    pub subsystem: String,
    pub uuid: String,
    pub metadata: Metadata,
}

/// What the binary part of one copy says.
struct Binary {
    version: u16,
    hdr_size: u64,
    seqid: u64,
    label: String,
    checksum_alg: String,
    uuid: String,
    subsystem: String,
    offset: u64,
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0; 8];
    x.copy_from_slice(&b[at..][..8]);
    u64::from_be_bytes(x)
}

/// A NUL-padded text field.
fn text(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The layout of `struct luks2_hdr_disk` (big-endian).
fn binary(b: &[u8; 4096]) -> Binary {
    Binary {
        version: u16::from_be_bytes([b[6], b[7]]),
        hdr_size: be64(b, 8),
        seqid: be64(b, 16),
        label: text(&b[24..72]),
        checksum_alg: text(&b[72..104]),
        uuid: text(&b[168..208]),
        subsystem: text(&b[208..256]),
        offset: be64(b, 256),
    }
}

/// Where the checksum lies in the binary header.
const CSUM: std::ops::Range<usize> = 448..512;

/// Reads and checks the header of a device of `device_bytes`.
pub fn read(disk: &(impl ReadAt + ?Sized), device_bytes: u64) -> Result<Header, Error> {
    let first = head(disk, 0, device_bytes)?;
    let primary = match &first {
        Some(b) if b[..6] == *MAGIC_PRIMARY && u16::from_be_bytes([b[6], b[7]]) == 1 => {
            return Err(Error::Luks1)
        }
        Some(b) => one(disk, b, 0, device_bytes)?,
        None => Err("the device is shorter than a header".to_string()),
    };
    let secondary = match &primary {
        Ok(p) => match head(disk, p.hdr_size, device_bytes)? {
            Some(b) => one(disk, &b, p.hdr_size, device_bytes)?,
            None => Err(format!("the device ends before byte {}", p.hdr_size)),
        },
        Err(_) => scan(disk, device_bytes)?,
    };
    match (primary, secondary) {
        (Ok(p), Ok(s)) if s.seqid > p.seqid => Ok(s),
        (Ok(p), _) => Ok(p),
        (Err(_), Ok(s)) => Ok(s),
        (Err(p), Err(s)) => {
            let magic = first.as_ref().is_some_and(|b| b[..6] == *MAGIC_PRIMARY);
            if !magic && s == NO_SECONDARY {
                return Err(Error::NotLuks);
            }
            Err(Error::corrupt(format!(
                "neither copy can be used (the primary: {p}; the secondary: {s})"
            )))
        }
    }
}

const NO_SECONDARY: &str = "no secondary header at any of its offsets";

/// With no usable primary, the first secondary found at an offset a
/// secondary can have that checks.
fn scan(disk: &(impl ReadAt + ?Sized), device_bytes: u64) -> Result<Result<Header, String>, Error> {
    let mut why = NO_SECONDARY.to_string();
    for offset in SIZES {
        let Some(b) = head(disk, offset, device_bytes)? else {
            break;
        };
        if b[..6] != *MAGIC_SECONDARY {
            continue;
        }
        match one(disk, &b, offset, device_bytes)? {
            Ok(h) => return Ok(Ok(h)),
            Err(e) => why = format!("at byte {offset}: {e}"),
        }
    }
    Ok(Err(why))
}

/// The 4 KiB binary header at `offset`, or none past the device's end.
fn head(
    disk: &(impl ReadAt + ?Sized),
    offset: u64,
    device_bytes: u64,
) -> Result<Option<Box<[u8; 4096]>>, Error> {
    if offset
        .checked_add(BINARY_HEADER)
        .is_none_or(|e| e > device_bytes)
    {
        return Ok(None);
    }
    let mut b = Box::new([0u8; 4096]);
    disk.read_exact_at(&mut b[..], offset).map_err(|e| {
        SysError::new(
            "pread",
            format_args!("the LUKS2 header at byte {offset}"),
            e,
        )
    })?;
    Ok(Some(b))
}

/// One copy, whose binary header `b` was read at `offset`: checked, its
/// JSON area read, checksummed, parsed and checked. A failed read is an
/// error; the inner error is why this copy does not count.
fn one(
    disk: &(impl ReadAt + ?Sized),
    b: &[u8; 4096],
    offset: u64,
    device_bytes: u64,
) -> Result<Result<Header, String>, Error> {
    let bin = match check_binary(b, offset, device_bytes) {
        Ok(bin) => bin,
        Err(why) => return Ok(Err(why)),
    };
    // hdr_size is one of SIZES: at most 4 MiB.
    let json_len = usize::try_from(bin.hdr_size.saturating_sub(BINARY_HEADER)).unwrap_or(0);
    let at = offset.saturating_add(BINARY_HEADER);
    let area = read_bytes(disk, at, json_len, "the LUKS2 JSON area")?;
    Ok(finish(b, bin, &area, device_bytes))
}

/// What the binary header `b`, read at `offset`, says, if it can be one.
fn check_binary(b: &[u8; 4096], offset: u64, device_bytes: u64) -> Result<Binary, String> {
    let secondary = offset != 0;
    let magic = if secondary {
        MAGIC_SECONDARY
    } else {
        MAGIC_PRIMARY
    };
    if b[..6] != *magic {
        return Err("no LUKS2 magic".into());
    }
    let bin = binary(b);
    if bin.version != 2 {
        return Err(format!("version {}, not 2", bin.version));
    }
    if bin.offset != offset {
        return Err(format!(
            "it says it lies at byte {}, not {offset}",
            bin.offset
        ));
    }
    if !SIZES.contains(&bin.hdr_size) {
        return Err(format!(
            "a size of {} bytes, not one of 16 KiB, 32 KiB, … 4 MiB",
            bin.hdr_size
        ));
    }
    if secondary && bin.hdr_size != offset {
        return Err(format!(
            "a size of {} bytes, yet it lies at byte {offset}",
            bin.hdr_size
        ));
    }
    if offset.saturating_add(bin.hdr_size) > device_bytes {
        return Err(format!(
            "a size of {} bytes, past the device's end",
            bin.hdr_size
        ));
    }
    if bin.checksum_alg != "sha256" {
        return Err(format!(
            "checksum algorithm {:?}, not sha256",
            bin.checksum_alg
        ));
    }
    Ok(bin)
}

/// The copy whose binary header `b` says `bin` and whose JSON area is `area`.
fn finish(b: &[u8; 4096], bin: Binary, area: &[u8], device_bytes: u64) -> Result<Header, String> {
    let mut zeroed = *b;
    zeroed[CSUM].fill(0);
    let sum = Sha256::new()
        .chain_update(zeroed)
        .chain_update(area)
        .finalize();
    if b[CSUM][..32] != sum[..] {
        return Err("a checksum that does not match".into());
    }
    let Some(nul) = area.iter().position(|&c| c == 0) else {
        return Err("a JSON area with no NUL: the JSON runs over its area".into());
    };
    let root = json::parse(&area[..nul])?;
    let metadata = metadata::read(&root, bin.hdr_size, device_bytes)?;
    Ok(Header {
        copy: if bin.offset != 0 {
            Copy::Secondary
        } else {
            Copy::Primary
        },
        hdr_size: bin.hdr_size,
        seqid: bin.seqid,
        label: bin.label,
        subsystem: bin.subsystem,
        uuid: bin.uuid,
        metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::luks2::fixture::{image, json, rechecksum, write_copy, DEVICE};

    fn refused(img: &[u8]) -> String {
        match read(&Head(img), DEVICE) {
            Err(Error::Corrupt { what }) => what,
            other => panic!("not refused as corrupt: {other:?}"),
        }
    }

    #[test]
    fn both_good_copies_read_and_the_higher_seqid_wins() {
        let j = json(|s| s);
        let h = read(&Head(&image(&j)), DEVICE).unwrap();
        assert_eq!((h.copy, h.seqid, h.hdr_size), (Copy::Primary, 3, 16384));
        assert_eq!(h.uuid, "1bf7a5b2-0000-4000-8000-000000000000");
        let mut img = image(&j);
        write_copy(&mut img, 16384, 16384, 4, &j);
        assert_eq!(read(&Head(&img), DEVICE).unwrap().copy, Copy::Secondary);
        write_copy(&mut img, 0, 16384, 5, &j);
        assert_eq!(read(&Head(&img), DEVICE).unwrap().copy, Copy::Primary);
    }

    #[test]
    fn a_checksum_mismatch_gives_way_to_the_other_copy() {
        let mut img = image(&json(|s| s));
        img[4096 + 3] ^= 1;
        assert_eq!(read(&Head(&img), DEVICE).unwrap().copy, Copy::Secondary);
        // Primary bad: a secondary is found at whatever size it has.
        let j = json(|s| {
            s.replace("\"json_size\":\"12288\"", "\"json_size\":\"61440\"")
                .replace(
                    "\"keyslots_size\":\"16744448\"",
                    "\"keyslots_size\":\"16646144\"",
                )
                .replace("\"offset\":\"32768\"", "\"offset\":\"131072\"")
        });
        let mut img = Vec::new();
        write_copy(&mut img, 65536, 65536, 9, &j);
        img[..6].copy_from_slice(MAGIC_PRIMARY);
        let h = read(&Head(&img), DEVICE).unwrap();
        assert_eq!((h.copy, h.hdr_size, h.seqid), (Copy::Secondary, 65536, 9));
        // Secondary bad, primary good.
        let mut img = image(&json(|s| s));
        img[16384 + 4096 + 3] ^= 1;
        assert_eq!(read(&Head(&img), DEVICE).unwrap().copy, Copy::Primary);
    }

    #[test]
    fn both_copies_bad_is_refused_naming_each() {
        let mut img = image(&json(|s| s));
        img[4096 + 3] ^= 1;
        img[16384 + 4096 + 3] ^= 1;
        let what = refused(&img);
        assert!(
            what.contains("the primary: a checksum that does not match"),
            "{what}"
        );
        assert!(
            what.contains("the secondary: at byte 16384: a checksum"),
            "{what}"
        );
        let e = read(&Head(&img), DEVICE).unwrap_err();
        assert_eq!(e.code(), crate::code::Code::FailedPrecondition);
    }

    #[test]
    fn not_luks_and_luks1_are_told_apart() {
        let zeros = vec![0u8; 1 << 20];
        assert!(matches!(read(&zeros[..], 1 << 20), Err(Error::NotLuks)));
        let mut v1 = zeros.clone();
        v1[..6].copy_from_slice(MAGIC_PRIMARY);
        v1[7] = 1;
        let e = read(&v1[..], 1 << 20).unwrap_err();
        assert!(matches!(e, Error::Luks1), "{e}");
        assert!(matches!(read(&[0u8; 100][..], 100), Err(Error::NotLuks)));
    }

    #[test]
    fn sizes_are_checked_before_anything_of_that_size_is_read() {
        // A size outside cryptsetup's set, in both copies (checksums right).
        for size in [0u64, 4096, 20480, 8 << 20, u64::MAX] {
            let mut img = image(&json(|s| s));
            for at in [0usize, 16384] {
                img[at + 8..at + 16].copy_from_slice(&size.to_be_bytes());
                img[at + 448..at + 512].fill(0);
                let sum = Sha256::digest(&img[at..at + 16384]);
                img[at + 448..at + 480].copy_from_slice(&sum);
            }
            let what = refused(&img);
            assert!(what.contains(&format!("a size of {size} bytes")), "{what}");
        }
        // A size past the device: the device is too short to hold it.
        let img = image(&json(|s| s));
        assert!(read(&Head(&img), 20000).is_err());
        // An offset field that lies.
        let mut img = image(&json(|s| s));
        img[256 + 7] = 1;
        rechecksum(&mut img, 0, 16384);
        assert_eq!(read(&Head(&img), DEVICE).unwrap().copy, Copy::Secondary);
    }

    #[test]
    fn json_over_its_area_is_refused() {
        let long = json(|s| {
            s.replace(
                "\"tokens\":{}",
                &format!("\"tokens\":{{\"0\":{{\"x\":\"{}\"}}}}", "a".repeat(12288)),
            )
        });
        let mut img = image(&json(|s| s));
        for at in [0usize, 16384] {
            img[at + 4096..at + 16384].copy_from_slice(&long[..12288]);
            rechecksum(&mut img, at as u64, 16384);
        }
        let what = refused(&img);
        assert!(what.contains("runs over its area"), "{what}");
    }

    #[test]
    fn checksum_algorithms_other_than_sha256_are_refused() {
        let mut img = image(&json(|s| s));
        for at in [0usize, 16384] {
            img[at + 72..at + 78].copy_from_slice(b"sha512");
            rechecksum(&mut img, at as u64, 16384);
        }
        assert!(refused(&img).contains("checksum algorithm \"sha512\""));
    }
}

//! A new LUKS2 volume, laid out as `cryptsetup luksFormat --type luks2
//! --cipher aes-xts-plain64 --key-size 512` lays it out (cryptsetup 2.6's
//! defaults): two 16 KiB headers (the primary at 0, the secondary at
//! 16 KiB), keyslot 0's area at 32 KiB, the data from 16 MiB. With
//! integrity ([`Mac`]), as `luksFormat --integrity hmac-sha256` lays it
//! out: the same places, a 768-bit volume key (the 512-bit XTS key, then
//! the 256-bit HMAC key), a keyslot of `key_size` 96 whose area (376 KiB)
//! is still encrypted with a 512-bit aes-xts-plain64 key, and a segment
//! that names its integrity with no journal key; the dm-integrity
//! superblock at the data's start is the kernel's to write
//! (`made_integrity`). Pure: the
//! caller gives the device's size, the passphrase, the keyslot's KDF and
//! a source of random bytes, and gets the volume key, the data segment
//! and the bytes to write where. Nothing here touches a disk; the caller
//! writes only a disk it has proved blank (`blank`).
//!
//! The KDF's cost is the caller's to choose and bound (Argon2's memory by
//! what the guest has): it is held only to cryptsetup's own bounds, so that
//! what is made is a volume cryptsetup could have made, and the caller's
//! unlock [`Limits`](super::unlock::Limits) must admit it for the agent to
//! open it again.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use aes::cipher::KeyInit;
use aes::Aes256;
use sha2::{Digest as _, Sha256};
use xts_mode::{get_tweak_default, Xts128};
use zeroize::Zeroizing;

use super::error::Error;
use super::json::base64_encode;
use super::kdf::{self, Argon2Cost, Hash};
use super::metadata::{Integrity, Segment};
use super::unlock::VolumeKey;
use crate::sys::error::SysError;

/// Each header's size, binary header and JSON area (cryptsetup's default).
pub const HEADER_BYTES: u64 = HEADER_LEN as u64;
const HEADER_LEN: usize = 16384;
/// The JSON area's size: the header's less its 4 KiB binary part.
pub const JSON_BYTES: u64 = 12288;
/// Where the keyslots area, and keyslot 0's area, start: after both headers.
pub const KEYSLOTS_OFFSET: u64 = 32768;
/// Where the data starts (cryptsetup's default alignment, 16 MiB).
pub const DATA_OFFSET: u64 = 16 << 20;
/// The keyslots area: from both headers' end to the data.
pub const KEYSLOTS_BYTES: u64 = 16_744_448;
/// The volume key's size without integrity, and the keyslot area's key's
/// always: aes-xts-plain64 with two AES-256 keys.
pub const KEY_BYTES: usize = 64;
/// The AF splitter's stripes (cryptsetup's, and LUKS1's).
pub const STRIPES: u32 = 4000;
/// With integrity, the least the disk holds after its header: room for
/// dm-integrity's superblock, journal and tags besides the data (the
/// kernel refuses a device too small for them; this bound keeps the
/// refusal ours, before anything is written).
pub const INTEGRITY_MIN_DATA: u64 = 4 << 20;

/// The MAC a new volume's integrity is made with: what `luksFormat
/// --integrity` takes, of those the agent makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mac {
    /// `hmac-sha256`: HMAC-SHA-256 over each sector, a 32-byte tag.
    HmacSha256,
}

impl Mac {
    /// Every MAC the agent makes.
    pub const ALL: &'static [Mac] = &[Mac::HmacSha256];

    /// As a request and cryptsetup's `--integrity` name it.
    pub fn flag(self) -> &'static str {
        match self {
            Mac::HmacSha256 => "hmac-sha256",
        }
    }

    /// As the header and the kernel's crypto API name it.
    pub fn kind(self) -> &'static str {
        match self {
            Mac::HmacSha256 => "hmac(sha256)",
        }
    }

    /// The MAC named `flag` (`hmac-sha256`), if the agent makes it.
    pub fn from_flag(flag: &str) -> Option<Mac> {
        Mac::ALL.iter().copied().find(|m| m.flag() == flag)
    }

    /// Its key's bytes, which follow the XTS key in the volume key.
    fn key_bytes(self) -> usize {
        match self {
            Mac::HmacSha256 => 32,
        }
    }
}

/// The volume key's bytes for a volume made with `integrity`.
pub fn volume_key_bytes(integrity: Option<Mac>) -> usize {
    KEY_BYTES.saturating_add(integrity.map_or(0, Mac::key_bytes))
}

/// Keyslot 0's area for a volume key of `key_bytes`: the split key (key
/// size × [`STRIPES`], whole sectors) rounded up to 4 KiB, as cryptsetup's
/// `get_area_size` does: 258,048 bytes for 64, 385,024 for 96.
pub fn area_bytes(key_bytes: usize) -> usize {
    key_bytes
        .saturating_mul(STRIPES as usize)
        .div_ceil(4096)
        .saturating_mul(4096)
}
/// The digest's PBKDF2-SHA256 iterations: cryptsetup's floor
/// (LUKS_MKD_ITERATIONS_MIN). It benchmarks for 125 ms above it, but the
/// digest checks a random 512-bit key, which no count of iterations makes
/// harder to guess; every unlock pays it once per keyslot tried.
pub const DIGEST_ITERATIONS: u32 = 1000;
/// Salts of the keyslot's KDF and the digest (cryptsetup's LUKS_SALTSIZE).
const SALT_BYTES: usize = 32;
/// The salt in each binary header.
const HEADER_SALT_BYTES: usize = 64;
/// Where the binary header's checksum lies.
const CSUM: std::ops::Range<usize> = 448..512;

/// How keyslot 0's key comes from the passphrase, at the caller's cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdfCost {
    /// Argon2id (cryptsetup's default for LUKS2).
    Argon2id {
        /// KiB: 32 to 4 GiB (4,194,304).
        memory_kib: u32,
        /// Passes: 4 or more.
        passes: u32,
        /// Lanes: 1 to 4. The agent runs them one after another.
        lanes: u32,
    },
    /// PBKDF2-HMAC-SHA256.
    Pbkdf2Sha256 {
        /// 1000 or more.
        iterations: u32,
    },
}

impl KdfCost {
    /// Refused unless cryptsetup would make a keyslot at this cost
    /// (`crypt_pbkdf_get_limits`).
    fn check(self) -> Result<(), Error> {
        let refuse = |what: String, bounds| Err(Error::FormatCost { what, bounds });
        match self {
            KdfCost::Argon2id {
                memory_kib,
                passes,
                lanes,
            } => {
                const BOUNDS: &str =
                    "Argon2 keyslots with 32 to 4194304 KiB of memory, 4 passes or more, and 1 to 4 lanes";
                if !(32..=4_194_304).contains(&memory_kib) {
                    return refuse(format!("Argon2 memory of {memory_kib} KiB"), BOUNDS);
                }
                if passes < 4 {
                    return refuse(format!("{passes} Argon2 passes"), BOUNDS);
                }
                if !(1..=4).contains(&lanes) {
                    return refuse(format!("{lanes} Argon2 lanes"), BOUNDS);
                }
            }
            KdfCost::Pbkdf2Sha256 { iterations } => {
                if iterations < 1000 {
                    return refuse(
                        format!("{iterations} PBKDF2 iterations"),
                        "PBKDF2 keyslots with 1000 iterations or more",
                    );
                }
            }
        }
        Ok(())
    }
}

/// The data segment's sector size: what dm-crypt encrypts as one unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SectorSize {
    /// 512 bytes: any disk.
    #[default]
    Bytes512,
    /// 4096 bytes: faster on disks with 4 KiB blocks, for a disk whose size
    /// after the header is a multiple of 4 KiB.
    Bytes4096,
}

impl SectorSize {
    /// In bytes.
    pub fn bytes(self) -> u32 {
        match self {
            SectorSize::Bytes512 => 512,
            SectorSize::Bytes4096 => 4096,
        }
    }
}

/// What the new volume is made with besides its passphrase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Keyslot 0's KDF and its cost.
    pub kdf: KdfCost,
    /// The data segment's sector size.
    pub sector_size: SectorSize,
    /// The data segment's integrity, if any.
    pub integrity: Option<Mac>,
}

/// Where random bytes come from: the kernel in the agent, a fixed stream in tests.
pub trait Random {
    /// Fills `buf`, or fails.
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), Error>;
}

/// The kernel's random source (getrandom(2), which waits until the pool is
/// initialised, as cryptsetup's does).
pub struct OsRandom;

impl Random for OsRandom {
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), Error> {
        let mut done = 0;
        while let Some(rest) = buf.get_mut(done..).filter(|r| !r.is_empty()) {
            match rustix::rand::getrandom(rest, rustix::rand::GetRandomFlags::empty()) {
                Ok(n) => done = done.saturating_add(n),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    return Err(SysError::new("getrandom", "random bytes for LUKS2", e).into())
                }
            }
        }
        Ok(())
    }
}

/// Bytes to write at an offset of the device.
#[derive(Clone, PartialEq, Eq)]
pub struct Write {
    /// Bytes from the device's start.
    pub offset: u64,
    /// What goes there (no key material: a header, or an encrypted area).
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Write({} bytes at {})", self.bytes.len(), self.offset)
    }
}

/// A new volume: its key, its data segment, and what to write.
#[derive(Debug)]
pub struct Formatted {
    /// The volume key (random), zeroed when dropped.
    pub volume_key: VolumeKey,
    /// The data segment, as [`unlock`](super::unlock::unlock) would answer
    /// it: for the dm-crypt table.
    pub segment: Segment,
    /// The header's uuid (random, version 4), which names the mapping.
    pub uuid: String,
    /// In this order: keyslot 0's area, the secondary header, the primary.
    /// A disk reads as LUKS only once its keyslot is whole. The rest of the
    /// keyslots area is left as it is: cryptsetup fills it with random bytes
    /// so that unused keyslot areas look like used ones, which hides nothing
    /// when the JSON says there is one keyslot.
    pub writes: Vec<Write>,
}

/// A new LUKS2 volume on a device of `device_bytes`, opened by
/// `passphrase`, made with `options` and the bytes of `random`. Refused,
/// before any work, on a device too small or not a whole number of
/// sectors, or at a KDF cost cryptsetup would not make.
pub fn format(
    device_bytes: u64,
    passphrase: &Zeroizing<Vec<u8>>,
    options: &Options,
    random: &mut dyn Random,
) -> Result<Formatted, Error> {
    let sector_size = options.sector_size.bytes();
    check_device(device_bytes, sector_size, options.integrity)?;
    options.kdf.check()?;
    let mut volume_key = Zeroizing::new(vec![0u8; volume_key_bytes(options.integrity)]);
    random.fill(&mut volume_key)?;
    let keyslot_salt = random_bytes(random, SALT_BYTES)?;
    let area = keyslot_area(passphrase, &volume_key, options.kdf, &keyslot_salt, random)?;
    let digest_salt = random_bytes(random, SALT_BYTES)?;
    let mut digest = [0u8; 32];
    Hash::Sha256.pbkdf2(&volume_key, &digest_salt, DIGEST_ITERATIONS, &mut digest);
    let uuid = uuid_v4(random)?;
    let json = json_area(&Json {
        kdf: options.kdf,
        keyslot_salt: &keyslot_salt,
        digest_salt: &digest_salt,
        digest: &digest,
        sector_size,
        integrity: options.integrity,
    });
    let secondary = binary_header(HEADER_BYTES, &uuid, &json, random)?;
    let primary = binary_header(0, &uuid, &json, random)?;
    Ok(Formatted {
        volume_key: VolumeKey::new(volume_key),
        segment: Segment {
            kind: "crypt".into(),
            offset: DATA_OFFSET,
            size: None,
            iv_tweak: 0,
            encryption: "aes-xts-plain64".into(),
            sector_size,
            integrity: options.integrity.map(|m| Integrity {
                kind: m.kind().into(),
                journal_encryption: "none".into(),
                journal_integrity: "none".into(),
            }),
            flags: Vec::new(),
        },
        uuid,
        writes: vec![
            Write {
                offset: KEYSLOTS_OFFSET,
                bytes: area,
            },
            Write {
                offset: HEADER_BYTES,
                bytes: secondary,
            },
            Write {
                offset: 0,
                bytes: primary,
            },
        ],
    })
}

/// Refused unless the device holds the metadata and at least one data
/// sector after it, in whole sectors; with integrity, at least
/// [`INTEGRITY_MIN_DATA`] after it, in any size (dm-integrity provides
/// whole blocks of what it has, as cryptsetup leaves it to).
fn check_device(device_bytes: u64, sector_size: u32, integrity: Option<Mac>) -> Result<(), Error> {
    let (data, what) = match integrity {
        Some(_) => (
            INTEGRITY_MIN_DATA,
            format!(
                "{} MiB (dm-integrity's journal and tags)",
                INTEGRITY_MIN_DATA >> 20
            ),
        ),
        None => (sector_size.into(), format!("one {sector_size}-byte sector")),
    };
    let needs = DATA_OFFSET.saturating_add(data);
    if device_bytes < needs {
        return Err(Error::TooSmall {
            device_bytes,
            data: what,
            needs,
        });
    }
    if integrity.is_none() && !device_bytes.is_multiple_of(sector_size.into()) {
        return Err(Error::Misaligned {
            device_bytes,
            sector_size,
        });
    }
    Ok(())
}

fn random_bytes(random: &mut dyn Random, len: usize) -> Result<Vec<u8>, Error> {
    let mut b = vec![0u8; len];
    random.fill(&mut b)?;
    Ok(b)
}

/// Keyslot 0's area: the volume key AF-split over [`STRIPES`] (random
/// stripes but the last), encrypted with aes-xts-plain64 under the
/// [`KEY_BYTES`] key the KDF derives from the passphrase (512-byte sectors
/// numbered from the area's start, as the unlock decrypts it), then random
/// bytes to the area's end.
fn keyslot_area(
    passphrase: &[u8],
    volume_key: &[u8],
    kdf: KdfCost,
    salt: &[u8],
    random: &mut dyn Random,
) -> Result<Vec<u8>, Error> {
    let mut area_key = Zeroizing::new(vec![0u8; KEY_BYTES]);
    match kdf {
        KdfCost::Argon2id {
            memory_kib,
            passes,
            lanes,
        } => {
            let cost = Argon2Cost {
                id: true,
                time: passes,
                memory_kib,
                cpus: lanes,
            };
            kdf::argon2(&cost, passphrase, salt, &mut area_key, 0)?;
        }
        KdfCost::Pbkdf2Sha256 { iterations } => {
            Hash::Sha256.pbkdf2(passphrase, salt, iterations, &mut area_key);
        }
    }
    // Whole 512-byte sectors: key sizes are multiples of 32 bytes.
    let mut split = Zeroizing::new(vec![0u8; volume_key.len().saturating_mul(STRIPES as usize)]);
    random.fill(&mut split)?;
    Hash::Sha256.af_split(volume_key, &mut split);
    let (k1, k2) = area_key.split_at(KEY_BYTES / 2);
    let (Ok(a), Ok(b)) = (Aes256::new_from_slice(k1), Aes256::new_from_slice(k2)) else {
        unreachable!("two halves of a 64-byte key are AES-256 keys");
    };
    Xts128::new(a, b).encrypt_area(&mut split, 512, 0, get_tweak_default);
    let mut area = vec![0u8; area_bytes(volume_key.len())];
    let (head, tail) = area.split_at_mut(split.len());
    head.copy_from_slice(&split);
    random.fill(tail)?;
    Ok(area)
}

/// A version 4 uuid from 16 random bytes, lowercase, as libuuid writes it.
fn uuid_v4(random: &mut dyn Random) -> Result<String, Error> {
    let mut b = [0u8; 16];
    random.fill(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok([
        hex[..4].concat(),
        hex[4..6].concat(),
        hex[6..8].concat(),
        hex[8..10].concat(),
        hex[10..].concat(),
    ]
    .join("-"))
}

/// What the JSON area says beyond the layout's constants.
struct Json<'a> {
    kdf: KdfCost,
    keyslot_salt: &'a [u8],
    digest_salt: &'a [u8],
    digest: &'a [u8],
    sector_size: u32,
    integrity: Option<Mac>,
}

/// The JSON area's text, member for member as cryptsetup writes it: sizes
/// and offsets as decimal strings, salts and the digest in base64; with
/// integrity, the keyslot's key is the volume key's size while its area's
/// stays [`KEY_BYTES`] (cryptsetup's `crypt_keyslot_get_encryption`: a
/// cipher with tags does not encrypt a keyslot).
fn json_area(j: &Json<'_>) -> String {
    let kdf = match j.kdf {
        KdfCost::Argon2id {
            memory_kib,
            passes,
            lanes,
        } => format!(
            r#"{{"type":"argon2id","time":{passes},"memory":{memory_kib},"cpus":{lanes},"salt":"{}"}}"#,
            base64_encode(j.keyslot_salt)
        ),
        KdfCost::Pbkdf2Sha256 { iterations } => format!(
            r#"{{"type":"pbkdf2","hash":"sha256","iterations":{iterations},"salt":"{}"}}"#,
            base64_encode(j.keyslot_salt)
        ),
    };
    format!(
        concat!(
            r#"{{"keyslots":{{"0":{{"type":"luks2","key_size":{volume_key},"af":{{"type":"luks1","stripes":{stripes},"hash":"sha256"}},"#,
            r#""area":{{"type":"raw","offset":"{area_offset}","size":"{area_size}","encryption":"aes-xts-plain64","key_size":{key}}},"#,
            r#""kdf":{kdf}}}}},"tokens":{{}},"#,
            r#""segments":{{"0":{{"type":"crypt","offset":"{data}","size":"dynamic","iv_tweak":"0","encryption":"aes-xts-plain64","sector_size":{sector}{integrity}}}}},"#,
            r#""digests":{{"0":{{"type":"pbkdf2","keyslots":["0"],"segments":["0"],"hash":"sha256","iterations":{iterations},"salt":"{salt}","digest":"{digest}"}}}},"#,
            r#""config":{{"json_size":"{json}","keyslots_size":"{keyslots}"}}}}"#
        ),
        volume_key = volume_key_bytes(j.integrity),
        key = KEY_BYTES,
        stripes = STRIPES,
        area_offset = KEYSLOTS_OFFSET,
        area_size = area_bytes(volume_key_bytes(j.integrity)),
        kdf = kdf,
        data = DATA_OFFSET,
        sector = j.sector_size,
        integrity = j.integrity.map_or(String::new(), |m| format!(
            r#","integrity":{{"type":"{}","journal_encryption":"none","journal_integrity":"none"}}"#,
            m.kind()
        )),
        iterations = DIGEST_ITERATIONS,
        salt = base64_encode(j.digest_salt),
        digest = base64_encode(j.digest),
        json = JSON_BYTES,
        keyslots = KEYSLOTS_BYTES,
    )
}

/// One copy of the header at `offset` (0 the primary, [`HEADER_BYTES`] the
/// secondary): the binary header (`struct luks2_hdr_disk`, big-endian) with
/// a random salt of its own, `json` NUL-padded to the area, and the
/// SHA-256 checksum over both with the checksum field zeroed.
fn binary_header(
    offset: u64,
    uuid: &str,
    json: &str,
    random: &mut dyn Random,
) -> Result<Vec<u8>, Error> {
    // The JSON text is about 1 KiB, a fraction of its 12 KiB area, whatever
    // the options (numbers and fixed-length salts); the uuid is 36 bytes of
    // its field's 40.
    let mut h = vec![0u8; HEADER_LEN];
    h[..6].copy_from_slice(if offset == 0 {
        b"LUKS\xba\xbe"
    } else {
        b"SKUL\xba\xbe"
    });
    h[6..8].copy_from_slice(&2u16.to_be_bytes());
    h[8..16].copy_from_slice(&HEADER_BYTES.to_be_bytes());
    // seqid: the first version of this header.
    h[16..24].copy_from_slice(&1u64.to_be_bytes());
    h[72..78].copy_from_slice(b"sha256");
    random.fill(&mut h[104..104 + HEADER_SALT_BYTES])?;
    h[168..][..uuid.len()].copy_from_slice(uuid.as_bytes());
    h[256..264].copy_from_slice(&offset.to_be_bytes());
    h[4096..][..json.len()].copy_from_slice(json.as_bytes());
    let sum = Sha256::digest(&h);
    h[CSUM][..32].copy_from_slice(&sum);
    Ok(h)
}

#[cfg(test)]
#[path = "format_tests.rs"]
mod tests;

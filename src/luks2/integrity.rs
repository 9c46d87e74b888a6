//! A LUKS2 data segment with integrity, as cryptsetup 2.6 opens one: a
//! dm-integrity device (`<name>_dif`) over the segment, which keeps a tag
//! per sector and whose superblock `luksFormat --integrity` wrote, then the
//! dm-crypt mapping over it with an AEAD cipher that writes and checks the
//! tags. The whole volume key goes to dm-crypt: for
//! `authenc(hmac(sha256),xts(aes))` it is the XTS key then the HMAC key,
//! which dm-crypt splits itself; dm-integrity holds no key.
//!
//! What is opened: `hmac(sha256)` and `hmac(sha512)` over `aes-xts-plain64`
//! or `aes-xts-random`, and `aead` over `aes-gcm-random`, without a
//! journal key. Anything else is refused by name.

use super::error::Error;
use super::header::ReadAt;
use super::metadata::{Integrity, Segment};
use crate::sys::dm_integrity::{self, Mode, Superblock, SUPERBLOCK_LEN};
use crate::sys::kmsg::Record;

/// What dm-crypt is given for a segment with integrity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Aead {
    /// The kernel crypto API's cipher, e.g. `capi:authenc(hmac(sha256),xts(aes))-plain64`.
    pub cipher: String,
    /// Bytes of tag per sector: the random IV's bytes and the MAC's.
    pub tag: u16,
}

/// The integrity kinds the agent opens, with their MAC key and tag bytes
/// (cryptsetup's `INTEGRITY_key_size` and `INTEGRITY_tag_size`).
const MACS: &[(&str, usize, u16)] = &[("hmac(sha256)", 32, 32), ("hmac(sha512)", 64, 64)];

/// dm-crypt's cipher and tag size for `segment`, whose volume key is
/// `key_len` bytes; refused, by name, for any kind, cipher or key size the
/// agent does not open.
pub fn aead(segment: &Segment, key_len: usize) -> Result<Aead, Error> {
    let Some(i) = &segment.integrity else {
        return Err(Error::corrupt("the segment has no integrity"));
    };
    check_journal(i)?;
    let enc = segment.encryption.as_str();
    let bad_key = |enc_len: usize| Error::IntegrityUnsupported {
        what: format!(
            "{:?} over {enc:?} with a {}-bit volume key ({}-bit cipher key)",
            i.kind,
            key_len.saturating_mul(8),
            enc_len.saturating_mul(8)
        ),
    };
    if i.kind == "aead" {
        if enc != "aes-gcm-random" {
            return Err(Error::IntegrityUnsupported {
                what: format!("\"aead\" over {enc:?}"),
            });
        }
        if ![16, 24, 32].contains(&key_len) {
            return Err(bad_key(key_len));
        }
        return Ok(Aead {
            cipher: "capi:gcm(aes)-random".into(),
            tag: 12 + 16,
        });
    }
    let Some(&(_, mac_key, mac_tag)) = MACS.iter().find(|(k, ..)| *k == i.kind) else {
        return Err(Error::IntegrityUnsupported {
            what: format!("{:?}", i.kind),
        });
    };
    let iv_tag = match enc {
        "aes-xts-plain64" => 0,
        "aes-xts-random" => 16,
        _ => {
            return Err(Error::IntegrityUnsupported {
                what: format!("{:?} over {enc:?}", i.kind),
            })
        }
    };
    let enc_len = key_len.saturating_sub(mac_key);
    if ![32, 64].contains(&enc_len) {
        return Err(bad_key(enc_len));
    }
    let iv = enc.rsplit('-').next().unwrap_or("plain64");
    Ok(Aead {
        cipher: format!("capi:authenc({},xts(aes))-{iv}", i.kind),
        tag: iv_tag + mac_tag,
    })
}

/// A journal with its own encryption or MAC needs keys LUKS2 does not keep.
fn check_journal(i: &Integrity) -> Result<(), Error> {
    for (what, value) in [
        ("journal encryption", &i.journal_encryption),
        ("journal integrity", &i.journal_integrity),
    ] {
        if value != "none" {
            return Err(Error::IntegrityUnsupported {
                what: format!("with {what} {value:?}"),
            });
        }
    }
    Ok(())
}

/// The journal mode cryptsetup opens with: no journal when the header's
/// persistent flags say `no-journal`.
pub fn mode(config_flags: &[String]) -> Mode {
    if config_flags.iter().any(|f| f == "no-journal") {
        Mode::Direct
    } else {
        Mode::Journal
    }
}

/// Reads and checks the dm-integrity superblock at the start of
/// `segment` on `disk` (of `disk_bytes`): its tags must be `aead.tag`
/// bytes, its blocks the segment's sectors, and what it provides must lie
/// on the disk. The sectors it provides: both mappings' length.
pub fn superblock(
    disk: &(impl ReadAt + ?Sized),
    disk_bytes: u64,
    segment: &Segment,
    aead: &Aead,
) -> Result<Superblock, Error> {
    let mut buf = [0u8; SUPERBLOCK_LEN];
    disk.read_exact_at(&mut buf, segment.offset).map_err(|e| {
        Error::corrupt(format!(
            "its dm-integrity superblock at byte {} cannot be read ({e})",
            segment.offset
        ))
    })?;
    let Some(sb) = Superblock::parse(&buf) else {
        return Err(Error::corrupt(format!(
            "its data segment has integrity but no dm-integrity superblock at byte {} (was it formatted by cryptsetup luksFormat --integrity, and not wiped since?)",
            segment.offset
        )));
    };
    if sb.tag_size != aead.tag {
        return Err(Error::corrupt(format!(
            "its dm-integrity superblock keeps {}-byte tags where {} needs {}",
            sb.tag_size, aead.cipher, aead.tag
        )));
    }
    if sb.block_bytes() != Some(segment.sector_size) {
        return Err(Error::corrupt(format!(
            "its dm-integrity superblock has blocks of 2^{} sectors where the segment has {}-byte sectors",
            sb.log2_sectors_per_block, segment.sector_size
        )));
    }
    let room = disk_bytes.saturating_sub(segment.offset) / 512;
    let unit = u64::from(segment.sector_size / 512);
    let provided = sb.provided_data_sectors;
    if provided == 0 || provided >= room || provided % unit.max(1) != 0 {
        return Err(Error::corrupt(format!(
            "its dm-integrity superblock provides {provided} sectors, which do not fit in whole {}-byte sectors below the {room} sectors after byte {}",
            segment.sector_size, segment.offset
        )));
    }
    Ok(sb)
}

/// How many sectors of a mapping with integrity were refused as tampered
/// since the kernel log's record `from`: dm-crypt's reports of a tag that
/// does not match (which name the mapping or its dm-integrity device,
/// `minors`; rate-limited, so at least that many), and the dm-integrity
/// device's own count of mismatches (`status`, its target's status line).
pub fn tampered(records: &[Record], from: u64, minors: &[u32], status: Option<&str>) -> u64 {
    let said = records
        .iter()
        .filter(|r| r.seq >= from)
        .filter(|r| {
            // Debian's 6.1 prints them behind a stray "trusted_key: ".
            let at = r.message.find("device-mapper: crypt: dm-");
            minors.iter().any(|m| {
                at.and_then(|at| r.message.get(at..))
                    .and_then(|rest| rest.strip_prefix("device-mapper: crypt: dm-"))
                    .and_then(|rest| rest.strip_prefix(&m.to_string()))
                    .is_some_and(|rest| rest.starts_with(": INTEGRITY AEAD ERROR"))
            })
        })
        .count();
    let counted = status.and_then(dm_integrity::mismatches).unwrap_or(0);
    u64::try_from(said)
        .unwrap_or(u64::MAX)
        .saturating_add(counted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::dm_integrity::{sb_flag, MAGIC};

    fn segment(encryption: &str, kind: &str) -> Segment {
        Segment {
            kind: "crypt".into(),
            offset: 16 << 20,
            size: None,
            iv_tweak: 0,
            encryption: encryption.into(),
            sector_size: 4096,
            integrity: Some(Integrity {
                kind: kind.into(),
                journal_encryption: "none".into(),
                journal_integrity: "none".into(),
            }),
            flags: vec![],
        }
    }

    #[test]
    fn ciphers_and_tags_are_cryptsetups() {
        let a = aead(&segment("aes-xts-plain64", "hmac(sha256)"), 96).unwrap();
        assert_eq!(a.cipher, "capi:authenc(hmac(sha256),xts(aes))-plain64");
        assert_eq!(a.tag, 32);
        let a = aead(&segment("aes-xts-random", "hmac(sha256)"), 96).unwrap();
        assert_eq!(
            (a.cipher.as_str(), a.tag),
            ("capi:authenc(hmac(sha256),xts(aes))-random", 48)
        );
        let a = aead(&segment("aes-xts-plain64", "hmac(sha512)"), 128).unwrap();
        assert_eq!(
            (a.cipher.as_str(), a.tag),
            ("capi:authenc(hmac(sha512),xts(aes))-plain64", 64)
        );
        let a = aead(&segment("aes-gcm-random", "aead"), 32).unwrap();
        assert_eq!((a.cipher.as_str(), a.tag), ("capi:gcm(aes)-random", 28));
    }

    #[test]
    fn what_is_not_opened_is_named() {
        for (enc, kind, key, says) in [
            ("aes-xts-plain64", "crc32c", 64, "\"crc32c\""),
            ("aes-xts-plain64", "cmac(aes)", 80, "\"cmac(aes)\""),
            ("aes-xts-plain64", "none", 64, "\"none\""),
            (
                "serpent-xts-plain64",
                "hmac(sha256)",
                96,
                "\"serpent-xts-plain64\"",
            ),
            ("aes-cbc-essiv:sha256", "hmac(sha256)", 64, "aes-cbc"),
            ("aes-xts-plain64", "hmac(sha256)", 80, "384-bit cipher key"),
            (
                "aes-xts-plain64",
                "aead",
                64,
                "\"aead\" over \"aes-xts-plain64\"",
            ),
            ("aes-gcm-random", "aead", 64, "512-bit"),
        ] {
            let e = aead(&segment(enc, kind), key).unwrap_err();
            assert!(matches!(e, Error::IntegrityUnsupported { .. }), "{e}");
            assert!(e.to_string().contains(says), "{says}: {e}");
        }
        let mut s = segment("aes-xts-plain64", "hmac(sha256)");
        s.integrity.as_mut().unwrap().journal_integrity = "hmac(sha256)".into();
        let e = aead(&s, 96).unwrap_err();
        assert!(e.to_string().contains("journal integrity"), "{e}");
    }

    #[test]
    fn the_mode_follows_the_headers_flags() {
        assert_eq!(mode(&[]), Mode::Journal);
        assert_eq!(
            mode(&["allow-discards".into(), "no-journal".into()]),
            Mode::Direct
        );
    }

    #[test]
    fn tampering_is_counted_for_this_mapping_since_it_was_opened() {
        let r = |seq, message: &str| Record {
            seq,
            message: message.into(),
        };
        let log = [
            r(
                5,
                "device-mapper: crypt: dm-3: INTEGRITY AEAD ERROR, sector 8",
            ),
            r(
                9,
                "device-mapper: crypt: dm-3: INTEGRITY AEAD ERROR, sector 16",
            ),
            r(
                10,
                "device-mapper: crypt: dm-2: INTEGRITY AEAD ERROR, sector 16",
            ),
            r(
                11,
                "device-mapper: crypt: dm-31: INTEGRITY AEAD ERROR, sector 16",
            ),
            r(
                12,
                "device-mapper: crypt: dm-4: INTEGRITY AEAD ERROR, sector 24",
            ),
            r(
                13,
                "Buffer I/O error on dev dm-3, logical block 2, async page read",
            ),
            r(
                14,
                "trusted_key: device-mapper: crypt: dm-4: INTEGRITY AEAD ERROR, sector 24",
            ),
        ];
        assert_eq!(tampered(&log, 0, &[3, 4], None), 4);
        assert_eq!(tampered(&log, 6, &[3, 4], None), 3, "an earlier device's");
        assert_eq!(tampered(&log, 6, &[3], Some("2 55632 -")), 3);
        assert_eq!(tampered(&log, 6, &[7, 8], Some("0 55632 -")), 0);
        assert_eq!(tampered(&[], 0, &[3], Some("garbage")), 0);
    }

    fn disk(tag: u16, log2: u8, provided: u64) -> Vec<u8> {
        let mut d = vec![0u8; (16 << 20) + 512];
        let sb = &mut d[16 << 20..];
        sb[..8].copy_from_slice(MAGIC);
        sb[8] = 4;
        sb[10..12].copy_from_slice(&tag.to_le_bytes());
        sb[16..24].copy_from_slice(&provided.to_le_bytes());
        sb[24..28].copy_from_slice(&sb_flag::FIXED_PADDING.to_le_bytes());
        sb[28] = log2;
        d
    }

    #[test]
    fn the_superblock_must_fit_the_header_and_the_disk() {
        let s = segment("aes-xts-plain64", "hmac(sha256)");
        let a = aead(&s, 96).unwrap();
        let bytes = 64u64 << 20;
        let sb = superblock(&disk(32, 3, 90_000)[..], bytes, &s, &a).unwrap();
        assert_eq!(sb.provided_data_sectors, 90_000);
        for (d, says) in [
            (disk(48, 3, 90_000), "48-byte tags"),
            (disk(32, 0, 90_000), "2^0 sectors"),
            (disk(32, 3, 0), "provides 0 sectors"),
            (disk(32, 3, 90_001), "provides 90001"),
            (disk(32, 3, 98_304), "provides 98304"),
            (vec![0u8; (16 << 20) + 512], "no dm-integrity superblock"),
            (vec![0u8; 100], "cannot be read"),
        ] {
            let e = superblock(&d[..], bytes, &s, &a).unwrap_err();
            assert!(matches!(e, Error::Corrupt { .. }), "{e}");
            assert!(e.to_string().contains(says), "{says}: {e}");
        }
    }
}

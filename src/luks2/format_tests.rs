//! The format against the agent's own reader and unlock, on images in
//! memory, with random bytes from a fixed stream; what cryptsetup says of
//! a formatted image is in `luks2/tests.rs`.

use zeroize::Zeroizing;

use super::*;
use crate::code::Code;
use crate::luks2::fixture;
use crate::luks2::header::{self, Copy, Head};
use crate::luks2::json::base64;
use crate::luks2::metadata::Kdf;
use crate::luks2::unlock::{unlock, Limits};

/// A fixed stream of bytes (a linear congruential generator), so that a
/// format is the same each run.
struct Stream(u64);

impl Random for Stream {
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), Error> {
        for b in buf {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            *b = self.0.to_be_bytes()[0];
        }
        Ok(())
    }
}

/// A source that must not be asked: the format was to refuse first.
struct NoRandom;

impl Random for NoRandom {
    fn fill(&mut self, _: &mut [u8]) -> Result<(), Error> {
        panic!("random bytes were asked for before the refusal");
    }
}

const DEVICE: u64 = 32 << 20;

const PBKDF2: Options = Options {
    kdf: KdfCost::Pbkdf2Sha256 { iterations: 1000 },
    sector_size: SectorSize::Bytes512,
    integrity: None,
};

/// `luksFormat --integrity hmac-sha256 --sector-size 4096 --pbkdf pbkdf2`.
const INTEGRITY: Options = Options {
    sector_size: SectorSize::Bytes4096,
    integrity: Some(Mac::HmacSha256),
    ..PBKDF2
};

/// Argon2id at cryptsetup's least passes, with little memory: fast.
const ARGON2ID: Options = Options {
    kdf: KdfCost::Argon2id {
        memory_kib: 1024,
        passes: 4,
        lanes: 2,
    },
    sector_size: SectorSize::Bytes512,
    integrity: None,
};

const LIMITS: Limits = Limits {
    argon2_memory_kib: 1 << 20,
    argon2_passes: 16,
    pbkdf2_iterations: 1000,
};

fn pw(p: &[u8]) -> Zeroizing<Vec<u8>> {
    Zeroizing::new(p.to_vec())
}

/// The device's first bytes as the writes leave a zeroed device.
fn image(f: &Formatted) -> Vec<u8> {
    let mut img = vec![0u8; 1 << 20];
    for w in &f.writes {
        let at = usize::try_from(w.offset).unwrap();
        img[at..at + w.bytes.len()].copy_from_slice(&w.bytes);
    }
    img
}

#[test]
fn what_is_formatted_reads_back_and_unlocks_to_its_key() {
    let at_4096 = Options {
        sector_size: SectorSize::Bytes4096,
        ..PBKDF2
    };
    for options in [PBKDF2, ARGON2ID, at_4096] {
        let f = format(DEVICE, &pw(b"correct horse"), &options, &mut Stream(1)).unwrap();
        let img = image(&f);
        let h = header::read(&Head(&img), DEVICE).unwrap();
        assert_eq!((h.copy, h.hdr_size, h.seqid), (Copy::Primary, 16384, 1));
        assert_eq!((h.uuid.as_str(), h.label.as_str()), (f.uuid.as_str(), ""));
        let m = &h.metadata;
        assert_eq!(m.segments, [(0, f.segment.clone())]);
        assert_eq!(f.segment.sector_size, options.sector_size.bytes());
        assert_eq!(
            (m.config.json_size, m.config.keyslots_size),
            (12288, 16_744_448)
        );
        let [(0, slot)] = &m.keyslots[..] else {
            panic!("{:?}", m.keyslots)
        };
        let st = slot.stored.as_ref().unwrap();
        assert_eq!(
            (slot.key_size, st.stripes, st.af_hash.as_str()),
            (64, 4000, "sha256")
        );
        assert_eq!(
            (st.area_offset, st.area_size, st.area_key_size),
            (32768, 258_048, 64)
        );
        match (&st.kdf, options.kdf) {
            (
                Kdf::Pbkdf2 {
                    iterations, salt, ..
                },
                KdfCost::Pbkdf2Sha256 { .. },
            ) => {
                assert_eq!((*iterations, salt.len()), (1000, 32));
            }
            (
                Kdf::Argon2 {
                    id,
                    time,
                    memory_kib,
                    cpus,
                    ..
                },
                KdfCost::Argon2id { .. },
            ) => {
                assert_eq!((*id, *time, *memory_kib, *cpus), (true, 4, 1024, 2));
            }
            other => panic!("{other:?}"),
        }
        let u = unlock(&Head(&img), &h, &pw(b"correct horse"), LIMITS, None).unwrap();
        assert_eq!(u.keyslot, 0);
        assert_eq!(u.volume_key.bytes(), f.volume_key.bytes());
        assert_eq!(u.segment, f.segment);
        let e = unlock(&Head(&img), &h, &pw(b"correct horsf"), LIMITS, None).unwrap_err();
        assert!(matches!(e, Error::WrongPassphrase), "{e}");
    }
}

#[test]
fn the_secondary_header_alone_opens_the_volume() {
    let f = format(DEVICE, &pw(b"pw"), &PBKDF2, &mut Stream(2)).unwrap();
    let mut img = image(&f);
    img[..4096].fill(0);
    let h = header::read(&Head(&img), DEVICE).unwrap();
    assert_eq!(h.copy, Copy::Secondary);
    let u = unlock(&Head(&img), &h, &pw(b"pw"), LIMITS, None).unwrap();
    assert_eq!(u.volume_key.bytes(), f.volume_key.bytes());
}

/// The JSON is byte for byte what cryptsetup writes: the fixture's text is
/// cryptsetup's, with its salts.
#[test]
fn the_json_area_is_cryptsetups_byte_for_byte() {
    let salt = base64("2l3gRScdV3fYdPjlkSaf2cMmUhlnQrgrJqou/QUsS+0=").unwrap();
    let json = |kdf| {
        json_area(&Json {
            kdf,
            keyslot_salt: &salt,
            digest_salt: &salt,
            digest: &salt,
            sector_size: 4096,
            integrity: None,
        })
    };
    let ours = json(KdfCost::Pbkdf2Sha256 { iterations: 1000 });
    assert_eq!(ours.as_bytes(), &fixture::json(|s| s)[..]);
    // An Argon2id keyslot's kdf, as a cryptsetup 2.6 image holds it.
    let ours = json(KdfCost::Argon2id {
        memory_kib: 32768,
        passes: 4,
        lanes: 2,
    });
    let theirs = fixture::json(|s| {
        s.replace(
            r#""kdf":{"type":"pbkdf2","hash":"sha256","iterations":1000,"#,
            r#""kdf":{"type":"argon2id","time":4,"memory":32768,"cpus":2,"#,
        )
    });
    assert_eq!(ours.as_bytes(), &theirs[..]);
}

#[test]
fn the_writes_are_the_area_then_each_header_each_salted_apart() {
    let f = format(DEVICE, &pw(b"pw"), &ARGON2ID, &mut Stream(3)).unwrap();
    let at: Vec<(u64, usize)> = f.writes.iter().map(|w| (w.offset, w.bytes.len())).collect();
    assert_eq!(at, [(32768, 258_048), (16384, 16384), (0, 16384)]);
    let (secondary, primary) = (&f.writes[1].bytes, &f.writes[2].bytes);
    assert_eq!(&primary[..6], b"LUKS\xba\xbe");
    assert_eq!(&secondary[..6], b"SKUL\xba\xbe");
    assert_ne!(primary[104..168], secondary[104..168]);
    assert_eq!(primary[4096..], secondary[4096..]);
    // Nothing of the area is left as zeros past the split key.
    assert!(f.writes[0].bytes[256_000..].iter().any(|b| *b != 0));
    // The key is never shown.
    let shown = format!("{f:?}");
    assert!(
        shown.contains("redacted") && shown.contains("258048 bytes at 32768"),
        "{shown}"
    );
}

#[test]
fn each_format_is_new_and_the_same_random_bytes_make_the_same_volume() {
    let a = format(DEVICE, &pw(b"pw"), &PBKDF2, &mut Stream(4)).unwrap();
    let b = format(DEVICE, &pw(b"pw"), &PBKDF2, &mut Stream(4)).unwrap();
    let c = format(DEVICE, &pw(b"pw"), &PBKDF2, &mut Stream(5)).unwrap();
    assert_eq!(a.writes, b.writes);
    assert_eq!(a.volume_key.bytes(), b.volume_key.bytes());
    assert_ne!(a.volume_key.bytes(), c.volume_key.bytes());
    assert_ne!(a.uuid, c.uuid);
    for u in [&a.uuid, &c.uuid] {
        let b = u.as_bytes();
        assert_eq!(u.len(), 36, "{u}");
        assert!(
            u.bytes()
                .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f' | b'-')),
            "{u}"
        );
        assert_eq!(
            (b[8], b[13], b[14], b[18], b[23]),
            (b'-', b'-', b'4', b'-', b'-'),
            "{u}"
        );
        assert!(matches!(b[19], b'8' | b'9' | b'a' | b'b'), "{u}");
    }
}

#[test]
fn a_device_too_small_or_in_part_sectors_is_refused_before_any_work() {
    let mib16 = 16u64 << 20;
    let at_4096 = Options {
        sector_size: SectorSize::Bytes4096,
        ..PBKDF2
    };
    for (size, options, needs) in [
        (0, PBKDF2, mib16 + 512),
        (mib16, PBKDF2, mib16 + 512),
        (mib16 + 511, PBKDF2, mib16 + 512),
        (mib16 + 4095, at_4096, mib16 + 4096),
    ] {
        let e = format(size, &pw(b"pw"), &options, &mut NoRandom).unwrap_err();
        assert!(
            matches!(e, Error::TooSmall { device_bytes, needs: n, .. } if device_bytes == size && n == needs),
            "{e}"
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("nothing was written"), "{e}");
    }
    for (size, options) in [(mib16 + 513, PBKDF2), (mib16 + 4096 + 512, at_4096)] {
        let e = format(size, &pw(b"pw"), &options, &mut NoRandom).unwrap_err();
        assert!(matches!(e, Error::Misaligned { .. }), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition);
    }
    // One sector of data is enough.
    let f = format(mib16 + 512, &pw(b"pw"), &PBKDF2, &mut Stream(6)).unwrap();
    header::read(&Head(&image(&f)), mib16 + 512).unwrap();
}

#[test]
fn kdf_costs_cryptsetup_would_not_make_are_refused_before_any_work() {
    let argon2 = |memory_kib, passes, lanes| KdfCost::Argon2id {
        memory_kib,
        passes,
        lanes,
    };
    for (kdf, says) in [
        (argon2(31, 4, 1), "Argon2 memory of 31 KiB"),
        (argon2(4_194_305, 4, 1), "Argon2 memory of 4194305 KiB"),
        (argon2(1024, 3, 1), "3 Argon2 passes"),
        (argon2(1024, 4, 0), "0 Argon2 lanes"),
        (argon2(1024, 4, 5), "5 Argon2 lanes"),
        (
            KdfCost::Pbkdf2Sha256 { iterations: 999 },
            "999 PBKDF2 iterations",
        ),
    ] {
        let options = Options { kdf, ..PBKDF2 };
        let e = format(DEVICE, &pw(b"pw"), &options, &mut NoRandom).unwrap_err();
        assert!(matches!(e, Error::FormatCost { .. }), "{e}");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.to_string().contains(says), "{says}: {e}");
    }
    // cryptsetup's least memory with four lanes: 8 KiB a lane.
    let options = Options {
        kdf: argon2(32, 4, 4),
        ..PBKDF2
    };
    format(DEVICE, &pw(b"pw"), &options, &mut Stream(7)).unwrap();
}

#[test]
fn the_kernel_gives_random_bytes() {
    let mut a = [0u8; 64];
    let mut b = [0u8; 64];
    OsRandom.fill(&mut a).unwrap();
    OsRandom.fill(&mut b).unwrap();
    assert_ne!(a, b);
}

/// The host owns the disk's bytes, and a LUKS2 header's checksum is an
/// unkeyed SHA-256: it can rewrite the data segment's `encryption` and
/// recompute the checksum, and the digest still matches (it binds the
/// volume key, not the segment). "aes-xts-null" (an all-zero IV for every
/// sector, which dm-crypt accepts) would encrypt equal plaintext at the
/// same offset of any two sectors equally. The unlock takes no segment
/// cipher but aes-xts-plain64 (with integrity, its own list).
#[test]
fn a_host_rewritten_segment_cipher_is_refused() {
    let pass = pw(b"guest secret");
    let f = format(DEVICE, &pass, &PBKDF2, &mut Stream(7)).unwrap();
    let mut img = image(&f);
    for at in [0usize, 16384] {
        let area = &mut img[at + 4096..at + 16384];
        let end = area.iter().position(|b| *b == 0).unwrap();
        let text = String::from_utf8(area[..end].to_vec()).unwrap();
        let seg = "\"encryption\":\"aes-xts-plain64\",\"sector_size\"";
        assert!(text.contains(seg), "{text}");
        let edited = text.replace(seg, "\"encryption\":\"aes-xts-null\",\"sector_size\"");
        area.fill(0);
        area[..edited.len()].copy_from_slice(edited.as_bytes());
        fixture::rechecksum(&mut img, at as u64, 16384);
    }
    let h = header::read(&Head(&img), DEVICE).unwrap();
    let e = unlock(&Head(&img), &h, &pass, LIMITS, None).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.to_string().contains("aes-xts-null"), "{e}");
}

/// A volume with integrity as `cryptsetup luksFormat --type luks2
/// --integrity hmac-sha256 --sector-size 4096 --pbkdf pbkdf2` (2.6.1, in
/// a guest: it needs device-mapper) wrote its JSON area, salts and digest
/// included.
const CRYPTSETUP_INTEGRITY_JSON: &str = concat!(
    r#"{"keyslots":{"0":{"type":"luks2","key_size":96,"af":{"type":"luks1","stripes":4000,"hash":"sha256"},"#,
    r#""area":{"type":"raw","offset":"32768","size":"385024","encryption":"aes-xts-plain64","key_size":64},"#,
    r#""kdf":{"type":"pbkdf2","hash":"sha256","iterations":1000,"salt":"8clR3gQsQ0U5P98g2IsefUWFqZOZ4kQzQ8VhsJ4KErA="}}},"#,
    r#""tokens":{},"segments":{"0":{"type":"crypt","offset":"16777216","size":"dynamic","iv_tweak":"0","#,
    r#""encryption":"aes-xts-plain64","sector_size":4096,"#,
    r#""integrity":{"type":"hmac(sha256)","journal_encryption":"none","journal_integrity":"none"}}},"#,
    r#""digests":{"0":{"type":"pbkdf2","keyslots":["0"],"segments":["0"],"hash":"sha256","iterations":1000,"#,
    r#""salt":"oH5JZHRxf8NQnxwP4KaJjbwRWV15mmuGsjjlGs/5Jz8=","digest":"dQ9vOBRorA8QmSw/UhqG3HQVQnrYaJHIv9tqDD/sxFg="}},"#,
    r#""config":{"json_size":"12288","keyslots_size":"16744448"}}"#
);

#[test]
fn an_integrity_json_area_is_cryptsetups_byte_for_byte() {
    let ours = json_area(&Json {
        kdf: KdfCost::Pbkdf2Sha256 { iterations: 1000 },
        keyslot_salt: &base64("8clR3gQsQ0U5P98g2IsefUWFqZOZ4kQzQ8VhsJ4KErA=").unwrap(),
        digest_salt: &base64("oH5JZHRxf8NQnxwP4KaJjbwRWV15mmuGsjjlGs/5Jz8=").unwrap(),
        digest: &base64("dQ9vOBRorA8QmSw/UhqG3HQVQnrYaJHIv9tqDD/sxFg=").unwrap(),
        sector_size: 4096,
        integrity: Some(Mac::HmacSha256),
    });
    assert_eq!(ours, CRYPTSETUP_INTEGRITY_JSON);
}

/// What is formatted with integrity reads back as cryptsetup's layout,
/// unlocks to a 768-bit key, and is what the agent's open computes
/// dm-crypt's AEAD from.
#[test]
fn a_volume_with_integrity_reads_back_and_unlocks_to_its_768_bit_key() {
    let f = format(DEVICE, &pw(b"tags"), &INTEGRITY, &mut Stream(8)).unwrap();
    assert_eq!(f.volume_key.bytes().len(), 96);
    let at: Vec<(u64, usize)> = f.writes.iter().map(|w| (w.offset, w.bytes.len())).collect();
    assert_eq!(at, [(32768, 385_024), (16384, 16384), (0, 16384)]);
    let img = image(&f);
    let h = header::read(&Head(&img), DEVICE).unwrap();
    let [(0, slot)] = &h.metadata.keyslots[..] else {
        panic!("{:?}", h.metadata.keyslots)
    };
    let st = slot.stored.as_ref().unwrap();
    assert_eq!(
        (slot.key_size, st.area_size, st.area_key_size),
        (96, 385_024, 64)
    );
    assert_eq!(h.metadata.segments, [(0, f.segment.clone())]);
    let i = f.segment.integrity.as_ref().unwrap();
    assert_eq!(
        (
            i.kind.as_str(),
            i.journal_encryption.as_str(),
            i.journal_integrity.as_str(),
            f.segment.sector_size
        ),
        ("hmac(sha256)", "none", "none", 4096)
    );
    let u = unlock(&Head(&img), &h, &pw(b"tags"), LIMITS, None).unwrap();
    assert_eq!(u.volume_key.bytes(), f.volume_key.bytes());
    let aead = crate::luks2::integrity::aead(&u.segment, u.volume_key.bytes().len()).unwrap();
    assert_eq!(
        (aead.cipher.as_str(), aead.tag),
        ("capi:authenc(hmac(sha256),xts(aes))-plain64", 32)
    );
}

/// dm-integrity needs room past the header, in any size: cryptsetup does
/// not ask whole sectors of a disk with integrity.
#[test]
fn a_disk_too_small_for_integrity_is_refused_before_any_work() {
    let needs = (16u64 << 20) + INTEGRITY_MIN_DATA;
    let e = format(needs - 4096, &pw(b"pw"), &INTEGRITY, &mut NoRandom).unwrap_err();
    assert!(
        matches!(e, Error::TooSmall { needs: n, .. } if n == needs),
        "{e}"
    );
    assert!(
        e.to_string().contains(
            "at least 4 MiB (dm-integrity's journal and tags) after them, 20971520 bytes"
        ),
        "{e}"
    );
    format(needs + 512, &pw(b"pw"), &INTEGRITY, &mut Stream(9)).unwrap();
}

#[test]
fn the_macs_are_named_as_cryptsetup_and_the_kernel_name_them() {
    assert_eq!(Mac::from_flag("hmac-sha256"), Some(Mac::HmacSha256));
    assert_eq!(Mac::HmacSha256.kind(), "hmac(sha256)");
    for other in ["", "hmac(sha256)", "HMAC-SHA256", "hmac-sha512", "crc32c"] {
        assert_eq!(Mac::from_flag(other), None, "{other}");
    }
    assert_eq!((area_bytes(64), area_bytes(96)), (258_048, 385_024));
}

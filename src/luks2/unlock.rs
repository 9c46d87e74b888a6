//! A keyslot unlocked with a passphrase, as cryptsetup does it: the keyslots
//! that hold the data segment's key, high priority first (priority 0 only
//! when named), each checked for what it needs (a cipher, KDF and hash the
//! agent has, Argon2 memory within the caller's limit) before any is
//! tried; then for each in turn the KDF, the area read and decrypted
//! (aes-xts-plain64, 512-byte sectors numbered from the area's start), the
//! AF merge and the digest check in constant time. The volume key leaves
//! only in [`VolumeKey`], which is zeroed when dropped and never printed.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use aes::cipher::KeyInit;
use aes::{Aes128, Aes256};
use xts_mode::{get_tweak_default, Xts128};
use zeroize::Zeroizing;

use super::error::Error;
use super::header::{read_bytes, Header, ReadAt};
use super::kdf::{self, Argon2Cost, Hash};
use super::metadata::{Digest, Kdf, Keyslot, Segment, Stored};

/// What the caller lets an unlock use, so that a hostile header's costs are
/// refused before any work rather than run for hours.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The most memory one Argon2 derivation may take, in KiB.
    pub argon2_memory_kib: u64,
    /// The most passes one Argon2 derivation may make.
    pub argon2_passes: u32,
    /// The most iterations a PBKDF2 (a keyslot's, or the digest's) may run.
    pub pbkdf2_iterations: u32,
}

impl Limits {
    /// A refusal if `cost` of `what` exceeds `limit`.
    fn check(
        whose: impl Fn() -> String,
        what: &'static str,
        cost: u32,
        limit: u32,
    ) -> Result<(), Error> {
        if cost > limit {
            return Err(Error::CostOverLimit {
                whose: whose(),
                what,
                cost: cost.into(),
                limit: limit.into(),
            });
        }
        Ok(())
    }
}

/// The volume key: zeroed when dropped; its Debug shows only its size.
pub struct VolumeKey(Zeroizing<Vec<u8>>);

impl VolumeKey {
    /// A key made in this module's siblings (a new volume's, by `format`).
    pub(super) fn new(key: Zeroizing<Vec<u8>>) -> Self {
        VolumeKey(key)
    }

    /// The key's bytes, for the device-mapper table and nothing else.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for VolumeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VolumeKey({} bytes, redacted)", self.0.len())
    }
}

/// An unlocked volume: the key, and the segment it opens.
#[derive(Debug)]
pub struct Unlocked {
    /// The keyslot that opened.
    pub keyslot: u32,
    pub volume_key: VolumeKey,
    /// The data segment: where the ciphertext lies, its cipher, sector
    /// size and integrity, for the dm-crypt table.
    pub segment: Segment,
}

/// A keyslot that can be tried: its number, what it says, its parsed parts.
struct Candidate<'a> {
    id: u32,
    slot: &'a Keyslot,
    stored: &'a Stored,
    af_hash: Hash,
}

/// Unlocks the data segment of `header` (read from `disk`) with
/// `passphrase`: the keyslot `only` if given, else each in cryptsetup's order.
pub fn unlock(
    disk: &(impl ReadAt + ?Sized),
    header: &Header,
    passphrase: &Zeroizing<Vec<u8>>,
    limits: Limits,
    only: Option<u32>,
) -> Result<Unlocked, Error> {
    let m = &header.metadata;
    if !m.config.requirements.is_empty() {
        return Err(Error::unsupported(format!(
            "the requirements {:?} (a re-encryption in progress?)",
            m.config.requirements
        )));
    }
    let (seg_id, segment) = match &m.segments[..] {
        [(id, s)] if s.kind == "crypt" => (*id, s),
        [(_, s)] => {
            return Err(Error::unsupported(format!(
                "a segment of type {:?}",
                s.kind
            )))
        }
        many => {
            return Err(Error::unsupported(format!(
                "{} data segments (a re-encryption in progress?)",
                many.len()
            )))
        }
    };
    // The segment's cipher is the host's to write (the header's checksum
    // is keyed by nothing): only the one the agent maps safely is taken,
    // never, say, an IV mode that repeats (`aes-xts-null`). With
    // integrity, `integrity::aead` holds the cipher to its own list.
    if segment.integrity.is_none() && segment.encryption != "aes-xts-plain64" {
        return Err(Error::unsupported(format!(
            "the data segment's cipher {:?}",
            segment.encryption
        )));
    }
    let Some((_, digest)) = m.digests.iter().find(|(_, d)| d.segments.contains(&seg_id)) else {
        return Err(Error::NoKeyslot {
            what: format!("opens its data segment: no digest names segment {seg_id}"),
        });
    };
    let digest_hash = Hash::named(&digest.hash)?;
    Limits::check(
        || "the digest".into(),
        "PBKDF2 iterations",
        digest.iterations,
        limits.pbkdf2_iterations,
    )?;
    let (candidates, refused) = plan(header, digest, limits, only)?;
    check_total(&candidates, digest, digest_hash, limits)?;
    for c in &candidates {
        if let Some(volume_key) = try_one(disk, c, passphrase, digest, digest_hash)? {
            return Ok(Unlocked {
                keyslot: c.id,
                volume_key,
                segment: segment.clone(),
            });
        }
    }
    match refused {
        Some(e) => Err(e),
        None => Err(Error::WrongPassphrase),
    }
}

/// Refuses, before any work, an unlock whose keyslots together (each tried
/// with the digest check after it) would cost more than two keyslots at
/// the limits may: each keyslot is bounded on its own, and without this 32
/// of them would hold an unlock, and every encrypted publish behind it,
/// for tens of minutes.
fn check_total(
    candidates: &[Candidate<'_>],
    digest: &Digest,
    digest_hash: Hash,
    limits: Limits,
) -> Result<(), Error> {
    // PBKDF2's work is its iterations times the blocks of output it makes.
    let blocks = |out: usize, h: Hash| {
        u64::try_from(out.div_ceil(h.output_bytes()).max(1)).unwrap_or(u64::MAX)
    };
    let check =
        u64::from(digest.iterations).saturating_mul(blocks(digest.digest.len(), digest_hash));
    let (mut pbkdf2, mut argon2) = (0u64, 0u64);
    for c in candidates {
        match &c.stored.kdf {
            Kdf::Pbkdf2 {
                hash, iterations, ..
            } => {
                let n = blocks(c.stored.area_key_size as usize, Hash::named(hash)?);
                pbkdf2 = pbkdf2.saturating_add(u64::from(*iterations).saturating_mul(n));
            }
            Kdf::Argon2 {
                memory_kib, time, ..
            } => {
                argon2 =
                    argon2.saturating_add(u64::from(*memory_kib).saturating_mul(u64::from(*time)))
            }
        }
        pbkdf2 = pbkdf2.saturating_add(check);
    }
    let whose = || {
        format!(
            "the {} keyslots of the LUKS2 header, with their digest checks, together",
            candidates.len()
        )
    };
    // Two keyslots at the limits: 64-byte keys from a 32-byte hash are two blocks each.
    let pbkdf2_limit = u64::from(limits.pbkdf2_iterations).saturating_mul(4);
    // Eight passes over the most memory one keyslot may take.
    let argon2_limit = limits.argon2_memory_kib.saturating_mul(8);
    for (what, cost, limit) in [
        ("PBKDF2 hash blocks", pbkdf2, pbkdf2_limit),
        ("KiB of Argon2 memory times passes", argon2, argon2_limit),
    ] {
        if cost > limit {
            return Err(Error::CostOverLimit {
                whose: whose(),
                what,
                cost,
                limit,
            });
        }
    }
    Ok(())
}

/// The keyslots to try, in order, and the first refusal among the others
/// (answered if none of those tried opens: the passphrase may be theirs).
fn plan<'a>(
    header: &'a Header,
    digest: &Digest,
    limits: Limits,
    only: Option<u32>,
) -> Result<(Vec<Candidate<'a>>, Option<Error>), Error> {
    let slots = &header.metadata.keyslots;
    let order: Vec<&(u32, Keyslot)> = match only {
        Some(n) => {
            let named: Vec<_> = slots.iter().filter(|(id, _)| *id == n).collect();
            if named.is_empty() {
                return Err(Error::NoKeyslot {
                    what: format!("is numbered {n}"),
                });
            }
            named
        }
        // High, then normal; by number within each (slots are in order).
        None => [2, 1]
            .iter()
            .flat_map(|p| slots.iter().filter(move |(_, k)| k.priority == *p))
            .collect(),
    };
    let (mut candidates, mut refused) = (Vec::new(), None);
    for (id, slot) in order {
        if slot.kind != "luks2" || !digest.keyslots.contains(id) {
            continue;
        }
        match candidate(*id, slot, limits) {
            Ok(c) => candidates.push(c),
            Err(e) => {
                refused.get_or_insert(e);
            }
        }
    }
    if candidates.is_empty() && refused.is_none() {
        return Err(Error::NoKeyslot {
            what: "holds the data segment's key".into(),
        });
    }
    Ok((candidates, refused))
}

/// A keyslot checked for what trying it needs, before any work.
fn candidate(id: u32, slot: &Keyslot, limits: Limits) -> Result<Candidate<'_>, Error> {
    let Some(stored) = &slot.stored else {
        return Err(Error::unsupported(format!(
            "keyslot {id} of type {:?}",
            slot.kind
        )));
    };
    if stored.area_cipher != "aes-xts-plain64" || ![32, 64].contains(&stored.area_key_size) {
        return Err(Error::unsupported(format!(
            "keyslot {id}'s cipher {:?} with a {}-bit key",
            stored.area_cipher,
            u64::from(stored.area_key_size) * 8
        )));
    }
    let af_hash = Hash::named(&stored.af_hash)?;
    let whose = || format!("keyslot {id}");
    match &stored.kdf {
        Kdf::Pbkdf2 {
            hash, iterations, ..
        } => {
            Hash::named(hash)?;
            Limits::check(
                whose,
                "PBKDF2 iterations",
                *iterations,
                limits.pbkdf2_iterations,
            )?;
        }
        Kdf::Argon2 {
            memory_kib, time, ..
        } => {
            Limits::check(whose, "Argon2 passes", *time, limits.argon2_passes)?;
            if u64::from(*memory_kib) > limits.argon2_memory_kib {
                return Err(Error::MemoryOverLimit {
                    keyslot: id,
                    cost_kib: u64::from(*memory_kib),
                    limit_kib: limits.argon2_memory_kib,
                });
            }
        }
    }
    Ok(Candidate {
        id,
        slot,
        stored,
        af_hash,
    })
}

/// Tries one keyslot: the volume key if the passphrase opens it.
fn try_one(
    disk: &(impl ReadAt + ?Sized),
    c: &Candidate<'_>,
    passphrase: &[u8],
    digest: &Digest,
    digest_hash: Hash,
) -> Result<Option<VolumeKey>, Error> {
    let st = c.stored;
    let mut area_key = Zeroizing::new(vec![0u8; st.area_key_size as usize]);
    match &st.kdf {
        Kdf::Pbkdf2 {
            hash,
            iterations,
            salt,
        } => Hash::named(hash)?.pbkdf2(passphrase, salt, *iterations, &mut area_key),
        Kdf::Argon2 {
            id,
            time,
            memory_kib,
            cpus,
            salt,
        } => {
            let cost = Argon2Cost {
                id: *id,
                time: *time,
                memory_kib: *memory_kib,
                cpus: *cpus,
            };
            kdf::argon2(&cost, passphrase, salt, &mut area_key, c.id)?;
        }
    }
    // At most 256 bytes × 4000 stripes (metadata.rs), inside the area.
    let len = st.split_bytes(c.slot.key_size);
    let len = usize::try_from(len).map_err(|_| Error::OutOfMemory {
        keyslot: c.id,
        bytes: len,
    })?;
    let mut split = Zeroizing::new(read_bytes(
        disk,
        st.area_offset,
        len,
        "a LUKS2 keyslot area",
    )?);
    decrypt_xts(&area_key, &mut split);
    let mut key = Zeroizing::new(vec![0u8; c.slot.key_size as usize]);
    let used = (c.slot.key_size as usize).saturating_mul(st.stripes as usize);
    c.af_hash
        .af_merge(&split[..used.min(split.len())], &mut key);
    let mut check = Zeroizing::new(vec![0u8; digest.digest.len()]);
    digest_hash.pbkdf2(&key, &digest.salt, digest.iterations, &mut check);
    Ok(kdf::same(&check, &digest.digest).then(|| VolumeKey(key)))
}

/// Decrypts `data` in place with aes-xts-plain64 under `key` (two halves:
/// AES-128 for a 256-bit key, AES-256 for 512), 512-byte sectors numbered
/// from 0 little-endian. The key's size was checked by [`candidate`].
fn decrypt_xts(key: &[u8], data: &mut [u8]) {
    let (k1, k2) = key.split_at(key.len() / 2);
    if key.len() == 32 {
        let (Ok(a), Ok(b)) = (Aes128::new_from_slice(k1), Aes128::new_from_slice(k2)) else {
            return;
        };
        Xts128::new(a, b).decrypt_area(data, 512, 0, get_tweak_default);
    } else {
        let (Ok(a), Ok(b)) = (Aes256::new_from_slice(k1), Aes256::new_from_slice(k2)) else {
            return;
        };
        Xts128::new(a, b).decrypt_area(data, 512, 0, get_tweak_default);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::code::Code;
    use crate::luks2::fixture::{image, json, DEVICE};
    use crate::luks2::header::{read, Head};

    fn try_unlock(edit: impl Fn(String) -> String, limit_kib: u64) -> Error {
        let img = image(&json(edit));
        let h = read(&Head(&img), DEVICE).unwrap();
        let limits = Limits {
            argon2_memory_kib: limit_kib,
            argon2_passes: 4,
            pbkdf2_iterations: 1000,
        };
        unlock(
            &Head(&img),
            &h,
            &Zeroizing::new(b"pw".to_vec()),
            limits,
            None,
        )
        .unwrap_err()
    }

    const ARGON2: &str =
        "\"kdf\":{\"type\":\"argon2id\",\"time\":4,\"memory\":4194304,\"cpus\":4,\"salt\"";

    #[test]
    fn argon2_memory_over_the_limit_is_refused_at_once_naming_both() {
        let start = Instant::now();
        let e = try_unlock(
            |s| {
                s.replace(
                    "\"kdf\":{\"type\":\"pbkdf2\",\"hash\":\"sha256\",\"iterations\":1000,\"salt\"",
                    ARGON2,
                )
            },
            65536,
        );
        assert!(start.elapsed() < Duration::from_millis(100));
        assert!(
            matches!(
                e,
                Error::MemoryOverLimit {
                    keyslot: 0,
                    cost_kib: 4194304,
                    limit_kib: 65536
                }
            ),
            "{e}"
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.to_string()
                .contains("4194304 KiB of memory but the agent may use 65536 KiB"),
            "{e}"
        );
    }

    #[test]
    fn kdf_costs_over_the_limits_are_refused_at_once_naming_both() {
        let slow = "\"iterations\":4000000000,\"salt\"";
        let e = try_unlock(
            |s| s.replacen("\"iterations\":1000,\"salt\"", slow, 1),
            1 << 20,
        );
        assert!(matches!(e, Error::CostOverLimit { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.starts_with("keyslot 0 of the LUKS2 header asks for 4000000000 PBKDF2 iterations but the agent allows 1000"), "{msg}");
        // The digest's: the last of the two in the text.
        let e = try_unlock(
            |s| {
                let at = s.rfind("\"iterations\":1000").unwrap();
                format!("{}\"iterations\":4000000000{}", &s[..at], &s[at + 17..])
            },
            1 << 20,
        );
        assert!(
            e.to_string()
                .starts_with("the digest of the LUKS2 header asks for 4000000000"),
            "{e}"
        );
        let passes = ARGON2
            .replace("\"time\":4", "\"time\":400000")
            .replace("4194304", "65536");
        let e = try_unlock(
            |s| {
                s.replace(
                    "\"kdf\":{\"type\":\"pbkdf2\",\"hash\":\"sha256\",\"iterations\":1000,\"salt\"",
                    &passes,
                )
            },
            1 << 20,
        );
        assert!(
            e.to_string()
                .contains("asks for 400000 Argon2 passes but the agent allows 4"),
            "{e}"
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
    }

    #[test]
    fn what_the_agent_cannot_do_is_named() {
        for (from, to, says) in [
            ("\"encryption\":\"aes-xts-plain64\",\"key_size\":64}", "\"encryption\":\"serpent-xts-plain64\",\"key_size\":64}", "\"serpent-xts-plain64\" with a 512-bit key"),
            ("\"encryption\":\"aes-xts-plain64\",\"key_size\":64}", "\"encryption\":\"aes-xts-plain64\",\"key_size\":48}", "with a 384-bit key"),
            ("\"hash\":\"sha256\"},\"area\"", "\"hash\":\"whirlpool\"},\"area\"", "the hash \"whirlpool\""),
            ("\"hash\":\"sha256\",\"iterations\":1000,\"salt\"", "\"hash\":\"ripemd160\",\"iterations\":1000,\"salt\"", "\"ripemd160\""),
            ("\"json_size\":\"12288\"", "\"json_size\":\"12288\",\"requirements\":{\"mandatory\":[\"online-reencrypt-v2\"]}", "online-reencrypt-v2"),
            ("\"segments\":{\"0\":{\"type\":\"crypt\"", "\"segments\":{\"0\":{\"type\":\"linear\"", "a segment of type \"linear\""),
        ] {
            let e = try_unlock(|s| { assert!(s.contains(from), "{from}"); s.replacen(from, to, 1) }, 1 << 20);
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
            assert_eq!(e.code(), Code::FailedPrecondition);
            assert!(e.to_string().contains(says), "{says}: {e}");
        }
    }

    #[test]
    fn keyslots_outside_the_segments_digest_are_not_tried() {
        let e = try_unlock(
            |s| s.replace("\"keyslots\":[\"0\"]", "\"keyslots\":[]"),
            1 << 20,
        );
        assert!(matches!(e, Error::NoKeyslot { .. }), "{e}");
        let e = try_unlock(
            |s| s.replace("\"segments\":[\"0\"]", "\"segments\":[]"),
            1 << 20,
        );
        assert!(e.to_string().contains("no digest names segment 0"), "{e}");
        let e = try_unlock(
            |s| {
                s.replace(
                    "\"key_size\":64,\"af\"",
                    "\"key_size\":64,\"priority\":0,\"af\"",
                )
            },
            1 << 20,
        );
        assert!(matches!(e, Error::NoKeyslot { .. }), "{e}");
    }

    /// The hand-built slot holds no real key: the passphrase opens nothing.
    #[test]
    fn a_slot_that_does_not_open_is_a_wrong_passphrase() {
        let e = try_unlock(|s| s, 1 << 20);
        assert!(matches!(e, Error::WrongPassphrase), "{e}");
        assert_eq!(e.code(), Code::PermissionDenied);
    }
}

#[cfg(test)]
mod total_tests {
    use super::*;
    use crate::luks2::fixture::{image, DEVICE};
    use crate::luks2::header::{read, Head};

    /// A hostile header: `n` keyslots, each PBKDF2-SHA1 at `iters`, and a
    /// 64-byte SHA1 digest at `iters` — every cost within the per-keyslot
    /// limits the agent checks.
    fn hostile(n: u32, iters: u32) -> Vec<u8> {
        let salt = "2l3gRScdV3fYdPjlkSaf2cMmUhlnQrgrJqou/QUsS+0=";
        let digest64 = "A".repeat(86) + "==";
        let mut slots = Vec::new();
        let mut ids = Vec::new();
        for i in 0..n {
            let off = 32768 + u64::from(i) * 4096;
            slots.push(format!(
                r#""{i}":{{"type":"luks2","key_size":64,"af":{{"type":"luks1","stripes":1,"hash":"sha1"}},"area":{{"type":"raw","offset":"{off}","size":"4096","encryption":"aes-xts-plain64","key_size":64}},"kdf":{{"type":"pbkdf2","hash":"sha1","iterations":{iters},"salt":"{salt}"}}}}"#
            ));
            ids.push(format!("\"{i}\""));
        }
        let json = format!(
            r#"{{"keyslots":{{{}}},"tokens":{{}},"segments":{{"0":{{"type":"crypt","offset":"16777216","size":"dynamic","iv_tweak":"0","encryption":"aes-xts-plain64","sector_size":4096}}}},"digests":{{"0":{{"type":"pbkdf2","keyslots":[{}],"segments":["0"],"hash":"sha1","iterations":{iters},"salt":"{salt}","digest":"{digest64}"}}}},"config":{{"json_size":"12288","keyslots_size":"16744448"}}}}"#,
            slots.join(","),
            ids.join(",")
        );
        image(json.as_bytes())
    }

    /// 32 keyslots, each within the agent's limits on its own, with a
    /// 64-byte SHA1 digest checked after each: together they would hold an
    /// unlock (and every encrypted publish behind it) for tens of minutes.
    /// Refused before any work, naming the total and the limit.
    #[test]
    fn a_32_keyslot_header_within_each_limit_is_refused_for_its_total() {
        // What mapping::guest_limits allows in a guest with 1 GiB free.
        let limits = Limits {
            argon2_memory_kib: 512 << 10,
            argon2_passes: 64,
            pbkdf2_iterations: 20_000_000,
        };
        let img = hostile(32, limits.pbkdf2_iterations);
        let h = read(&Head(&img), DEVICE).unwrap();
        let e = unlock(
            &Head(&img),
            &h,
            &Zeroizing::new(b"pw".to_vec()),
            limits,
            None,
        )
        .unwrap_err();
        assert!(matches!(e, Error::CostOverLimit { .. }), "{e}");
        assert!(e.to_string().contains("32 keyslots"), "{e}");
        // A few keyslots at ordinary costs stay within the total.
        let img = hostile(3, 1000);
        let h = read(&Head(&img), DEVICE).unwrap();
        let e = unlock(
            &Head(&img),
            &h,
            &Zeroizing::new(b"pw".to_vec()),
            limits,
            None,
        )
        .unwrap_err();
        assert!(matches!(e, Error::WrongPassphrase), "{e}");
    }
}

//! The fuzz target's way in (`crust_agent::fuzz::luks2_header`), beside
//! what it checks: a header as a hostile disk could carry it, read as the
//! agent reads it, and unlocked under limits that keep its KDFs cheap.

use sha2::{Digest as _, Sha256};
use zeroize::Zeroizing;

use super::header::{read, Head, SIZES};
use super::metadata::MAX_NUMBERED;
use super::unlock::{unlock, Limits};
use crate::code::Code;

/// The device the fuzzed bytes start: 1 GiB, zeros after the bytes.
const DEVICE: u64 = 1 << 30;

/// The passphrase fuzz/seeds.py formats the seeds with.
pub const PASSPHRASE: &[u8] = b"crust";

/// Reads `data` (a disk's first bytes) as a LUKS2 header, as it is and
/// with the checksum of every copy it holds made right (a checksum is a
/// gate no mutation passes: without this, the fuzzer's changes to a JSON
/// area would never reach the JSON reader). Whether `data` as it is was
/// accepted; [`one`] says what must hold.
pub fn fuzz_header(data: &[u8]) -> bool {
    one(&checksummed(data));
    one(data)
}

/// `data` with each copy's checksum recomputed: the primary at 0 and a
/// secondary at each offset one can have, wherever the magic and a size
/// from cryptsetup's set are found (the zeros after `data` included).
fn checksummed(data: &[u8]) -> Vec<u8> {
    let mut d = data.to_vec();
    for offset in std::iter::once(0).chain(SIZES) {
        let at = usize::try_from(offset).unwrap();
        let Some(b) = d.get(at..at + 4096) else { break };
        let magic: &[u8] = if at == 0 {
            b"LUKS\xba\xbe"
        } else {
            b"SKUL\xba\xbe"
        };
        let size = u64::from_be_bytes(b[8..16].try_into().unwrap());
        if &b[..6] != magic || !SIZES.contains(&size) {
            continue;
        }
        let end = at + usize::try_from(size).unwrap();
        if d.len() < end {
            d.resize(end, 0);
        }
        d[at + 448..at + 512].fill(0);
        let sum = Sha256::digest(&d[at..end]);
        d[at + 448..at + 480].copy_from_slice(&sum);
    }
    d
}

/// Reads `data` (a disk's first bytes) as a LUKS2 header. A refusal is the
/// disk's, never INTERNAL. What is accepted keeps the promises the unlock
/// relies on: a size from cryptsetup's set, at most 32 of each section,
/// keyslot areas inside the keyslots area and long enough, segments after
/// the metadata and inside the device, digests naming what exists. The
/// unlock is tried too, under limits that keep every KDF cheap (the seeds'
/// keyslot areas are not in the bytes, so their passphrase opens nothing):
/// it answers a key of the keyslot's size or a refusal, never INTERNAL.
/// Whether the header was accepted.
fn one(data: &[u8]) -> bool {
    let h = match read(&Head(data), DEVICE) {
        Ok(h) => h,
        Err(e) => {
            assert_ne!(e.code(), Code::Internal, "{e}");
            return false;
        }
    };
    let m = &h.metadata;
    assert!(SIZES.contains(&h.hdr_size), "{}", h.hdr_size);
    assert_eq!(m.config.json_size + 4096, h.hdr_size);
    let end = m.end(h.hdr_size);
    assert!(end <= DEVICE);
    let n = |len: usize| u32::try_from(len).unwrap() <= MAX_NUMBERED;
    assert!(n(m.keyslots.len()) && n(m.segments.len()) && n(m.digests.len()));
    for (id, k) in &m.keyslots {
        if let Some(st) = &k.stored {
            assert!(st.area_offset >= 2 * h.hdr_size, "keyslot {id}");
            assert!(st.area_offset + st.area_size <= end, "keyslot {id}");
            assert!(st.split_bytes(k.key_size) <= st.area_size, "keyslot {id}");
        }
    }
    for (id, s) in &m.segments {
        assert!(
            s.offset >= end && s.offset + s.size.unwrap_or(0) <= DEVICE,
            "segment {id}"
        );
    }
    for (_, d) in &m.digests {
        assert!(d
            .keyslots
            .iter()
            .all(|k| m.keyslots.iter().any(|(n, _)| n == k)));
        assert!(d
            .segments
            .iter()
            .all(|s| m.segments.iter().any(|(n, _)| n == s)));
    }
    // Limits that keep every KDF cheap, so the unlock always runs.
    let limits = Limits {
        argon2_memory_kib: 256,
        argon2_passes: 4,
        pbkdf2_iterations: 2000,
    };
    let pass = Zeroizing::new(PASSPHRASE.to_vec());
    match unlock(&Head(data), &h, &pass, limits, None) {
        Ok(u) => {
            let (_, k) = m.keyslots.iter().find(|(n, _)| *n == u.keyslot).unwrap();
            assert_eq!(u.volume_key.bytes().len(), k.key_size as usize);
        }
        Err(e) => assert_ne!(e.code(), Code::Internal, "{e}"),
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The headers cryptsetup made (fuzz/seeds.py) are accepted, so
    /// fuzzing starts from headers that read; the LUKS1 one is refused.
    /// A copy edited after it was written reads once its checksum is made right.
    #[test]
    fn checksums_are_made_right() {
        let seed = include_bytes!("../../fuzz/corpus/luks2_header/pbkdf2-sha256");
        let mut edited = seed.to_vec();
        // A salt's first character, in both copies: still a header that reads.
        let salt = seed.windows(8).position(|w| w == b"\"salt\":\"").unwrap() + 8 - 4096;
        for at in [4096 + salt, 16384 + 4096 + salt] {
            edited[at] = if edited[at] == b'A' { b'B' } else { b'A' };
        }
        assert!(!one(&edited));
        assert!(one(&checksummed(&edited)));
        assert_eq!(checksummed(seed), seed);
    }

    #[test]
    fn the_seed_luks2_headers_read() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/luks2_header");
        let mut read = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let ok = fuzz_header(&std::fs::read(&path).unwrap());
            assert_eq!(ok, !name.starts_with("luks1"), "{name}");
            read += usize::from(ok);
        }
        assert!(read >= 5, "{read} seeds read");
    }
}

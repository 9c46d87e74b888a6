//! The hashes LUKS2 names and what is made with them: PBKDF2 (keyslot KDF
//! and digest), Argon2i/Argon2id (keyslot KDF), and the AF splitter's
//! split and merge with their diffusion. Every derived key is returned in
//! memory that is zeroed when dropped.

use sha2::digest::{Digest, FixedOutputReset};
use sha2::{Sha256, Sha384, Sha512};
use zeroize::Zeroizing;

use super::error::Error;
use crust_argon2::{self as argon2, Argon2, Extra};

/// A hash as LUKS2 names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    Sha1,
    Sha256,
    Sha384,
    Sha512,
}

impl Hash {
    /// The hash of cryptsetup's `name`, or Unsupported naming it.
    pub fn named(name: &str) -> Result<Hash, Error> {
        Ok(match name {
            "sha1" => Hash::Sha1,
            "sha256" => Hash::Sha256,
            "sha384" => Hash::Sha384,
            "sha512" => Hash::Sha512,
            _ => return Err(Error::unsupported(format!("the hash {name:?}"))),
        })
    }

    /// The size of its output in bytes: what one PBKDF2 block gives.
    pub fn output_bytes(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    /// PBKDF2-HMAC of `password` and `salt` over `rounds`, filling `out`.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
        use pbkdf2::pbkdf2_hmac;
        match self {
            Hash::Sha1 => pbkdf2_hmac::<sha1::Sha1>(password, salt, rounds, out),
            Hash::Sha256 => pbkdf2_hmac::<Sha256>(password, salt, rounds, out),
            Hash::Sha384 => pbkdf2_hmac::<Sha384>(password, salt, rounds, out),
            Hash::Sha512 => pbkdf2_hmac::<Sha512>(password, salt, rounds, out),
        }
    }

    /// The AF splitter's merge of `split` (stripes × key size) into `key`.
    pub fn af_merge(self, split: &[u8], key: &mut [u8]) {
        match self {
            Hash::Sha1 => af_merge::<sha1::Sha1>(split, key),
            Hash::Sha256 => af_merge::<Sha256>(split, key),
            Hash::Sha384 => af_merge::<Sha384>(split, key),
            Hash::Sha512 => af_merge::<Sha512>(split, key),
        }
    }

    /// The AF splitter's split of `key` into `split` (stripes × key size),
    /// whose stripes but the last the caller has filled with random bytes:
    /// the last is made so that [`Hash::af_merge`] gives `key` back.
    pub fn af_split(self, key: &[u8], split: &mut [u8]) {
        match self {
            Hash::Sha1 => af_split::<sha1::Sha1>(key, split),
            Hash::Sha256 => af_split::<Sha256>(key, split),
            Hash::Sha384 => af_split::<Sha384>(key, split),
            Hash::Sha512 => af_split::<Sha512>(key, split),
        }
    }
}

/// LUKS's AF split (cryptsetup's `AF_split`), the random stripes given:
/// the buffer runs over them as [`af_merge`] runs, and the last stripe is
/// the buffer XOR the key. `split` holds at least one stripe of `key.len()`.
fn af_split<D: Digest + FixedOutputReset>(key: &[u8], split: &mut [u8]) {
    let n = key.len();
    let mut buf = Zeroizing::new(vec![0u8; n]);
    let mut stripes = split.chunks_exact_mut(n);
    let last = stripes.next_back();
    for stripe in stripes {
        for (b, s) in buf.iter_mut().zip(stripe.iter()) {
            *b ^= s;
        }
        diffuse::<D>(&mut buf);
    }
    for ((s, b), k) in last.into_iter().flatten().zip(buf.iter()).zip(key) {
        *s = b ^ k;
    }
}

/// LUKS's AF merge (cryptsetup's `AF_merge`): every stripe but the last is
/// XORed into a buffer that is diffused after each; the last XORed with the
/// buffer is the key. `split` holds at least one stripe of `key.len()`.
fn af_merge<D: Digest + FixedOutputReset>(split: &[u8], key: &mut [u8]) {
    let n = key.len();
    let mut buf = Zeroizing::new(vec![0u8; n]);
    let mut stripes = split.chunks_exact(n);
    let last = stripes.next_back().unwrap_or(&[]);
    for stripe in stripes {
        for (b, s) in buf.iter_mut().zip(stripe) {
            *b ^= s;
        }
        diffuse::<D>(&mut buf);
    }
    for ((k, b), s) in key.iter_mut().zip(buf.iter()).zip(last) {
        *k = b ^ s;
    }
}

/// LUKS's diffusion: each digest-sized piece (the last may be shorter) is
/// replaced by the hash of its index (big-endian u32) and itself, cut to its length.
fn diffuse<D: Digest + FixedOutputReset>(buf: &mut [u8]) {
    let mut h = D::new();
    for (i, piece) in buf.chunks_mut(<D as Digest>::output_size()).enumerate() {
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        Digest::update(&mut h, index.to_be_bytes());
        Digest::update(&mut h, &*piece);
        let out = h.finalize_reset();
        piece.copy_from_slice(&out[..piece.len()]);
    }
}

/// Argon2's parameters as a keyslot gives them.
pub struct Argon2Cost {
    pub id: bool,
    pub time: u32,
    pub memory_kib: u32,
    pub cpus: u32,
}

/// The most threads one Argon2 derivation runs its lanes on, whatever the
/// CPUs: a bound on what a header's lane count can make the agent start.
const MOST_THREADS: usize = 16;

/// Argon2 of `password` and `salt` at `cost`, filling `out`. The caller has
/// checked the memory against its limit; the blocks are allocated here,
/// fallibly, and zeroed when dropped. The lanes run on up to one thread a
/// CPU (at most one a lane, and [`MOST_THREADS`]). `keyslot` names the slot
/// in errors.
pub fn argon2(
    cost: &Argon2Cost,
    password: &[u8],
    salt: &[u8],
    out: &mut [u8],
    keyslot: u32,
) -> Result<(), Error> {
    let bad =
        |e: argon2::Bad| Error::corrupt(format!("keyslot {keyslot}'s Argon2 parameters: {e}"));
    let a = Argon2::new(cost.id, cost.time, cost.memory_kib, cost.cpus).map_err(bad)?;
    let blocks = a.block_count();
    let mut memory = Zeroizing::new(
        argon2::zeroed_blocks(blocks).ok_or(Error::OutOfMemory {
            keyslot,
            bytes: u64::try_from(blocks)
                .unwrap_or(u64::MAX)
                .saturating_mul(1024),
        })?,
    );
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(MOST_THREADS);
    a.hash(password, salt, Extra::default(), out, &mut memory, threads)
        .map_err(bad)
}

/// Whether `a` and `b` are equal, in time that depends only on their lengths.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// RFC 6070's and the usual SHA-2 vectors: PBKDF2 is the standard one.
    #[test]
    fn pbkdf2_matches_the_published_vectors() {
        let mut out = [0u8; 20];
        Hash::Sha1.pbkdf2(b"password", b"salt", 2, &mut out);
        assert_eq!(
            out.to_vec(),
            hex("ea6c014dc72d6f8ccd1ed92ace1d41f0d8de8957")
        );
        let mut out = [0u8; 32];
        Hash::Sha256.pbkdf2(b"password", b"salt", 1, &mut out);
        assert_eq!(
            out.to_vec(),
            hex("120fb6cffcf8b32c43e7225256c4f837a86548c92ccc35480805987cb70be17b")
        );
    }

    /// The merge of stripes split by hand (cryptsetup's AF_split with the
    /// random stripes fixed) gives the key back, for a key that is not a
    /// whole number of digests.
    #[test]
    fn af_split_and_af_merge_undo_each_other() {
        let key: Vec<u8> = (0..40u8).collect();
        let stripes = 5;
        let mut split = Vec::new();
        let mut buf = vec![0u8; key.len()];
        for i in 0..stripes - 1 {
            let stripe: Vec<u8> = (0..40u8)
                .map(|b| b.wrapping_mul(7).wrapping_add(i))
                .collect();
            for (x, s) in buf.iter_mut().zip(&stripe) {
                *x ^= s;
            }
            diffuse::<Sha256>(&mut buf);
            split.extend_from_slice(&stripe);
        }
        split.extend(buf.iter().zip(&key).map(|(b, k)| b ^ k));
        let mut merged = vec![0u8; key.len()];
        Hash::Sha256.af_merge(&split, &mut merged);
        assert_eq!(merged, key);
        Hash::Sha1.af_merge(&split, &mut merged);
        assert_ne!(merged, key);
        // The split makes the same last stripe from the same random ones.
        let mut again = split.clone();
        let last = again.len() - key.len();
        again[last..].fill(0);
        Hash::Sha256.af_split(&key, &mut again);
        assert_eq!(again, split);
        for hash in [Hash::Sha1, Hash::Sha512] {
            hash.af_split(&key, &mut again);
            hash.af_merge(&again, &mut merged);
            assert_eq!(merged, key, "{hash:?}");
        }
    }

    #[test]
    fn unknown_hashes_are_named() {
        let e = Hash::named("whirlpool").unwrap_err();
        assert!(e.to_string().contains("\"whirlpool\""), "{e}");
        assert_eq!(e.code(), crate::code::Code::FailedPrecondition);
    }

    #[test]
    fn same_compares_whole_slices() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"ab"));
    }
}

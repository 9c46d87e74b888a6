//! Argon2i and Argon2id (RFC 9106, version 0x13), with a keyslot's lanes
//! on threads as libargon2 runs them for cryptsetup.
//!
//! Within one of a pass's four slices the lanes are independent: a block
//! refers to blocks of its own lane and to the finished slices of the
//! others, never to a segment another lane is filling. So each slice
//! hands its lanes to up to `threads` threads (std scoped threads, joined
//! before the next slice), and the memory is split so that safe Rust
//! proves the rule: each lane's current segment is the one `&mut` its
//! filler holds, the rest of every lane is shared. A thread that cannot
//! be started costs only speed: the lanes go to the threads that run.
//!
//! The compression is BlaMka, with AVX2 when the CPU has it and runs it
//! faster (one 256-bit register holds four words, as libargon2's optimised
//! core does) and in plain Rust otherwise; the tests hold both to RFC 9106's vectors and to
//! RustCrypto's `argon2` crate on random parameters. The memory is the
//! caller's, zeroed when it drops it; the initial hash and the final
//! block are zeroed here.

use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use blake2::digest::{Digest, Update, VariableOutput};
use blake2::{Blake2b512, Blake2bVar};
use zeroize::{Zeroize, Zeroizing};

/// 64-bit words in a block.
const WORDS: usize = 128;
/// The slices of a pass: lanes synchronise between them.
const SLICES: usize = 4;
/// Argon2 version 0x13, the one cryptsetup writes.
const VERSION: u32 = 0x13;
/// The most lanes Argon2 allows.
pub const MAX_LANES: u32 = 0x00FF_FFFF;
/// A filling thread's stack: a few blocks and the hashes, with room.
const STACK_BYTES: usize = 256 << 10;

/// One kibibyte of Argon2 memory.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Block([u64; WORDS]);

impl Block {
    const ZERO: Block = Block([0; WORDS]);

    fn from_bytes(bytes: &[u8; 1024]) -> Block {
        let mut b = Block::ZERO;
        for (w, c) in b.0.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            *w = u64::from_le_bytes(word);
        }
        b
    }
}

impl Zeroize for Block {
    fn zeroize(&mut self) {
        self.0.zeroize();
    }
}

/// Argon2 parameters that cannot be computed, each named with its value.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Bad {
    #[error("{0} lanes, where Argon2 allows 1 to 16777215")]
    Lanes(u32),
    #[error("no passes, where Argon2 needs at least one")]
    Passes,
    #[error("{memory_kib} KiB of memory, under Argon2's 8 KiB a lane for {lanes} lanes")]
    Memory { memory_kib: u32, lanes: u32 },
    #[error("a salt of {0} bytes, where Argon2 takes 8 to 4294967295")]
    Salt(usize),
    #[error("{0} bytes of input, over Argon2's 4294967295")]
    Input(usize),
    #[error("a key of {0} bytes, where Argon2 gives 4 to 4294967295")]
    Output(usize),
    #[error("{given} blocks of memory given where Argon2 fills {needs}")]
    Blocks { given: usize, needs: usize },
}

/// The secret and associated data Argon2 may mix in beside the password
/// and salt. LUKS2 uses neither; RFC 9106's vectors use both.
#[derive(Clone, Copy, Default)]
pub struct Extra<'a> {
    pub secret: &'a [u8],
    pub data: &'a [u8],
}

/// Argon2 with its costs checked.
#[derive(Clone, Copy, Debug)]
pub struct Argon2 {
    id: bool,
    passes: u32,
    memory_kib: u32,
    lanes: u32,
    /// Blocks in a segment: a lane's share of one slice.
    segment: usize,
    /// The compressions the CPU runs.
    simd: Simd,
}

impl Argon2 {
    /// Argon2id (`id`) or Argon2i at these costs, or why they cannot be.
    pub fn new(id: bool, passes: u32, memory_kib: u32, lanes: u32) -> Result<Argon2, Bad> {
        if !(1..=MAX_LANES).contains(&lanes) {
            return Err(Bad::Lanes(lanes));
        }
        if passes == 0 {
            return Err(Bad::Passes);
        }
        if u64::from(memory_kib) < 8 * u64::from(lanes) {
            return Err(Bad::Memory { memory_kib, lanes });
        }
        // Argon2's m': the memory rounded down to 4 segments a lane.
        let segment = memory_kib as usize / (SLICES * lanes as usize);
        Ok(Argon2 {
            id,
            passes,
            memory_kib,
            lanes,
            segment,
            simd: Simd::detect(),
        })
    }

    /// The blocks [`Argon2::hash`] needs.
    pub fn block_count(&self) -> usize {
        self.segment * SLICES * self.lanes as usize
    }

    /// Fills `out` with the hash of `password` and `salt`, in `memory`
    /// (at least [`Argon2::block_count`] blocks, any contents), the lanes
    /// on up to `threads` threads (at most one a lane).
    pub fn hash(
        &self,
        password: &[u8],
        salt: &[u8],
        extra: Extra<'_>,
        out: &mut [u8],
        memory: &mut [Block],
        threads: usize,
    ) -> Result<(), Bad> {
        if !(8..=0xFFFF_FFFF).contains(&salt.len()) {
            return Err(Bad::Salt(salt.len()));
        }
        if !(4..=0xFFFF_FFFF).contains(&out.len()) {
            return Err(Bad::Output(out.len()));
        }
        let h0 = self.initial_hash(password, salt, extra, out.len())?;
        let (given, needs) = (memory.len(), self.block_count());
        let memory = memory
            .get_mut(..needs)
            .ok_or(Bad::Blocks { given, needs })?;
        let lane_len = self.segment * SLICES;
        let mut bytes = Zeroizing::new([0u8; 1024]);
        for (l, lane) in memory.chunks_exact_mut(lane_len).enumerate() {
            for (i, block) in lane[..2].iter_mut().enumerate() {
                let (i, l) = (word32(i), word32(l));
                long_hash(
                    &[&h0[..], &i.to_le_bytes(), &l.to_le_bytes()],
                    &mut bytes[..],
                );
                *block = Block::from_bytes(&bytes);
            }
        }
        let threads = threads.clamp(1, self.lanes as usize);
        for pass in 0..self.passes {
            for slice in 0..SLICES {
                self.slice(memory, Position { pass, slice }, threads, self.simd);
            }
        }
        let mut last = Zeroizing::new(Block::ZERO);
        for lane in memory.chunks_exact(lane_len) {
            for (w, x) in last.0.iter_mut().zip(lane[lane_len - 1].0) {
                *w ^= x;
            }
        }
        for (c, w) in bytes.chunks_exact_mut(8).zip(last.0) {
            c.copy_from_slice(&w.to_le_bytes());
        }
        long_hash(&[&bytes[..]], out);
        Ok(())
    }

    /// H0: every parameter and input, hashed.
    fn initial_hash(
        &self,
        password: &[u8],
        salt: &[u8],
        extra: Extra<'_>,
        out_len: usize,
    ) -> Result<Zeroizing<[u8; 64]>, Bad> {
        let mut h = Blake2b512::new();
        let kind: u32 = if self.id { 2 } else { 1 };
        let out_len = u32::try_from(out_len).map_err(|_| Bad::Output(out_len))?;
        for v in [
            self.lanes,
            out_len,
            self.memory_kib,
            self.passes,
            VERSION,
            kind,
        ] {
            Digest::update(&mut h, v.to_le_bytes());
        }
        for input in [password, salt, extra.secret, extra.data] {
            let len = u32::try_from(input.len()).map_err(|_| Bad::Input(input.len()))?;
            Digest::update(&mut h, len.to_le_bytes());
            Digest::update(&mut h, input);
        }
        let mut h0 = Zeroizing::new([0u8; 64]);
        h0.copy_from_slice(&h.finalize());
        Ok(h0)
    }

    /// One slice of one pass: every lane's segment, on the threads.
    fn slice(&self, memory: &mut [Block], at: Position, threads: usize, simd: Simd) {
        let (seg, lane_len) = (self.segment, self.segment * SLICES);
        let start = at.slice * seg;
        let mut shared = Vec::with_capacity(self.lanes as usize);
        let mut work = Vec::with_capacity(self.lanes as usize);
        for (l, lane) in memory.chunks_exact_mut(lane_len).enumerate() {
            let (before, rest) = lane.split_at_mut(start);
            let (current, after) = rest.split_at_mut(seg);
            shared.push(Shared { before, after });
            work.push(Segment { lane: l, current });
        }
        let work = Mutex::new(work);
        let fill = || loop {
            let next = work.lock().unwrap_or_else(PoisonError::into_inner).pop();
            let Some(mut s) = next else { break };
            self.segment(&mut s, &shared, at, simd);
        };
        std::thread::scope(|scope| {
            for _ in 1..threads {
                // A thread that does not start leaves its lanes to the others.
                let _ = std::thread::Builder::new()
                    .stack_size(STACK_BYTES)
                    .spawn_scoped(scope, fill);
            }
            fill();
        });
    }

    /// Fills one lane's segment of the slice `at`.
    fn segment(&self, s: &mut Segment<'_>, lanes: &[Shared<'_>], at: Position, simd: Simd) {
        let seg = self.segment;
        let lane_len = seg * SLICES;
        let own = &lanes[s.lane];
        let independent = !self.id || (at.pass == 0 && at.slice < SLICES / 2);
        let mut input = Block::ZERO;
        let mut address = Block::ZERO;
        if independent {
            let m = self.block_count();
            input.0[..6].copy_from_slice(&[
                u64::from(at.pass),
                s.lane as u64,
                at.slice as u64,
                m as u64,
                u64::from(self.passes),
                if self.id { 2 } else { 1 },
            ]);
        }
        let first = if at.pass == 0 && at.slice == 0 { 2 } else { 0 };
        if independent && first == 2 {
            next_addresses(&mut input, &mut address, simd);
        }
        for b in first..seg {
            let rand = if independent {
                if b % WORDS == 0 {
                    next_addresses(&mut input, &mut address, simd);
                }
                address.0[b % WORDS]
            } else {
                previous(s, own, b, at.slice)[0]
            };
            let ref_lane = if at.pass == 0 && at.slice == 0 {
                s.lane
            } else {
                ((rand >> 32) % u64::from(self.lanes)) as usize
            };
            let same = ref_lane == s.lane;
            let area = match (at.pass, same) {
                (0, _) if at.slice == 0 => b - 1,
                (0, true) => at.slice * seg + b - 1,
                (0, false) => at.slice * seg - usize::from(b == 0),
                (_, true) => lane_len - seg + b - 1,
                (_, false) => lane_len - seg - usize::from(b == 0),
            };
            let x = rand & 0xFFFF_FFFF;
            let x = (x * x) >> 32;
            let relative = area - 1 - ((area as u64 * x) >> 32) as usize;
            let start = if at.pass != 0 && at.slice != SLICES - 1 {
                (at.slice + 1) * seg
            } else {
                0
            };
            let index = (start + relative) % lane_len;
            let (done, todo) = s.current.split_at_mut(b);
            let prev = match done.last() {
                Some(p) => p,
                None if at.slice == 0 => &own.after[own.after.len() - 1],
                None => &own.before[own.before.len() - 1],
            };
            let cur_start = at.slice * seg;
            let reference = if same && (cur_start..cur_start + seg).contains(&index) {
                &done[index - cur_start]
            } else {
                lanes[ref_lane].block(index, cur_start, seg)
            };
            compress(prev, reference, &mut todo[0], at.pass != 0, simd);
        }
    }
}

/// A pass and a slice.
#[derive(Clone, Copy)]
struct Position {
    pass: u32,
    slice: usize,
}

/// A lane's segment being filled.
struct Segment<'a> {
    lane: usize,
    current: &'a mut [Block],
}

/// What the fillers share of a lane: all but its current segment.
struct Shared<'a> {
    before: &'a [Block],
    after: &'a [Block],
}

impl Shared<'_> {
    /// Block `index` of the lane, outside its current segment, which
    /// starts at `start` and holds `seg` blocks.
    fn block(&self, index: usize, start: usize, seg: usize) -> &Block {
        if index < start {
            &self.before[index]
        } else {
            &self.after[index - start - seg]
        }
    }
}

/// The block before block `b` of the segment.
fn previous<'a>(s: &'a Segment<'_>, own: &'a Shared<'_>, b: usize, slice: usize) -> &'a [u64] {
    if b > 0 {
        &s.current[b - 1].0
    } else if slice == 0 {
        &own.after[own.after.len() - 1].0
    } else {
        &own.before[own.before.len() - 1].0
    }
}

/// The next block of data-independent addresses: the counter counts,
/// then G(0, G(0, input)).
fn next_addresses(input: &mut Block, address: &mut Block, simd: Simd) {
    input.0[6] += 1;
    let mut once = Block::ZERO;
    compress(&Block::ZERO, input, &mut once, false, simd);
    compress(&Block::ZERO, &once, address, false, simd);
}

/// A count that fits 32 bits by Argon2's bounds (lanes, the two first blocks).
fn word32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The compression to run: AVX2 or plain Rust.
#[derive(Clone, Copy, Debug)]
struct Simd {
    avx2: bool,
}

/// Compressions each way in one timing of [`Simd::detect`].
const TRIAL: usize = 32;

impl Simd {
    /// AVX2 where the CPU has it and it runs faster than plain Rust there.
    /// An emulated CPU's AVX2 can be the slower: in a QEMU TCG guest (one
    /// vCPU), 64 MiB × 4 passes took 4.3 s with AVX2 against 1.75 s
    /// without. So the first derivation of a process times a few
    /// compressions each way (best of three, well under a millisecond on
    /// hardware) and keeps the faster; both give the same bytes.
    fn detect() -> Simd {
        static CHOSEN: OnceLock<bool> = OnceLock::new();
        let avx2 = *CHOSEN.get_or_init(|| Simd::has_avx2() && Simd::avx2_is_faster());
        Simd { avx2 }
    }

    /// Whether the CPU has AVX2 at all.
    fn has_avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        let has = std::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let has = false;
        has
    }

    /// Whether [`TRIAL`] AVX2 compressions take less time than plain ones
    /// (the CPU has AVX2).
    fn avx2_is_faster() -> bool {
        let mut input = Block::ZERO;
        input.0[0] = 1;
        let mut best = [Duration::MAX; 2];
        for _ in 0..3 {
            for (b, avx2) in best.iter_mut().zip([false, true]) {
                let mut out = Block::ZERO;
                let t = Instant::now();
                for _ in 0..TRIAL {
                    compress(&input, &out.clone(), &mut out, true, Simd { avx2 });
                    std::hint::black_box(&mut out);
                }
                *b = (*b).min(t.elapsed());
            }
        }
        best[1] < best[0]
    }
}

/// G(prev, reference), stored in `out` or, after the first pass, XORed
/// into it.
fn compress(prev: &Block, reference: &Block, out: &mut Block, xor: bool, simd: Simd) {
    #[cfg(target_arch = "x86_64")]
    if simd.avx2 {
        // SAFETY: `simd.avx2` is true only when the CPU has AVX2
        // (`Simd::has_avx2`, checked before any AVX2 compression).
        unsafe { avx2::compress(prev, reference, out, xor) };
        return;
    }
    let _ = simd;
    plain::compress(prev, reference, out, xor);
}

/// BlaMka in plain Rust, word by word as RFC 9106 writes it.
mod plain {
    use super::{Block, WORDS};

    #[inline(always)]
    fn mul_add(x: u64, y: u64) -> u64 {
        let product = (x & 0xFFFF_FFFF) * (y & 0xFFFF_FFFF);
        x.wrapping_add(y).wrapping_add(product << 1)
    }

    #[inline(always)]
    fn g(v: &mut [u64; 16], a: usize, b: usize, c: usize, d: usize) {
        v[a] = mul_add(v[a], v[b]);
        v[d] = (v[d] ^ v[a]).rotate_right(32);
        v[c] = mul_add(v[c], v[d]);
        v[b] = (v[b] ^ v[c]).rotate_right(24);
        v[a] = mul_add(v[a], v[b]);
        v[d] = (v[d] ^ v[a]).rotate_right(16);
        v[c] = mul_add(v[c], v[d]);
        v[b] = (v[b] ^ v[c]).rotate_right(63);
    }

    /// The permutation P over 16 words.
    #[inline(always)]
    fn p(v: &mut [u64; 16]) {
        g(v, 0, 4, 8, 12);
        g(v, 1, 5, 9, 13);
        g(v, 2, 6, 10, 14);
        g(v, 3, 7, 11, 15);
        g(v, 0, 5, 10, 15);
        g(v, 1, 6, 11, 12);
        g(v, 2, 7, 8, 13);
        g(v, 3, 4, 9, 14);
    }

    pub(super) fn compress(prev: &Block, reference: &Block, out: &mut Block, xor: bool) {
        let mut r = Block::ZERO;
        for ((r, a), b) in r.0.iter_mut().zip(prev.0).zip(reference.0) {
            *r = a ^ b;
        }
        let mut q = r;
        for row in 0..8 {
            let mut v = [0u64; 16];
            v.copy_from_slice(&q.0[row * 16..row * 16 + 16]);
            p(&mut v);
            q.0[row * 16..row * 16 + 16].copy_from_slice(&v);
        }
        for col in 0..8 {
            let at = |k: usize| 2 * col + (k / 2) * 16 + k % 2;
            let mut v = [0u64; 16];
            for (k, x) in v.iter_mut().enumerate() {
                *x = q.0[at(k)];
            }
            p(&mut v);
            for (k, x) in v.iter().enumerate() {
                q.0[at(k)] = *x;
            }
        }
        for i in 0..WORDS {
            let g = q.0[i] ^ r.0[i];
            out.0[i] = if xor { out.0[i] ^ g } else { g };
        }
    }
}

/// BlaMka with AVX2: the block as 32 registers of four words, two rows of
/// the 8×8 matrix of word pairs at a time, as libargon2's optimised core
/// arranges it.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_blend_epi32, _mm256_mul_epu32, _mm256_permute4x64_epi64,
        _mm256_setr_epi8, _mm256_shuffle_epi32, _mm256_shuffle_epi8, _mm256_srli_epi64,
        _mm256_xor_si256,
    };

    use super::Block;

    type Regs = [__m256i; 32];

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rotr32(x: __m256i) -> __m256i {
        _mm256_shuffle_epi32::<0b10_11_00_01>(x)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rotr24(x: __m256i) -> __m256i {
        let m = _mm256_setr_epi8(
            3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10, 3, 4, 5, 6, 7, 0, 1, 2, 11, 12,
            13, 14, 15, 8, 9, 10,
        );
        _mm256_shuffle_epi8(x, m)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rotr16(x: __m256i) -> __m256i {
        let m = _mm256_setr_epi8(
            2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9, 2, 3, 4, 5, 6, 7, 0, 1, 10, 11,
            12, 13, 14, 15, 8, 9,
        );
        _mm256_shuffle_epi8(x, m)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rotr63(x: __m256i) -> __m256i {
        _mm256_xor_si256(_mm256_srli_epi64::<63>(x), _mm256_add_epi64(x, x))
    }

    /// x + y + 2·lo(x)·lo(y), four words at once.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn mul_add(x: __m256i, y: __m256i) -> __m256i {
        let m = _mm256_mul_epu32(x, y);
        _mm256_add_epi64(x, _mm256_add_epi64(y, _mm256_add_epi64(m, m)))
    }

    /// Half of G on four columns: with rotations 32, 24 (`first`) or 16, 63.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn half(a: &mut __m256i, b: &mut __m256i, c: &mut __m256i, d: &mut __m256i, first: bool) {
        *a = mul_add(*a, *b);
        *d = _mm256_xor_si256(*d, *a);
        *d = if first { rotr32(*d) } else { rotr16(*d) };
        *c = mul_add(*c, *d);
        *b = _mm256_xor_si256(*b, *c);
        *b = if first { rotr24(*b) } else { rotr63(*b) };
    }

    /// G on the eight registers: (a0, b0, c0, d0) and (a1, b1, c1, d1).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn g(v: &mut Regs, i: [usize; 8]) {
        let [a0, a1, b0, b1, c0, c1, d0, d1] = i;
        for first in [true, false] {
            let (mut a, mut b, mut c, mut d) = (v[a0], v[b0], v[c0], v[d0]);
            half(&mut a, &mut b, &mut c, &mut d, first);
            (v[a0], v[b0], v[c0], v[d0]) = (a, b, c, d);
            let (mut a, mut b, mut c, mut d) = (v[a1], v[b1], v[c1], v[d1]);
            half(&mut a, &mut b, &mut c, &mut d, first);
            (v[a1], v[b1], v[c1], v[d1]) = (a, b, c, d);
        }
    }

    /// The rows' round: diagonals by rotating words within registers.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn round_rows(v: &mut Regs, i: [usize; 8]) {
        let [_, _, b0, b1, c0, c1, d0, d1] = i;
        g(v, i);
        for (b, c, d) in [(b0, c0, d0), (b1, c1, d1)] {
            v[b] = _mm256_permute4x64_epi64::<0b00_11_10_01>(v[b]);
            v[c] = _mm256_permute4x64_epi64::<0b01_00_11_10>(v[c]);
            v[d] = _mm256_permute4x64_epi64::<0b10_01_00_11>(v[d]);
        }
        g(v, i);
        for (b, c, d) in [(b0, c0, d0), (b1, c1, d1)] {
            v[b] = _mm256_permute4x64_epi64::<0b10_01_00_11>(v[b]);
            v[c] = _mm256_permute4x64_epi64::<0b01_00_11_10>(v[c]);
            v[d] = _mm256_permute4x64_epi64::<0b00_11_10_01>(v[d]);
        }
    }

    /// The columns' round: diagonals across register pairs.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn round_columns(v: &mut Regs, i: [usize; 8]) {
        let [_, _, b0, b1, c0, c1, d0, d1] = i;
        g(v, i);
        let t1 = _mm256_blend_epi32::<0xCC>(v[b0], v[b1]);
        let t2 = _mm256_blend_epi32::<0x33>(v[b0], v[b1]);
        v[b1] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t1);
        v[b0] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t2);
        v.swap(c0, c1);
        let t1 = _mm256_blend_epi32::<0xCC>(v[d0], v[d1]);
        let t2 = _mm256_blend_epi32::<0x33>(v[d0], v[d1]);
        v[d0] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t1);
        v[d1] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t2);
        g(v, i);
        let t1 = _mm256_blend_epi32::<0xCC>(v[b0], v[b1]);
        let t2 = _mm256_blend_epi32::<0x33>(v[b0], v[b1]);
        v[b0] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t1);
        v[b1] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t2);
        v.swap(c0, c1);
        let t1 = _mm256_blend_epi32::<0x33>(v[d0], v[d1]);
        let t2 = _mm256_blend_epi32::<0xCC>(v[d0], v[d1]);
        v[d0] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t1);
        v[d1] = _mm256_permute4x64_epi64::<0b10_11_00_01>(t2);
    }

    fn regs(b: &Block) -> &Regs {
        // SAFETY: a Block is 1024 bytes aligned to 64, as 32 registers of 32
        // bytes (aligned to 32) are; every bit pattern is a value of both.
        unsafe { &*std::ptr::from_ref(b).cast::<Regs>() }
    }

    fn regs_mut(b: &mut Block) -> &mut Regs {
        // SAFETY: as in `regs`, and the borrow is the block's own.
        unsafe { &mut *std::ptr::from_mut(b).cast::<Regs>() }
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn compress(prev: &Block, reference: &Block, out: &mut Block, xor: bool) {
        let (p, q) = (regs(prev), regs(reference));
        let mut r: Regs = *p;
        for (r, q) in r.iter_mut().zip(q) {
            *r = _mm256_xor_si256(*r, *q);
        }
        let mut v = r;
        for i in 0..4 {
            let k = 8 * i;
            round_rows(&mut v, [k, k + 4, k + 1, k + 5, k + 2, k + 6, k + 3, k + 7]);
        }
        for i in 0..4 {
            round_columns(
                &mut v,
                [i, i + 4, i + 8, i + 12, i + 16, i + 20, i + 24, i + 28],
            );
        }
        let o = regs_mut(out);
        for ((o, v), r) in o.iter_mut().zip(v).zip(r) {
            let g = _mm256_xor_si256(v, r);
            *o = if xor { _mm256_xor_si256(*o, g) } else { g };
        }
    }
}

/// Argon2's variable-length hash H' of the concatenated `inputs`, filling `out`.
fn long_hash(inputs: &[&[u8]], out: &mut [u8]) {
    let len = word32(out.len()).to_le_bytes();
    if out.len() <= 64 {
        // Lengths 1 to 64 are Blake2b's own; the callers pass 4 and more.
        if let Ok(mut h) = Blake2bVar::new(out.len()) {
            h.update(&len);
            for i in inputs {
                h.update(i);
            }
            let _ = h.finalize_variable(out);
        }
        return;
    }
    let mut h = Blake2b512::new();
    Digest::update(&mut h, len);
    for i in inputs {
        Digest::update(&mut h, i);
    }
    let mut v = Zeroizing::new([0u8; 64]);
    v.copy_from_slice(&h.finalize());
    // V_1 … V_r give their first 32 bytes each, until 64 or fewer are left;
    // the last 1 to 64 are a hash of V_r of that length.
    let mut at = 0;
    loop {
        out[at..at + 32].copy_from_slice(&v[..32]);
        at += 32;
        if out.len() - at <= 64 {
            break;
        }
        let next = Blake2b512::digest(&v[..]);
        v.copy_from_slice(&next);
    }
    let rest = out.len() - at;
    if let Ok(mut h) = Blake2bVar::new(rest) {
        h.update(&v[..]);
        let _ = h.finalize_variable(&mut out[at..]);
    }
}

/// `n` zeroed blocks, or none if the memory cannot be had. From
/// `alloc_zeroed`, so pages the kernel zeroes as they are first touched:
/// no pass over the memory before Argon2's own (filling 256 MiB with
/// zeroed blocks costs about a tenth of a 4-pass derivation).
pub fn zeroed_blocks(n: usize) -> Option<Vec<Block>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<Block>(n).ok()?;
    // SAFETY: the layout's size is not zero (n > 0 blocks of 1 KiB).
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Block>();
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with the layout of `n`
    // blocks, which is the capacity given; all `n` are initialised, since a
    // block is an array of u64 (any bytes are a value).
    Some(unsafe { Vec::from_raw_parts(p, n, n) })
}

#[cfg(test)]
mod tests;

//! Argon2 against RFC 9106's vectors and against RustCrypto's `argon2`
//! crate on random parameters, with one thread and many, with AVX2 and
//! without.

use super::*;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The compressions this machine can run: plain always, AVX2 where the CPU has it.
fn simds() -> Vec<Simd> {
    let mut v = vec![Simd { avx2: false }];
    if Simd::has_avx2() {
        v.push(Simd { avx2: true });
    }
    v
}

fn ours(
    a: &Argon2,
    password: &[u8],
    salt: &[u8],
    extra: Extra<'_>,
    out_len: usize,
    threads: usize,
    simd: Simd,
) -> Vec<u8> {
    let mut memory = zeroed_blocks(a.block_count()).unwrap();
    let mut out = vec![0u8; out_len];
    let a = Argon2 { simd, ..*a };
    a.hash(password, salt, extra, &mut out, &mut memory, threads)
        .unwrap();
    out
}

/// RFC 9106 §5.2 and §5.3: 32 KiB, 3 passes, 4 lanes, with a secret and
/// associated data.
#[test]
fn rfc_9106_vectors_hold_on_every_thread_count_and_compression() {
    let vectors = [
        (
            false,
            "c8 14 d9 d1 dc 7f 37 aa 13 f0 d7 7f 24 94 bd a1 c8 de 6b 01 6d d3 88 d2 99 52 a4 c4 67 2b 6c e8",
        ),
        (
            true,
            "0d 64 0d f5 8d 78 76 6c 08 c0 37 a3 4a 8b 53 c9 d0 1e f0 45 2d 75 b6 5e b5 25 20 e9 6b 01 e6 59",
        ),
    ];
    let extra = Extra {
        secret: &[3; 8],
        data: &[4; 12],
    };
    for (id, tag) in vectors {
        let a = Argon2::new(id, 3, 32, 4).unwrap();
        for simd in simds() {
            for threads in [1, 2, 4, 9] {
                let out = ours(&a, &[1; 32], &[2; 16], extra, 32, threads, simd);
                assert_eq!(
                    out,
                    hex(tag),
                    "id {id}, {threads} threads, avx2 {}",
                    simd.avx2
                );
            }
        }
    }
}

/// The crate's answer for the same inputs, LUKS2's way (no secret, no data).
fn reference(id: bool, p: (u32, u32, u32), password: &[u8], salt: &[u8], len: usize) -> Vec<u8> {
    let (passes, memory_kib, lanes) = p;
    let algorithm = if id {
        ::argon2::Algorithm::Argon2id
    } else {
        ::argon2::Algorithm::Argon2i
    };
    let params = ::argon2::Params::new(memory_kib, passes, lanes, Some(len)).unwrap();
    let mut memory = vec![::argon2::Block::new(); params.block_count()];
    let mut out = vec![0u8; len];
    ::argon2::Argon2::new(algorithm, ::argon2::Version::V0x13, params)
        .hash_password_into_with_memory(password, salt, &mut out, &mut memory[..])
        .unwrap();
    out
}

/// Random costs (memory not a multiple of the lanes' segments too),
/// passwords, salts, key lengths around H''s 64-byte turn, thread counts
/// under, at and over the lanes: the same bytes as RustCrypto's argon2.
#[test]
fn random_parameters_give_what_rustcrypto_gives() {
    let mut rng = fastrand::Rng::with_seed(0x0a2_9106);
    for round in 0..60 {
        let id = rng.bool();
        let lanes = rng.u32(1..=6);
        let memory_kib = rng.u32(8 * lanes..=8 * lanes + 300);
        let passes = rng.u32(1..=4);
        let password: Vec<u8> = (0..rng.usize(0..80)).map(|_| rng.u8(..)).collect();
        let salt: Vec<u8> = (0..rng.usize(8..48)).map(|_| rng.u8(..)).collect();
        let len = [4, 32, 63, 64, 65, 96, 97, 130][rng.usize(0..8)];
        let want = reference(id, (passes, memory_kib, lanes), &password, &salt, len);
        let a = Argon2::new(id, passes, memory_kib, lanes).unwrap();
        for simd in simds() {
            let threads = rng.usize(1..=lanes as usize + 2);
            let got = ours(&a, &password, &salt, Extra::default(), len, threads, simd);
            assert_eq!(
                got, want,
                "round {round}: id {id}, t {passes}, m {memory_kib}, p {lanes}, \
                 {threads} threads, {len} bytes, avx2 {}",
                simd.avx2
            );
        }
    }
}

/// A keyslot's shape, big enough that the lanes' threads overlap: the
/// threaded fill gives what one thread gives, and the crate's answer.
#[test]
fn a_keyslot_sized_derivation_is_the_same_on_threads() {
    let a = Argon2::new(true, 2, 8192, 4).unwrap();
    let (password, salt) = (b"crust bench".as_slice(), [7u8; 32]);
    let want = reference(true, (2, 8192, 4), password, &salt, 64);
    for simd in simds() {
        for threads in [1, 2, 4] {
            let got = ours(&a, password, &salt, Extra::default(), 64, threads, simd);
            assert_eq!(got, want, "{threads} threads, avx2 {}", simd.avx2);
        }
    }
}

/// The two compressions agree on random blocks, stored and XORed.
#[test]
fn avx2_and_plain_compressions_agree() {
    if !Simd::has_avx2() {
        return;
    }
    let mut rng = fastrand::Rng::with_seed(7);
    let mut random = || {
        let mut b = Block::ZERO;
        b.0.iter_mut().for_each(|w| *w = rng.u64(..));
        b
    };
    for xor in [false, true] {
        let (p, r, o) = (random(), random(), random());
        let (mut a, mut b) = (o, o);
        compress(&p, &r, &mut a, xor, Simd { avx2: false });
        compress(&p, &r, &mut b, xor, Simd { avx2: true });
        assert_eq!(a.0, b.0, "xor {xor}");
        assert_ne!(a.0, o.0);
    }
}

#[test]
fn costs_argon2_cannot_compute_are_named() {
    let cases = [
        (Argon2::new(true, 4, 1024, 0).unwrap_err(), "0 lanes"),
        (
            Argon2::new(true, 4, 1024, MAX_LANES + 1).unwrap_err(),
            "16777216 lanes",
        ),
        (Argon2::new(true, 0, 1024, 1).unwrap_err(), "no passes"),
        (
            Argon2::new(true, 1, 31, 4).unwrap_err(),
            "31 KiB of memory, under Argon2's 8 KiB a lane for 4 lanes",
        ),
    ];
    for (e, want) in cases {
        assert!(e.to_string().contains(want), "{e}");
    }
    let a = Argon2::new(true, 1, 32, 1).unwrap();
    let mut memory = zeroed_blocks(a.block_count()).unwrap();
    let mut out = [0u8; 32];
    let e = a
        .hash(b"", &[0; 7], Extra::default(), &mut out, &mut memory, 1)
        .unwrap_err();
    assert_eq!(e, Bad::Salt(7));
    let e = a
        .hash(
            b"",
            &[0; 8],
            Extra::default(),
            &mut out[..3],
            &mut memory,
            1,
        )
        .unwrap_err();
    assert_eq!(e, Bad::Output(3));
    let e = a
        .hash(
            b"",
            &[0; 8],
            Extra::default(),
            &mut out,
            &mut memory[..31],
            1,
        )
        .unwrap_err();
    assert_eq!(
        e,
        Bad::Blocks {
            given: 31,
            needs: 32
        }
    );
    assert_eq!(out, [0; 32], "nothing is written for a refused call");
}

/// A header's many lanes of two blocks a segment (what a hostile lane
/// count can ask within the memory limit): the threads are bounded by the
/// caller, the lanes still all filled, and the answer is the crate's.
#[test]
fn many_small_lanes_on_a_few_threads() {
    let (lanes, memory_kib) = (200, 8 * 200 + 37);
    let a = Argon2::new(false, 2, memory_kib, lanes).unwrap();
    let want = reference(false, (2, memory_kib, lanes), b"pw", &[5; 16], 32);
    for threads in [3, 16] {
        let got = ours(&a, b"pw", &[5; 16], Extra::default(), 32, threads, a.simd);
        assert_eq!(got, want, "{threads} threads");
    }
}

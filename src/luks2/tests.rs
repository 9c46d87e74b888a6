//! The header reader and the unlock against images `cryptsetup luksFormat`
//! made on plain files (no device-mapper needed), and cryptsetup against
//! images the agent's `format` made, each volume key compared with
//! `cryptsetup luksDump --dump-volume-key`. They are ignored in a plain
//! `cargo test` (make test runs them) and fail, saying so, where cryptsetup
//! is missing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

use super::error::Error;
use super::format::{self, Formatted, KdfCost, OsRandom, SectorSize};
use super::header::{self, Copy, Header};
use super::unlock::{unlock, Limits, Unlocked};
use crate::code::Code;

// ------------------------------------------------------------ cryptsetup --

/// The first line of each test here: cryptsetup on PATH, or the test fails
/// saying so.
#[track_caller]
fn needs_cryptsetup() {
    crust_testkit::needs::tools(&["cryptsetup"], "apt-get install cryptsetup-bin");
}

/// Runs cryptsetup through the test kit (the agent's own code spawns
/// nothing); its stdout, or the test fails with its stderr.
fn cryptsetup(args: &[&str]) -> String {
    crust_testkit::run("cryptsetup", args)
}

/// An image file made by `cryptsetup luksFormat --type luks2` with `args`,
/// its first passphrase written to a key file beside it.
struct Image {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Image {
    /// A sparse image of `bytes`, all zeros.
    fn blank(bytes: u64) -> Image {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(bytes)
            .unwrap();
        Image { _dir: dir, path }
    }

    fn format(passphrase: &[u8], args: &[&str]) -> Image {
        let img = Image::blank(32 << 20);
        let key = write_key(img.dir(), "key0", passphrase);
        let mut all = vec!["luksFormat", "--batch-mode", "--key-file", &key];
        all.extend_from_slice(args);
        all.push(img.path.to_str().unwrap());
        cryptsetup(&all);
        img
    }

    /// A blank 32 MiB image formatted by the agent with `options`, from
    /// the kernel's random bytes.
    fn format_by_agent(passphrase: &[u8], options: format::Options) -> (Image, Formatted) {
        use std::os::unix::fs::FileExt;
        let img = Image::blank(32 << 20);
        let pass = Zeroizing::new(passphrase.to_vec());
        let f = format::format(32 << 20, &pass, &options, &mut OsRandom).unwrap();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&img.path)
            .unwrap();
        for w in &f.writes {
            file.write_all_at(&w.bytes, w.offset).unwrap();
        }
        (img, f)
    }

    fn dir(&self) -> &Path {
        self._dir.path()
    }

    /// Adds `new` as a passphrase (opened with `old`), with `args`.
    fn add_key(&self, old: &[u8], new: &[u8], args: &[&str]) {
        let old = write_key(self.dir(), "old", old);
        let new = write_key(self.dir(), "new", new);
        let mut all = vec!["luksAddKey", "--batch-mode", "--key-file", &old];
        all.extend_from_slice(args);
        all.extend_from_slice(&[self.path.to_str().unwrap(), &new]);
        cryptsetup(&all);
    }

    /// The volume key as cryptsetup dumps it with `passphrase`.
    fn volume_key(&self, passphrase: &[u8]) -> Vec<u8> {
        let key = write_key(self.dir(), "dump", passphrase);
        let out = cryptsetup(&[
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
            &key,
            self.path.to_str().unwrap(),
        ]);
        let dump = out
            .split_once("MK dump:")
            .unwrap_or_else(|| panic!("no MK dump in {out}"))
            .1;
        dump.split_whitespace()
            .map(|h| u8::from_str_radix(h, 16).unwrap())
            .collect()
    }

    fn header(&self) -> Result<Header, Error> {
        let f = std::fs::File::open(&self.path).unwrap();
        header::read(&f, f.metadata().unwrap().len())
    }

    fn unlock(&self, passphrase: &[u8], only: Option<u32>) -> Result<Unlocked, Error> {
        let h = self.header()?;
        let f = std::fs::File::open(&self.path).unwrap();
        let limits = Limits {
            argon2_memory_kib: 1 << 20,
            argon2_passes: 16,
            pbkdf2_iterations: 1 << 20,
        };
        unlock(&f, &h, &Zeroizing::new(passphrase.to_vec()), limits, only)
    }

    /// Unlocks with the agent and checks the key against cryptsetup's.
    fn same_key(&self, passphrase: &[u8]) -> Unlocked {
        let u = self.unlock(passphrase, None).unwrap();
        assert_eq!(u.volume_key.bytes(), &self.volume_key(passphrase)[..]);
        u
    }
}

fn write_key(dir: &Path, name: &str, passphrase: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, passphrase).unwrap();
    p.to_str().unwrap().to_string()
}

const FAST_PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
const FAST_ARGON2ID: &[&str] = &[
    "--pbkdf",
    "argon2id",
    "--pbkdf-memory",
    "32768",
    "--pbkdf-force-iterations",
    "4",
];

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn pbkdf2_keyslots_open_with_cryptsetups_volume_key() {
    needs_cryptsetup();
    for (extra, key_bits) in [
        (&["--key-size", "512"][..], 512),
        (&["--key-size", "256"], 256),
        (&["--key-size", "512", "--hash", "sha512"], 512),
        (&["--key-size", "256", "--hash", "sha1"], 256),
        (&["--key-size", "512", "--sector-size", "512"], 512),
    ] {
        let args = [FAST_PBKDF2, extra].concat();
        let img = Image::format(b"correct horse", &args);
        let u = img.same_key(b"correct horse");
        assert_eq!(u.volume_key.bytes().len() * 8, key_bits, "{args:?}");
        assert_eq!(u.keyslot, 0);
        let s = &u.segment;
        assert_eq!(
            (s.kind.as_str(), s.encryption.as_str()),
            ("crypt", "aes-xts-plain64")
        );
        assert_eq!(
            (s.offset, s.size, s.iv_tweak, s.integrity.as_ref()),
            (16 << 20, None, 0, None)
        );
        let sector = if extra.contains(&"--sector-size") {
            512
        } else {
            4096
        };
        assert_eq!(s.sector_size, sector, "{args:?}");
        // Debug shows the key's size only.
        let shown = format!("{u:?}");
        assert!(
            shown.contains("VolumeKey(") && shown.contains("redacted"),
            "{shown}"
        );
        let hex: String = u.volume_key.bytes()[..4]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(!shown.contains(&hex), "{shown}");
    }
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn argon2_keyslots_open_with_cryptsetups_volume_key() {
    needs_cryptsetup();
    for kdf in ["argon2id", "argon2i"] {
        for parallel in ["1", "4"] {
            let mut args = FAST_ARGON2ID.to_vec();
            args[1] = kdf;
            args.extend_from_slice(&["--pbkdf-parallel", parallel]);
            let img = Image::format(b"p\xffss\0word", &args);
            img.same_key(b"p\xffss\0word");
        }
    }
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn each_of_several_keyslots_opens_and_a_wrong_passphrase_does_not() {
    needs_cryptsetup();
    let img = Image::format(b"first", FAST_PBKDF2);
    img.add_key(
        b"first",
        b"second",
        &[FAST_ARGON2ID, &["--key-slot", "3"]].concat(),
    );
    img.add_key(
        b"first",
        b"third",
        &[FAST_PBKDF2, &["--hash", "sha512", "--key-slot", "7"]].concat(),
    );
    let key = img.volume_key(b"first");
    for (pass, slot) in [(&b"first"[..], 0), (b"second", 3), (b"third", 7)] {
        let u = img.unlock(pass, None).unwrap();
        assert_eq!((u.keyslot, u.volume_key.bytes()), (slot, &key[..]));
    }
    let e = img.unlock(b"fourth", None).unwrap_err();
    assert!(matches!(e, Error::WrongPassphrase), "{e}");
    assert_eq!(e.code(), Code::PermissionDenied);
    // Named: only that slot is tried.
    assert!(matches!(
        img.unlock(b"third", Some(3)),
        Err(Error::WrongPassphrase)
    ));
    assert_eq!(img.unlock(b"third", Some(7)).unwrap().keyslot, 7);
    assert!(matches!(
        img.unlock(b"third", Some(9)),
        Err(Error::NoKeyslot { .. })
    ));
    // Priority: an ignored slot opens only when named; a preferred one is tried first.
    let path = img.path.to_str().unwrap();
    cryptsetup(&["config", "--priority", "ignore", "--key-slot", "7", path]);
    assert!(matches!(
        img.unlock(b"third", None),
        Err(Error::WrongPassphrase)
    ));
    assert_eq!(img.unlock(b"third", Some(7)).unwrap().keyslot, 7);
    cryptsetup(&["config", "--priority", "prefer", "--key-slot", "3", path]);
    let h = img.header().unwrap();
    let prio: Vec<(u32, u8)> = h
        .metadata
        .keyslots
        .iter()
        .map(|(n, k)| (*n, k.priority))
        .collect();
    assert_eq!(prio, [(0, 1), (3, 2), (7, 0)]);
    assert_eq!(img.unlock(b"second", None).unwrap().keyslot, 3);
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn argon2_memory_over_the_limit_is_refused_before_any_work() {
    needs_cryptsetup();
    let img = Image::format(
        b"pw",
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "262144",
            "--pbkdf-force-iterations",
            "4",
        ],
    );
    let h = img.header().unwrap();
    let f = std::fs::File::open(&img.path).unwrap();
    let start = Instant::now();
    let limits = Limits {
        argon2_memory_kib: 65536,
        argon2_passes: 4,
        pbkdf2_iterations: 1000,
    };
    let e = unlock(&f, &h, &Zeroizing::new(b"pw".to_vec()), limits, None).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_millis(50),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(e.code(), Code::FailedPrecondition);
    let msg = e.to_string();
    assert!(
        msg.contains("262144 KiB") && msg.contains("65536 KiB"),
        "{msg}"
    );
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn a_damaged_primary_gives_way_to_the_secondary_as_in_cryptsetup() {
    needs_cryptsetup();
    let img = Image::format(b"pw", FAST_PBKDF2);
    let key = img.volume_key(b"pw");
    assert_eq!(img.header().unwrap().copy, Copy::Primary);
    // A flipped byte in the primary's JSON area: its checksum no longer holds.
    let mut bytes = std::fs::read(&img.path).unwrap();
    bytes[4096 + 10] ^= 0x20;
    std::fs::write(&img.path, &bytes).unwrap();
    let h = img.header().unwrap();
    assert_eq!(h.copy, Copy::Secondary);
    assert_eq!(
        img.unlock(b"pw", None).unwrap().volume_key.bytes(),
        &key[..]
    );
    // cryptsetup reads the same volume key from what is left.
    assert_eq!(img.volume_key(b"pw"), key);
    // Both damaged: refused, naming both.
    let mut bytes = std::fs::read(&img.path).unwrap();
    bytes[4096 + 10] ^= 0x20;
    bytes[16384 + 4096 + 10] ^= 0x20;
    bytes[4096 + 11] ^= 0x20;
    std::fs::write(&img.path, &bytes).unwrap();
    let e = img.header().unwrap_err();
    assert!(
        e.to_string()
            .contains("the primary: a checksum that does not match"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("the secondary: at byte 16384: a checksum"),
        "{e}"
    );
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn luks1_is_recognised_and_refused() {
    needs_cryptsetup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let key = write_key(dir.path(), "k", b"pw");
    cryptsetup(&[
        "luksFormat",
        "--type",
        "luks1",
        "--batch-mode",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        &key,
        path.to_str().unwrap(),
    ]);
    let f = std::fs::File::open(&path).unwrap();
    let e = header::read(&f, 8 << 20).unwrap_err();
    assert!(matches!(e, Error::Luks1), "{e}");
    assert!(e.to_string().contains("LUKS1"), "{e}");
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn the_header_reads_as_luksdump_says() {
    needs_cryptsetup();
    let img = Image::format(
        b"pw",
        &[
            FAST_PBKDF2,
            &[
                "--label",
                "pvc-1",
                "--subsystem",
                "crust",
                "--luks2-metadata-size",
                "64k",
            ],
        ]
        .concat(),
    );
    let h = img.header().unwrap();
    let dump = cryptsetup(&["luksDump", img.path.to_str().unwrap()]);
    assert!(
        dump.contains(&format!("UUID:          \t{}", h.uuid)),
        "{dump}"
    );
    assert_eq!(
        (h.label.as_str(), h.subsystem.as_str(), h.hdr_size),
        ("pvc-1", "crust", 65536)
    );
    assert!(
        dump.contains(&format!("Epoch:         \t{}", h.seqid)),
        "{dump}"
    );
    assert_eq!(h.metadata.config.json_size, 65536 - 4096);
    img.same_key(b"pw");
}

// ------------------------------------------------ what the agent formats --

/// Options with `kdf` and `sector_size`, and no integrity.
fn options(kdf: KdfCost, sector_size: SectorSize) -> format::Options {
    format::Options {
        kdf,
        sector_size,
        integrity: None,
    }
}

/// What the agent formatted, as cryptsetup reads it: luksDump names its
/// parts, `open --test-passphrase` takes its passphrase and refuses
/// another, and `luksDump --dump-volume-key` gives the agent's volume key,
/// which the agent's own unlock gives too.
fn cryptsetup_opens(options: format::Options, dump_says: &[&str]) {
    needs_cryptsetup();
    let (img, f) = Image::format_by_agent(b"p\xffss\0word", options);
    let path = img.path.to_str().unwrap();
    cryptsetup(&["isLuks", "--type", "luks2", path]);
    let dump = cryptsetup(&["luksDump", path]);
    let sector = format!("sector: {} [bytes]", options.sector_size.bytes());
    let key_bytes = format::volume_key_bytes(options.integrity);
    let key = format!("Key:        {} bits", key_bytes * 8);
    let area = format!("Area length:{} [bytes]", format::area_bytes(key_bytes));
    for says in [
        "Version:       \t2",
        "Metadata area: \t16384 [bytes]",
        "Keyslots area: \t16744448 [bytes]",
        &format!("UUID:          \t{}", f.uuid),
        "0: crypt",
        "offset: 16777216 [bytes]",
        "length: (whole device)",
        "cipher: aes-xts-plain64",
        &sector,
        "0: luks2",
        &key,
        "Cipher:     aes-xts-plain64",
        "Cipher key: 512 bits",
        "AF stripes: 4000",
        "AF hash:    sha256",
        "Area offset:32768 [bytes]",
        &area,
        "0: pbkdf2",
        "Iterations: 1000",
    ]
    .iter()
    .chain(dump_says)
    {
        assert!(dump.contains(says), "{says:?} not in\n{dump}");
    }
    let key = write_key(img.dir(), "open", b"p\xffss\0word");
    cryptsetup(&["open", "--test-passphrase", "--key-file", &key, path]);
    let wrong = write_key(img.dir(), "wrong", b"p\xffss\0wore");
    let said = crust_testkit::fails(
        "cryptsetup",
        &["open", "--test-passphrase", "--key-file", &wrong, path],
    );
    assert!(
        said.contains("No key available with this passphrase"),
        "{said}"
    );
    assert_eq!(img.volume_key(b"p\xffss\0word"), f.volume_key.bytes());
    let u = img.same_key(b"p\xffss\0word");
    assert_eq!(u.segment, f.segment);
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn cryptsetup_opens_what_the_agent_formats_with_argon2id() {
    let kdf = KdfCost::Argon2id {
        memory_kib: 32768,
        passes: 4,
        lanes: 2,
    };
    let says = [
        "PBKDF:      argon2id",
        "Time cost:  4",
        "Memory:     32768",
        "Threads:    2",
    ];
    cryptsetup_opens(options(kdf, SectorSize::Bytes512), &says);
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn cryptsetup_opens_what_the_agent_formats_with_pbkdf2() {
    let kdf = KdfCost::Pbkdf2Sha256 { iterations: 1000 };
    let says = ["PBKDF:      pbkdf2", "Hash:       sha256"];
    cryptsetup_opens(options(kdf, SectorSize::Bytes512), &says);
}

/// A header with integrity, as the agent writes it for `--integrity
/// hmac-sha256`: the host has no device-mapper, so cryptsetup reads the
/// header and the keyslot only (the VM test opens the volume).
#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn cryptsetup_opens_what_the_agent_formats_with_integrity() {
    let o = format::Options {
        integrity: Some(format::Mac::HmacSha256),
        ..options(
            KdfCost::Argon2id {
                memory_kib: 1024,
                passes: 4,
                lanes: 1,
            },
            SectorSize::Bytes4096,
        )
    };
    cryptsetup_opens(o, &["integrity: hmac(sha256)", "PBKDF:      argon2id"]);
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn cryptsetup_opens_what_the_agent_formats_with_4096_byte_sectors() {
    let kdf = KdfCost::Argon2id {
        memory_kib: 1024,
        passes: 4,
        lanes: 1,
    };
    cryptsetup_opens(
        options(kdf, SectorSize::Bytes4096),
        &["PBKDF:      argon2id"],
    );
}

/// cryptsetup's `repair` finds nothing to mend, and its JSON dump (printed
/// with whitespace between the members) is the agent's JSON area.
#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn cryptsetup_finds_nothing_to_repair_in_what_the_agent_formats() {
    needs_cryptsetup();
    let kdf = KdfCost::Pbkdf2Sha256 { iterations: 1000 };
    let (img, f) = Image::format_by_agent(b"pw", options(kdf, SectorSize::Bytes512));
    let path = img.path.to_str().unwrap();
    let before = std::fs::read(&img.path).unwrap();
    cryptsetup(&["repair", "--batch-mode", path]);
    assert!(
        before == std::fs::read(&img.path).unwrap(),
        "cryptsetup repair changed the image"
    );
    let json = cryptsetup(&["luksDump", "--dump-json-metadata", path]);
    let area = &f.writes[2].bytes[4096..];
    let ours = std::str::from_utf8(&area[..area.iter().position(|b| *b == 0).unwrap()]).unwrap();
    assert_eq!(json.split_whitespace().collect::<String>(), ours);
}

#[test]
#[ignore = "needs cryptsetup: make test runs it"]
fn a_device_too_small_is_refused_and_left_as_it_is() {
    needs_cryptsetup();
    let img = Image::blank(16 << 20);
    let options = options(
        KdfCost::Pbkdf2Sha256 { iterations: 1000 },
        SectorSize::Bytes512,
    );
    let e = format::format(
        16 << 20,
        &Zeroizing::new(b"pw".to_vec()),
        &options,
        &mut OsRandom,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooSmall {
                needs: 16_777_728,
                ..
            }
        ),
        "{e}"
    );
    assert!(crust_testkit::allocated(&img.path) == 0);
    let said = crust_testkit::fails("cryptsetup", &["isLuks", img.path.to_str().unwrap()]);
    assert!(
        said.is_empty() || said.contains("not a valid LUKS"),
        "{said}"
    );
}

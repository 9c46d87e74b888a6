//! The blank rule on disks in memory and on sparse image files: zeros are
//! blank, a byte in any region read is not, a byte outside them is not
//! seen; what mkfs.ext4 and the agent's own format write is named.

use std::cell::Cell;
use std::os::unix::fs::FileExt;

use super::*;
use crate::code::Code;
use crate::luks2::format::{self, KdfCost, SectorSize};
use crate::luks2::header::Head;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A disk that counts the bytes read from it, zeros after `bytes`.
struct Counted<'a> {
    bytes: &'a [u8],
    read: Cell<u64>,
}

impl ReadAt for Counted<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.read.set(self.read.get() + buf.len() as u64);
        Head(self.bytes).read_exact_at(buf, offset)
    }
}

/// The most read from any disk (the tail starts on a sector: up to 511
/// bytes more on a device that is not whole sectors).
const MOST: u64 = HEAD + 8 * WINDOW + TAIL + 511;

#[test]
fn the_regions_are_bounded_ordered_apart_and_inside_the_device() {
    for size in [
        0,
        1,
        511,
        4096,
        MIB,
        HEAD,
        HEAD + 1,
        5 * MIB,
        8 * MIB + 100,
        9 * MIB,
        GIB,
        GIB + 1,
        GIB + WINDOW + 1000,
        2 * GIB,
        1 << 40,
        u64::MAX,
    ] {
        let r = regions(size);
        let total: u64 = r.iter().map(|(_, len)| len).sum();
        assert!(total <= MOST && total <= size, "{size}: {r:?}");
        let mut end = 0;
        for (at, len) in &r {
            assert!(*at >= end && *len > 0 && at % 512 == 0, "{size}: {r:?}");
            end = at + len;
        }
        assert!(end <= size, "{size}: {r:?}");
        // The first and the last MiB are read whole.
        if size > 0 {
            assert_eq!(r[0], (0, size.min(HEAD)), "{size}");
            assert_eq!(end, size, "{size}");
        }
    }
    assert_eq!(
        regions(2 * GIB),
        [
            (0, HEAD),
            (8 * MIB, WINDOW),
            (16 * MIB, WINDOW),
            (32 * MIB, WINDOW),
            (64 * MIB, WINDOW),
            (128 * MIB, WINDOW),
            (256 * MIB, WINDOW),
            (512 * MIB, WINDOW),
            (GIB, WINDOW),
            (2 * GIB - MIB, MIB),
        ]
    );
    // The tail joins what is read already, never reading a byte twice.
    assert_eq!(regions(5 * MIB), [(0, HEAD), (HEAD, 5 * MIB - HEAD)]);
}

#[test]
fn zeros_are_blank_and_cost_a_bounded_read() {
    for size in [0, 4096, 20 * MIB, 2 * GIB, 1 << 44] {
        let disk = Counted {
            bytes: &[],
            read: Cell::new(0),
        };
        check_blank(&disk, size).unwrap();
        assert!(
            disk.read.get() <= MOST.min(size),
            "{size}: {}",
            disk.read.get()
        );
    }
}

#[test]
fn a_small_disk_is_read_to_its_end_and_no_further() {
    // `[u8]` refuses a read past its end.
    for size in [0usize, 1000, 4096, 3 << 20] {
        let mut disk = vec![0u8; size];
        check_blank(&disk[..], size as u64).unwrap();
        if size > 0 {
            disk[size - 1] = 7;
            let e = check_blank(&disk[..], size as u64).unwrap_err();
            assert!(
                matches!(e, NotBlank::NotZero { byte } if byte == size as u64 - 1),
                "{e}"
            );
        }
    }
    // A device that says it is longer than it reads: an error, not blank.
    let e = check_blank(&[0u8; 100][..], MIB).unwrap_err();
    assert!(matches!(e, NotBlank::Read(_)), "{e}");
    assert_eq!(e.code(), Code::Internal);
}

/// One byte 1 at `at` of a 2 GiB sparse image: whether it is seen.
fn one_byte_at(at: u64) -> Result<(), NotBlank> {
    let dir = tempfile::tempdir().unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(dir.path().join("disk.img"))
        .unwrap();
    f.set_len(2 * GIB).unwrap();
    f.write_all_at(&[1], at).unwrap();
    check_blank(&f, 2 * GIB)
}

#[test]
fn a_byte_is_seen_in_every_region_and_only_there() {
    for at in [
        0,
        63 * 512,
        MIB + 5,
        4 * MIB,
        HEAD - 1,
        8 * MIB,
        8 * MIB + WINDOW - 1,
        512 * MIB + 100 * 1024,
        GIB + WINDOW - 1,
        2 * GIB - MIB,
        2 * GIB - 1,
    ] {
        let e = one_byte_at(at).unwrap_err();
        assert!(
            matches!(e, NotBlank::NotZero { byte } if byte == at),
            "{at}: {e}"
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        let msg = e.to_string();
        assert!(msg.contains(&format!("byte {at} is not zero")), "{msg}");
        assert!(msg.contains("left this one as it is"), "{msg}");
    }
    // Outside every region: not seen (the rule's documented limit).
    for at in [
        HEAD,
        8 * MIB + WINDOW,
        700 * MIB,
        GIB + WINDOW,
        2 * GIB - MIB - 1,
    ] {
        one_byte_at(at).unwrap_or_else(|e| panic!("{at}: {e}"));
    }
}

#[test]
fn a_luks2_header_the_agent_made_is_named() {
    let options = format::Options {
        kdf: KdfCost::Pbkdf2Sha256 { iterations: 1000 },
        sector_size: SectorSize::Bytes512,
        integrity: None,
    };
    let pass = zeroize::Zeroizing::new(b"pw".to_vec());
    let f = format::format(32 * MIB, &pass, &options, &mut format::OsRandom).unwrap();
    let mut img = vec![0u8; 1 << 20];
    for w in &f.writes {
        let at = usize::try_from(w.offset).unwrap();
        img[at..at + w.bytes.len()].copy_from_slice(&w.bytes);
    }
    let e = check_blank(&Head(&img), 32 * MIB).unwrap_err();
    assert!(
        matches!(
            e,
            NotBlank::Holds {
                what: "a LUKS header",
                at: 0,
                byte: 0
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .starts_with("the disk is not blank: it holds a LUKS header at byte 0"),
        "{e}"
    );
    // Its secondary header alone.
    img[..16384].fill(0);
    let e = check_blank(&Head(&img), 32 * MIB).unwrap_err();
    assert!(
        matches!(
            e,
            NotBlank::Holds {
                what: "a LUKS2 secondary header",
                at: 16384,
                byte: 16384
            }
        ),
        "{e}"
    );
}

/// A 4 MiB ext4 made by mkfs.ext4 at `offset` of a 64 MiB image (a
/// partition there).
fn ext4_at(offset: u64) -> Result<(), NotBlank> {
    crust_testkit::needs::tools(&["mkfs.ext4"], "apt-get install e2fsprogs");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let path = path.to_str().unwrap();
    let offset_option = format!("offset={offset}");
    crust_testkit::run("mkfs.ext4", &["-q", "-F", "-E", &offset_option, path, "4M"]);
    let f = std::fs::File::open(path).unwrap();
    check_blank(&f, 64 * MIB)
}

#[test]
#[ignore = "needs mkfs.ext4: make test runs it"]
fn an_ext4_is_named_where_it_starts() {
    for offset in [0, MIB, 8 * MIB] {
        let e = ext4_at(offset).unwrap_err();
        let NotBlank::Holds { what, at, byte } = e else {
            panic!("{offset}: {e}");
        };
        assert_eq!((what, at), ("an ext2/3/4 file system", offset), "{offset}");
        assert!(byte >= offset && byte < offset + 2048, "{offset}: {byte}");
    }
    // At 10 MiB, an offset where nothing is looked for: not seen.
    ext4_at(10 * MIB).unwrap();
}

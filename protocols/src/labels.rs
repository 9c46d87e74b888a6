//! A look at what a disk holds, with no tool: the labels filesystems,
//! volume managers, RAID and encryption write, wherever one could start on
//! a 512-byte boundary in the region read, and the offsets where
//! partitions and filesystems start. Pure: a function from bytes (and where
//! they lie on the device) to the first label found. Written once for the
//! two rules that a disk is blank before it is formatted: crustd's on the
//! host (with blkid beside it), the agent's in the guest (without).
//!
//! Each label is a magic number at a fixed place relative to the sector it
//! sits in; a sector is where a filesystem or a partition could begin, or
//! (for ext2/3/4) two sectors after such a place.

/// One kind of label.
struct Label {
    /// What it is, in words.
    name: &'static str,
    /// Where the magic lies within its 512-byte sector.
    at: usize,
    magic: &'static [u8],
    /// How far before that sector the thing it labels starts.
    starts_before: u64,
}

/// bcache's superblock magic (bcache.h), 24 bytes into its sector.
const BCACHE: [u8; 16] = [
    0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba, 0x6d, 0x81,
];

/// The labels looked for: what `blkid -p` would name, written down from
/// each format's own definition.
const LABELS: &[Label] = &[
    // ext2/3/4: the superblock is 1024 bytes in, s_magic 0xEF53 at 56.
    Label {
        name: "an ext2/3/4 file system",
        at: 56,
        magic: &[0x53, 0xef],
        starts_before: 1024,
    },
    // XFS: the superblock opens the file system, "XFSB".
    Label {
        name: "an XFS file system",
        at: 0,
        magic: b"XFSB",
        starts_before: 0,
    },
    // GPT header ("EFI PART") at LBA 1, or a backup header at the last LBA.
    Label {
        name: "a GPT partition table header",
        at: 0,
        magic: b"EFI PART",
        starts_before: 0,
    },
    // LVM2's physical volume label, in one of the first four sectors.
    Label {
        name: "an LVM2 physical volume label",
        at: 0,
        magic: b"LABELONE",
        starts_before: 0,
    },
    // LUKS 1 and 2, and LUKS2's secondary header.
    Label {
        name: "a LUKS header",
        at: 0,
        magic: b"LUKS\xba\xbe",
        starts_before: 0,
    },
    Label {
        name: "a LUKS2 secondary header",
        at: 0,
        magic: b"SKUL\xba\xbe",
        starts_before: 0,
    },
    // MD RAID superblocks (0.90, 1.0, 1.1, 1.2): 0xa92b4efc, little-endian.
    Label {
        name: "an MD RAID superblock",
        at: 0,
        magic: &[0xfc, 0x4e, 0x2b, 0xa9],
        starts_before: 0,
    },
    // bcache: its superblock at sector 8 of the device, magic at 24.
    Label {
        name: "a bcache superblock",
        at: 24,
        magic: &BCACHE,
        starts_before: 4096,
    },
    // Linux swap: "SWAPSPACE2" ends the first 4 KiB page.
    Label {
        name: "Linux swap",
        at: 502,
        magic: b"SWAPSPACE2",
        starts_before: 3584,
    },
    // btrfs: "_BHRfS_M" 64 bytes into the superblock at 64 KiB.
    Label {
        name: "a btrfs file system",
        at: 64,
        magic: b"_BHRfS_M",
        starts_before: 65536,
    },
    // A DOS partition table or a boot sector (FAT, NTFS): 0x55AA ends the sector.
    Label {
        name: "a DOS partition table or boot sector",
        at: 510,
        magic: &[0x55, 0xaa],
        starts_before: 0,
    },
];

/// Where partitions and filesystems start besides the device's start, and
/// so where blkid is asked to probe: 63 sectors (the DOS era's first
/// partition), then every power of two from 1 MiB to 1 GiB (the alignments
/// of fdisk, parted, sgdisk and the clouds' images). Those beyond a device
/// are skipped.
pub const PROBE_AT: [u64; 12] = [
    63 * 512,
    1 << 20,
    2 << 20,
    4 << 20,
    8 << 20,
    16 << 20,
    32 << 20,
    64 << 20,
    128 << 20,
    256 << 20,
    512 << 20,
    1 << 30,
];

/// Sector size the labels are placed by.
pub const SECTOR: usize = 512;

/// A label found: what, and the byte on the device where what it labels starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub what: &'static str,
    pub at: u64,
}

/// The first label in `bytes`, which lie at byte `offset` of the device
/// (a multiple of [`SECTOR`]).
pub fn first_label(bytes: &[u8], offset: u64) -> Option<Found> {
    for (i, sector) in bytes.chunks_exact(SECTOR).enumerate() {
        if sector.iter().all(|b| *b == 0) {
            continue;
        }
        let here = offset.saturating_add(u64::try_from(i * SECTOR).unwrap_or(u64::MAX));
        for l in LABELS {
            let end = l.at + l.magic.len();
            if sector.get(l.at..end) == Some(l.magic) {
                return Some(Found {
                    what: l.name,
                    at: here.saturating_sub(l.starts_before),
                });
            }
        }
    }
    None
}

/// The first byte in `bytes` (at `offset` of the device) that is not zero.
pub fn first_nonzero(bytes: &[u8], offset: u64) -> Option<u64> {
    bytes
        .iter()
        .position(|b| *b != 0)
        .map(|i| offset.saturating_add(u64::try_from(i).unwrap_or(u64::MAX)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` zero bytes with `magic` written at `at`.
    fn with(len: usize, at: usize, magic: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; len];
        b[at..at + magic.len()].copy_from_slice(magic);
        b
    }

    #[test]
    fn each_label_is_found_where_its_thing_starts() {
        let mib = 1 << 20;
        let table: &[(usize, &[u8], &str, u64)] = &[
            // An ext4 at 1 MiB: its magic at 1 MiB + 1080.
            (mib + 1080, &[0x53, 0xef], "ext2/3/4", 1 << 20),
            // An ext4 at 63 sectors (a DOS-era first partition).
            (63 * 512 + 1080, &[0x53, 0xef], "ext2/3/4", 63 * 512),
            (3 * mib + 512, b"XFSB", "XFS", 3 * (1 << 20) + 512),
            (512, b"EFI PART", "GPT", 512),
            (mib + 512, b"LABELONE", "LVM2", (1 << 20) + 512),
            (4096, b"LUKS\xba\xbe", "LUKS header", 4096),
            (16384, b"SKUL\xba\xbe", "LUKS2 secondary", 16384),
            (4096, &[0xfc, 0x4e, 0x2b, 0xa9], "MD RAID", 4096),
            (4096 + 24, &BCACHE, "bcache", 0),
            (4086, b"SWAPSPACE2", "swap", 0),
            (65536 + 64, b"_BHRfS_M", "btrfs", 0),
            (510, &[0x55, 0xaa], "DOS", 0),
        ];
        for (at, magic, says, start) in table {
            let b = with(4 * mib, *at, magic);
            let f = first_label(&b, 0).unwrap_or_else(|| panic!("{says} not found"));
            assert!(f.what.contains(says), "{says}: {f:?}");
            assert_eq!(f.at, *start, "{says}");
        }
        // Placed by the device offset of the bytes read.
        let b = with(mib, 1080, &[0x53, 0xef]);
        assert_eq!(first_label(&b, 7 << 20).unwrap().at, 7 << 20);
        // Zeros hold nothing; a magic that straddles its place is not one.
        assert_eq!(first_label(&vec![0u8; mib], 0), None);
        assert_eq!(first_label(&with(mib, 1081, &[0x53, 0xef]), 0), None);
        assert_eq!(first_nonzero(&with(1024, 700, &[1]), 4096), Some(4796));
        assert_eq!(first_nonzero(&[0u8; 64], 0), None);
    }
}

//! "Provably blank", in the guest: the agent formats only a disk that reads
//! as zeros wherever something could start, the rule crustd holds on the
//! host before createFilesystem, with no blkid. Stricter where it must be:
//! any byte that is not zero in a region read refuses the disk, whether or
//! not a label is recognised there; a label (from the scan shared with
//! crustd, `crust_protocols::labels`) only names what was found. Reads a
//! bounded few MiB, whatever the disk's size; never writes.
//!
//! The regions, on a device of `n` bytes (each cut at the device's end):
//!
//! - the first [`HEAD`] bytes (4 MiB + 256 KiB): partition tables, every
//!   superblock at the start, LUKS2's secondary header at each offset it
//!   can have (16 KiB to 4 MiB), and [`WINDOW`] bytes from each of
//!   `PROBE_AT`'s offsets below 4 MiB (63 sectors, 1, 2, 4 MiB);
//! - [`WINDOW`] bytes (256 KiB) from each of `PROBE_AT`'s other offsets,
//!   8 MiB to 1 GiB: where partitions start, and enough of one to hold the
//!   superblocks of ext2/3/4 (at +1 KiB), XFS (+0), btrfs (+64 KiB), swap,
//!   LVM2, MD RAID 1.1 and 1.2, bcache, LUKS and ZFS's first label;
//! - the last [`TAIL`] bytes (1 MiB): GPT's backup header, MD RAID 0.90 and
//!   1.0, ZFS's last labels, and what ends with the disk.
//!
//! At most 7.25 MiB in all (and up to 511 bytes more, on a device that is
//! not whole sectors, whose tail starts on one). What is not seen: something that starts at an
//! offset that is none of these and leaves all of them zeros (a second
//! partition of a disk whose partition tables were wiped; a file system
//! written at an odd offset). crustd's 64 MiB label scan sees more on the
//! host, with blkid's probes beside it; the guest has neither the tool nor
//! the time to read a disk whole.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use crust_protocols::labels::{self, PROBE_AT};

use super::disk::ReadAt;
use crate::sys::error::SysError;

/// The first bytes read: 4 MiB, and a window past LUKS2's last secondary offset.
pub const HEAD: u64 = (4 << 20) + WINDOW;
/// How much is read from each offset where a partition could start.
pub const WINDOW: u64 = 256 << 10;
/// The last bytes read.
pub const TAIL: u64 = 1 << 20;
/// The most read at a time.
const CHUNK: usize = 1 << 20;

/// What every refusal says the rule is.
const RULE: &str = "the agent formats only a disk that reads as zeros wherever something could start (its first 4.25 MiB, its last MiB, and 256 KiB at 8 MiB, 16 MiB, … 1 GiB), and left this one as it is";

crate::code::coded_errors! {
/// Why a disk is not provably blank.
#[derive(Debug, thiserror::Error)]
pub enum NotBlank {
    #[code(FailedPrecondition)]
    #[error("the disk is not blank: it holds {what} at byte {at} (byte {byte} is its first that is not zero); {rule}", rule = RULE)]
    Holds {
        /// What the label says it is ("an ext2/3/4 file system").
        what: &'static str,
        /// Where that starts.
        at: u64,
        /// The first byte read that is not zero.
        byte: u64,
    },
    #[code(FailedPrecondition)]
    #[error("the disk is not blank: byte {byte} is not zero, though no label the agent knows is there; {rule}", rule = RULE)]
    NotZero {
        /// The first byte read that is not zero.
        byte: u64,
    },
    #[code(Internal)]
    #[error(transparent)]
    Read(#[from] SysError),
}
}

/// The regions read on a device of `device_bytes`: (first byte, length),
/// in order, apart, none empty, each starting on a 512-byte sector.
pub fn regions(device_bytes: u64) -> Vec<(u64, u64)> {
    let mut out = vec![(0, device_bytes.min(HEAD))];
    for at in PROBE_AT
        .into_iter()
        .filter(|at| (HEAD..device_bytes).contains(at))
    {
        out.push((at, WINDOW.min(device_bytes.saturating_sub(at))));
    }
    let covered = out.last().map_or(0, |(at, len)| at.saturating_add(*len));
    let tail = device_bytes.saturating_sub(TAIL);
    // Past what is read already; on a sector, so that labels line up (what
    // is read already ends on one, or at the device's end).
    let tail = tail
        .saturating_sub(tail.checked_rem(labels::SECTOR as u64).unwrap_or(0))
        .max(covered);
    out.push((tail, device_bytes.saturating_sub(tail)));
    out.retain(|(_, len)| *len > 0);
    out
}

/// Whether `disk`, of `device_bytes`, is provably blank: every byte of
/// [`regions`] zero. Refused naming the first byte that is not, and what
/// starts there when the label is one the scan knows.
pub fn check_blank(disk: &(impl ReadAt + ?Sized), device_bytes: u64) -> Result<(), NotBlank> {
    let mut buf = vec![0u8; CHUNK];
    for (start, len) in regions(device_bytes) {
        let end = start.saturating_add(len);
        let mut pos = start;
        while pos < end {
            let n = usize::try_from(end.saturating_sub(pos)).map_or(CHUNK, |left| left.min(CHUNK));
            let chunk = &mut buf[..n];
            disk.read_exact_at(chunk, pos).map_err(|e| {
                SysError::new(
                    "pread",
                    format_args!("the disk at byte {pos}, to prove it blank"),
                    e,
                )
            })?;
            if let Some(byte) = labels::first_nonzero(chunk, pos) {
                return Err(match labels::first_label(chunk, pos) {
                    Some(found) => NotBlank::Holds {
                        what: found.what,
                        at: found.at,
                        byte,
                    },
                    None => NotBlank::NotZero { byte },
                });
            }
            pos = pos.saturating_add(n as u64);
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "blank_tests.rs"]
mod tests;

//! A new volume's dm-integrity superblock, made as cryptsetup 2.6 makes it
//! (`_crypt_format_luks2`, `INTEGRITY_format`): the superblock's block at
//! the data's start is zeroed, then an `integrity` table of
//! [`FORMAT_SECTORS`] is loaded over it under the name of the volume's
//! dm-integrity device; the kernel, finding no superblock, sizes the
//! journal and the tags from the disk and writes one; the device is
//! removed at once. Named so, a device left by an agent killed in between
//! is the volume's own to the next open and to recovery, which remove it.
//! (The wipe that follows is `wipe`'s.)
//!
//! The disk is read and written here with O_DIRECT, and the bytes the
//! kernel writes behind the page cache are dropped from it, so that the
//! open that follows reads them from the disk.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use zeroize::Zeroizing;

use super::disk::Disk;
use super::error::Error;
use super::integrity;
use super::metadata::Segment;
use crate::sys::dm::{self, Control, Target};
use crate::sys::dm_integrity::{self, Superblock, FORMAT_SECTORS};
use crate::sys::error::SysError;

/// O_DIRECT's alignment: the largest logical block a mapping has.
pub const ALIGN: usize = 4096;

/// `len` zero bytes at an address O_DIRECT takes, inside the returned
/// buffer (which holds [`ALIGN`] more).
pub fn aligned_zeros(len: usize) -> (Vec<u8>, usize) {
    let buf = vec![0u8; len.saturating_add(ALIGN)];
    let at = buf.as_ptr().align_offset(ALIGN).min(ALIGN);
    (buf, at)
}

/// `path` opened with O_DIRECT, for writing or for reading.
pub fn open_direct(path: &Path, write: bool) -> Result<File, Error> {
    File::options()
        .read(!write)
        .write(write)
        .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
        .open(path)
        .map_err(|e| SysError::new("open", path.display(), e).into())
}

/// Drops `path`'s cached pages, which the kernel may have written behind.
fn drop_cache(path: &Path) -> Result<(), Error> {
    let f = File::open(path).map_err(|e| SysError::new("open", path.display(), e))?;
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)
        .map_err(|e| SysError::new("fadvise", path.display(), e))?;
    Ok(())
}

/// The superblock at the start of `seg` on `path`, read past the page
/// cache; None where there is none.
fn read_superblock(path: &Path, seg: &Segment) -> Result<Option<Superblock>, Error> {
    let f = open_direct(path, false)?;
    let (mut buf, at) = aligned_zeros(ALIGN);
    let block = &mut buf[at..at + ALIGN];
    f.read_exact_at(block, seg.offset)
        .map_err(|e| SysError::new("read", path.display(), e))?;
    Ok(Superblock::parse(block))
}

/// Formats the dm-integrity superblock of the new volume `luks_uuid` on
/// `disk`, whose data segment is `seg`, and checks what the kernel wrote.
pub fn format_superblock(disk: &Disk<'_>, luks_uuid: &str, seg: &Segment) -> Result<(), Error> {
    // The tag size follows from the segment as its open computes it.
    let key_len = seg
        .integrity
        .as_ref()
        .and_then(|i| super::format::Mac::ALL.iter().find(|m| m.kind() == i.kind))
        .map(|m| super::format::volume_key_bytes(Some(*m)))
        .ok_or_else(|| Error::IntegrityUnsupported {
            what: format!("{:?} for a new volume", seg.integrity),
        })?;
    let aead = integrity::aead(seg, key_len)?;
    let f = open_direct(disk.path, true)?;
    let (buf, at) = aligned_zeros(ALIGN);
    f.write_all_at(&buf[at..at + ALIGN], seg.offset)
        .and_then(|()| f.sync_all())
        .map_err(|e| SysError::new("write", disk.path.display(), e))?;
    drop(f);
    let control = Control::open()?;
    let sub = dm_integrity::subdevice_name(disk.name);
    let uuid = dm_integrity::subdevice_uuid(luks_uuid, disk.name)?;
    // One left by a format cut short (its mapping never made) goes first.
    let stale = matches!(control.status(disk.name), Err(dm::Error::NotFound(_)))
        && control.status(&sub).is_ok_and(|i| i.uuid == uuid);
    if stale {
        control.remove(&sub)?;
    }
    let target = Target {
        start: 0,
        length: FORMAT_SECTORS,
        kind: "integrity",
        params: Zeroizing::new(dm_integrity::format_params(
            disk.dev,
            seg.offset / 512,
            aead.tag,
            seg.sector_size,
        )?),
    };
    let made = control.create(&sub, &uuid).and_then(|_| {
        control.load(&sub, &[target], false)?;
        control.resume(&sub)
    });
    if !matches!(made, Err(dm::Error::Exists { .. })) {
        let removed = control.remove(&sub);
        made?;
        removed?;
    } else {
        made?;
    }
    drop_cache(disk.path)?;
    match read_superblock(disk.path, seg)? {
        Some(sb) if sb.tag_size == aead.tag && sb.block_bytes() == Some(seg.sector_size) => Ok(()),
        sb => Err(Error::IntegrityFormat {
            why: match sb {
                None => "the kernel wrote no superblock".into(),
                Some(sb) => format!(
                    "the kernel wrote one with {}-byte tags and blocks of 2^{} sectors where {} and {}-byte sectors were asked",
                    sb.tag_size, sb.log2_sectors_per_block, aead.tag, seg.sector_size
                ),
            },
        }),
    }
}

/// Formats the superblock of volume `luks_uuid` on `disk` (segment `seg`)
/// unless it has one: for a volume whose wipe has not begun, left by a
/// publish stopped between its header and its superblock.
pub fn superblock_if_missing(disk: &Disk<'_>, luks_uuid: &str, seg: &Segment) -> Result<(), Error> {
    if seg.integrity.is_none() || read_superblock(disk.path, seg)?.is_some() {
        return Ok(());
    }
    format_superblock(disk, luks_uuid, seg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_are_aligned_for_o_direct() {
        for len in [ALIGN, 1 << 20] {
            let (buf, at) = aligned_zeros(len);
            assert_eq!(buf[at..].as_ptr() as usize % ALIGN, 0);
            assert!(buf[at..at + len].iter().all(|&b| b == 0));
        }
    }
}

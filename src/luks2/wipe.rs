//! The wipe of a new volume with integrity, as luksFormat's (cryptsetup
//! 2.6's `_wipe_data_device`): zeros written through the volume's mapping
//! over every sector, so that each has a tag (a sector never written has
//! none, and reading it fails with EIO). In [`CHUNK`]s with O_DIRECT, so
//! the page cache holds none of it and memory stays at one chunk; stopped
//! by the caller's cancel between chunks. How far it has gone is recorded
//! in the header (`made::record_wipe`) every [`RECORD_EVERY`] and when it
//! stops, so that the next publish goes on from there: a wipe takes as
//! long as writing the whole disk once, which a caller's deadline may not
//! allow in one publish.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::error::Error;
use super::header;
use super::made;
use super::made_integrity::{aligned_zeros, open_direct, ALIGN};
use crate::cancel::Cancel;
use crate::sys::error::SysError;

/// The wipe's unit: cryptsetup's (`DEFAULT_WIPE_BLOCK`), and all the
/// memory it holds.
pub const CHUNK: usize = 1 << 20;
/// How often a wipe records how far it has gone.
pub const RECORD_EVERY: Duration = Duration::from_secs(5);

/// Wipes the mapping `mapped` of the unfinished volume on `disk` from
/// where its header says the wipe has reached to its end, and records it
/// done; the bytes of the mapping it wrote, or None (and nothing written)
/// when the header says no wipe is under way. Stopped by `cancel` between
/// chunks, having recorded how far it got.
pub fn wipe(disk: &Path, mapped: &Path, cancel: &Cancel) -> Result<Option<Range<u64>>, Error> {
    let from = {
        let f = File::open(disk).map_err(|e| SysError::new("open", disk.display(), e))?;
        let size = crate::sys::blockdev::size_of(&f, disk)?;
        made::wiped(&header::read(&f, size)?)
    };
    let Some(from) = from else {
        return Ok(None);
    };
    let f = open_direct(mapped, true)?;
    let size = crate::sys::blockdev::size_of(&f, mapped)?;
    let (buf, at) = aligned_zeros(CHUNK);
    let zeros = &buf[at..at + CHUNK];
    let align = ALIGN as u64;
    let mut done = from.min(size) / align * align;
    let start = done;
    let mut recorded = Instant::now();
    let synced = |done: u64| -> Result<(), Error> {
        f.sync_all()
            .map_err(|e| SysError::new("fsync", mapped.display(), e))?;
        made::record_wipe(disk, Some(done))
    };
    while done < size {
        if let Err(stopped) = cancel.check(|| {
            format!("wiping the new volume's sectors through its mapping ({done} of {size} bytes)")
        }) {
            synced(done)?;
            return Err(stopped.into());
        }
        let n = usize::try_from(size - done).map_or(CHUNK, |left| left.min(CHUNK));
        f.write_all_at(&zeros[..n], done)
            .map_err(|e| SysError::new("write", mapped.display(), e))?;
        done += n as u64;
        if recorded.elapsed() >= RECORD_EVERY {
            synced(done)?;
            recorded = Instant::now();
        }
    }
    f.sync_all()
        .map_err(|e| SysError::new("fsync", mapped.display(), e))?;
    made::record_wipe(disk, None)?;
    Ok(Some(start..size))
}

//! A disk as LUKS2 reads it: bytes at offsets, from a device or image
//! file, or from memory. Apart from the header's reader so that what only
//! reads a disk (the blank check) needs nothing else of LUKS2. And the
//! disk a new volume is made on, as the steps of making it name it.

use std::os::unix::fs::FileExt;
use std::path::Path;

/// The disk a volume is made on: its node, its device number, and the name
/// its mapping will have (which names its dm-integrity device too).
#[derive(Clone, Copy, Debug)]
pub struct Disk<'a> {
    pub path: &'a Path,
    pub dev: (u32, u32),
    pub name: &'a str,
}

/// A disk, read at offsets: a device or image file, or bytes in memory.
pub trait ReadAt {
    /// Fills `buf` from `offset`, or fails (a short read is a failure).
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
}

impl ReadAt for std::fs::File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let part = usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(buf.len())?))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(part);
        Ok(())
    }
}

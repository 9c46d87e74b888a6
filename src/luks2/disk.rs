//! A disk as LUKS2 reads it: bytes at offsets, from a device or image
//! file, or from memory. Apart from the header's reader so that what only
//! reads a disk (the blank check) needs nothing else of LUKS2.

use std::os::unix::fs::FileExt;

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

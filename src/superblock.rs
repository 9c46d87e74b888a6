//! The on-disk superblocks the agent reads from disks it does not control
//! (ext4's, its multi-mount protection block, xfs's), parsed from bytes and
//! nothing more: what to make of them is the probe's judgement, and growth's
//! arithmetic. The parsers are total: every offset is checked, every read
//! bounded, and a short or foreign buffer is None, never a panic.

// Every offset and size here comes from a disk the agent does not control.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

/// Where the ext4 superblock starts on the disk.
const EXT4_SB_OFFSET: usize = 1024;
/// s_feature_compat: the filesystem has a journal.
pub const EXT4_COMPAT_HAS_JOURNAL: u32 = 0x4;
/// s_feature_incompat: the device is an external journal, not a filesystem.
pub const EXT4_INCOMPAT_JOURNAL_DEV: u32 = 0x8;
/// s_feature_incompat: block counts have a high word.
pub const EXT4_INCOMPAT_64BIT: u32 = 0x80;
/// s_feature_incompat: multi-mount protection.
pub const EXT4_INCOMPAT_MMP: u32 = 0x100;
/// The largest s_log_block_size the kernel mounts (64 KiB blocks).
const EXT4_MAX_LOG_BLOCK_SIZE: u32 = 6;

/// The fields of an ext4 superblock the agent reads (fs/ext4/ext4.h, struct
/// ext4_super_block).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ext4Super {
    /// s_blocks_count, with its high word when the 64bit feature is on.
    pub blocks_count: u64,
    /// s_first_data_block.
    pub first_data_block: u32,
    /// s_log_block_size: the block size is 1024 << this.
    pub log_block_size: u32,
    /// s_blocks_per_group.
    pub blocks_per_group: u32,
    /// s_state has EXT4_ERROR_FS, or s_error_count > 0.
    pub has_errors: bool,
    /// s_feature_compat.
    pub compat: u32,
    /// s_feature_incompat.
    pub incompat: u32,
    /// s_journal_inum: the journal's inode, 0 for an external journal.
    pub journal_inum: u32,
    /// s_journal_dev: an external journal's device number.
    pub journal_dev: u32,
    /// s_mmp_update_interval, seconds.
    pub mmp_update_interval: u16,
    /// s_mmp_block.
    pub mmp_block: u64,
    /// s_mount_opts: options the kernel applies before the mount's own.
    pub mount_opts: [u8; 64],
}

impl Ext4Super {
    /// Parses the superblock from a disk's first bytes (`head`, at least 2 KiB);
    /// None without the ext4 magic or when `head` is too short.
    pub fn parse(head: &[u8]) -> Option<Ext4Super> {
        Ext4Super::parse_block(head.get(EXT4_SB_OFFSET..)?)
    }

    /// Parses a superblock from its own 1024 bytes (`sb`).
    pub fn parse_block(sb: &[u8]) -> Option<Ext4Super> {
        if le16(sb, 0x38)? != 0xEF53 {
            return None;
        }
        let incompat = le32(sb, 0x60)?;
        let hi = if incompat & EXT4_INCOMPAT_64BIT != 0 {
            le32(sb, 0x150)?
        } else {
            0
        };
        Some(Ext4Super {
            blocks_count: u64::from(hi) << 32 | u64::from(le32(sb, 0x04)?),
            first_data_block: le32(sb, 0x14)?,
            log_block_size: le32(sb, 0x18)?,
            blocks_per_group: le32(sb, 0x20)?,
            has_errors: le16(sb, 0x3A)? & 0x0002 != 0 || le32(sb, 0x194)? > 0,
            compat: le32(sb, 0x5C)?,
            incompat,
            journal_inum: le32(sb, 0xE0)?,
            journal_dev: le32(sb, 0xE4)?,
            mmp_update_interval: le16(sb, 0x166)?,
            mmp_block: le64(sb, 0x168)?,
            mount_opts: bytes_at(sb, 0x200)?,
        })
    }

    /// The block size, or None when no kernel would mount it (beyond 64 KiB).
    pub fn block_size(&self) -> Option<u64> {
        (self.log_block_size <= EXT4_MAX_LOG_BLOCK_SIZE).then(|| 1024u64 << self.log_block_size)
    }
}

/// The fields of an MMP block (struct mmp_struct) the agent reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mmp {
    /// mmp_magic.
    pub magic: u32,
    /// mmp_seq: CLEAN, FSCK, or a live sequence.
    pub seq: u32,
    /// mmp_nodename: who last wrote it.
    pub nodename: String,
    /// mmp_check_interval, seconds.
    pub check_interval: u16,
}

impl Mmp {
    /// The size of struct mmp_struct.
    pub const LEN: usize = 1024;

    /// Parses an MMP block; None when `b` is shorter than one.
    pub fn parse(b: &[u8]) -> Option<Mmp> {
        let name: [u8; 64] = bytes_at(b, 16)?;
        let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
        Some(Mmp {
            magic: le32(b, 0)?,
            seq: le32(b, 4)?,
            nodename: String::from_utf8_lossy(name.get(..end)?).into_owned(),
            check_interval: le16(b, 0x70)?,
        })
    }
}

/// The fields of an xfs superblock the agent reads (struct xfs_dsb, big endian).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XfsSuper {
    /// sb_blocksize.
    pub blocksize: u32,
    /// sb_dblocks: the data section's blocks.
    pub dblocks: u64,
    /// sb_rblocks: the realtime section's blocks (on another device).
    pub rblocks: u64,
    /// sb_logstart: 0 when the log is on another device.
    pub logstart: u64,
}

impl XfsSuper {
    /// Parses the superblock at the start of a disk; None without the magic
    /// or when `head` is too short.
    pub fn parse(head: &[u8]) -> Option<XfsSuper> {
        if !at(head, 0, b"XFSB") {
            return None;
        }
        Some(XfsSuper {
            blocksize: be32(head, 4)?,
            dblocks: be64(head, 8)?,
            rblocks: be64(head, 16)?,
            logstart: be64(head, 48)?,
        })
    }
}

/// Does `buf` hold `magic` at `offset`? (False when the disk is shorter than that.)
pub fn at(buf: &[u8], offset: usize, magic: &[u8]) -> bool {
    offset
        .checked_add(magic.len())
        .and_then(|end| buf.get(offset..end))
        == Some(magic)
}

/// `N` bytes of `buf` at `offset`, if the buffer is that long.
pub fn bytes_at<const N: usize>(buf: &[u8], offset: usize) -> Option<[u8; N]> {
    buf.get(offset..offset.checked_add(N)?)?.try_into().ok()
}

pub fn le16(buf: &[u8], offset: usize) -> Option<u16> {
    bytes_at(buf, offset).map(u16::from_le_bytes)
}

pub fn le32(buf: &[u8], offset: usize) -> Option<u32> {
    bytes_at(buf, offset).map(u32::from_le_bytes)
}

pub fn le64(buf: &[u8], offset: usize) -> Option<u64> {
    bytes_at(buf, offset).map(u64::from_le_bytes)
}

pub fn be32(buf: &[u8], offset: usize) -> Option<u32> {
    bytes_at(buf, offset).map(u32::from_be_bytes)
}

pub fn be64(buf: &[u8], offset: usize) -> Option<u64> {
    bytes_at(buf, offset).map(u64::from_be_bytes)
}

/// A disk's first bytes, zero but for `patches`, for the tests' tables.
#[cfg(test)]
pub(crate) fn with(patches: &[(usize, &[u8])]) -> Vec<u8> {
    let mut b = vec![0u8; 65536 + 4096];
    for (off, bytes) in patches {
        b[*off..*off + bytes.len()].copy_from_slice(bytes);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ext4_superblocks_at_their_offsets() {
        let mut head = vec![0u8; 2048];
        let sb = &mut head[1024..];
        sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[0x04..0x08].copy_from_slice(&65536u32.to_le_bytes());
        sb[0x14..0x18].copy_from_slice(&1u32.to_le_bytes());
        sb[0x18..0x1C].copy_from_slice(&0u32.to_le_bytes());
        sb[0x5C..0x60].copy_from_slice(&EXT4_COMPAT_HAS_JOURNAL.to_le_bytes());
        sb[0x60..0x64].copy_from_slice(&(EXT4_INCOMPAT_MMP).to_le_bytes());
        sb[0x150..0x154].copy_from_slice(&7u32.to_le_bytes()); // no 64bit: ignored
        sb[0xE0..0xE4].copy_from_slice(&8u32.to_le_bytes());
        sb[0x166..0x168].copy_from_slice(&5u16.to_le_bytes());
        sb[0x168..0x170].copy_from_slice(&1234u64.to_le_bytes());
        sb[0x200..0x209].copy_from_slice(b"acl,debug");
        let p = Ext4Super::parse(&head).unwrap();
        assert_eq!(p.blocks_count, 65536);
        assert_eq!(p.first_data_block, 1);
        assert_eq!(p.block_size(), Some(1024));
        assert_eq!(p.journal_inum, 8);
        assert_eq!(p.mmp_update_interval, 5);
        assert_eq!(p.mmp_block, 1234);
        assert_eq!(&p.mount_opts[..10], b"acl,debug\0");
        head[1024 + 0x60] |= 0x80; // EXT4_INCOMPAT_64BIT
        assert_eq!(
            Ext4Super::parse(&head).unwrap().blocks_count,
            (7 << 32) + 65536
        );
        head[1024 + 0x18] = 7;
        assert_eq!(Ext4Super::parse(&head).unwrap().block_size(), None);
        head[1024 + 0x38] = 0;
        assert_eq!(Ext4Super::parse(&head), None);
    }

    #[test]
    fn parses_xfs_superblocks() {
        let head = with(&[
            (0, b"XFSB"),
            (4, &4096u32.to_be_bytes()),
            (8, &76800u64.to_be_bytes()),
            (48, &65540u64.to_be_bytes()),
        ]);
        let want = XfsSuper {
            blocksize: 4096,
            dblocks: 76800,
            rblocks: 0,
            logstart: 65540,
        };
        assert_eq!(XfsSuper::parse(&head).unwrap(), want);
        assert_eq!(XfsSuper::parse(&head[..55]), None);
    }
}

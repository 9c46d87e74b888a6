//! Filesystem identification from on-disk superblocks, before anything else
//! touches a disk, and the judgement of what a superblock asks the kernel to
//! do. Opens the device read-only and only reads: the agent never formats,
//! and never mounts a disk whose filesystem is not the requested one, is
//! larger than its device, leans on another device (an external journal or
//! log), would hold the mount in the kernel for minutes (ext4 MMP), or
//! plants mount options the agent does not let a disk choose (s_mount_opts).
//! The parsers are total: every offset is checked, every read bounded.
//!
//! One idea a file: the refusals (`error`), the disk read and the verdict
//! (`judge`), and each filesystem's superblock rules (`ext4`, `xfs`); the
//! superblocks themselves are parsed in `crate::superblock`.

pub mod error;
pub mod ext4;
pub mod judge;
pub mod xfs;

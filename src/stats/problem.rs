//! What a check of a volume's condition can find wrong, one sentence each:
//! the condition's message is these, joined.

use std::fmt;
use std::path::PathBuf;

use rustix::io::Errno;

use crate::model::{Device, FsType, MountId};
use crate::sys::mountinfo::shown;

/// A disk as the messages name it: `vdb (254:16)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    pub name: String,
    /// Its device number.
    pub major: u32,
    /// Its device number.
    pub minor: u32,
}

impl Disk {
    /// How the messages name `dev`.
    pub fn of(dev: &Device) -> Disk {
        Disk {
            name: dev.name.clone(),
            major: dev.major,
            minor: dev.minor,
        }
    }
}

impl fmt::Display for Disk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}:{})", self.name, self.major, self.minor)
    }
}

/// Errnos that mean the filesystem or its disk is failing, not that the
/// request was odd.
pub fn failing(e: Errno) -> bool {
    [
        Errno::IO,
        Errno::NODEV,
        Errno::NOTCONN,
        Errno::STALE,
        Errno::NXIO,
        Errno::ILSEQ,
    ]
    .contains(&e)
}

/// An errno as the messages name it.
pub fn errno_name(e: Errno) -> String {
    let name = match e {
        Errno::IO => "EIO",
        Errno::NODEV => "ENODEV",
        Errno::NOTCONN => "ENOTCONN",
        Errno::STALE => "ESTALE",
        Errno::NXIO => "ENXIO",
        Errno::ILSEQ => "EILSEQ",
        Errno::NOENT => "ENOENT",
        Errno::ACCESS => "EACCES",
        _ => return format!("errno {}", e.raw_os_error()),
    };
    name.to_string()
}

/// What the call's failure says of the filesystem.
fn failing_text(e: Errno) -> &'static str {
    if failing(e) {
        ": the filesystem has shut down or its disk is failing"
    } else {
        ""
    }
}

/// What ext4 does on an error, when it is why a volume is read-only.
fn read_only_hint(fs: FsType) -> &'static str {
    match fs {
        FsType::Ext4 => " (ext4 remounts read-only after an error under errors=remount-ro)",
        FsType::Xfs => "",
    }
}

/// One thing wrong with a volume.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// The guest path is gone.
    #[error(
        "{} is gone: the volume was unmounted and removed behind the agent's back",
        shown(path)
    )]
    PathGone { path: PathBuf },
    /// The guest path now leads through a symlink or out of the root.
    #[error("{} is now a symlink or leads outside the agent's root: the volume was unmounted behind the agent's back", shown(path))]
    PathEscapes { path: PathBuf },
    /// A call on the volume fails.
    #[error("{call} on {} fails with {}{}", shown(path), errno_name(*errno), failing_text(*errno))]
    CallFails {
        call: &'static str,
        path: PathBuf,
        errno: Errno,
    },
    /// Nothing is mounted at the guest path.
    #[error(
        "{} is no longer a mount point: the volume was unmounted behind the agent's back",
        shown(path)
    )]
    NotMountPoint { path: PathBuf },
    /// Another disk is mounted at the guest path.
    #[error("{} is now a mount of device {}:{}, not of the volume's disk {disk}", shown(path), found.0, found.1)]
    OtherDevice {
        path: PathBuf,
        found: (u32, u32),
        disk: Disk,
    },
    /// Another mount of the volume's disk is at the guest path.
    #[error("{} is now another mount of the volume's disk {disk_name} than the agent made (mount {found} instead of {made})", shown(path))]
    OtherMount {
        path: PathBuf,
        disk_name: String,
        found: MountId,
        made: MountId,
    },
    /// The mount table could not be read.
    #[error("cannot tell how {} is mounted: {why}", shown(path))]
    TableUnreadable { path: PathBuf, why: String },
    /// The mount shows a directory of the filesystem, not its root.
    #[error(
        "{} now shows {} inside the disk's filesystem, not its root",
        shown(path),
        shown(root)
    )]
    OtherRoot { path: PathBuf, root: PathBuf },
    /// The mount is of another filesystem type.
    #[error("{} is now a {found} mount, not {fs}", shown(path))]
    OtherType {
        path: PathBuf,
        found: String,
        fs: FsType,
    },
    /// A volume published read-write is read-only now.
    #[error("{} was published read-write but is now read-only{}", shown(path), read_only_hint(*fs))]
    NowReadOnly { path: PathBuf, fs: FsType },
    /// ext4 recorded errors.
    #[error("ext4 on {disk_name} has recorded {count} error(s) ({file}); check the filesystem with e2fsck on the host")]
    Ext4Errors {
        disk_name: String,
        count: u64,
        file: String,
    },
    /// The disk shrank under its filesystem.
    #[error("the filesystem is larger than its device: the {fs} at {} is {fs_bytes} bytes but disk {disk_name} now holds only {size_bytes} bytes (it shrank under the mount; reads past its end fail)", shown(path))]
    LargerThanDevice {
        fs: FsType,
        path: PathBuf,
        fs_bytes: u64,
        disk_name: String,
        size_bytes: u64,
    },
    /// The disk was detached.
    #[error("disk {disk} is gone from {}: the host detached it", shown(dir))]
    DiskGone { disk: Disk, dir: PathBuf },
    /// The disk's backing storage is gone.
    #[error("disk {disk} reports size 0: its backing storage is gone")]
    DiskEmpty { disk: Disk },
    /// A block volume's guest path is gone.
    #[error(
        "{} is gone: the block volume's bind was removed behind the agent's back",
        shown(path)
    )]
    BindGone { path: PathBuf },
    /// A block volume's guest path leads through a symlink or out of the root.
    #[error("{} now leads through a symlink or outside the agent's root: the block volume's bind was removed behind the agent's back", shown(path))]
    BindEscapes { path: PathBuf },
    /// statx of a block volume's guest path fails.
    #[error("statx on {} fails with {}", shown(path), errno_name(*errno))]
    BindStatx { path: PathBuf, errno: Errno },
    /// A block volume's node is no longer bound there.
    #[error(
        "{} is no longer bound to disk {disk}: the bind was removed behind the agent's back",
        shown(path)
    )]
    NotBound { path: PathBuf, disk: Disk },
    /// Something else is mounted at a block volume's guest path.
    #[error("{} is now a mount of something else than disk {disk}", shown(path))]
    BoundOther { path: PathBuf, disk: Disk },
    /// Another bind of the disk is at a block volume's guest path.
    #[error("{} is now another bind of disk {disk_name} than the agent made (mount {found} instead of {made})", shown(path))]
    OtherBind {
        path: PathBuf,
        disk_name: String,
        found: MountId,
        made: MountId,
    },
    /// The block device refused or went away (its own sentence).
    #[error("{0}")]
    Device(String),
    /// A block volume published read-write refuses writes now.
    #[error("disk {disk_name} was published read-write but the kernel now refuses writes to it (its read-only flag was set behind the agent's back, or the host made the disk read-only)")]
    RefusesWrites { disk_name: String },
    /// A block volume published read-only accepts writes again.
    #[error("disk {disk_name} was published read-only but the kernel accepts writes to it again (its read-only flag was cleared behind the agent's back)")]
    AcceptsWrites { disk_name: String },
    /// An encrypted volume's mapping is suspended: I/O to it waits.
    #[error("the volume's dm-crypt mapping {mapping} is suspended: reads and writes wait until it is resumed")]
    MappingSuspended { mapping: String },
    /// An encrypted volume's mapping is gone, or has no live table.
    #[error(
        "the volume's dm-crypt mapping {mapping} is {how}: the filesystem cannot reach its disk"
    )]
    MappingGone { mapping: String, how: &'static str },
    /// The kernel refused sectors of a mapping with integrity: what the
    /// disk holds there is not what the volume wrote.
    #[error("the kernel refused {sectors} sector(s) of the volume's mapping {mapping} whose authentication tag does not match (dm-crypt with integrity {integrity}): the disk's ciphertext was changed outside the guest, and reads of those sectors fail with an I/O error rather than return it")]
    IntegrityMismatches {
        mapping: String,
        integrity: String,
        sectors: u64,
    },
}

/// How bad a problem is, in CSI 1.13's words (NodeGetVolumeHealth).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// The volume cannot be reached: unmounted, replaced, or its disk gone.
    Inaccessible,
    /// Data may be lost: the filesystem recorded errors, or outgrew its disk.
    DataLoss,
    /// Reachable, but not as published: read-only now, or failing I/O.
    Degraded,
}

impl Problem {
    /// Its health status and reason (CamelCase, as CSI asks).
    pub fn health(&self) -> (Health, &'static str) {
        use Health::*;
        match self {
            Problem::PathGone { .. } | Problem::NotMountPoint { .. } => (Inaccessible, "Unmounted"),
            Problem::PathEscapes { .. } => (Inaccessible, "PathReplaced"),
            // A tag that does not match, as the block layer says it.
            Problem::CallFails {
                errno: Errno::ILSEQ,
                ..
            } => (DataLoss, "IntegrityMismatch"),
            Problem::CallFails { errno, .. } if failing(*errno) => (Degraded, "IOErrors"),
            Problem::CallFails { .. } => (Inaccessible, "CallFails"),
            Problem::OtherDevice { .. }
            | Problem::OtherMount { .. }
            | Problem::OtherRoot { .. }
            | Problem::OtherType { .. } => (Inaccessible, "MountReplaced"),
            Problem::TableUnreadable { .. } => (Inaccessible, "MountTableUnreadable"),
            Problem::NowReadOnly { .. } => (Degraded, "RemountedReadOnly"),
            Problem::Ext4Errors { .. } => (DataLoss, "FilesystemErrorsRecorded"),
            Problem::LargerThanDevice { .. } => (DataLoss, "FilesystemLargerThanDisk"),
            Problem::DiskGone { .. } => (Inaccessible, "DiskDetached"),
            Problem::DiskEmpty { .. } => (Inaccessible, "DiskEmpty"),
            Problem::BindGone { .. } | Problem::NotBound { .. } => (Inaccessible, "Unmounted"),
            Problem::BindEscapes { .. } => (Inaccessible, "PathReplaced"),
            Problem::BindStatx { .. } => (Inaccessible, "CallFails"),
            Problem::BoundOther { .. } | Problem::OtherBind { .. } => {
                (Inaccessible, "MountReplaced")
            }
            Problem::Device(_) => (Inaccessible, "DeviceFails"),
            Problem::RefusesWrites { .. } => (Degraded, "RefusesWrites"),
            Problem::AcceptsWrites { .. } => (Degraded, "AcceptsWrites"),
            Problem::MappingSuspended { .. } => (Inaccessible, "MappingSuspended"),
            Problem::MappingGone { .. } => (Inaccessible, "MappingGone"),
            Problem::IntegrityMismatches { .. } => (DataLoss, "IntegrityMismatches"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tampering_is_data_loss() {
        let p = Problem::IntegrityMismatches {
            mapping: "crust-v".into(),
            integrity: "hmac(sha256)".into(),
            sectors: 3,
        };
        assert_eq!(p.health(), (Health::DataLoss, "IntegrityMismatches"));
        assert!(p.to_string().contains("refused 3 sector(s)"), "{p}");
        let call = |errno| Problem::CallFails {
            call: "stat",
            path: "/v".into(),
            errno,
        };
        assert_eq!(
            call(Errno::ILSEQ).health(),
            (Health::DataLoss, "IntegrityMismatch")
        );
        assert!(call(Errno::ILSEQ).to_string().contains("EILSEQ"));
        assert_eq!(call(Errno::IO).health(), (Health::Degraded, "IOErrors"));
    }
}

//! The host side of a volume. `host_volume_id` must be an absolute path to a
//! block device (a symlink to one is fine). From the device, opened once
//! and then known by its fd, crustd learns:
//!
//! - where its bytes lie ([`Extent`]): a byte range on a whole disk, or on
//!   the file behind a loop device, so that "one disk, one volume" holds
//!   for a disk and its partitions, for partitions a hostile table makes
//!   overlap, and for two loop devices over one file, whatever path names
//!   them (sysfs `start`/`size`, LOOP_GET_STATUS64);
//! - whether the host uses it ([`HostDevice::check_unused`]): mounted, held
//!   (`holders/`: device-mapper, md), swap, or under a loop device, for the
//!   device and every device that shares sectors with it;
//! - and it takes crustd's exclusive hold ([`HostDevice::hold`]): an
//!   O_EXCL open, which the kernel refuses while anything has the device
//!   (or its whole disk, or a partition of it) mounted or claimed, and
//!   which, kept while the volume is published, makes the kernel refuse
//!   the host's own mount, swapon or device-mapper table on it. QEMU opens
//!   the device without O_EXCL (block/file-posix.c), which an exclusive
//!   holder does not prevent.
//!
//! The names crustd gives the volume in QEMU and in the guest are derived
//! from `host_volume_id`, so that every call, and every crustd after a
//! restart, picks the same ones.
//!
//! What it cannot see: a mount in another mount namespace is found only by
//! the kernel refusing the O_EXCL open (the message then cannot name the
//! mount point); a program writing the device without O_EXCL (dd, another
//! VM's QEMU) is invisible; a device-mapper or md device over part of a
//! disk is compared as a disk of its own (its table is not read); a loop
//! device over another loop device is compared with that loop device, not
//! with the file behind it.

use std::fs::{self, File};
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{self as rfs, FileType, Mode, OFlags};
use rustix::io::Errno;

mod error;
mod place;
mod users;

use error::PATH_MAX;
pub use error::{Error, Named, NotBlock, Vanished};

type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) use place::LoopInfo64;
use place::{aliases, extent_of, loop_status, parse_dev, Host};
pub use place::{Backing, Extent};

/// A host block device, resolved and open (not exclusively).
#[derive(Debug)]
pub struct HostDevice {
    /// What the caller named it by, for messages.
    pub shown: String,
    /// The device node, symlinks resolved (what QEMU opens).
    pub path: PathBuf,
    /// `MAJOR:MINOR`.
    pub rdev: String,
    /// The device's number, as the open file has it.
    dev: (u32, u32),
    /// Opened read-only, non-blocking, not exclusive: the identity every
    /// check below goes by, so a path changed meanwhile changes nothing.
    file: File,
}

/// crustd's exclusive hold on a published device (an O_EXCL open); the
/// kernel lets go when it is dropped.
#[derive(Debug)]
pub struct Hold(#[allow(dead_code)] File);

/// Why [`open_block`] did not open a device.
#[derive(Debug)]
pub enum Unusable {
    /// The path is not a block device: the caller says who named it.
    NotBlock(NotBlock),
    /// A block device that cannot be opened now, or changed while opened.
    Failed(Error),
}

/// Opens the block device at `path` (a symlink to one is fine), read-only and
/// not exclusively; anything but a block device is [`Unusable::NotBlock`].
pub fn open_block(path: &str) -> Result<HostDevice, Unusable> {
    let md = fs::metadata(path).map_err(|e| Unusable::NotBlock(NotBlock::Missing(Arc::new(e))))?;
    if !md.file_type().is_block_device() {
        return Err(Unusable::NotBlock(if md.is_dir() {
            NotBlock::Directory
        } else if md.is_file() {
            NotBlock::RegularFile
        } else {
            NotBlock::Other
        }));
    }
    // Only now is it opened: opening some character devices does things.
    // A block device that cannot be opened (no medium, a policy) is
    // FAILED_PRECONDITION: the argument is right, the device is not ready.
    open_node(Path::new(path), path, md.rdev()).map_err(Unusable::Failed)
}

/// Resolves `host_volume_id` to a block device and opens it; anything else
/// is INVALID_ARGUMENT.
pub fn resolve(host_volume_id: &str) -> Result<HostDevice> {
    check_path(host_volume_id)?;
    open_block(host_volume_id).map_err(|e| match e {
        Unusable::NotBlock(what) => Error::NotBlock {
            id: host_volume_id.to_string(),
            what,
        },
        Unusable::Failed(e) => e,
    })
}

/// Opens the device a record names by `MAJOR:MINOR` (after a restart),
/// through the node sysfs names for it.
pub fn open_recorded(rdev: &str) -> Result<HostDevice> {
    let gone = |why| Error::Gone {
        rdev: rdev.to_string(),
        why,
    };
    let (maj, min) = parse_dev(rdev).ok_or_else(|| gone(Vanished::NotANumber))?;
    let uevent = fs::read_to_string(format!("/sys/dev/block/{maj}:{min}/uevent"))
        .map_err(|e| gone(Vanished::Sysfs(Arc::new(e))))?;
    let name = uevent
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .filter(|n| !n.is_empty() && !n.contains(".."))
        .ok_or_else(|| gone(Vanished::NoNode))?;
    let node = PathBuf::from("/dev").join(name);
    open_node(
        &node,
        &node.display().to_string(),
        rustix::fs::makedev(maj, min),
    )
}

/// Opens `path` read-only without blocking and checks that it is the
/// block device `rdev` stat found (not one swapped in since).
fn open_node(path: &Path, shown: &str, rdev: u64) -> Result<HostDevice> {
    let fd = rfs::open(
        path,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| Error::Open {
        shown: shown.to_string(),
        errno,
    })?;
    let st = rfs::fstat(&fd).map_err(|errno| Error::Stat {
        shown: shown.to_string(),
        errno,
    })?;
    if FileType::from_raw_mode(st.st_mode) != FileType::BlockDevice || st.st_rdev != rdev {
        return Err(Error::Changed {
            shown: shown.to_string(),
        });
    }
    let file = File::from(fd);
    let path = fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .or_else(|_| fs::canonicalize(path))
        .map_err(|e| Error::Resolve {
            shown: shown.to_string(),
            source: Arc::new(e),
        })?;
    let dev = (rfs::major(st.st_rdev), rfs::minor(st.st_rdev));
    Ok(HostDevice {
        shown: shown.to_string(),
        path,
        rdev: format!("{}:{}", dev.0, dev.1),
        dev,
        file,
    })
}

impl HostDevice {
    /// The open device's descriptor number (host tools are given
    /// `/proc/<crustd>/fd/<n>`: the device checked, not its name again).
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// The open device (read-only, not exclusive).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its size in bytes now (seeking to the end gives what BLKGETSIZE64 does).
    pub fn size(&self) -> Result<u64> {
        (&self.file)
            .seek(SeekFrom::End(0))
            .map_err(|e| Error::Size {
                name: self.name(),
                source: Arc::new(e),
            })
    }

    /// The bytes the guest can read back now: its size, and for a loop
    /// device also what its backing file holds past the loop's offset. A
    /// discard that reached a loop's image can truncate the file (as in
    /// microsandbox #1472) while the loop device keeps its size: reads past
    /// the file's end then come back as zeros or errors.
    pub fn capacity(&self) -> Result<u64> {
        let size = self.size()?;
        let (maj, min) = self.dev;
        let Ok(name) = fs::read(format!("/sys/dev/block/{maj}:{min}/loop/backing_file")) else {
            return Ok(size);
        };
        let name = name.strip_suffix(b"\n").unwrap_or(&name);
        let name =
            PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name));
        // Only the very file the loop is bound to counts (its device and
        // inode): a path renamed or replaced since says nothing of it.
        match (loop_status(&self.file), fs::metadata(&name)) {
            (Ok(info), Ok(md)) if md.dev() == info.lo_device && md.ino() == info.lo_inode => {
                Ok(size.min(md.size().saturating_sub(info.lo_offset)))
            }
            _ => Ok(size),
        }
    }

    /// Where its bytes lie.
    pub fn extent(&self) -> Result<Extent> {
        extent_of(&Host::system(), &self.file, self.dev).map_err(|e| Error::Extent {
            shown: self.shown.clone(),
            rdev: self.rdev.clone(),
            source: Arc::new(e),
        })
    }

    /// Refuses (FAILED_PRECONDITION, saying what holds it) a device that the
    /// host uses: mounted, held by device-mapper or md, swap, or under a
    /// loop device; it, its whole disk, any partition sharing its sectors,
    /// or another loop device over the same bytes.
    pub fn check_unused(&self) -> Result<()> {
        let users = self.users()?;
        if users.is_empty() {
            return Ok(());
        }
        Err(Error::InUse {
            name: self.name(),
            users,
        })
    }

    /// What on the host uses this device, in words.
    fn users(&self) -> Result<Vec<String>> {
        let h = Host::system();
        users::users(&h, &aliases(&h, &self.file, self.dev)).map_err(|e| Error::Users {
            shown: self.shown.clone(),
            rdev: self.rdev.clone(),
            source: Arc::new(e),
        })
    }

    /// "/dev/disk/by-id/x (/dev/loop3)", or "/dev/loop3" when that is what was given.
    pub fn name(&self) -> Named {
        Named::new(&self.shown, &self.path)
    }

    /// Takes the exclusive hold: an O_EXCL open of the same device (through
    /// /proc/self/fd, so no path is looked up again). Refused by the kernel
    /// (EBUSY) while anything holds it: FAILED_PRECONDITION naming what,
    /// when crustd can see it.
    pub fn hold(&self) -> Result<Hold> {
        let again = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        match rfs::open(
            again.as_str(),
            OFlags::RDONLY | OFlags::EXCL | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => {
                let same = rfs::fstat(&fd)
                    .is_ok_and(|st| (rfs::major(st.st_rdev), rfs::minor(st.st_rdev)) == self.dev);
                if !same {
                    return Err(Error::Reopened {
                        shown: self.shown.clone(),
                    });
                }
                Ok(Hold(File::from(fd)))
            }
            Err(Errno::BUSY) => {
                let users = self.users().unwrap_or_default();
                Err(if users.is_empty() {
                    Error::HeldUnseen { name: self.name() }
                } else {
                    Error::InUse {
                        name: self.name(),
                        users,
                    }
                })
            }
            Err(errno) => Err(Error::Hold {
                shown: self.shown.clone(),
                rdev: self.rdev.clone(),
                errno,
            }),
        }
    }
}

/// The processes other than crustd that have block device `rdev`
/// (`MAJOR:MINOR`) open, in words ("process 12 (qemu-system-x86)"): a VMM
/// whose monitor is gone but which still has the device would be one. Only
/// `devices` asks, before it frees a device.
pub(crate) fn openers(rdev: &str) -> Vec<String> {
    match parse_dev(rdev) {
        Some((maj, min)) => users::openers(&Host::system(), rfs::makedev(maj, min)),
        None => Vec::new(),
    }
}

/// `host_volume_id` must be a non-empty absolute path.
pub fn check_path(host_volume_id: &str) -> Result<()> {
    if host_volume_id.is_empty() {
        return Err(Error::EmptyPath);
    }
    let nul = host_volume_id.contains('\0');
    if host_volume_id.len() > PATH_MAX || nul {
        return Err(Error::LongPath {
            len: host_volume_id.len(),
            nul,
        });
    }
    if !host_volume_id.starts_with('/') {
        return Err(Error::RelativePath(host_volume_id.to_string()));
    }
    Ok(())
}

/// The names one host volume gets, all derived from `host_volume_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// The agent's volume id: `crustd-<hash>`.
    pub volume_id: String,
    /// The virtio-blk serial: `cr-<hash>` (19 bytes; virtio-blk holds 20).
    pub serial: String,
    /// QEMU's block node: `crustd-<hash>` (QEMU allows 31 characters).
    pub node: String,
    /// QEMU's device id: `crustd-dev-<hash>`.
    pub device: String,
}

impl Names {
    pub fn derive(host_volume_id: &str) -> Names {
        let h = format!("{:016x}", fnv1a64(host_volume_id.as_bytes()));
        Names {
            volume_id: format!("crustd-{h}"),
            serial: format!("cr-{h}"),
            node: format!("crustd-{h}"),
            device: format!("crustd-dev-{h}"),
        }
    }
}

/// FNV-1a, 64 bits: stable across releases and platforms, unlike std's hasher.
fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::code::Code;
    use crust_testkit::{disks, needs};

    #[test]
    fn names_are_stable_and_fit() {
        // Pinned: changing the derivation would orphan every published volume.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        let n = Names::derive("/dev/loop3");
        assert_eq!(n, Names::derive("/dev/loop3"));
        assert_ne!(n.serial, Names::derive("/dev/loop4").serial);
        assert_eq!(n.serial.len(), 19);
        assert!(n.node.len() <= 31 && n.device.len() <= 31);
        // The agent refuses any other serial (the rule it shares with crustd).
        assert_eq!(crust_protocols::names::serial(&n.serial), Ok(()));
    }

    #[test]
    fn only_block_devices() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("img");
        fs::write(&f, b"x").unwrap();
        let long = format!("/{}", "d".repeat(5000));
        for (p, what) in [
            ("", "empty"),
            ("dev/loop0", "absolute"),
            (long.as_str(), "5001 bytes"),
            ("/dev/lo\0op0", "NUL"),
            ("/nonexistent/x", "No such file"),
            (t.path().to_str().unwrap(), "a directory"),
            (f.to_str().unwrap(), "regular file"),
            ("/dev/null", "not a block device"),
        ] {
            let e = resolve(p).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{p}");
            assert!(e.to_string().contains(what), "{p}: {e}");
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn two_loop_devices_over_one_file_are_one_disk() {
        needs::loop_devices();
        let d = disks::LoopDisk::new(64, None);
        let first = resolve(&d.path()).unwrap().extent().unwrap();
        assert!(matches!(first.backing, Backing::File { .. }), "{first}");
        assert_eq!((first.start, first.end), (0, None));
        // The same file again, whole: the same bytes.
        let again = d.alias(0, 0);
        let e = resolve(&again.0).unwrap().extent().unwrap();
        assert_eq!(e, first);
        // The second half only, and the first quarter only: both inside the
        // first device, not inside each other.
        let half = d.alias(32 << 20, 0);
        let quarter = d.alias(0, 16 << 20);
        let h = resolve(&half.0).unwrap().extent().unwrap();
        let q = resolve(&quarter.0).unwrap().extent().unwrap();
        assert_eq!((h.start, h.end), (32 << 20, None));
        assert_eq!((q.start, q.end), (0, Some(16 << 20)));
        assert!(h.overlaps(&first) && q.overlaps(&first));
        assert!(!h.overlaps(&q) && !q.overlaps(&h));
        // A partition of the first device lies at its sectors in the file.
        let p1 = d.add_partition();
        let p = resolve(p1.to_str().unwrap()).unwrap().extent().unwrap();
        assert_eq!(
            (p.backing, p.start, p.end),
            (first.backing, 2048 * 512, Some(64 << 20))
        );
        assert!(
            p.overlaps(&h)
                && !p.overlaps(&Extent {
                    start: 0,
                    end: Some(2048 * 512),
                    ..q
                })
        );
        // Another file is another disk.
        let other = disks::LoopDisk::new(16, None);
        let o = resolve(&other.path()).unwrap().extent().unwrap();
        assert!(!o.overlaps(&first));
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_mounted_loop_device_is_in_use_and_cannot_be_held() {
        needs::loop_devices();
        let d = disks::LoopDisk::new(32, Some("ext4"));
        let dev = resolve(&d.path()).unwrap();
        dev.check_unused().unwrap();
        let held = dev.hold().unwrap();
        // Held: the host cannot mount it.
        let out = std::process::Command::new("mount")
            .args(["-t", "ext4", &d.path()])
            .arg(d.scratch("m"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "mounted a device crustd holds");
        // Nor can crustd hold it twice.
        assert_eq!(dev.hold().unwrap_err().code(), Code::FailedPrecondition);
        drop(held);
        let m = disks::Mounted::new(&d.device, "ext4", "");
        let e = dev.check_unused().unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        let mp = m.path.display().to_string();
        assert!(
            e.to_string().contains(&format!("is mounted at {mp}")),
            "{e}"
        );
        let e = dev.hold().unwrap_err();
        assert!(e.to_string().contains(&mp), "{e}");
        // Its partition: the whole disk is mounted.
        drop(m);
        let p1 = d.add_partition();
        let m = disks::Mounted::new(&d.device, "ext4", "");
        let part = resolve(p1.to_str().unwrap()).unwrap();
        let e = part.check_unused().unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("{} is mounted at", d.name())),
            "{e}"
        );
        assert!(part.hold().is_err());
        drop(m);
        // A second loop device over the same file, mounted: the first is in use.
        let alias = d.alias(0, 0);
        let m = disks::Mounted::new(Path::new(&alias.0), "ext4", "");
        let e = dev.check_unused().unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("is mounted at {}", m.path.display())),
            "{e}"
        );
    }
}

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

use std::fmt;
use std::fs::{self, File};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// Bytes in one of the 512-byte sectors sysfs counts `start` and `size` in.
const SECTOR: u64 = 512;

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

/// Where a device's bytes lie on the host's storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// The whole disk, or the file behind a loop device.
    pub backing: Backing,
    /// First byte.
    pub start: u64,
    /// One past the last byte; `None`: to the end, whatever size it grows to.
    pub end: Option<u64>,
}

/// What an extent is a range of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// A whole disk, by its number.
    Disk { major: u32, minor: u32 },
    /// A file behind loop devices, by its filesystem's device and inode.
    File { dev: u64, ino: u64 },
}

impl Extent {
    /// Whether the two ranges share a byte.
    pub fn overlaps(&self, other: &Extent) -> bool {
        self.backing == other.backing
            && self.start < other.end.unwrap_or(u64::MAX)
            && other.start < self.end.unwrap_or(u64::MAX)
    }
}

impl fmt::Display for Extent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.backing {
            Backing::Disk { major, minor } => write!(f, "disk {major}:{minor}")?,
            Backing::File { dev, ino } => write!(
                f,
                "the file with inode {ino} on device {}:{} (behind a loop device)",
                major(dev),
                minor(dev)
            )?,
        }
        match self.end {
            Some(end) => write!(f, " bytes {}..{end}", self.start),
            None => write!(f, " from byte {} to its end", self.start),
        }
    }
}

/// crustd's exclusive hold on a published device (an O_EXCL open); the
/// kernel lets go when it is dropped.
#[derive(Debug)]
pub struct Hold(#[allow(dead_code)] File);

/// Resolves `host_volume_id` to a block device and opens it; anything else
/// is INVALID_ARGUMENT.
pub fn resolve(host_volume_id: &str) -> Result<HostDevice> {
    check_path(host_volume_id)?;
    let md = fs::metadata(host_volume_id).map_err(|e| {
        Error::invalid(format!(
            "host_volume_id {host_volume_id} is not a block device on this host: {e}"
        ))
    })?;
    if !md.file_type().is_block_device() {
        let kind = if md.is_dir() {
            "a directory"
        } else if md.is_file() {
            "a regular file (attach it with losetup and give the /dev/loopN)"
        } else {
            "not a block device"
        };
        return Err(Error::invalid(format!(
            "host_volume_id {host_volume_id} is {kind}: give the block device of the volume, e.g. /dev/sdx"
        )));
    }
    // Only now is it opened: opening some character devices does things.
    // A block device that cannot be opened (no medium, a policy) is
    // FAILED_PRECONDITION: the argument is right, the device is not ready.
    open_node(Path::new(host_volume_id), host_volume_id, md.rdev())
}

/// Opens the device a record names by `MAJOR:MINOR` (after a restart),
/// through the node sysfs names for it.
pub fn open_recorded(rdev: &str) -> Result<HostDevice> {
    let gone = |why: String| {
        Error::precondition(format!(
            "host device {rdev} that crustd recorded is not on this host any more: {why}"
        ))
    };
    let (maj, min) = parse_dev(rdev).ok_or_else(|| gone("not a device number".into()))?;
    let uevent = fs::read_to_string(format!("/sys/dev/block/{maj}:{min}/uevent"))
        .map_err(|e| gone(e.to_string()))?;
    let name = uevent
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .filter(|n| !n.is_empty() && !n.contains(".."))
        .ok_or_else(|| gone("sysfs names no device node".into()))?;
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
    .map_err(|e| Error::precondition(format!("cannot open host device {shown}: {e}")))?;
    let st = rfs::fstat(&fd)
        .map_err(|e| Error::internal(format!("cannot stat host device {shown}: {e}")))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::BlockDevice || st.st_rdev != rdev {
        return Err(Error::precondition(format!(
            "host device {shown} changed while crustd opened it: try again"
        )));
    }
    let file = File::from(fd);
    let path = fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .or_else(|_| fs::canonicalize(path))
        .map_err(|e| Error::internal(format!("cannot resolve {shown}: {e}")))?;
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
    /// Where its bytes lie.
    pub fn extent(&self) -> Result<Extent> {
        extent_of(&Host::system(), &self.file, self.dev).map_err(|e| {
            Error::internal(format!(
                "cannot find where host device {} ({}) lies in /sys: {e}",
                self.shown, self.rdev
            ))
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
        Err(self.in_use(&users.join("; ")))
    }

    /// What on the host uses this device, in words.
    fn users(&self) -> Result<Vec<String>> {
        let h = Host::system();
        users(&h, &aliases(&h, &self.file, self.dev)).map_err(|e| {
            Error::internal(format!(
                "cannot find out whether the host uses {} ({}): {e}",
                self.shown, self.rdev
            ))
        })
    }

    /// "/dev/disk/by-id/x (/dev/loop3)", or "/dev/loop3" when that is what was given.
    pub fn name(&self) -> String {
        named(&self.shown, &self.path.display().to_string())
    }

    fn in_use(&self, what: &str) -> Error {
        Error::precondition(format!(
            "host device {} is in use on this host: {what}; free it there first (unmount it, swapoff, remove the holder) or publish another device",
            self.name()
        ))
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
                    return Err(Error::internal(format!(
                        "host device {} reopened as another device",
                        self.shown
                    )));
                }
                Ok(Hold(File::from(fd)))
            }
            Err(Errno::BUSY) => {
                let users = self.users().unwrap_or_default();
                Err(self.in_use(&if users.is_empty() {
                    "the kernel reports another exclusive user (a mount in another mount namespace, swap, device-mapper or md, or a program that opened it with O_EXCL)".to_string()
                } else {
                    users.join("; ")
                }))
            }
            Err(e) => Err(Error::internal(format!(
                "cannot hold host device {} ({}) exclusively: {e}",
                self.shown, self.rdev
            ))),
        }
    }
}

/// `given`, followed by `node` in parentheses when they differ.
pub fn named(given: &str, node: &str) -> String {
    if given == node {
        given.to_string()
    } else {
        format!("{given} ({node})")
    }
}

/// Where sysfs and procfs are (a test points them at a tree of its own).
struct Host {
    sys: PathBuf,
    proc: PathBuf,
}

impl Host {
    fn system() -> Host {
        Host {
            sys: PathBuf::from("/sys"),
            proc: PathBuf::from("/proc"),
        }
    }
}

/// A block device as sysfs places it on its whole disk.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Place {
    /// The kernel's name ("loop0p1").
    name: String,
    /// Its number.
    dev: (u32, u32),
    /// Its sysfs directory.
    dir: PathBuf,
    /// The whole disk's sysfs directory (`dir` for a whole disk).
    whole: PathBuf,
    /// The whole disk's number.
    whole_dev: (u32, u32),
    /// (start, length) in sectors on the whole disk; `None` for the whole disk.
    range: Option<(u64, u64)>,
}

fn read_trim(p: &Path) -> io::Result<String> {
    Ok(fs::read_to_string(p)?.trim().to_string())
}

fn read_u64(p: &Path) -> io::Result<u64> {
    read_trim(p)?
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", p.display())))
}

/// "7:3" as (7, 3).
fn parse_dev(s: &str) -> Option<(u32, u32)> {
    let (a, b) = s.trim().split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

fn read_dev(p: &Path) -> io::Result<(u32, u32)> {
    let s = read_trim(p)?;
    parse_dev(&s).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {s:?} is not MAJOR:MINOR", p.display()),
        )
    })
}

fn place(h: &Host, dev: (u32, u32)) -> io::Result<Place> {
    let dir = fs::canonicalize(h.sys.join(format!("dev/block/{}:{}", dev.0, dev.1)))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if dir.join("partition").exists() {
        let whole = dir
            .parent()
            .ok_or_else(|| io::Error::other("a partition without a disk"))?
            .to_path_buf();
        Ok(Place {
            name,
            dev,
            range: Some((read_u64(&dir.join("start"))?, read_u64(&dir.join("size"))?)),
            whole_dev: read_dev(&whole.join("dev"))?,
            dir,
            whole,
        })
    } else {
        Ok(Place {
            name,
            dev,
            whole: dir.clone(),
            dir,
            whole_dev: dev,
            range: None,
        })
    }
}

/// Whether two ranges in sectors on one disk meet (`None`: the whole disk).
fn meets(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> bool {
    match (a, b) {
        (Some((s1, l1)), Some((s2, l2))) => {
            s1 < s2.saturating_add(l2) && s2 < s1.saturating_add(l1)
        }
        _ => true,
    }
}

/// The devices that share sectors with `p` on its disk: itself, the whole
/// disk, and every partition whose range meets its own (all of them when
/// `p` is the whole disk).
fn sharing(p: &Place) -> io::Result<Vec<Place>> {
    let whole = Place {
        name: p
            .whole
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        dev: p.whole_dev,
        dir: p.whole.clone(),
        whole: p.whole.clone(),
        whole_dev: p.whole_dev,
        range: None,
    };
    let mut out = vec![whole];
    for e in fs::read_dir(&p.whole)? {
        let dir = e?.path();
        if !dir.join("partition").exists() {
            continue;
        }
        let range = Some((read_u64(&dir.join("start"))?, read_u64(&dir.join("size"))?));
        if meets(p.range, range) {
            out.push(Place {
                name: dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                dev: read_dev(&dir.join("dev"))?,
                whole: p.whole.clone(),
                whole_dev: p.whole_dev,
                dir,
                range,
            });
        }
    }
    Ok(out)
}

/// `struct loop_info64` of linux/loop.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// LOOP_GET_STATUS64 (linux/loop.h).
const LOOP_GET_STATUS64: rustix::ioctl::Opcode = 0x4C05;

/// What a loop device (or a partition of one) is bound to.
fn loop_status(f: impl AsFd) -> io::Result<LoopInfo64> {
    // SAFETY: LOOP_GET_STATUS64 writes one struct loop_info64, which
    // LoopInfo64 mirrors field for field (repr(C), same types and order).
    let get = unsafe { rustix::ioctl::Getter::<LOOP_GET_STATUS64, LoopInfo64>::new() };
    // SAFETY: the opcode and its output type match (above); a device that
    // is not a loop device answers an error, not a write.
    Ok(unsafe { rustix::ioctl::ioctl(f, get) }?)
}

/// The byte range of sectors `range` (`None`: the whole disk).
fn bytes(range: Option<(u64, u64)>) -> (u64, Option<u64>) {
    match range {
        Some((s, l)) => (
            s.saturating_mul(SECTOR),
            Some(s.saturating_add(l).saturating_mul(SECTOR)),
        ),
        None => (0, None),
    }
}

/// Where device `dev` (open as `file`) lies: on its whole disk, or, for a
/// loop device and its partitions, on the file (or the block device) behind
/// it, shifted by the loop's offset and cut at its size limit.
fn extent_of(h: &Host, file: impl AsFd, dev: (u32, u32)) -> io::Result<Extent> {
    let p = place(h, dev)?;
    let (start, end) = bytes(p.range);
    let disk = Extent {
        backing: Backing::Disk {
            major: p.whole_dev.0,
            minor: p.whole_dev.1,
        },
        start,
        end,
    };
    if !p.whole.join("loop").is_dir() {
        return Ok(disk);
    }
    let Ok(lo) = loop_status(file) else {
        // Not bound to anything (no bytes behind it): a disk of its own.
        return Ok(disk);
    };
    let (backing, base, base_end) = if lo.lo_rdevice != 0 {
        // Over a block device: its place, on its own disk.
        let b = place(h, (rfs::major(lo.lo_rdevice), rfs::minor(lo.lo_rdevice)))?;
        let (s, e) = bytes(b.range);
        let backing = Backing::Disk {
            major: b.whole_dev.0,
            minor: b.whole_dev.1,
        };
        (backing, s, e)
    } else {
        let backing = Backing::File {
            dev: lo.lo_device,
            ino: lo.lo_inode,
        };
        (backing, 0, None)
    };
    let origin = base.saturating_add(lo.lo_offset);
    let limit = (lo.lo_sizelimit > 0).then(|| origin.saturating_add(lo.lo_sizelimit));
    Ok(Extent {
        backing,
        start: origin.saturating_add(start),
        end: [end.map(|e| origin.saturating_add(e)), limit, base_end]
            .into_iter()
            .flatten()
            .min(),
    })
}

/// Every device whose use by the host would reach this one's bytes: the
/// devices sharing its sectors on its disk; for a loop device over a block
/// device, those sharing that device's sectors; and every other loop device
/// whose bytes overlap its own (a second loop over the same file), with
/// the devices sharing sectors with that one.
fn aliases(h: &Host, file: &File, dev: (u32, u32)) -> Vec<Place> {
    let mut out = Vec::new();
    let Ok(p) = place(h, dev) else {
        return out;
    };
    out.extend(sharing(&p).unwrap_or_default());
    let Ok(mine) = extent_of(h, file, dev) else {
        return out;
    };
    if let Backing::Disk { major, minor } = mine.backing {
        if (major, minor) != p.whole_dev {
            // A loop over a block device: that device's disk, where it overlaps.
            if let Ok(b) = place(h, (major, minor)) {
                out.extend(sharing(&b).unwrap_or_default().into_iter().filter(|s| {
                    let (s0, e0) = bytes(s.range);
                    mine.overlaps(&Extent {
                        backing: mine.backing,
                        start: s0,
                        end: e0,
                    })
                }));
            }
        }
    }
    for other in loop_devices(h) {
        if other.whole_dev == p.whole_dev {
            continue;
        }
        let Ok(f) = open_quietly(h, other.dev) else {
            continue;
        };
        if extent_of(h, &f, other.dev).is_ok_and(|e| e.overlaps(&mine)) {
            out.extend(sharing(&other).unwrap_or_default());
        }
    }
    out.sort_by_key(|p| p.dev);
    out.dedup_by(|a, b| a.dev == b.dev);
    out
}

/// Every bound loop device (whole disks) in sysfs.
fn loop_devices(h: &Host) -> Vec<Place> {
    let Ok(rd) = fs::read_dir(h.sys.join("block")) else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
        .filter(|e| e.path().join("loop/backing_file").exists())
        .filter_map(|e| read_dev(&e.path().join("dev")).ok())
        .filter_map(|d| place(h, d).ok())
        .collect()
}

/// Opens device `dev` read-only and non-blocking through its node in /dev.
fn open_quietly(h: &Host, dev: (u32, u32)) -> io::Result<File> {
    let uevent = fs::read_to_string(h.sys.join(format!("dev/block/{}:{}/uevent", dev.0, dev.1)))?;
    let name = uevent
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .ok_or_else(|| io::Error::other("no DEVNAME"))?;
    let fd = rfs::open(
        Path::new("/dev").join(name).as_path(),
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let st = rfs::fstat(&fd)?;
    if (rfs::major(st.st_rdev), rfs::minor(st.st_rdev)) != dev {
        return Err(io::Error::other("another device at that node"));
    }
    Ok(File::from(fd))
}

/// What on the host uses any of `devices`, in words: mounts (this mount
/// namespace's table), holders in sysfs, swap, loop devices over them.
fn users(h: &Host, devices: &[Place]) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    let mountinfo = fs::read(h.proc.join("self/mountinfo"))?;
    let mounts = parse_mountinfo(&mountinfo);
    let swaps = fs::read(h.proc.join("swaps")).unwrap_or_default();
    let swaps = parse_swaps(&swaps);
    let loops: Vec<(String, Option<(u32, u32)>)> = loop_devices(h)
        .into_iter()
        .map(|l| {
            let b = fs::read(l.dir.join("loop/backing_file")).unwrap_or_default();
            let b = unescape(trim_nl(&b));
            // Only a device node is looked at: a backing file's path could be anywhere.
            (
                l.name,
                b.starts_with(b"/dev/").then(|| node_dev(&b)).flatten(),
            )
        })
        .collect();
    for d in devices {
        for m in &mounts {
            let by_source = m.source.starts_with(b"/dev/") && node_dev(&m.source) == Some(d.dev);
            if m.dev == Some(d.dev) || by_source {
                out.push(format!(
                    "{} is mounted at {}",
                    d.name,
                    String::from_utf8_lossy(&m.mount_point)
                ));
            }
        }
        if let Ok(rd) = fs::read_dir(d.dir.join("holders")) {
            let mut holders: Vec<String> = rd
                .flatten()
                .map(|e| describe_holder(h, &e.file_name().to_string_lossy()))
                .collect();
            holders.sort();
            for holder in holders {
                out.push(format!("{} is held by {holder}", d.name));
            }
        }
        for s in &swaps {
            if s.starts_with(b"/dev/") && node_dev(s) == Some(d.dev) {
                out.push(format!("{} is used as swap", d.name));
            }
        }
        for (l, b) in &loops {
            if *b == Some(d.dev) {
                out.push(format!("{} is under loop device {l}", d.name));
            }
        }
    }
    out.dedup();
    Ok(out)
}

/// "device-mapper dm-0 (vg-lv)", "md RAID md0", or the holder's name.
fn describe_holder(h: &Host, holder: &str) -> String {
    let dir = h.sys.join("class/block").join(holder);
    if let Ok(name) = read_trim(&dir.join("dm/name")) {
        format!("device-mapper {holder} ({name})")
    } else if dir.join("md").is_dir() {
        format!("md RAID {holder}")
    } else {
        holder.to_string()
    }
}

/// The device number of the block device node at `path`, if it is one.
fn node_dev(path: &[u8]) -> Option<(u32, u32)> {
    use std::os::unix::ffi::OsStrExt;
    let md = fs::metadata(std::ffi::OsStr::from_bytes(path)).ok()?;
    md.file_type()
        .is_block_device()
        .then(|| (rfs::major(md.rdev()), rfs::minor(md.rdev())))
}

fn trim_nl(b: &[u8]) -> &[u8] {
    b.strip_suffix(b"\n").unwrap_or(b)
}

/// One line of mountinfo: what crustd needs of it.
#[derive(Debug, PartialEq, Eq)]
struct Mount {
    /// Field 3, the filesystem's st_dev.
    dev: Option<(u32, u32)>,
    /// Field 5, unescaped.
    mount_point: Vec<u8>,
    /// The source after " - FSTYPE ", unescaped.
    source: Vec<u8>,
}

/// Parses mountinfo as bytes (paths are not UTF-8); malformed lines are skipped.
fn parse_mountinfo(text: &[u8]) -> Vec<Mount> {
    text.split(|&b| b == b'\n')
        .filter_map(|line| {
            let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
            let sep = fields.iter().position(|f| *f == b"-")?;
            Some(Mount {
                dev: parse_dev(std::str::from_utf8(fields.get(2)?).ok()?),
                mount_point: unescape(fields.get(4)?),
                source: unescape(fields.get(sep.checked_add(2)?)?),
            })
        })
        .collect()
}

/// The file names of /proc/swaps, unescaped (the header line skipped).
fn parse_swaps(text: &[u8]) -> Vec<Vec<u8>> {
    text.split(|&b| b == b'\n')
        .skip(1)
        .filter_map(|l| l.split(|b| b.is_ascii_whitespace()).find(|f| !f.is_empty()))
        .map(unescape)
        .collect()
}

/// Undoes the kernel's octal escapes (`\040` for a space).
fn unescape(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let oct = s
            .get(i + 1..i + 4)
            .filter(|o| o.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (s[i], oct) {
            (b'\\', Some(o)) => {
                let v = o.iter().fold(0u32, |a, c| a * 8 + u32::from(c - b'0'));
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// `host_volume_id` must be a non-empty absolute path.
pub fn check_path(host_volume_id: &str) -> Result<()> {
    if host_volume_id.is_empty() {
        return Err(Error::invalid(
            "host_volume_id is empty: give the volume's block device on the host, e.g. /dev/sdx",
        ));
    }
    if !host_volume_id.starts_with('/') {
        return Err(Error::invalid(format!(
            "host_volume_id {host_volume_id:?} is not an absolute path: give the block device, e.g. /dev/sdx"
        )));
    }
    Ok(())
}

/// The device's size in bytes as the host kernel sees it now (what
/// BLKGETSIZE64 answers; seeking to the end of a block device gives the same
/// without an ioctl).
pub fn size(path: &Path) -> Result<u64> {
    let sized = File::open(path).and_then(|mut f| f.seek(SeekFrom::End(0)));
    sized.map_err(|e: io::Error| {
        Error::precondition(format!("cannot read the size of {}: {e}", path.display()))
    })
}

fn major(rdev: u64) -> u64 {
    ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0xfff)
}

fn minor(rdev: u64) -> u64 {
    ((rdev >> 12) & 0xffff_ff00) | (rdev & 0xff)
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
    use crate::disks;
    use crate::error::Code;

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
        assert!(n
            .serial
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    }

    #[test]
    fn only_block_devices() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("img");
        fs::write(&f, b"x").unwrap();
        for (p, what) in [
            ("", "empty"),
            ("dev/loop0", "absolute"),
            ("/nonexistent/x", "No such file"),
            (t.path().to_str().unwrap(), "a directory"),
            (f.to_str().unwrap(), "regular file"),
            ("/dev/null", "not a block device"),
        ] {
            let e = resolve(p).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{p}");
            assert!(e.message.contains(what), "{p}: {e}");
        }
    }

    #[test]
    fn device_numbers() {
        // makedev(7, 3) and makedev(259, 1048577) in glibc's encoding.
        assert_eq!((major(0x703), minor(0x703)), (7, 3));
        let big: u64 = (259 << 8) | ((1_048_577 & 0xff) | ((1_048_577 & !0xff) << 12));
        assert_eq!((major(big), minor(big)), (259, 1_048_577));
    }

    /// A sysfs and procfs of our own: disk loop9 (7:9) with partitions p1
    /// (sectors 2048..42048, held by dm-3), p2 (30000..50000: overlapping p1,
    /// as a hostile table makes them; mounted at "/mnt/with space") and p3
    /// (60000..70000).
    fn fake_host(t: &Path) -> Host {
        let sys = t.join("sys");
        let whole = sys.join("devices/virtual/block/loop9");
        let w = |p: PathBuf, text: &str| {
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        };
        w(whole.join("dev"), "7:9\n");
        fs::create_dir_all(whole.join("holders")).unwrap();
        fs::create_dir_all(sys.join("dev/block")).unwrap();
        std::os::unix::fs::symlink(&whole, sys.join("dev/block/7:9")).unwrap();
        for (n, start, size) in [(1, 2048, 40000), (2, 30000, 20000), (3, 60000, 10000)] {
            let d = whole.join(format!("loop9p{n}"));
            w(d.join("partition"), &format!("{n}\n"));
            w(d.join("start"), &format!("{start}\n"));
            w(d.join("size"), &format!("{size}\n"));
            w(d.join("dev"), &format!("259:{n}\n"));
            fs::create_dir_all(d.join("holders")).unwrap();
            std::os::unix::fs::symlink(&d, sys.join(format!("dev/block/259:{n}"))).unwrap();
        }
        fs::create_dir(whole.join("loop9p1/holders/dm-3")).unwrap();
        w(sys.join("class/block/dm-3/dm/name"), "vg-lv\n");
        let proc = t.join("proc");
        w(
            proc.join("self/mountinfo"),
            "22 1 254:0 / / rw - ext4 /dev/vda rw\n\
             90 22 259:2 / /mnt/with\\040space rw,relatime shared:5 - ext4 /dev/nowhere rw\n",
        );
        w(proc.join("swaps"), "Filename\tType\tSize\tUsed\tPriority\n");
        Host { sys, proc }
    }

    #[test]
    fn sectors_shared_by_a_disk_and_its_partitions_overlapping_ones_included() {
        let t = tempfile::tempdir().unwrap();
        let h = fake_host(t.path());
        let whole = place(&h, (7, 9)).unwrap();
        assert_eq!((whole.range, whole.whole_dev), (None, (7, 9)));
        let p1 = place(&h, (259, 1)).unwrap();
        assert_eq!((p1.range, p1.whole_dev), (Some((2048, 40000)), (7, 9)));
        let sorted = |p: &Place| {
            let mut n: Vec<String> = sharing(p).unwrap().iter().map(|x| x.name.clone()).collect();
            n.sort();
            n
        };
        assert_eq!(sorted(&whole), ["loop9", "loop9p1", "loop9p2", "loop9p3"]);
        // p1 and p2 overlap (both ways); p3 shares sectors only with the disk.
        assert_eq!(sorted(&p1), ["loop9", "loop9p1", "loop9p2"]);
        assert_eq!(
            sorted(&place(&h, (259, 2)).unwrap()),
            ["loop9", "loop9p1", "loop9p2"]
        );
        assert_eq!(sorted(&place(&h, (259, 3)).unwrap()), ["loop9", "loop9p3"]);
        // As extents: the same verdicts.
        let ext = |dev| {
            let p = place(&h, dev).unwrap();
            let (start, end) = bytes(p.range);
            Extent {
                backing: Backing::Disk { major: 7, minor: 9 },
                start,
                end,
            }
        };
        let (w, e1, e2, e3) = (ext((7, 9)), ext((259, 1)), ext((259, 2)), ext((259, 3)));
        for (a, b, overlap) in [
            (&w, &e1, true),
            (&e1, &w, true),
            (&e1, &e2, true),
            (&e2, &e1, true),
            (&e1, &e3, false),
            (&e3, &e2, false),
            (&w, &e3, true),
        ] {
            assert_eq!(a.overlaps(b), overlap, "{a} / {b}");
        }
    }

    #[test]
    fn what_holds_a_device_or_a_device_sharing_its_sectors_is_named() {
        let t = tempfile::tempdir().unwrap();
        let h = fake_host(t.path());
        let on = |dev| users(&h, &sharing(&place(&h, dev).unwrap()).unwrap()).unwrap();
        // The whole disk: a partition held and a partition mounted.
        let u = on((7, 9));
        assert!(
            u.contains(&"loop9p1 is held by device-mapper dm-3 (vg-lv)".to_string()),
            "{u:?}"
        );
        assert!(
            u.contains(&"loop9p2 is mounted at /mnt/with space".to_string()),
            "{u:?}"
        );
        // p2 itself is unused, but it overlaps p1, which is held.
        let u = on((259, 2));
        assert!(u.iter().any(|x| x.starts_with("loop9p1 is held")), "{u:?}");
        // p3 shares nothing with them.
        assert!(on((259, 3)).is_empty());
    }

    #[test]
    fn mountinfo_and_swaps_are_read_as_bytes() {
        let m = parse_mountinfo(
            b"36 35 98:0 /mnt1 /mnt/parent\\040dir rw,noatime master:1 - ext3 /dev/root rw\n\
              37 35 0:5 / /x\xff rw - tmpfs tmpfs rw\nbroken line\n",
        );
        assert_eq!(
            m,
            [
                Mount {
                    dev: Some((98, 0)),
                    mount_point: b"/mnt/parent dir".to_vec(),
                    source: b"/dev/root".to_vec()
                },
                Mount {
                    dev: Some((0, 5)),
                    mount_point: b"/x\xff".to_vec(),
                    source: b"tmpfs".to_vec()
                }
            ]
        );
        let s = parse_swaps(
            b"Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n\
              /dev/loop3                              partition\t65532\t\t0\t\t-2\n\
              /swap\\040file file 1 0 -3\n",
        );
        assert_eq!(s, [b"/dev/loop3".to_vec(), b"/swap file".to_vec()]);
        assert_eq!(unescape(b"a\\134b\\0"), b"a\\b\\0");
    }

    /// A loop device over `image` from `offset` for `limit` bytes (0: to the end), detached on drop.
    struct Loop(String);
    impl Loop {
        fn new(image: &Path, offset: u64, limit: u64) -> Loop {
            let mut args = vec!["--find".to_string(), "--show".into()];
            args.extend(["-o".into(), offset.to_string()]);
            if limit > 0 {
                args.extend(["--sizelimit".into(), limit.to_string()]);
            }
            args.push(image.display().to_string());
            let out = std::process::Command::new("losetup")
                .args(&args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Loop(String::from_utf8_lossy(&out.stdout).trim().to_string())
        }
    }
    impl Drop for Loop {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.0])
                .output();
        }
    }

    #[test]
    fn two_loop_devices_over_one_file_are_one_disk() {
        if !disks::root_or_skip("two_loop_devices_over_one_file_are_one_disk") {
            return;
        }
        let d = disks::LoopDisk::new(64, None);
        let first = resolve(&d.path()).unwrap().extent().unwrap();
        assert!(matches!(first.backing, Backing::File { .. }), "{first}");
        assert_eq!((first.start, first.end), (0, None));
        // The same file again, whole: the same bytes.
        let again = Loop::new(&d.image, 0, 0);
        let e = resolve(&again.0).unwrap().extent().unwrap();
        assert_eq!(e, first);
        // The second half only, and the first quarter only: both inside the
        // first device, not inside each other.
        let half = Loop::new(&d.image, 32 << 20, 0);
        let quarter = Loop::new(&d.image, 0, 16 << 20);
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
    fn a_mounted_loop_device_is_in_use_and_cannot_be_held() {
        if !disks::root_or_skip("a_mounted_loop_device_is_in_use_and_cannot_be_held") {
            return;
        }
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
        assert_eq!(dev.hold().unwrap_err().code, Code::FailedPrecondition);
        drop(held);
        let m = disks::Mounted::new(&d.device, "ext4", "");
        let e = dev.check_unused().unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition);
        let mp = m.path.display().to_string();
        assert!(e.message.contains(&format!("is mounted at {mp}")), "{e}");
        let e = dev.hold().unwrap_err();
        assert!(e.message.contains(&mp), "{e}");
        // Its partition: the whole disk is mounted.
        drop(m);
        let p1 = d.add_partition();
        let m = disks::Mounted::new(&d.device, "ext4", "");
        let part = resolve(p1.to_str().unwrap()).unwrap();
        let e = part.check_unused().unwrap_err();
        assert!(
            e.message.contains(&format!("{} is mounted at", d.name())),
            "{e}"
        );
        assert!(part.hold().is_err());
        drop(m);
        // A second loop device over the same file, mounted: the first is in use.
        let alias = Loop::new(&d.image, 0, 0);
        let m = disks::Mounted::new(Path::new(&alias.0), "ext4", "");
        let e = dev.check_unused().unwrap_err();
        assert!(
            e.message
                .contains(&format!("is mounted at {}", m.path.display())),
            "{e}"
        );
    }
}

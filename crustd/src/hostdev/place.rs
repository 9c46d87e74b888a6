//! Where a block device's bytes lie, from sysfs: its place on its whole
//! disk (`start` and `size` of a partition), the devices that share its
//! sectors (the whole disk, overlapping partitions), and for loop devices
//! the file or device behind them (LOOP_GET_STATUS64), so that a device is
//! known by its bytes whatever node names it.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, Mode, OFlags};

use std::fmt;

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
                rfs::major(dev),
                rfs::minor(dev)
            )?,
        }
        match self.end {
            Some(end) => write!(f, " bytes {}..{end}", self.start),
            None => write!(f, " from byte {} to its end", self.start),
        }
    }
}

/// Bytes in one of the 512-byte sectors sysfs counts `start` and `size` in.
const SECTOR: u64 = 512;

/// Where sysfs and procfs are (a test points them at a tree of its own).
pub(super) struct Host {
    /// Where sysfs is mounted.
    pub(super) sys: PathBuf,
    /// Where procfs is mounted.
    pub(super) proc: PathBuf,
}

impl Host {
    pub(super) fn system() -> Host {
        Host {
            sys: PathBuf::from("/sys"),
            proc: PathBuf::from("/proc"),
        }
    }
}

/// A block device as sysfs places it on its whole disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Place {
    /// The kernel's name ("loop0p1").
    pub(super) name: String,
    /// Its number.
    pub(super) dev: (u32, u32),
    /// Its sysfs directory.
    pub(super) dir: PathBuf,
    /// The whole disk's sysfs directory (`dir` for a whole disk).
    pub(super) whole: PathBuf,
    /// The whole disk's number.
    pub(super) whole_dev: (u32, u32),
    /// (start, length) in sectors on the whole disk; `None` for the whole disk.
    pub(super) range: Option<(u64, u64)>,
}

pub(super) fn read_trim(p: &Path) -> io::Result<String> {
    Ok(fs::read_to_string(p)?.trim().to_string())
}

fn read_u64(p: &Path) -> io::Result<u64> {
    read_trim(p)?
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", p.display())))
}

/// "7:3" as (7, 3).
pub(super) fn parse_dev(s: &str) -> Option<(u32, u32)> {
    let (a, b) = s.trim().split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

pub(super) fn read_dev(p: &Path) -> io::Result<(u32, u32)> {
    let s = read_trim(p)?;
    parse_dev(&s).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {s:?} is not MAJOR:MINOR", p.display()),
        )
    })
}

pub(super) fn place(h: &Host, dev: (u32, u32)) -> io::Result<Place> {
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
pub(super) fn sharing(p: &Place) -> io::Result<Vec<Place>> {
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
pub(crate) struct LoopInfo64 {
    pub(crate) lo_device: u64,
    pub(crate) lo_inode: u64,
    pub(crate) lo_rdevice: u64,
    pub(crate) lo_offset: u64,
    pub(crate) lo_sizelimit: u64,
    pub(crate) lo_number: u32,
    pub(crate) lo_encrypt_type: u32,
    pub(crate) lo_encrypt_key_size: u32,
    pub(crate) lo_flags: u32,
    pub(crate) lo_file_name: [u8; 64],
    pub(crate) lo_crypt_name: [u8; 64],
    pub(crate) lo_encrypt_key: [u8; 32],
    pub(crate) lo_init: [u64; 2],
}

/// LOOP_GET_STATUS64 (linux/loop.h).
const LOOP_GET_STATUS64: rustix::ioctl::Opcode = 0x4C05;

/// What a loop device (or a partition of one) is bound to.
pub(super) fn loop_status(f: impl AsFd) -> io::Result<LoopInfo64> {
    // SAFETY: LOOP_GET_STATUS64 writes one struct loop_info64, which
    // LoopInfo64 mirrors field for field (repr(C), same types and order).
    let get = unsafe { rustix::ioctl::Getter::<LOOP_GET_STATUS64, LoopInfo64>::new() };
    // SAFETY: the opcode and its output type match (above); a device that
    // is not a loop device answers an error, not a write.
    Ok(unsafe { rustix::ioctl::ioctl(f, get) }?)
}

/// The byte range of sectors `range` (`None`: the whole disk).
pub(super) fn bytes(range: Option<(u64, u64)>) -> (u64, Option<u64>) {
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
pub(super) fn extent_of(h: &Host, file: impl AsFd, dev: (u32, u32)) -> io::Result<Extent> {
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
pub(super) fn aliases(h: &Host, file: &File, dev: (u32, u32)) -> Vec<Place> {
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
pub(super) fn loop_devices(h: &Host) -> Vec<Place> {
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A sysfs and procfs of our own: disk loop9 (7:9) with partitions p1
    /// (sectors 2048..42048, held by dm-3), p2 (30000..50000: overlapping p1,
    /// as a hostile table makes them; mounted at "/mnt/with space") and p3
    /// (60000..70000).
    pub(crate) fn fake_host(t: &Path) -> Host {
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
}

//! Finding the volume's disk: by the serial the host gave it (a scan of
//! /sys/block, woken by kernel uevents), or by a path under /dev; and its size,
//! now or once the host has grown it. Reads only: nothing here opens a disk for writing.

// Sizes come from disks and superblocks the agent does not control: every
// sum and product of them is checked.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::fs::{self, File};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cancel::{deadline_after, until, Cancel, Stopped};
use crate::model::{Device, DiskState};
use crate::sys::blockdev::size_of;
use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;
use crate::sys::sysfs::{parse_devnum, read_attr, Sysfs};
use crate::sys::uevents::Uevents;

crate::code::coded_errors! {
/// What can go wrong finding or sizing a disk.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(DeadlineExceeded)]
    #[error("no disk with serial {serial} appeared within {} ms; check that the host attached it as virtio-blk with that serial", .waited.as_millis())]
    SerialNotFound {
        /// The serial asked for.
        serial: String,
        /// How long the agent waited.
        waited: Duration,
    },
    #[code(DeadlineExceeded)]
    #[error("disk {name} with serial {serial} is listed in sysfs but {} did not appear within {} ms; is devtmpfs mounted on /dev?", .node.display(), .waited.as_millis())]
    NodeMissing {
        /// The serial asked for.
        serial: String,
        /// The disk's kernel name.
        name: String,
        /// The node that was expected.
        node: PathBuf,
        /// How long the agent waited.
        waited: Duration,
    },
    #[code(FailedPrecondition)]
    #[error("{} is not the block device {major}:{minor} that sysfs lists as {name} ({found}); refusing a node that may be another disk", .node.display())]
    NodeMismatch {
        /// The disk's kernel name.
        name: String,
        /// The node that was checked.
        node: PathBuf,
        /// The major number sysfs gives.
        major: u32,
        /// The minor number sysfs gives.
        minor: u32,
        /// What the node is instead.
        found: String,
    },
    #[code(FailedPrecondition)]
    #[error("several disks have serial {serial} ({names}); the agent cannot tell which is the volume: give each disk a unique serial")]
    DuplicateSerial {
        /// The serial asked for.
        serial: String,
        /// The disks that have it.
        names: String,
    },
    #[code(InvalidArgument)]
    #[error("the serial is empty; give the serial the host set on the disk")]
    EmptySerial,
    #[code(InvalidArgument)]
    #[error("device path {} {reason}; give the absolute path of a block device under /dev", shown(path))]
    BadPath {
        /// The path as given.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    #[code(OutOfRange)]
    #[error("{} is {actual} bytes, less than the required {required} bytes, still after waiting {} ms; the host must grow the disk first", .device.display(), .waited.as_millis())]
    TooSmall {
        device: PathBuf,
        /// The bytes asked for.
        required: u64,
        /// The bytes the device has.
        actual: u64,
        /// How long the agent waited.
        waited: Duration,
    },
    #[code(FailedPrecondition)]
    #[error("disk {name} ({major}:{minor}) is gone from sysfs or now reports size 0; the host must re-attach it")]
    Gone {
        /// The disk's kernel name.
        name: String,
        major: u32,
        minor: u32,
    },
    #[code(inner)]
    #[error(transparent)]
    Stopped(#[from] Stopped),
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

/// How often a serial lookup rescans even without uevents (missed events, fake trees).
const RESCAN: Duration = Duration::from_millis(500);
/// How often a size wait re-reads the size even without uevents.
const SIZE_POLL: Duration = Duration::from_millis(100);

/// What one scan of /sys/block found for a serial.
enum Scan {
    Found(Device),
    /// The disk is listed but its node is not there (yet).
    NoNode(String, PathBuf),
    Nothing,
}

fn scan(sysfs: &Sysfs, serial: &str) -> Result<Scan, Error> {
    let entries = fs::read_dir(&sysfs.sys_block)
        .map_err(|e| SysError::new("readdir", sysfs.sys_block.display(), e))?;
    let mut names = Vec::new();
    for entry in entries.flatten() {
        let dir = entry.path();
        // /sys/block lists whole disks; a `partition` attribute marks anything else.
        if dir.join("partition").exists() {
            continue;
        }
        if read_attr(&dir.join("serial")).as_deref() == Some(serial) {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    let name = match names.as_slice() {
        [] => return Ok(Scan::Nothing),
        [one] => one.clone(),
        _ => {
            return Err(Error::DuplicateSerial {
                serial: serial.to_string(),
                names: names.join(", "),
            })
        }
    };
    // `dev` may not be readable for an instant while the disk is being added.
    let Some((major, minor)) =
        read_attr(&sysfs.sys_block.join(&name).join("dev")).and_then(|s| parse_devnum(&s))
    else {
        return Ok(Scan::Nothing);
    };
    let node = sysfs.dev_dir.join(&name);
    match check_node(&node, major, minor) {
        Ok(()) => Ok(Scan::Found(Device {
            name,
            path: node,
            major,
            minor,
            serial: Some(serial.to_string()),
        })),
        Err(None) => Ok(Scan::NoNode(name, node)),
        Err(Some(found)) => Err(Error::NodeMismatch {
            name,
            node,
            major,
            minor,
            found,
        }),
    }
}

/// Checks `node` is the block device major:minor. Err(None): it does not exist;
/// Err(Some(what)): it is something else.
fn check_node(node: &Path, major: u32, minor: u32) -> Result<(), Option<String>> {
    let st = match rustix::fs::stat(node) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Err(None),
        Err(e) => return Err(Some(format!("stat failed: {e}"))),
    };
    let ft = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if ft != rustix::fs::FileType::BlockDevice {
        return Err(Some(format!("it is a {ft:?}, not a block device")));
    }
    let (ma, mi) = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
    if (ma, mi) != (major, minor) {
        return Err(Some(format!("it is block device {ma}:{mi}")));
    }
    Ok(())
}

/// Finds the whole disk whose serial is `serial`, waiting up to `timeout` for it to appear.
/// `cancel` stops the wait early (its deadline, the agent's shutdown).
pub fn find_by_serial(
    sysfs: &Sysfs,
    serial: &str,
    timeout: Duration,
    cancel: &Cancel,
) -> Result<Device, Error> {
    if serial.is_empty() {
        return Err(Error::EmptySerial);
    }
    let start = Instant::now();
    let deadline = deadline_after(start, timeout);
    let events = Uevents::open();
    let during = || format!("waiting for the disk with serial {serial}");
    loop {
        cancel.check(during)?;
        let pending = match scan(sysfs, serial)? {
            Scan::Found(dev) => return Ok(dev),
            Scan::NoNode(name, node) => Some((name, node)),
            Scan::Nothing => None,
        };
        if Instant::now() >= deadline {
            let (serial, waited) = (serial.to_string(), start.elapsed());
            return Err(match pending {
                Some((name, node)) => Error::NodeMissing {
                    serial,
                    name,
                    node,
                    waited,
                },
                None => Error::SerialNotFound { serial, waited },
            });
        }
        events.wait(cancel.slice(until(deadline, RESCAN)), |ev| {
            ev.subsystem == "block" && (ev.action == "add" || ev.action == "change")
        });
    }
}

/// Is `path` lexically under /dev (no `..` climbing out)?
fn under_dev(path: &Path) -> bool {
    let mut c = path.components();
    c.next() == Some(Component::RootDir)
        && c.next() == Some(Component::Normal("dev".as_ref()))
        && c.clone().next().is_some()
        && c.all(|c| matches!(c, Component::Normal(_)))
}

/// The block device at `path`: an absolute path under /dev (symlinks such as
/// /dev/disk/by-id are followed only while they stay under /dev).
pub fn from_path(sysfs: &Sysfs, path: &Path) -> Result<Device, Error> {
    let bad = |reason: String| Error::BadPath {
        path: path.to_path_buf(),
        reason,
    };
    if !path.is_absolute() {
        return Err(bad("is relative".into()));
    }
    if !under_dev(path) {
        return Err(bad("is not under /dev".into()));
    }
    let real = fs::canonicalize(path).map_err(|e| bad(format!("cannot be resolved ({e})")))?;
    if !under_dev(&real) {
        return Err(bad(format!("resolves to {}, outside /dev", real.display())));
    }
    let meta = fs::metadata(&real).map_err(|e| bad(format!("cannot be examined ({e})")))?;
    if !meta.file_type().is_block_device() {
        return Err(bad("is not a block device".into()));
    }
    use std::os::unix::fs::MetadataExt;
    let rdev = meta.rdev();
    let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let name = sysfs
        .name_of((major, minor))
        .or_else(|| real.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let serial = sysfs.serial_of((major, minor));
    Ok(Device {
        name,
        path: real,
        major,
        minor,
        serial,
    })
}

/// BLKGETSIZE64: the device's size in bytes, as the kernel sees it now.
pub fn size_bytes(device: &Path) -> Result<u64, Error> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(device)
        .map_err(|e| SysError::new("open", device.display(), e))?;
    Ok(size_of(&file, device)?)
}

/// Waits until `dev` is at least `min_bytes` (the host grows disks, the guest
/// notices a little later) and returns its size; OUT_OF_RANGE after
/// `timeout`. `cancel` stops the wait early.
pub fn wait_for_size(
    sysfs: &Sysfs,
    dev: &Device,
    min_bytes: u64,
    timeout: Duration,
    cancel: &Cancel,
) -> Result<u64, Error> {
    let start = Instant::now();
    let deadline = deadline_after(start, timeout);
    let events = Uevents::open();
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(&dev.path)
        .map_err(|e| SysError::new("open", dev.path.display(), e))?;
    let during = || {
        format!(
            "waiting for {} to grow to {min_bytes} bytes",
            dev.path.display()
        )
    };
    loop {
        cancel.check(during)?;
        let size = size_of(&file, &dev.path)?;
        if size >= min_bytes {
            return Ok(size);
        }
        if sysfs.disk_state(dev) == DiskState::Gone {
            return Err(Error::Gone {
                name: dev.name.clone(),
                major: dev.major,
                minor: dev.minor,
            });
        }
        if Instant::now() >= deadline {
            return Err(Error::TooSmall {
                device: dev.path.clone(),
                required: min_bytes,
                actual: size,
                waited: start.elapsed(),
            });
        }
        events.wait(cancel.slice(until(deadline, SIZE_POLL)), |ev| {
            ev.subsystem == "block" && ev.action == "change" && ev.devname == dev.name
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;
    use crate::model::Extent;
    use crust_testkit::{needs, run, LoopDisk};

    #[test]
    fn parses_devnums_and_paths() {
        for (s, want) in [
            ("253:16\n", Some((253, 16))),
            ("7:0", Some((7, 0))),
            ("7", None),
            ("a:1", None),
            ("", None),
            ("1:2:3", None),
        ] {
            assert_eq!(parse_devnum(s), want, "{s:?}");
        }
        for (p, want) in [
            ("/dev/vdb", true),
            ("/dev/disk/by-id/x", true),
            ("/dev", false),
            ("/dev/../etc/passwd", false),
            ("/devx/vdb", false),
            ("dev/vdb", false),
            ("/sys/dev/vdb", false),
        ] {
            assert_eq!(under_dev(Path::new(p)), want, "{p}");
        }
    }

    /// A fake /sys/block and /dev whose disks point at real loop devices' numbers.
    struct FakeTree {
        root: tempfile::TempDir,
        sysfs: Sysfs,
    }

    impl FakeTree {
        fn new() -> FakeTree {
            let root = tempfile::tempdir().unwrap();
            let sysfs = Sysfs {
                sys_block: root.path().join("sys/block"),
                dev_dir: root.path().join("dev"),
                dev_block: root.path().join("sys/dev/block"),
            };
            fs::create_dir_all(&sysfs.sys_block).unwrap();
            fs::create_dir_all(&sysfs.dev_dir).unwrap();
            fs::create_dir_all(&sysfs.dev_block).unwrap();
            FakeTree { root, sysfs }
        }

        /// Lists disk `name` with `serial` and numbers `major:minor`; makes its node if `node` says so.
        fn add(
            &self,
            name: &str,
            serial: &str,
            (major, minor): (u32, u32),
            node: Option<(u32, u32)>,
        ) {
            let dir = self.sysfs.sys_block.join(name);
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("serial"), format!("{serial}\n")).unwrap();
            fs::write(dir.join("size"), "2048\n").unwrap();
            fs::write(dir.join("dev"), format!("{major}:{minor}\n")).unwrap();
            let _ = std::os::unix::fs::symlink(
                format!("../../block/{name}"),
                self.sysfs.dev_block.join(format!("{major}:{minor}")),
            );
            if let Some((ma, mi)) = node {
                let path = self.sysfs.dev_dir.join(name);
                run(
                    "mknod",
                    &[
                        path.to_str().unwrap(),
                        "b",
                        &ma.to_string(),
                        &mi.to_string(),
                    ],
                );
            }
        }
    }

    impl FakeTree {
        /// Lists partition `name` of disk `disk` at `start` with `size` sectors.
        fn add_partition(
            &self,
            disk: &str,
            name: &str,
            (major, minor): (u32, u32),
            start: u64,
            size: u64,
        ) {
            let dir = self.sysfs.sys_block.join(disk).join(name);
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("partition"), "1\n").unwrap();
            fs::write(dir.join("start"), format!("{start}\n")).unwrap();
            fs::write(dir.join("size"), format!("{size}\n")).unwrap();
            fs::write(dir.join("dev"), format!("{major}:{minor}\n")).unwrap();
            std::os::unix::fs::symlink(
                format!("../../block/{disk}/{name}"),
                self.sysfs.dev_block.join(format!("{major}:{minor}")),
            )
            .unwrap();
        }
    }

    #[test]
    fn extents_tell_a_disk_its_partitions_and_overlapping_ones() {
        let t = FakeTree::new();
        t.add("vdb", "s", (7, 300), None);
        t.add("vdc", "s2", (7, 310), None);
        t.add_partition("vdb", "vdb1", (259, 1), 100, 1000);
        t.add_partition("vdb", "vdb2", (259, 2), 1100, 948);
        // A hostile table: a third partition inside the first.
        t.add_partition("vdb", "vdb3", (259, 3), 500, 100);
        t.add_partition("vdb", "vdb4", (259, 4), 2048, 0);
        let x = |d| t.sysfs.extent(d);
        assert_eq!(
            x((7, 300)),
            Extent {
                disk: (7, 300),
                start: 0,
                sectors: 2048,
                partition: false
            }
        );
        assert_eq!(
            x((259, 1)),
            Extent {
                disk: (7, 300),
                start: 100,
                sectors: 1000,
                partition: true
            }
        );
        let (disk, p1, p2, p3, p4) = (
            x((7, 300)),
            x((259, 1)),
            x((259, 2)),
            x((259, 3)),
            x((259, 4)),
        );
        for (a, b, want) in [
            (disk, p1, true),
            (disk, p2, true),
            (disk, p3, true),
            (p1, p2, false),
            (p1, p3, true),
            (p2, p3, false),
            (disk, p4, false),
            (disk, x((7, 310)), false),
            (p1, x((7, 310)), false),
            (disk, disk, true),
        ] {
            assert_eq!(a.overlaps(&b), want, "{a:?} vs {b:?}");
            assert_eq!(b.overlaps(&a), want, "{b:?} vs {a:?}: in both orders");
        }
        assert!(
            p1.describe(&p3)
                .contains("100..1100 of disk 7:300 against 500..600"),
            "{}",
            p1.describe(&p3)
        );
        // A device sysfs does not list is a whole disk of its own: it overlaps itself only.
        let gone = x((9, 9));
        assert_eq!(gone.disk, (9, 9));
        assert!(gone.overlaps(&gone) && !gone.overlaps(&disk));
        // A partition whose range cannot be read is held against all of its disk.
        fs::remove_file(t.sysfs.sys_block.join("vdb/vdb2/start")).unwrap();
        let p2 = x((259, 2));
        assert!(p2.partition && p2.overlaps(&p1) && p2.overlaps(&p3));
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn the_extent_of_a_real_partition_is_on_its_loop_disk() {
        needs::loop_devices();
        let disk = LoopDisk::new(16, None);
        let part = from_path(&Sysfs::system(), &disk.add_partition()).unwrap();
        let whole = from_path(&Sysfs::system(), &disk.device).unwrap();
        let sysfs = Sysfs::system();
        let (pe, we) = (
            sysfs.extent((part.major, part.minor)),
            sysfs.extent((whole.major, whole.minor)),
        );
        assert_eq!(
            pe,
            Extent {
                disk: (whole.major, whole.minor),
                start: 2048,
                sectors: 32768 - 2048,
                partition: true
            }
        );
        assert_eq!(
            we,
            Extent {
                disk: (whole.major, whole.minor),
                start: 0,
                sectors: 32768,
                partition: false
            }
        );
        assert!(pe.overlaps(&we) && we.overlaps(&pe));
    }

    #[test]
    fn a_wait_for_a_serial_stops_when_cancelled() {
        use crate::cancel::{Token, Why};
        let t = FakeTree::new();
        let token = Token::new(Why::Shutdown);
        let fire = token.clone();
        let firer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            fire.fire();
        });
        let started = Instant::now();
        let cancel = Cancel::never().with_token(&token);
        let e =
            find_by_serial(&t.sysfs, "vol-never", Duration::from_secs(30), &cancel).unwrap_err();
        firer.join().unwrap();
        assert!(matches!(e, Error::Stopped(_)), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        // The caller's deadline, earlier than timeout_ms, ends the wait as DEADLINE_EXCEEDED.
        let started = Instant::now();
        let cancel = Cancel::never().with_timeout(Duration::from_millis(150));
        let e =
            find_by_serial(&t.sysfs, "vol-never", Duration::from_secs(30), &cancel).unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn finds_a_disk_listed_at_start() {
        needs::loop_devices();
        let t = FakeTree::new();
        t.add("vdb", "vol-a", (7, 200), Some((7, 200)));
        t.add("vdc", "vol-b", (7, 201), Some((7, 201)));
        // A partition carrying the same serial must not count as a second disk.
        let part = t.sysfs.sys_block.join("vdb1");
        t.add("vdb1", "vol-a", (7, 202), Some((7, 202)));
        fs::write(part.join("partition"), "1\n").unwrap();
        let started = Instant::now();
        let dev =
            find_by_serial(&t.sysfs, "vol-a", Duration::from_secs(5), &Cancel::never()).unwrap();
        assert!(started.elapsed() < Duration::from_millis(400));
        assert_eq!(
            dev,
            Device {
                name: "vdb".into(),
                path: t.sysfs.dev_dir.join("vdb"),
                major: 7,
                minor: 200,
                serial: Some("vol-a".into())
            }
        );
        drop(t.root);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn trims_serials_padded_with_nuls() {
        needs::loop_devices();
        let t = FakeTree::new();
        t.add("vdd", "vol-pad", (7, 210), Some((7, 210)));
        fs::write(t.sysfs.sys_block.join("vdd/serial"), b"vol-pad \0\0\0\n").unwrap();
        assert_eq!(
            find_by_serial(
                &t.sysfs,
                "vol-pad",
                Duration::from_secs(1),
                &Cancel::never()
            )
            .unwrap()
            .name,
            "vdd"
        );
        // A prefix of a serial is not that serial.
        let e = find_by_serial(
            &t.sysfs,
            "vol-p",
            Duration::from_millis(50),
            &Cancel::never(),
        )
        .unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn waits_for_a_disk_that_appears_later() {
        needs::loop_devices();
        let t = FakeTree::new();
        let sysfs = t.sysfs.clone();
        let adder = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            t.add("vde", "vol-late", (7, 220), Some((7, 220)));
            t
        });
        let started = Instant::now();
        let dev =
            find_by_serial(&sysfs, "vol-late", Duration::from_secs(5), &Cancel::never()).unwrap();
        let took = started.elapsed();
        let _t = adder.join().unwrap();
        assert_eq!((dev.name.as_str(), dev.major, dev.minor), ("vde", 7, 220));
        // Found by the periodic rescan (fake trees send no uevents): within one period.
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_millis(1500),
            "{took:?}"
        );
    }

    #[test]
    fn gives_up_at_the_deadline() {
        let t = FakeTree::new();
        t.add("vdf", "vol-other", (7, 230), None);
        let started = Instant::now();
        let e = find_by_serial(
            &t.sysfs,
            "vol-never",
            Duration::from_millis(700),
            &Cancel::never(),
        )
        .unwrap_err();
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(700) && took < Duration::from_millis(1300),
            "{took:?}"
        );
        assert_eq!(e.code(), Code::DeadlineExceeded);
        let msg = e.to_string();
        assert!(
            msg.contains("serial vol-never") && msg.contains("within 7"),
            "{msg}"
        );
    }

    #[test]
    fn reports_a_listed_disk_whose_node_never_appears() {
        let t = FakeTree::new();
        t.add("vdg", "vol-nonode", (7, 240), None);
        let e = find_by_serial(
            &t.sysfs,
            "vol-nonode",
            Duration::from_millis(200),
            &Cancel::never(),
        )
        .unwrap_err();
        assert!(matches!(e, Error::NodeMissing { .. }), "{e}");
        assert_eq!(e.code(), Code::DeadlineExceeded);
        assert!(e.to_string().contains("devtmpfs"), "{e}");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn refuses_a_node_of_another_device() {
        needs::loop_devices();
        let t = FakeTree::new();
        t.add("vdh", "vol-wrong", (7, 250), Some((7, 251)));
        let e = find_by_serial(
            &t.sysfs,
            "vol-wrong",
            Duration::from_secs(2),
            &Cancel::never(),
        )
        .unwrap_err();
        assert!(matches!(e, Error::NodeMismatch { .. }), "{e}");
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("7:251"), "{e}");
        // A regular file where the node should be is refused too.
        t.add("vdi", "vol-file", (7, 252), None);
        fs::write(t.sysfs.dev_dir.join("vdi"), b"").unwrap();
        let e = find_by_serial(
            &t.sysfs,
            "vol-file",
            Duration::from_secs(2),
            &Cancel::never(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a block device"), "{e}");
    }

    #[test]
    fn refuses_a_duplicate_or_empty_serial() {
        let t = FakeTree::new();
        t.add("vdj", "vol-dup", (7, 260), None);
        t.add("vdk", "vol-dup", (7, 261), None);
        let e = find_by_serial(
            &t.sysfs,
            "vol-dup",
            Duration::from_secs(2),
            &Cancel::never(),
        )
        .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("vdj, vdk"), "{e}");
        // A disk without a serial has an empty `serial` file: "" must not find it.
        t.add("vdm", "", (7, 262), None);
        let e = find_by_serial(&t.sysfs, "", Duration::from_secs(2), &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn takes_a_real_loop_device_by_path() {
        needs::loop_devices();
        let disk = LoopDisk::new(16, None);
        let dev = from_path(&Sysfs::system(), &disk.device).unwrap();
        assert_eq!(dev.name, disk.name());
        assert_eq!(dev.path, disk.device);
        assert_eq!(dev.major, 7);
        assert_eq!(dev.serial, None);
        // Through a symlink that stays under /dev.
        let link = PathBuf::from(format!("/dev/crust-test-{}", disk.name()));
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&disk.device, &link).unwrap();
        let via = from_path(&Sysfs::system(), &link);
        fs::remove_file(&link).unwrap();
        assert_eq!(via.unwrap(), dev);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn refuses_paths_that_are_not_block_devices_under_dev() {
        needs::loop_devices();
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("disk.img");
        fs::write(&outside, b"x").unwrap();
        let escape = PathBuf::from(format!("/dev/crust-escape-{}", std::process::id()));
        let _ = fs::remove_file(&escape);
        std::os::unix::fs::symlink(&outside, &escape).unwrap();
        let cases = [
            (PathBuf::from("dev/loop0"), "is relative"),
            (outside.clone(), "is not under /dev"),
            (PathBuf::from("/dev/../etc/passwd"), "is not under /dev"),
            (PathBuf::from("/dev/null"), "is not a block device"),
            (
                PathBuf::from("/dev/crust-no-such-disk"),
                "cannot be resolved",
            ),
            (escape.clone(), "outside /dev"),
        ];
        for (p, why) in cases {
            let e = from_path(&Sysfs::system(), &p).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
            assert!(e.to_string().contains(why), "{p:?}: {e}");
        }
        fs::remove_file(&escape).unwrap();
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn sizes_and_waits_for_growth() {
        needs::loop_devices();
        let disk = LoopDisk::new(32, None);
        let dev = from_path(&Sysfs::system(), &disk.device).unwrap();
        let sysfs = Sysfs::system();
        assert_eq!(size_bytes(&disk.device).unwrap(), 32 << 20);
        assert_eq!(
            sysfs.disk_state(&dev),
            DiskState::Present {
                size_bytes: 32 << 20
            }
        );
        // Already big enough: immediately.
        assert_eq!(
            wait_for_size(
                &sysfs,
                &dev,
                16 << 20,
                Duration::from_secs(1),
                &Cancel::never()
            )
            .unwrap(),
            32 << 20
        );
        // Grown by "the host" while the agent waits.
        let disk = std::sync::Arc::new(disk);
        let grower = {
            let disk = disk.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                disk.resize(64);
            })
        };
        let started = Instant::now();
        let got = wait_for_size(
            &sysfs,
            &dev,
            64 << 20,
            Duration::from_secs(10),
            &Cancel::never(),
        )
        .unwrap();
        grower.join().unwrap();
        assert_eq!(got, 64 << 20);
        assert!(started.elapsed() < Duration::from_secs(5));
        // Never grown: OUT_OF_RANGE naming both sizes.
        let e = wait_for_size(
            &sysfs,
            &dev,
            128 << 20,
            Duration::from_millis(300),
            &Cancel::never(),
        )
        .unwrap_err();
        assert_eq!(e.code(), Code::OutOfRange);
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("{} bytes", 64u64 << 20))
                && msg.contains(&format!("{} bytes", 128u64 << 20)),
            "{msg}"
        );
        assert!(msg.contains("host must grow"), "{msg}");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_partition_given_by_path_is_present() {
        needs::loop_devices();
        // /sys/block lists whole disks only; a partition is found through /sys/dev/block.
        let disk = LoopDisk::new(16, None);
        let part = disk.add_partition();
        let d = from_path(&Sysfs::system(), &part).unwrap();
        assert!(!Sysfs::system().sys_block.join(&d.name).exists());
        match Sysfs::system().disk_state(&d) {
            DiskState::Present { size_bytes: b } => {
                assert_eq!(b, size_bytes(&part).unwrap());
            }
            other => panic!("partition {} reported {other:?}", part.display()),
        }
    }

    #[test]
    fn tells_gone_and_empty_disks() {
        let t = FakeTree::new();
        t.add("vdl", "vol-s", (7, 270), None);
        let dev = Device {
            name: "vdl".into(),
            path: t.sysfs.dev_dir.join("vdl"),
            major: 7,
            minor: 270,
            serial: None,
        };
        assert_eq!(
            t.sysfs.disk_state(&dev),
            DiskState::Present {
                size_bytes: 2048 * 512
            }
        );
        fs::write(t.sysfs.sys_block.join("vdl/size"), "0\n").unwrap();
        assert_eq!(t.sysfs.disk_state(&dev), DiskState::ZeroSize);
        // The name now belongs to another disk.
        fs::write(t.sysfs.sys_block.join("vdl/dev"), "7:271\n").unwrap();
        assert_eq!(t.sysfs.disk_state(&dev), DiskState::Gone);
        fs::remove_dir_all(t.sysfs.sys_block.join("vdl")).unwrap();
        assert_eq!(t.sysfs.disk_state(&dev), DiskState::Gone);
    }
}

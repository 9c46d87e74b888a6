//! The condition checks, each on its own and pure: what the gathering
//! (`mod.rs`) saw of a volume goes in as facts, the problems come out. The
//! seam between the two is these fact structs, so every check is tested
//! here without root, loop devices or a kernel that misbehaves on cue; the
//! gathering itself is proven against real disks in `mod.rs`'s tests.

use std::path::{Path, PathBuf};

use rustix::io::Errno;

use super::problem::{failing, Disk, Problem};
use crate::model::{Device, DiskState, FsType, MountId};
use crate::sys::beneath::MountPoint;
use crate::sys::mountinfo::MountEntry;

/// What a filesystem volume is checked against.
#[derive(Clone, Copy)]
pub struct Volume<'a> {
    /// Its guest path, for messages.
    pub path: &'a Path,
    /// The id of the mount the agent made, when it recorded one.
    pub mount_id: Option<MountId>,
    /// Its disk.
    pub device: &'a Device,
    pub read_only: bool,
    /// Its filesystem.
    pub fs: FsType,
}

/// What the gathering saw at a filesystem volume's guest path.
#[derive(Clone, Debug)]
pub struct MountFacts {
    /// statx of the mount root, once it opened; `Err` when statx failed.
    pub mount_point: Result<MountPoint, Errno>,
    /// When statx failed: the mount its fd is on (fdinfo and the mount
    /// table, which do not ask the filesystem).
    pub fd_mount: Option<MountEntry>,
    /// statfs: whether it says read-only, or its errno.
    pub statfs: Result<bool, Errno>,
    /// stat of the mount root through its fd: its errno, if it failed.
    pub stat: Option<Errno>,
}

/// What the gathering saw of the volume's own mount in the mount table:
/// its entry (None when not listed), or why the table could not be read.
pub type TableFacts = Result<Option<MountEntry>, String>;

/// What the gathering saw of the volume's disk.
#[derive(Clone, Debug)]
pub struct DiskFacts {
    /// ext4's recorded error count (None: not ext4, or not readable).
    pub ext4_errors: Option<u64>,
    /// Where that count is read, for messages.
    pub ext4_errors_file: String,
    /// Present (with its size), gone or empty.
    pub state: DiskState,
    /// Where disks are listed, for messages.
    pub dev_block: PathBuf,
    /// The filesystem's own size, when the mount is the volume's and it was read.
    pub fs_bytes: Option<u64>,
}

/// The guest path could not be opened beneath the root: why.
pub fn open_failed(v: &Volume, err: Errno) -> Problem {
    let path = v.path.to_path_buf();
    match err {
        Errno::NOENT => Problem::PathGone { path },
        Errno::LOOP | Errno::XDEV => Problem::PathEscapes { path },
        errno => Problem::CallFails {
            call: "open",
            path,
            errno,
        },
    }
}

/// Whether the mount at the guest path is still the volume's own, and
/// what is wrong if not quite. A shut-down filesystem that fails statx is
/// told apart by the mount its fd is on.
pub fn ours(v: &Volume, f: &MountFacts) -> (bool, Option<Problem>) {
    let (path, dev) = (v.path.to_path_buf(), v.device);
    match &f.mount_point {
        Err(errno) => {
            let own = f.fd_mount.as_ref().is_some_and(|m| {
                v.mount_id.is_none_or(|id| id == m.mount_id)
                    && (m.major, m.minor) == (dev.major, dev.minor)
                    && m.root == Path::new("/")
            });
            let p = Problem::CallFails {
                call: "statx",
                path,
                errno: *errno,
            };
            (own, Some(p))
        }
        Ok(mp) if !mp.is_root => (false, Some(Problem::NotMountPoint { path })),
        Ok(mp) if mp.dev != (dev.major, dev.minor) => {
            let p = Problem::OtherDevice {
                path,
                found: mp.dev,
                disk: Disk::of(dev),
            };
            (false, Some(p))
        }
        Ok(mp) if v.mount_id.is_some_and(|id| id != mp.mount_id) => {
            let p = Problem::OtherMount {
                path,
                disk_name: dev.name.clone(),
                found: mp.mount_id,
                made: v.mount_id.unwrap_or(MountId(0)),
            };
            (true, Some(p))
        }
        Ok(_) => (true, None),
    }
}

pub fn statfs_fails(v: &Volume, f: &MountFacts) -> Option<Problem> {
    let errno = *f.statfs.as_ref().err()?;
    Some(Problem::CallFails {
        call: "statfs",
        path: v.path.to_path_buf(),
        errno,
    })
}

/// A lookup in the filesystem fails the way a failing filesystem does
/// (statfs can still answer from the superblock of a shut-down xfs).
pub fn lookups_fail(v: &Volume, f: &MountFacts) -> Option<Problem> {
    let errno = f.stat.filter(|e| failing(*e))?;
    Some(Problem::CallFails {
        call: "stat",
        path: v.path.to_path_buf(),
        errno,
    })
}

/// The mount table could not be read.
pub fn table_unreadable(v: &Volume, t: &TableFacts) -> Option<Problem> {
    let why = t.as_ref().err()?;
    Some(Problem::TableUnreadable {
        path: v.path.to_path_buf(),
        why: why.clone(),
    })
}

/// The mount shows a directory of the filesystem, not its root.
pub fn other_root(v: &Volume, t: &TableFacts) -> Option<Problem> {
    let m = t.as_ref().ok()?.as_ref()?;
    (m.root != Path::new("/")).then(|| Problem::OtherRoot {
        path: v.path.to_path_buf(),
        root: m.root.clone(),
    })
}

/// The mount is of another filesystem type than published.
pub fn other_type(v: &Volume, t: &TableFacts) -> Option<Problem> {
    let m = t.as_ref().ok()?.as_ref()?;
    (m.fs_type != v.fs.name()).then(|| Problem::OtherType {
        path: v.path.to_path_buf(),
        found: m.fs_type.clone(),
        fs: v.fs,
    })
}

/// Read-only now (statfs, the mount or its superblock), published read-write.
pub fn now_read_only(v: &Volume, f: &MountFacts, t: &TableFacts) -> Option<Problem> {
    let listed = t
        .as_ref()
        .ok()
        .and_then(Option::as_ref)
        .is_some_and(|m| m.read_only() || m.super_read_only());
    let ro = f.statfs.as_ref().is_ok_and(|ro| *ro) || listed;
    (!v.read_only && ro).then(|| Problem::NowReadOnly {
        path: v.path.to_path_buf(),
        fs: v.fs,
    })
}

/// ext4 has recorded errors.
pub fn ext4_errors(v: &Volume, d: &DiskFacts) -> Option<Problem> {
    let count = d.ext4_errors.filter(|n| *n > 0 && v.fs == FsType::Ext4)?;
    Some(Problem::Ext4Errors {
        disk_name: v.device.name.clone(),
        count,
        file: d.ext4_errors_file.clone(),
    })
}

/// The disk is smaller than its filesystem (it shrank under the mount).
pub fn shrank(v: &Volume, d: &DiskFacts) -> Option<Problem> {
    let DiskState::Present { size_bytes } = d.state else {
        return None;
    };
    let fs_bytes = d.fs_bytes.filter(|n| *n > size_bytes)?;
    Some(Problem::LargerThanDevice {
        fs: v.fs,
        path: v.path.to_path_buf(),
        fs_bytes,
        disk_name: v.device.name.clone(),
        size_bytes,
    })
}

/// The disk is gone or empty: the same words for a filesystem and a block volume.
pub fn disk_gone(dev: &Device, d: &DiskFacts) -> Option<Problem> {
    match d.state {
        DiskState::Present { .. } => None,
        DiskState::Gone => Some(Problem::DiskGone {
            disk: Disk::of(dev),
            dir: d.dev_block.clone(),
        }),
        DiskState::ZeroSize => Some(Problem::DiskEmpty {
            disk: Disk::of(dev),
        }),
    }
}

/// Every problem of a filesystem volume, in the order the condition says
/// them. `mount`: what the guest path showed, or why it did not open;
/// `table`: the mount's entry, which the gathering asks only when the mount
/// is the volume's own (`ours`).
pub fn filesystem(
    v: &Volume,
    mount: &Result<MountFacts, Errno>,
    table: Option<&TableFacts>,
    disk: &DiskFacts,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    match mount {
        Err(err) => problems.push(open_failed(v, *err)),
        Ok(f) => {
            problems.extend(ours(v, f).1);
            problems.extend(statfs_fails(v, f));
            problems.extend(lookups_fail(v, f));
            if let Some(t) = table {
                problems.extend(table_unreadable(v, t));
                problems.extend(other_root(v, t));
                problems.extend(other_type(v, t));
                problems.extend(now_read_only(v, f, t));
            }
        }
    }
    problems.extend(ext4_errors(v, disk));
    problems.extend(shrank(v, disk));
    problems.extend(disk_gone(v.device, disk));
    problems
}

/// What a block volume is checked against.
#[derive(Clone, Copy)]
pub struct BlockVolume<'a> {
    /// Its guest path, for messages.
    pub path: &'a Path,
    /// The id of the bind the agent made, when it recorded one.
    pub mount_id: Option<MountId>,
    /// Its disk.
    pub device: &'a Device,
    pub read_only: bool,
}

/// What the gathering saw of a block volume's device, once opened: its
/// size and its read-only flag, or each one's error (as a sentence).
#[derive(Clone, Debug)]
pub struct DeviceFacts {
    /// BLKGETSIZE64.
    pub size: Result<u64, String>,
    /// BLKROGET.
    pub read_only: Result<bool, String>,
}

/// The guest path is no longer the bind of the device's node the agent made.
pub fn bind(v: &BlockVolume, here: &Result<MountPoint, Errno>) -> Option<Problem> {
    let (path, dev) = (v.path.to_path_buf(), v.device);
    let key = (dev.major, dev.minor);
    match here {
        Err(Errno::NOENT) => Some(Problem::BindGone { path }),
        Err(Errno::LOOP | Errno::XDEV) => Some(Problem::BindEscapes { path }),
        Err(errno) => Some(Problem::BindStatx {
            path,
            errno: *errno,
        }),
        Ok(mp) if !mp.is_root => Some(Problem::NotBound {
            path,
            disk: Disk::of(dev),
        }),
        Ok(mp) if !mp.is_block_node(key) => Some(Problem::BoundOther {
            path,
            disk: Disk::of(dev),
        }),
        Ok(mp) if v.mount_id.is_some_and(|id| id != mp.mount_id) => Some(Problem::OtherBind {
            path,
            disk_name: dev.name.clone(),
            found: mp.mount_id,
            made: v.mount_id.unwrap_or(MountId(0)),
        }),
        Ok(_) => None,
    }
}

/// The device could not be opened, sized or asked its flag, or its
/// read-only flag disagrees with how it was published.
pub fn device(v: &BlockVolume, d: &Result<DeviceFacts, String>) -> Vec<Problem> {
    let d = match d {
        Err(why) => return vec![Problem::Device(why.clone())],
        Ok(d) => d,
    };
    let mut problems = Vec::new();
    if let Err(why) = &d.size {
        problems.push(Problem::Device(why.clone()));
    }
    let disk_name = v.device.name.clone();
    match &d.read_only {
        Ok(true) if !v.read_only => problems.push(Problem::RefusesWrites { disk_name }),
        Ok(false) if v.read_only => problems.push(Problem::AcceptsWrites { disk_name }),
        Ok(_) => {}
        Err(why) => problems.push(Problem::Device(why.clone())),
    }
    problems
}

/// Every problem of a block volume, in the order the condition says them.
pub fn block(
    v: &BlockVolume,
    here: &Result<MountPoint, Errno>,
    dev: &Result<DeviceFacts, String>,
    disk: &DiskFacts,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    problems.extend(bind(v, here));
    problems.extend(device(v, dev));
    problems.extend(disk_gone(v.device, disk));
    problems
}

#[cfg(test)]
mod tests {
    use rustix::fs::FileType;

    use super::*;

    fn vdb() -> Device {
        Device {
            name: "vdb".into(),
            path: "/dev/vdb".into(),
            major: 254,
            minor: 16,
            serial: None,
        }
    }

    fn volume<'a>(dev: &'a Device, fs: FsType, mount_id: Option<MountId>) -> Volume<'a> {
        Volume {
            path: Path::new("/r/volumes/v"),
            mount_id,
            device: dev,
            read_only: false,
            fs,
        }
    }

    /// The mount the agent made: root of the disk's filesystem, mount 40.
    fn root_of(dev: (u32, u32)) -> MountPoint {
        MountPoint {
            mount_id: MountId(40),
            is_root: true,
            dev,
            kind: FileType::Directory,
            rdev: (0, 0),
        }
    }

    fn healthy() -> MountFacts {
        MountFacts {
            mount_point: Ok(root_of((254, 16))),
            fd_mount: None,
            statfs: Ok(false),
            stat: None,
        }
    }

    fn entry(fs_type: &str, root: &str, options: &str, super_options: &str) -> MountEntry {
        MountEntry {
            mount_id: MountId(40),
            parent_id: MountId(1),
            major: 254,
            minor: 16,
            root: root.into(),
            mount_point: "/r/volumes/v".into(),
            mount_options: options.into(),
            fs_type: fs_type.into(),
            source: "/dev/vdb".into(),
            super_options: super_options.into(),
        }
    }

    fn present() -> DiskFacts {
        DiskFacts {
            ext4_errors: Some(0),
            ext4_errors_file: "/sys/fs/ext4/vdb/errors_count".into(),
            state: DiskState::Present {
                size_bytes: 1 << 30,
            },
            dev_block: "/sys/dev/block".into(),
            fs_bytes: Some(1 << 30),
        }
    }

    /// The condition's sentences of a filesystem volume, and whether its mount is its own.
    fn said(
        v: &Volume,
        mount: Result<MountFacts, Errno>,
        table: Option<TableFacts>,
        disk: DiskFacts,
    ) -> (bool, Vec<String>) {
        let own = mount.as_ref().is_ok_and(|f| ours(v, f).0);
        let p = filesystem(v, &mount, table.as_ref(), &disk);
        (own, p.iter().map(Problem::to_string).collect())
    }

    #[test]
    fn a_healthy_volume_has_no_problem() {
        let dev = vdb();
        let v = volume(&dev, FsType::Ext4, Some(MountId(40)));
        let table = Some(Ok(Some(entry("ext4", "/", "rw,relatime", "rw"))));
        assert_eq!(said(&v, Ok(healthy()), table, present()), (true, vec![]));
    }

    #[test]
    fn a_guest_path_that_does_not_open_says_why() {
        let dev = vdb();
        let v = volume(&dev, FsType::Xfs, None);
        let cases = [
            (Errno::NOENT, "/r/volumes/v is gone: the volume was unmounted and removed behind the agent's back"),
            (Errno::LOOP, "/r/volumes/v is now a symlink or leads outside the agent's root: the volume was unmounted behind the agent's back"),
            (Errno::XDEV, "/r/volumes/v is now a symlink or leads outside the agent's root: the volume was unmounted behind the agent's back"),
            (Errno::IO, "open on /r/volumes/v fails with EIO: the filesystem has shut down or its disk is failing"),
            (Errno::ACCESS, "open on /r/volumes/v fails with EACCES"),
            (Errno::PERM, "open on /r/volumes/v fails with errno 1"),
        ];
        for (errno, says) in cases {
            let (own, p) = said(&v, Err(errno), None, present());
            assert_eq!((own, p), (false, vec![says.to_string()]), "{errno:?}");
        }
    }

    #[test]
    fn another_mount_at_the_guest_path_is_named_and_its_usage_is_not_ours() {
        let dev = vdb();
        let v = volume(&dev, FsType::Ext4, Some(MountId(40)));
        let mut f = healthy();
        f.mount_point = Ok(MountPoint {
            is_root: false,
            ..root_of((254, 16))
        });
        let (own, p) = said(&v, Ok(f.clone()), None, present());
        assert!(!own);
        assert_eq!(p, ["/r/volumes/v is no longer a mount point: the volume was unmounted behind the agent's back"]);
        f.mount_point = Ok(root_of((7, 3)));
        let (own, p) = said(&v, Ok(f.clone()), None, present());
        assert!(!own);
        assert_eq!(
            p,
            ["/r/volumes/v is now a mount of device 7:3, not of the volume's disk vdb (254:16)"]
        );
        // Another mount of the same disk: still its filesystem, said.
        f.mount_point = Ok(MountPoint {
            mount_id: MountId(41),
            ..root_of((254, 16))
        });
        let (own, p) = said(&v, Ok(f), Some(Ok(None)), present());
        assert!(own);
        assert_eq!(p, ["/r/volumes/v is now another mount of the volume's disk vdb than the agent made (mount 41 instead of 40)"]);
    }

    #[test]
    fn a_filesystem_whose_statx_fails_is_told_by_the_mount_its_fd_is_on() {
        let dev = vdb();
        let v = volume(&dev, FsType::Xfs, Some(MountId(40)));
        let mut f = healthy();
        f.mount_point = Err(Errno::IO);
        f.stat = Some(Errno::IO);
        f.fd_mount = Some(entry("xfs", "/", "rw", "rw"));
        let (own, p) = said(&v, Ok(f.clone()), Some(Ok(None)), present());
        assert!(own, "the fd is on the agent's own mount");
        assert_eq!(
            p,
            [
                "statx on /r/volumes/v fails with EIO: the filesystem has shut down or its disk is failing",
                "stat on /r/volumes/v fails with EIO: the filesystem has shut down or its disk is failing",
            ]
        );
        // On another mount, or none known: not its own.
        f.fd_mount = Some(MountEntry {
            mount_id: MountId(99),
            ..entry("xfs", "/", "rw", "rw")
        });
        assert!(!said(&v, Ok(f.clone()), None, present()).0);
        f.fd_mount = None;
        assert!(!said(&v, Ok(f), None, present()).0);
    }

    #[test]
    fn a_lookup_error_that_is_not_a_failing_disk_is_not_a_problem() {
        let dev = vdb();
        let v = volume(&dev, FsType::Xfs, None);
        let mut f = healthy();
        f.stat = Some(Errno::ACCESS);
        assert_eq!(
            said(&v, Ok(f.clone()), Some(Ok(None)), present()).1,
            Vec::<String>::new()
        );
        f.stat = Some(Errno::STALE);
        f.statfs = Err(Errno::NOTCONN);
        assert_eq!(
            said(&v, Ok(f), Some(Ok(None)), present()).1,
            [
                "statfs on /r/volumes/v fails with ENOTCONN: the filesystem has shut down or its disk is failing",
                "stat on /r/volumes/v fails with ESTALE: the filesystem has shut down or its disk is failing",
            ]
        );
    }

    #[test]
    fn how_the_own_mount_is_mounted_now_is_checked() {
        let dev = vdb();
        let v = volume(&dev, FsType::Ext4, None);
        let p = |t: TableFacts, f: MountFacts| said(&v, Ok(f), Some(t), present()).1;
        assert_eq!(
            p(
                Err("cannot read /proc/self/mountinfo: EMFILE".into()),
                healthy()
            ),
            ["cannot tell how /r/volumes/v is mounted: cannot read /proc/self/mountinfo: EMFILE"]
        );
        assert_eq!(
            p(Ok(Some(entry("ext4", "/data", "rw", "rw"))), healthy()),
            ["/r/volumes/v now shows /data inside the disk's filesystem, not its root"]
        );
        assert_eq!(
            p(Ok(Some(entry("ext2", "/", "rw", "rw"))), healthy()),
            ["/r/volumes/v is now a ext2 mount, not ext4"]
        );
        let ro = "/r/volumes/v was published read-write but is now read-only (ext4 remounts read-only after an error under errors=remount-ro)";
        assert_eq!(p(Ok(Some(entry("ext4", "/", "ro", "rw"))), healthy()), [ro]);
        assert_eq!(p(Ok(Some(entry("ext4", "/", "rw", "ro"))), healthy()), [ro]);
        let mut st_ro = healthy();
        st_ro.statfs = Ok(true);
        assert_eq!(p(Ok(None), st_ro.clone()), [ro]);
        // Published read-only: read-only is right.
        let ro_vol = Volume {
            read_only: true,
            ..v
        };
        assert!(said(&ro_vol, Ok(st_ro), Some(Ok(None)), present())
            .1
            .is_empty());
        // xfs has no errors=remount-ro to blame.
        let x = volume(&dev, FsType::Xfs, None);
        let mut f = healthy();
        f.statfs = Ok(true);
        assert_eq!(
            said(&x, Ok(f), Some(Ok(None)), present()).1,
            ["/r/volumes/v was published read-write but is now read-only"]
        );
    }

    #[test]
    fn the_disk_is_checked_whatever_the_mount_shows() {
        let dev = vdb();
        let v = volume(&dev, FsType::Ext4, None);
        let mut d = present();
        d.ext4_errors = Some(3);
        assert_eq!(
            said(&v, Err(Errno::NOENT), None, d.clone()).1[1],
            "ext4 on vdb has recorded 3 error(s) (/sys/fs/ext4/vdb/errors_count); check the filesystem with e2fsck on the host"
        );
        // An xfs volume has no such count to read.
        let x = volume(&dev, FsType::Xfs, None);
        assert!(said(&x, Ok(healthy()), Some(Ok(None)), d).1.is_empty());
        let mut d = present();
        d.fs_bytes = Some((1 << 30) + 4096);
        assert_eq!(
            said(&v, Ok(healthy()), Some(Ok(None)), d).1,
            ["the filesystem is larger than its device: the ext4 at /r/volumes/v is 1073745920 bytes but disk vdb now holds only 1073741824 bytes (it shrank under the mount; reads past its end fail)"]
        );
        let mut d = present();
        d.state = DiskState::Gone;
        assert_eq!(
            said(&v, Ok(healthy()), Some(Ok(None)), d.clone()).1,
            ["disk vdb (254:16) is gone from /sys/dev/block: the host detached it"]
        );
        d.state = DiskState::ZeroSize;
        assert_eq!(
            said(&v, Ok(healthy()), Some(Ok(None)), d).1,
            ["disk vdb (254:16) reports size 0: its backing storage is gone"]
        );
    }

    fn block_volume(dev: &Device, read_only: bool) -> BlockVolume<'_> {
        BlockVolume {
            path: Path::new("/r/volumes/b"),
            mount_id: Some(MountId(50)),
            device: dev,
            read_only,
        }
    }

    fn bound(dev: (u32, u32)) -> MountPoint {
        MountPoint {
            mount_id: MountId(50),
            is_root: true,
            dev: (0, 5),
            kind: FileType::BlockDevice,
            rdev: dev,
        }
    }

    #[test]
    fn a_block_volumes_bind_is_checked() {
        let dev = vdb();
        let v = block_volume(&dev, false);
        let fine = Ok(DeviceFacts {
            size: Ok(1 << 30),
            read_only: Ok(false),
        });
        let said = |here: Result<MountPoint, Errno>| -> Vec<String> {
            block(&v, &here, &fine, &present())
                .iter()
                .map(Problem::to_string)
                .collect()
        };
        assert!(said(Ok(bound((254, 16)))).is_empty());
        let cases: [(Result<MountPoint, Errno>, &str); 6] = [
            (Err(Errno::NOENT), "/r/volumes/b is gone: the block volume's bind was removed behind the agent's back"),
            (Err(Errno::XDEV), "/r/volumes/b now leads through a symlink or outside the agent's root: the block volume's bind was removed behind the agent's back"),
            (Err(Errno::IO), "statx on /r/volumes/b fails with EIO"),
            (Ok(MountPoint { is_root: false, ..bound((254, 16)) }), "/r/volumes/b is no longer bound to disk vdb (254:16): the bind was removed behind the agent's back"),
            (Ok(bound((7, 3))), "/r/volumes/b is now a mount of something else than disk vdb (254:16)"),
            (Ok(MountPoint { mount_id: MountId(51), ..bound((254, 16)) }), "/r/volumes/b is now another bind of disk vdb than the agent made (mount 51 instead of 50)"),
        ];
        for (here, says) in cases {
            assert_eq!(said(here), [says]);
        }
    }

    #[test]
    fn a_block_devices_flag_and_errors_are_checked() {
        let dev = vdb();
        let said = |read_only: bool, d: Result<DeviceFacts, String>| -> Vec<String> {
            block(
                &block_volume(&dev, read_only),
                &Ok(bound((254, 16))),
                &d,
                &present(),
            )
            .iter()
            .map(Problem::to_string)
            .collect()
        };
        let facts = |size: Result<u64, String>, ro: Result<bool, String>| {
            Ok(DeviceFacts {
                size,
                read_only: ro,
            })
        };
        assert!(said(true, facts(Ok(1), Ok(true))).is_empty());
        assert_eq!(
            said(false, facts(Ok(1), Ok(true))),
            ["disk vdb was published read-write but the kernel now refuses writes to it (its read-only flag was set behind the agent's back, or the host made the disk read-only)"]
        );
        assert_eq!(
            said(true, facts(Ok(1), Ok(false))),
            ["disk vdb was published read-only but the kernel accepts writes to it again (its read-only flag was cleared behind the agent's back)"]
        );
        assert_eq!(
            said(
                false,
                facts(Err("size failed".into()), Err("flag failed".into()))
            ),
            ["size failed", "flag failed"]
        );
        assert_eq!(said(false, Err("cannot open".into())), ["cannot open"]);
    }
}

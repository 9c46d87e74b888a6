//! A kernel in memory for the table's tests (`kernel::Kernel`): disks the
//! test makes up, a mount table kept as the table's calls change it,
//! frozen filesystems, read-only flags, LUKS2 disks and the mappings made
//! over them (each a made-up disk `dm-<minor>`, as devtmpfs names a
//! mapping's node), and an errno (or an action) the test plants for the
//! n-th call of a kind. So the table's logic runs in
//! milliseconds, without root.
//!
//! Directories and files are real, in the test's temporary directory
//! (openat2 needs no root); a mount is a note on a real directory or file,
//! and statx of a path is the real one with the notes laid over it: a
//! mount point is a mount root of the mount's disk, and what lies below it
//! is on that disk. Each effect is written in a journal, in order.

use std::collections::HashSet;
use std::ffi::CStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_protocols::sync::LockExt;
use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use zeroize::Zeroizing;

use super::idmap;
use super::kernel::Kernel;
use super::lease::Thaw;
use super::request::Source;
use crate::cancel::Cancel;
use crate::device;
use crate::error::Result;
use crate::luks2;
use crate::luks2::format::Mac;
use crate::luks2::made::Found;
use crate::luks2::mapping::{Live, Mapping};
use crate::model::{Device, FsType, IdMap, MountId, RecursiveReadOnly};
use crate::mount::bind::{BindSpec, Bound};
use crate::mount::error::Error as MountError;
use crate::mount::options::MountOptions;
use crate::mount::unmount::{self, Expect};
use crate::probe;
use crate::quiesce;
use crate::sys::beneath::{self, Leaf, MountPoint};
use crate::sys::blockdev;
use crate::sys::error::SysError;
use crate::sys::mountinfo::MountEntry;
use crate::sys::sysfs::Sysfs;

// The fake's device-mapper: its LUKS2 disks and mappings (`Luks`,
// `Mapped`, below), made and used by the methods in fake_crypt.rs.
#[path = "fake_crypt.rs"]
mod crypt;

/// The kinds of call a test can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Mount,
    Bind,
    BindNode,
    Unmount,
    Sync,
    MountInfo,
    Statx,
    Freeze,
    Thaw,
    Trim,
    OpenDisk,
    SetReadOnly,
    Flush,
    Wipe,
}

/// The device numbers devtmpfs shows for a bind of a device node.
const DEVTMPFS: (u32, u32) = (0, 6);
/// The major of made-up disks: one Linux leaves to local use, so no real
/// disk of the machine running the tests has it.
const MAJOR: u32 = 240;
/// The disk of a mount that is nobody's volume.
const FOREIGN: (u32, u32) = (MAJOR, 999);

/// A made-up disk.
struct Disk {
    device: Device,
    fs: Option<FsType>,
    read_only: bool,
    bytes: u64,
    /// A plain file that stands for its device node.
    node: PathBuf,
}

/// A mount, as the kernel would list it.
#[derive(Clone, Debug)]
struct Mount {
    id: MountId,
    /// Absolute, as /proc/self/fd names the directory or file.
    at: PathBuf,
    /// The device statx shows for what is on it.
    dev: (u32, u32),
    /// For a bind of a device node: that device.
    rdev: Option<(u32, u32)>,
    fs_type: String,
    source: String,
    /// The path inside its filesystem that is this mount's root.
    root: PathBuf,
    read_only: bool,
    /// A bind's mappings (mountinfo: `idmapped`; `stat` maps owners).
    idmap: Option<IdMap>,
}

impl Mount {
    fn is(&self, expect: Expect) -> bool {
        match expect {
            Expect::Mount(id, ma, mi) => {
                self.id == id && (self.dev == (ma, mi) || self.rdev == Some((ma, mi)))
            }
            Expect::Device(ma, mi) => self.dev == (ma, mi) || self.rdev == Some((ma, mi)),
        }
    }
}

/// What a test plants for the n-th call of a kind.
enum Plant {
    Errno(Errno),
    /// Runs before the call, which then goes through.
    Before(Box<dyn FnOnce() + Send>),
}

#[derive(Default)]
struct State {
    disks: Vec<Disk>,
    /// In the order they were made: the last at a path is the one on top.
    mounts: Vec<Mount>,
    next_id: u64,
    frozen: HashSet<MountId>,
    /// Call, how many calls of it still to let through, what then.
    plants: Vec<(Call, u32, Plant)>,
    /// The next mount gets another one stacked over it.
    cover_next: bool,
    journal: Vec<String>,
    /// LUKS2 disks made up, and mappings made over them.
    luks: Vec<Luks>,
    mapped: Vec<Mapped>,
}

impl State {
    fn new_id(&mut self) -> MountId {
        self.next_id += 1;
        MountId(5000 + self.next_id)
    }

    /// The mount on top at `at`.
    fn top_at(&self, at: &Path) -> Option<&Mount> {
        self.mounts.iter().rev().find(|m| m.at == at)
    }

    /// The mount `p` lies on, strictly below its mount point.
    fn below(&self, p: &Path) -> Option<&Mount> {
        self.mounts
            .iter()
            .filter(|m| p != m.at && p.starts_with(&m.at))
            .max_by_key(|m| m.at.components().count())
    }

    fn disk(&self, path: &Path) -> Option<&Disk> {
        self.disks.iter().find(|d| d.device.path == path)
    }
}

/// The fake kernel (the module doc). Clones share one state, so the test
/// keeps one to look at what the table did.
#[derive(Clone, Default)]
pub(crate) struct Fake {
    state: Arc<Mutex<State>>,
}

/// The path an fd names, as /proc/self/fd says it.
fn path_of(fd: BorrowedFd<'_>) -> PathBuf {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .expect("a test's fd names a path")
}

impl Fake {
    /// Makes up a disk `name` (also its serial) holding `fs` (None: blank),
    /// its node a file in `dir`.
    pub(crate) fn disk(&self, dir: &Path, name: &str, fs: Option<FsType>) -> Device {
        let mut st = self.state.locked();
        let minor = u32::try_from(st.disks.len()).unwrap();
        let node = dir.join(format!("node-{name}"));
        std::fs::write(&node, "").unwrap();
        let device = Device {
            name: name.into(),
            path: PathBuf::from("/dev").join(name),
            major: MAJOR,
            minor,
            serial: Some(name.into()),
        };
        st.disks.push(Disk {
            device: device.clone(),
            fs,
            read_only: false,
            bytes: 1 << 30,
            node,
        });
        device
    }

    /// Sets the size of disk `name`, and of its filesystem (as an
    /// ExpandVolume would).
    pub(crate) fn resize(&self, name: &str, bytes: u64) {
        let mut st = self.state.locked();
        let d = st.disks.iter_mut().find(|d| d.device.name == name);
        d.expect("a disk the test made").bytes = bytes;
    }

    /// The `nth` call of `call` from now on (1: the next) fails with `errno`.
    pub(crate) fn fail(&self, call: Call, nth: u32, errno: Errno) {
        self.state
            .locked()
            .plants
            .push((call, nth, Plant::Errno(errno)));
    }

    /// Runs `f` right before the `nth` call of `call` from now on.
    pub(crate) fn before(&self, call: Call, nth: u32, f: impl FnOnce() + Send + 'static) {
        self.state
            .locked()
            .plants
            .push((call, nth, Plant::Before(Box::new(f))));
    }

    /// The next mount the table makes is covered at once by another one,
    /// nobody's volume (something mounted over it meanwhile).
    pub(crate) fn cover_next_mount(&self) {
        self.state.locked().cover_next = true;
    }

    /// Mounts `disk`'s filesystem at `at` (an existing directory) behind
    /// the table's back.
    pub(crate) fn mount_behind(&self, disk: &Device, at: &Path) -> MountId {
        let mut st = self.state.locked();
        let id = st.new_id();
        st.mounts.push(Mount {
            id,
            at: std::fs::canonicalize(at).unwrap(),
            dev: (disk.major, disk.minor),
            rdev: None,
            fs_type: "ext4".into(),
            source: disk.path.display().to_string(),
            root: "/".into(),
            read_only: false,
            idmap: None,
        });
        id
    }

    /// Sets the mappings the mount on top at `at` shows, behind the
    /// table's back (as a mount id reused by another mount would).
    pub(crate) fn set_idmap_behind(&self, at: &Path, idmap: Option<IdMap>) {
        let at = std::fs::canonicalize(at).unwrap();
        let mut st = self.state.locked();
        let m = st
            .mounts
            .iter_mut()
            .rev()
            .find(|m| m.at == at)
            .expect("a mount there");
        m.idmap = idmap;
    }

    /// Unmounts what is on top at `at` behind the table's back.
    pub(crate) fn unmount_behind(&self, at: &Path) {
        let mut st = self.state.locked();
        let i = st.mounts.iter().rposition(|m| m.at == at).expect("mounted");
        st.mounts.remove(i);
    }

    /// The mount points, bottom first.
    pub(crate) fn mounts(&self) -> Vec<PathBuf> {
        self.state
            .locked()
            .mounts
            .iter()
            .map(|m| m.at.clone())
            .collect()
    }

    /// Whether the filesystem mounted at `at` is frozen.
    pub(crate) fn frozen(&self, at: &Path) -> bool {
        let st = self.state.locked();
        st.top_at(at).is_some_and(|m| st.frozen.contains(&m.id))
    }

    /// The read-only flag of `disk`.
    pub(crate) fn read_only(&self, disk: &Device) -> bool {
        self.state
            .locked()
            .disk(&disk.path)
            .is_some_and(|d| d.read_only)
    }

    /// The effects so far, paths beneath `root` relative to it; emptied.
    pub(crate) fn journal(&self, root: &Path) -> Vec<String> {
        let prefix = format!("{}/", root.display());
        std::mem::take(&mut self.state.locked().journal)
            .into_iter()
            .map(|l| l.replace(&prefix, ""))
            .collect()
    }

    fn note(&self, what: String) {
        self.state.locked().journal.push(what);
    }

    /// Lets the call through, or fails it as planted (journaled).
    fn call(&self, call: Call, what: impl std::fmt::Display) -> std::result::Result<(), Errno> {
        let mut st = self.state.locked();
        let mut planted = None;
        for (i, (c, n, _)) in st.plants.iter_mut().enumerate() {
            if *c == call {
                *n -= 1;
                if *n == 0 && planted.is_none() {
                    planted = Some(i);
                }
            }
        }
        let Some(i) = planted else {
            return Ok(());
        };
        match st.plants.remove(i).2 {
            Plant::Errno(e) => {
                st.journal.push(format!("{what} failed"));
                Err(e)
            }
            Plant::Before(f) => {
                drop(st);
                f();
                Ok(())
            }
        }
    }

    /// statx `real` of path `p`, with the mounts laid over it.
    fn overlay(&self, p: &Path, real: MountPoint) -> MountPoint {
        let st = self.state.locked();
        if let Some(m) = st.top_at(p) {
            return MountPoint {
                mount_id: m.id,
                is_root: true,
                dev: m.dev,
                kind: if m.rdev.is_some() {
                    FileType::BlockDevice
                } else {
                    real.kind
                },
                rdev: m.rdev.unwrap_or((0, 0)),
            };
        }
        match st.below(p) {
            Some(m) => MountPoint {
                mount_id: m.id,
                is_root: false,
                dev: m.dev,
                ..real
            },
            None => real,
        }
    }

    fn mount(&self, mut m: Mount) -> MountId {
        let mut st = self.state.locked();
        m.id = st.new_id();
        let id = m.id;
        let cover = std::mem::take(&mut st.cover_next).then(|| Mount {
            id: st.new_id(),
            dev: FOREIGN,
            rdev: None,
            fs_type: "tmpfs".into(),
            source: "tmpfs".into(),
            ..m.clone()
        });
        st.mounts.push(m);
        st.mounts.extend(cover);
        id
    }
}

/// A filesystem the fake froze.
pub(crate) struct FakeHold {
    fake: Fake,
    mount: MountId,
    at: PathBuf,
}

impl Thaw for FakeHold {
    fn thaw(&self) -> std::result::Result<bool, quiesce::Error> {
        let what = format!("thaw {}", self.at.display());
        self.fake
            .call(Call::Thaw, &what)
            .map_err(|e| SysError::new("FITHAW", self.at.display(), e))?;
        let was = self.fake.state.locked().frozen.remove(&self.mount);
        if was {
            self.fake.note(what);
        }
        Ok(was)
    }
}

/// A made-up disk, opened.
pub(crate) struct FakeDisk;

impl Kernel for Fake {
    type Hold = FakeHold;
    type Disk = FakeDisk;
    type Fs = PathBuf;

    fn find_disk(
        &self,
        _sysfs: &Sysfs,
        source: &Source,
        timeout: Duration,
        _cancel: &Cancel,
    ) -> Result<Device> {
        let st = self.state.locked();
        let found = st.disks.iter().find(|d| match source {
            Source::Serial(s) => d.device.serial.as_deref() == Some(s.as_str()),
            Source::Path(p) => d.device.path == *p,
        });
        match (found, source) {
            (Some(d), _) => Ok(d.device.clone()),
            (None, Source::Serial(serial)) => Err(device::Error::SerialNotFound {
                serial: serial.clone(),
                waited: timeout,
            }
            .into()),
            (None, Source::Path(p)) => Err(device::Error::BadPath {
                path: p.to_path_buf(),
                reason: "is not a block device".into(),
            }
            .into()),
        }
    }

    fn check_filesystem(&self, device: &Device, fs: FsType) -> Result<()> {
        let st = self.state.locked();
        let holds = st.disk(&device.path).and_then(|d| d.fs);
        match holds {
            Some(found) if found == fs => Ok(()),
            Some(found) => Err(probe::error::Error::Mismatch {
                device: device.path.clone(),
                found: found.name(),
                expected: fs,
            }
            .into()),
            None => Err(probe::error::Error::Unformatted {
                device: device.path.clone(),
                expected: fs,
            }
            .into()),
        }
    }

    fn identify(&self, device: &Device) -> Result<Option<&'static str>> {
        self.unwiped_fake(device)?;
        let st = self.state.locked();
        Ok(st.disk(&device.path).and_then(|d| d.fs).map(FsType::name))
    }

    fn mount_filesystem(
        &self,
        device: &Path,
        target: BorrowedFd<'_>,
        target_path: &Path,
        fs: FsType,
        options: &MountOptions,
    ) -> std::result::Result<(), MountError> {
        let at = path_of(target);
        let what = format!("mount {} {}", device.display(), at.display());
        self.call(Call::Mount, &what)
            .map_err(|e| SysError::new("mount", target_path.display(), e))?;
        let dev = {
            let st = self.state.locked();
            let d = st.disk(device).expect("a disk the test made");
            (d.device.major, d.device.minor)
        };
        self.mount(Mount {
            id: MountId(0),
            at,
            dev,
            rdev: None,
            fs_type: fs.name().into(),
            source: device.display().to_string(),
            root: "/".into(),
            read_only: options.flags & libc::MS_RDONLY != 0,
            idmap: None,
        });
        self.note(what);
        Ok(())
    }

    fn bind(&self, spec: &BindSpec<'_>) -> std::result::Result<Bound, MountError> {
        let root = path_of(spec.source_root);
        let source = if spec.subpath.as_os_str().is_empty() {
            rustix::io::fcntl_dupfd_cloexec(spec.source_root, 0)
                .map_err(|e| SysError::new("dup", spec.source_path.display(), e))?
        } else {
            let how = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
            beneath::open_with(spec.source_root, spec.subpath, OFlags::PATH, how).map_err(|_| {
                MountError::SubpathNotFound {
                    subpath: spec.subpath.to_path_buf(),
                    root: spec.source_path.to_path_buf(),
                }
            })?
        };
        let leaf = match beneath::file_type(source.as_fd()) {
            Ok(FileType::Directory) => Leaf::Dir(0o750),
            _ => Leaf::File(0o640),
        };
        let from = match spec.subpath.as_os_str().is_empty() {
            true => root.clone(),
            false => root.join(spec.subpath),
        };
        let what = format!("bind {} {}", from.display(), spec.target_path.display());
        self.call(Call::Bind, &what)
            .map_err(|e| SysError::new("move_mount", spec.target_path.display(), e))?;
        let mut created = Vec::new();
        let target =
            beneath::make_path(spec.target_base, spec.target_rel, 0o750, leaf, &mut created)
                .map_err(|e| MountError::BadTarget {
                    target: spec.target_path.to_path_buf(),
                    why: e.to_string(),
                })?;
        let on = {
            let st = self.state.locked();
            st.top_at(&root).or_else(|| st.below(&root)).cloned()
        }
        .expect("a bind's source is on a mount");
        let id = self.mount(Mount {
            id: MountId(0),
            at: path_of(target.as_fd()),
            root: on.root.join(spec.subpath),
            read_only: spec.read_only,
            idmap: spec.idmap.cloned(),
            ..on
        });
        self.note(what);
        Ok(Bound {
            recursive_read_only_applied: spec.read_only
                && spec.recursive_read_only != RecursiveReadOnly::Disabled,
            mount_id: id,
            created,
        })
    }

    fn bind_node(
        &self,
        spec: &BindSpec<'_>,
        target: &OwnedFd,
    ) -> std::result::Result<MountId, MountError> {
        let at = path_of(target.as_fd());
        let what = format!("bind {} {}", spec.source_path.display(), at.display());
        self.call(Call::BindNode, &what)
            .map_err(|e| SysError::new("move_mount", spec.target_path.display(), e))?;
        let dev = {
            let st = self.state.locked();
            let d = st.disk(spec.source_path).expect("a disk the test made");
            d.device.clone()
        };
        let id = self.mount(Mount {
            id: MountId(0),
            at,
            dev: DEVTMPFS,
            rdev: Some((dev.major, dev.minor)),
            fs_type: "devtmpfs".into(),
            source: "devtmpfs".into(),
            root: Path::new("/").join(&dev.name),
            read_only: spec.read_only,
            idmap: None,
        });
        self.note(what);
        Ok(id)
    }

    fn unmount_tree(
        &self,
        base: BorrowedFd<'_>,
        base_path: &Path,
        rel: &Path,
        expect: Expect,
    ) -> std::result::Result<bool, MountError> {
        let shown = base_path.join(rel);
        let at = match beneath::open_parent(base, rel) {
            Ok((parent, name)) => Some(path_of(parent.as_fd()).join(name.to_str().unwrap())),
            Err(Errno::NOENT | Errno::NOTDIR) => None,
            Err(Errno::LOOP | Errno::XDEV) => return Err(MountError::Unsafe { path: shown }),
            Err(e) => return Err(SysError::new("openat2", shown.display(), e).into()),
        };
        let st = self.state.locked();
        let listed = st
            .mounts
            .iter()
            .any(|m| matches!(expect, Expect::Mount(..)) && m.is(expect));
        let Some(top) = at.as_deref().and_then(|at| st.top_at(at)).cloned() else {
            return match listed {
                true => Err(MountError::Moved { path: shown }),
                false => Ok(false),
            };
        };
        if !top.is(expect) {
            let what = format!("{} ({})", top.source, top.fs_type);
            return match expect {
                Expect::Mount(..) if !listed => Ok(false),
                Expect::Mount(..) => Err(MountError::Covered { path: shown, what }),
                Expect::Device(..) => Err(MountError::NotOurs { path: shown, what }),
            };
        }
        drop(st);
        let what = format!("umount {}", top.at.display());
        self.call(Call::Unmount, &what)
            .map_err(|e| SysError::new("umount", shown.display(), e))?;
        let mut st = self.state.locked();
        // What is mounted below it comes off with it.
        st.mounts
            .retain(|m| m.id != top.id && !(m.at != top.at && m.at.starts_with(&top.at)));
        st.frozen.remove(&top.id);
        st.journal.push(what);
        Ok(true)
    }

    fn remove_node(&self, base: BorrowedFd<'_>, rel: &Path) {
        if let Ok((parent, name)) = beneath::open_parent(base, rel) {
            let at = path_of(parent.as_fd()).join(name.to_str().unwrap());
            if self.state.locked().top_at(&at).is_some() {
                return;
            }
        }
        unmount::remove_node(base, rel);
    }

    fn sync_filesystem(
        &self,
        at: BorrowedFd<'_>,
        path: &Path,
    ) -> std::result::Result<(), MountError> {
        let what = format!("syncfs {}", path_of(at).display());
        self.call(Call::Sync, &what)
            .map_err(|e| SysError::new("syncfs", path.display(), e))?;
        self.note(what);
        Ok(())
    }

    fn mountinfo(&self) -> std::result::Result<Vec<MountEntry>, SysError> {
        self.call(Call::MountInfo, "mountinfo")
            .map_err(|e| SysError::new("read", "/proc/self/mountinfo", e))?;
        let st = self.state.locked();
        Ok(st
            .mounts
            .iter()
            .map(|m| MountEntry {
                mount_id: m.id,
                parent_id: st.below(&m.at).map_or(MountId(1), |p| p.id),
                major: m.dev.0,
                minor: m.dev.1,
                root: m.root.clone(),
                mount_point: m.at.clone(),
                mount_options: match (m.read_only, m.idmap.is_some()) {
                    (false, false) => "rw",
                    (true, false) => "ro",
                    (false, true) => "rw,idmapped",
                    (true, true) => "ro,idmapped",
                }
                .into(),
                fs_type: m.fs_type.clone(),
                source: m.source.clone(),
                super_options: "rw".into(),
            })
            .collect())
    }

    fn mount_point(&self, fd: BorrowedFd<'_>) -> std::result::Result<MountPoint, Errno> {
        self.call(Call::Statx, "statx")?;
        let real = beneath::mount_point(fd)?;
        Ok(self.overlay(&path_of(fd), real))
    }

    fn mount_point_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &CStr,
    ) -> std::result::Result<MountPoint, Errno> {
        self.call(Call::Statx, "statx")?;
        let real = beneath::mount_point_at(dir, name)?;
        let p = path_of(dir).join(name.to_str().unwrap());
        Ok(self.overlay(&p, real))
    }

    fn stat(&self, fd: BorrowedFd<'_>) -> std::result::Result<rustix::fs::Stat, Errno> {
        let state = self.state.locked();
        let top = state.top_at(&path_of(fd));
        let Some((m, map)) = top.and_then(|m| Some((m, m.idmap.as_ref()?))) else {
            return rustix::fs::fstat(fd);
        };
        // An idmapped bind's root is its source's file (on the filesystem's
        // own mount), its owner mapped (65534 where the mappings leave it out).
        let own = |o: &&Mount| o.dev == m.dev && o.idmap.is_none() && o.root == Path::new("/");
        let fs = state.mounts.iter().find(own).ok_or(Errno::NOENT)?;
        let mut st = rustix::fs::stat(fs.at.join(m.root.strip_prefix("/").unwrap_or(&m.root)))?;
        st.st_uid = idmap::shown(&map.uids, st.st_uid).unwrap_or(65534);
        st.st_gid = idmap::shown(&map.gids, st.st_gid).unwrap_or(65534);
        Ok(st)
    }

    fn freeze(&self, at: BorrowedFd<'_>, path: &Path) -> Result<FakeHold> {
        let p = path_of(at);
        let what = format!("freeze {}", p.display());
        self.call(Call::Freeze, &what)
            .map_err(|e| quiesce::Error::from(SysError::new("FIFREEZE", path.display(), e)))?;
        let mut st = self.state.locked();
        let mount = st.top_at(&p).expect("frozen on its mount root").id;
        if !st.frozen.insert(mount) {
            return Err(quiesce::Error::FrozenElsewhere {
                path: path.to_path_buf(),
            }
            .into());
        }
        st.journal.push(what);
        Ok(FakeHold {
            fake: self.clone(),
            mount,
            at: p,
        })
    }

    fn thaw(&self, at: BorrowedFd<'_>, _path: &Path) -> Result<bool> {
        let p = path_of(at);
        let mount = self.state.locked().top_at(&p).map(|m| m.id);
        let Some(mount) = mount else {
            return Ok(false);
        };
        Ok(FakeHold {
            fake: self.clone(),
            mount,
            at: p,
        }
        .thaw()?)
    }

    fn fs_bytes(&self, at: BorrowedFd<'_>, _: &Path, _: &Device, _: FsType) -> Result<u64> {
        let st = self.state.locked();
        let dev = st.top_at(&path_of(at)).map(|m| m.dev);
        let bytes = st
            .disks
            .iter()
            .find(|d| Some((d.device.major, d.device.minor)) == dev)
            .map(|d| d.bytes);
        Ok(bytes.ok_or_else(|| SysError::new("statfs", path_of(at).display(), Errno::NODEV))?)
    }

    fn open_fs(
        &self,
        at: BorrowedFd<'_>,
        _path: &Path,
    ) -> std::result::Result<PathBuf, quiesce::Error> {
        Ok(path_of(at))
    }

    fn trim(
        &self,
        fs: &PathBuf,
        path: &Path,
        start: u64,
        len: u64,
        _min_len: u64,
    ) -> std::result::Result<u64, quiesce::Error> {
        let what = format!("trim {} {start}+{len}", fs.display());
        self.call(Call::Trim, &what)
            .map_err(|e| SysError::new("FITRIM", path.display(), e))?;
        self.note(what);
        Ok(len / 2)
    }

    fn open_node(&self, dev: &Device) -> std::result::Result<OwnedFd, blockdev::Error> {
        let node = self.state.locked().disk(&dev.path).map(|d| d.node.clone());
        let node = node.ok_or_else(|| gone(dev))?;
        Ok(
            rustix::fs::open(&node, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| SysError::new("open", dev.path.display(), e))?,
        )
    }

    fn open_disk(&self, dev: &Device) -> std::result::Result<FakeDisk, blockdev::Error> {
        self.call(Call::OpenDisk, format!("open {}", dev.name))
            .map_err(|e| SysError::new("open", dev.path.display(), e))?;
        match self.state.locked().disk(&dev.path) {
            Some(_) => Ok(FakeDisk),
            None => Err(gone(dev)),
        }
    }

    fn read_only(
        &self,
        _disk: &FakeDisk,
        dev: &Device,
    ) -> std::result::Result<bool, blockdev::Error> {
        Ok(self.read_only(dev))
    }

    fn set_read_only(
        &self,
        _disk: &FakeDisk,
        dev: &Device,
        ro: bool,
    ) -> std::result::Result<(), blockdev::Error> {
        let what = format!("ro {} {}", dev.name, if ro { "on" } else { "off" });
        self.call(Call::SetReadOnly, &what)
            .map_err(|e| SysError::new("BLKROSET", dev.path.display(), e))?;
        let mut st = self.state.locked();
        if let Some(d) = st.disks.iter_mut().find(|d| d.device.path == dev.path) {
            d.read_only = ro;
        }
        st.journal.push(what);
        Ok(())
    }

    fn flush(&self, _disk: &FakeDisk, dev: &Device) -> std::result::Result<(), blockdev::Error> {
        let what = format!("flush {}", dev.name);
        self.call(Call::Flush, &what)
            .map_err(|e| SysError::new("fsync", dev.path.display(), e))?;
        self.note(what);
        Ok(())
    }

    fn size(&self, _disk: &FakeDisk, dev: &Device) -> std::result::Result<u64, blockdev::Error> {
        Ok(self.state.locked().disk(&dev.path).map_or(0, |d| d.bytes))
    }

    fn open_mapping(
        &self,
        disk: &Device,
        name: &str,
        allow_discards: bool,
        passphrase: &Zeroizing<Vec<u8>>,
    ) -> std::result::Result<Mapping, luks2::error::Error> {
        self.open_mapping_fake(disk, name, allow_discards, passphrase)
    }

    fn format_if_blank(
        &self,
        disk: &Device,
        _name: &str,
        passphrase: &Zeroizing<Vec<u8>>,
        integrity: Option<Mac>,
    ) -> std::result::Result<Found, luks2::error::Error> {
        self.format_if_blank_fake(disk, passphrase, integrity)
    }

    fn wipe_mapping(
        &self,
        disk: &Device,
        mapped: &Device,
        _cancel: &Cancel,
    ) -> Result<Option<std::ops::Range<u64>>> {
        self.wipe_fake(disk, mapped)
    }

    fn finish_format(&self, disk: &Device) -> std::result::Result<(), luks2::error::Error> {
        self.finish_format_fake(disk);
        Ok(())
    }

    fn make_filesystem(&self, device: &Device, fs: FsType, _cancel: &Cancel) -> Result<()> {
        self.make_filesystem_fake(device, fs);
        Ok(())
    }

    fn close_mapping(&self, name: &str) -> std::result::Result<bool, luks2::error::Error> {
        self.close_mapping_fake(name)
    }

    fn mapping_live(&self, m: &Mapping) -> std::result::Result<Live, luks2::error::Error> {
        Ok(self.mapping_live_fake(m))
    }

    fn grow_mapping(
        &self,
        name: &str,
        _disk_bytes: u64,
    ) -> std::result::Result<u64, luks2::error::Error> {
        Err(luks2::error::Error::corrupt(format!(
            "the fake kernel grows no mapping ({name})"
        )))
    }

    fn agents_mappings(&self) -> std::result::Result<Vec<String>, luks2::error::Error> {
        let mut all = self.mappings();
        all.retain(|n| n.starts_with(luks2::mapping::NAME_PREFIX));
        Ok(all)
    }

    fn mapping_tampered(&self, m: &Mapping) -> std::result::Result<u64, luks2::error::Error> {
        let st = self.state.locked();
        Ok(st
            .mapped
            .iter()
            .find(|x| x.name == m.name)
            .map_or(0, |x| x.tampered))
    }
}

fn gone(dev: &Device) -> blockdev::Error {
    blockdev::Error::Gone {
        node: dev.path.display().to_string(),
        name: dev.name.clone(),
        major: dev.major,
        minor: dev.minor,
    }
}

/// A made-up LUKS2 disk.
struct Luks {
    /// Its disk's name.
    disk: String,
    passphrase: Vec<u8>,
    /// What the mapping holds.
    inner: Option<FsType>,
    /// Where the mapping's node file goes.
    dir: PathBuf,
    /// Its segment's integrity, if any.
    integrity: Option<String>,
    /// Sectors a mapping of it finds tampered as soon as it is made.
    tampered: u64,
    /// Made by the agent and not yet marked finished.
    unfinished: bool,
    /// Made with integrity, its wipe not yet done.
    wiping: bool,
}

/// A mapping made.
struct Mapped {
    name: String,
    /// The LUKS disk's name.
    disk: String,
    /// The mapping's device.
    dev: Device,
    /// Sectors the kernel refused as tampered.
    tampered: u64,
}

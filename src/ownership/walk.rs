//! The fsGroup walk (see the module doc of `ownership`): who does which
//! directory, in parallel, within the process's budgets of descriptors and
//! helper threads; the depth-first fallback past the descriptor budget;
//! progress reports and cancellation between items. What is done to each
//! entry is `entries`'; which mode it should end with is `rules`'.

use std::ffi::{CStr, OsStr, OsString};
use std::mem::MaybeUninit;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::sync::{CondvarExt, LockExt};
use rustix::fs::{FileType, Mode, OFlags, RawDir, ResolveFlags};
use rustix::io::Errno;

use super::budget::{DirFd, Helpers, Limits, HELD_DIRS};
use super::entries::{fix_dir, fix_entries, Counts, Names, Owner};
use super::error::Error;
use super::mounts::{relative, Skipped};
use super::rules::root_is_right;
use crate::cancel::Cancel;
use crate::model::Policy;
use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// OnRootMismatch found the root already right and did not walk (the
    /// table reports a read-only volume's fsGroup as skipped too).
    pub skipped: bool,
    /// Entries looked at (the root included; mount points of other mounts and what is below them not).
    pub visited: u64,
    /// Entries whose group or mode was changed.
    pub changed: u64,
    /// Entries that could not be changed (the walk went on).
    pub errors: u64,
    /// Wall time of the whole call.
    pub duration: Duration,
    /// Mount points below the root the walk did not enter (see [`run`]):
    /// what is at and below them kept its group.
    pub mounts_skipped: u64,
    /// The first `mounts::NAMED` of them, relative to the root, sorted, each
    /// at most `mounts::NAME_BYTES` long (cut in the middle with "…").
    pub skipped_mount_points: Vec<PathBuf>,
}

/// Non-directory entries of one directory are handed out in batches this big,
/// so that a single huge directory still keeps every CPU busy.
const BATCH: usize = 256;
/// The getdents64 buffer of each worker: about a thousand entries per call.
const READDIR_BUF: usize = 32 << 10;
/// A directory's non-directory entries are listed this many at a time (up
/// to the end of the getdents buffer that reaches it), the rest read from
/// the same fd once these are handed out: a directory of any size takes
/// about a megabyte of names at a time, not one entry per file it holds.
const CHUNK: usize = 16 << 10;
/// One fsGroup walk: what to apply where, and how it reports and stops.
#[derive(Clone, Copy)]
pub struct Walk<'a> {
    /// What to open as the root: `/proc/self/fd/N` for a directory the
    /// caller resolved itself, beneath its own root (or a plain path).
    pub open_at: &'a Path,
    /// The root as messages name it.
    pub shown: &'a Path,
    /// The fsGroup.
    pub gid: u32,
    /// Always, or only when the root is not right yet.
    pub policy: Policy,
    /// The volume is read-only: OnRootMismatch looks for r-x, not rwx.
    pub read_only: bool,
    /// Roughly how often `progress` is called while the walk runs.
    pub every: Duration,
    /// Called with the counts so far (and the time since the start), from
    /// one worker at a time, so that the caller can log a long walk; it runs
    /// on the walk's threads: keep it short.
    pub progress: &'a (dyn Fn(&Report) + Sync),
    /// Stops the walk between two items (within milliseconds); what was
    /// changed stays changed (see the module doc of `ownership`).
    pub cancel: &'a Cancel,
}

/// Applies fsGroup `gid` to the tree at `root` (the mounted volume's root),
/// with no progress reports and nothing to stop it: [`run`] for a plain path.
pub fn apply(root: &Path, gid: u32, policy: Policy, read_only: bool) -> Result<Report, Error> {
    run(&Walk {
        open_at: root,
        shown: root,
        gid,
        policy,
        read_only,
        every: Duration::MAX,
        progress: &|_| {},
        cancel: &Cancel::never(),
    })
}

/// Runs the walk `w` describes and reports what it did.
///
/// The mount point directory of another filesystem below the root is
/// neither changed nor visited: its inode belongs to the other filesystem
/// (kubelet's filepath.Walk would change it and walk into it). A bind mount
/// of this volume onto itself is skipped the same way (openat2
/// RESOLVE_NO_XDEV), and so are a file mounted over an entry and a
/// directory of another device number (a btrfs subvolume). Each is counted
/// in the report's `mounts_skipped`, and the first few named, so that an
/// operator sees why the files there kept their group.
pub fn run(w: &Walk) -> Result<Report, Error> {
    let (report, _threads) = walk(w, Limits::for_this_machine())?;
    Ok(report)
}

/// [`run`] within `limits`; also says how many threads worked on it.
fn walk(w: &Walk, limits: Limits) -> Result<(Report, usize), Error> {
    let Walk {
        open_at,
        shown: root,
        gid,
        policy,
        read_only,
        every,
        progress,
        cancel,
    } = *w;
    let start = Instant::now();
    let root_fd = rustix::fs::open(
        open_at,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::NOTDIR => Error::RootNotDirectory {
            root: root.to_path_buf(),
        },
        e @ (Errno::MFILE | Errno::NFILE) => Error::OutOfFds {
            gid,
            dir: root.to_path_buf(),
            source: e.into(),
        },
        e => SysError::new("open", root.display(), e).into(),
    })?;
    let st = rustix::fs::fstat(&root_fd).map_err(|e| SysError::new("fstat", root.display(), e))?;
    if policy == Policy::OnRootMismatch && root_is_right(st.st_mode, st.st_gid, gid, read_only) {
        let skipped = Report {
            skipped: true,
            duration: start.elapsed(),
            ..Report::default()
        };
        return Ok((skipped, 0));
    }

    // Where /proc says the root is, to name mount points relative to it.
    let root_link =
        rustix::fs::readlink(format!("/proc/self/fd/{}", root_fd.as_raw_fd()), Vec::new())
            .ok()
            .map(|p| p.into_bytes());
    let walk = Shared {
        root,
        root_link,
        gid,
        dev: st.st_dev,
        limits,
        queue: Mutex::new(Queue {
            items: vec![Item::Opened(root_fd)],
            busy: 0,
            failed: None,
        }),
        wake: Condvar::new(),
        stopping: AtomicBool::new(false),
        threads: AtomicUsize::new(0),
        visited: AtomicU64::new(0),
        changed: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        mounts: Skipped::default(),
        start,
        every: nanos(every),
        next_progress: AtomicU64::new(nanos(every)),
        progress_lock: Mutex::new(0),
        progress,
        cancel,
    };
    // Two workers per CPU: a worker often sleeps in the kernel (an inode table
    // block to read, a journal handle to wait for), and a second one per CPU
    // keeps it busy meanwhile.
    let mut helpers = Helpers::take(limits.workers.saturating_sub(1), limits.helpers);
    std::thread::scope(|s| {
        for i in 0..helpers.0 {
            let spawned = std::thread::Builder::new()
                .name(format!("fsgroup-{}", i + 1))
                .spawn_scoped(s, || walk.work());
            // Fewer threads is slower, not wrong: go on with what started.
            if spawned.is_err() {
                helpers.give_back_one();
            }
        }
        walk.work();
    });
    drop(helpers);
    let failed = walk.queue.locked().failed.take();
    if let Some(e) = failed {
        return Err(e);
    }
    Ok((
        walk.report(start.elapsed()),
        walk.threads.load(Ordering::Relaxed),
    ))
}

/// A duration in nanoseconds, `u64::MAX` (never) when it does not fit.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A unit of work.
enum Item {
    /// A directory already open (the root): fix it and list it.
    Opened(OwnedFd),
    /// A subdirectory to open, by its one-component name, from its parent's fd.
    Dir { parent: Arc<DirFd>, name: Box<CStr> },
    /// Non-directory entries of a listed directory: indexes into its names.
    Batch(Arc<Listing>, Range<usize>),
    /// A directory listed in part: read its next chunk from its fd.
    More(Arc<DirFd>),
}

/// The non-directory entries of a listed directory, shared by its batches.
struct Listing {
    dir: Arc<DirFd>,
    names: Names,
}

/// What a directory holds: its subdirectories (by d_type) and the rest.
#[derive(Default)]
struct Contents {
    subdirs: Vec<Box<CStr>>,
    others: Names,
}

struct Queue {
    /// LIFO: batches of a freshly read directory go first, which keeps few directories open.
    items: Vec<Item>,
    /// Items taken and not finished; 0 with an empty stack means done.
    busy: usize,
    /// The first error that stops the walk.
    failed: Option<Error>,
}

/// A directory of a subtree one worker finishes alone (past the fd budget).
struct Frame {
    /// Its name in its parent, to find it again if `..` does not lead back.
    name: Box<CStr>,
    /// Its inode, which `..` must lead back to.
    ino: u64,
    /// Subdirectories not walked yet.
    subdirs: Vec<Box<CStr>>,
}

/// A walk in progress, shared by its workers.
struct Shared<'a> {
    root: &'a Path,
    /// The root as /proc/self/fd names it (`None`: it could not).
    root_link: Option<Vec<u8>>,
    gid: u32,
    dev: u64,
    limits: Limits,
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Set with `failed`: workers deep in a subtree of their own stop too.
    stopping: AtomicBool,
    /// Threads that worked on this walk, its caller's included.
    threads: AtomicUsize,
    visited: AtomicU64,
    changed: AtomicU64,
    errors: AtomicU64,
    /// Mount points not entered.
    mounts: Skipped,
    start: Instant,
    /// Nanoseconds between progress calls.
    every: u64,
    /// When the next progress call is due, in nanoseconds since `start`
    /// (`u64::MAX`: never); the worker that moves it on makes the call.
    next_progress: AtomicU64,
    /// Held during a progress call; the time of the last one, in nanoseconds since `start`.
    progress_lock: Mutex<u64>,
    progress: &'a (dyn Fn(&Report) + Sync),
    /// Checked before every item.
    cancel: &'a Cancel,
}

impl Shared<'_> {
    /// The counts so far.
    fn report(&self, duration: Duration) -> Report {
        Report {
            skipped: false,
            visited: self.visited.load(Ordering::Relaxed),
            changed: self.changed.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            duration,
            mounts_skipped: self.mounts.count(),
            skipped_mount_points: self.mounts.names(),
        }
    }

    /// Counts a mount point not entered: `name` in `dir` (`depth` levels
    /// down), or `dir` itself; named while fewer than `mounts::NAMED` are.
    fn mount_point(&self, dir: BorrowedFd<'_>, depth: u64, name: Option<&CStr>) {
        self.mounts.add(|| {
            let link = format!("/proc/self/fd/{}", dir.as_raw_fd());
            let at = rustix::fs::readlink(link, Vec::new()).ok();
            let at = at.as_ref().map(|p| p.as_bytes());
            relative(
                self.root_link.as_deref(),
                at,
                depth,
                name.map(CStr::to_bytes),
            )
        });
    }

    /// Calls `progress` if it is due; checked after every item, which is
    /// at most one directory listing or one batch of entries.
    fn maybe_progress(&self) {
        let due = self.next_progress.load(Ordering::Relaxed);
        if due == u64::MAX {
            return;
        }
        let elapsed = self.start.elapsed();
        let now = nanos(elapsed);
        if now < due {
            return;
        }
        let next = now.saturating_add(self.every);
        // Whoever moves the deadline on reports; the others go on walking.
        if self
            .next_progress
            .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        // One call at a time, in order: a worker that won an earlier period
        // but comes late (preempted) skips its stale call. The counts are
        // read under the lock, so they never go backwards either.
        let Ok(mut last) = self.progress_lock.try_lock() else {
            return;
        };
        if now <= *last {
            return;
        }
        *last = now;
        (self.progress)(&self.report(elapsed));
    }

    fn check_cancel(&self) -> Result<(), Error> {
        Ok(self
            .cancel
            .check(|| format!("applying fsGroup {} to {}", self.gid, self.root.display()))?)
    }

    fn fail(&self, q: &mut Queue, e: Error) {
        q.failed.get_or_insert(e);
        self.stopping.store(true, Ordering::Relaxed);
        self.wake.notify_all();
    }

    fn work(&self) {
        self.threads.fetch_add(1, Ordering::Relaxed);
        let mut buf = vec![MaybeUninit::<u8>::uninit(); READDIR_BUF];
        loop {
            let item = {
                let mut q = self.queue.locked();
                loop {
                    if q.failed.is_some() {
                        return;
                    }
                    if let Err(e) = self.check_cancel() {
                        self.fail(&mut q, e);
                        return;
                    }
                    if let Some(item) = q.items.pop() {
                        q.busy += 1;
                        break item;
                    }
                    if q.busy == 0 {
                        self.wake.notify_all();
                        return;
                    }
                    q = self.wake.waited(q);
                }
            };
            let result = match item {
                Item::Opened(fd) => self.opened(fd, 0, &mut buf),
                Item::Dir { parent, name } => self.directory(parent, &name, &mut buf),
                Item::Batch(listing, range) => self.batch(&listing, range),
                Item::More(dir) => self.more(dir, &mut buf),
            };
            self.maybe_progress();
            let mut q = self.queue.locked();
            q.busy -= 1;
            if let Err(e) = result {
                self.fail(&mut q, e);
            } else if q.busy == 0 && q.items.is_empty() {
                self.wake.notify_all();
            }
        }
    }

    fn push(&self, items: Vec<Item>) {
        if items.is_empty() {
            return;
        }
        let n = items.len();
        self.queue.locked().items.extend(items);
        if n == 1 {
            self.wake.notify_one();
        } else {
            self.wake.notify_all();
        }
    }

    /// A directory for a message: where `dir` is now (lossily, from
    /// /proc/self/fd), then `name` in it if given.
    fn path_of(&self, dir: BorrowedFd<'_>, depth: u64, name: Option<&CStr>) -> PathBuf {
        let link = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let base = match rustix::fs::readlink(link, Vec::new()) {
            Ok(p) => PathBuf::from(OsString::from_vec(p.into_bytes())),
            // Longer than PATH_MAX, or no /proc.
            Err(_) => PathBuf::from(format!("{}/…({depth} levels down)…", shown(self.root))),
        };
        match name {
            Some(n) => base.join(OsStr::from_bytes(n.to_bytes())),
            None => base,
        }
    }

    fn read_dir_error(
        &self,
        dir: BorrowedFd<'_>,
        depth: u64,
        name: Option<&CStr>,
        e: Errno,
    ) -> Error {
        let dir = self.path_of(dir, depth, name);
        if e == Errno::MFILE || e == Errno::NFILE {
            return Error::OutOfFds {
                gid: self.gid,
                dir,
                source: e.into(),
            };
        }
        Error::ReadDir {
            gid: self.gid,
            dir,
            source: e.into(),
        }
    }

    /// Opens subdirectory `name` of `dir` (at `depth`): one component, no
    /// symlink, no mount crossing. `None`: not ours (a mount point), or gone
    /// or replaced since it was listed (counted as an error).
    fn open_child(
        &self,
        dir: BorrowedFd<'_>,
        depth: u64,
        name: &CStr,
    ) -> Result<Option<OwnedFd>, Error> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let how = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV;
        let mut again = 0;
        loop {
            match rustix::fs::openat2(dir, name, flags, Mode::empty(), how) {
                Ok(fd) => return Ok(Some(fd)),
                // A mount point: another filesystem, or a bind; not ours to change.
                Err(Errno::XDEV) => {
                    self.mount_point(dir, depth, Some(name));
                    return Ok(None);
                }
                // Gone, or replaced by a symlink or a file since it was listed.
                Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
                // openat2 asks for a retry when a rename raced with the lookup.
                Err(Errno::AGAIN) if again < 3 => again += 1,
                Err(e) => return Err(self.read_dir_error(dir, depth, Some(name), e)),
            }
        }
    }

    /// Opens subdirectory `name` of `parent`, then fixes and lists it.
    fn directory(
        &self,
        parent: Arc<DirFd>,
        name: &CStr,
        buf: &mut [MaybeUninit<u8>],
    ) -> Result<(), Error> {
        let depth = parent.depth + 1;
        let Some(fd) = self.open_child(parent.fd.as_fd(), parent.depth, name)? else {
            return Ok(());
        };
        // Before going on: a pure chain keeps only the directory at hand open.
        drop(parent);
        self.opened(fd, depth, buf)
    }

    /// Fixes directory `fd` and reads its entries, the first chunk of them
    /// (true: more to read). `None`: not ours (another filesystem).
    fn fix_and_list(
        &self,
        fd: &OwnedFd,
        depth: u64,
        buf: &mut [MaybeUninit<u8>],
    ) -> Result<Option<(u64, Contents, bool)>, Error> {
        let st =
            rustix::fs::fstat(fd).map_err(|e| self.read_dir_error(fd.as_fd(), depth, None, e))?;
        if st.st_dev != self.dev {
            // Not a mount, yet another filesystem (a btrfs subvolume).
            self.mount_point(fd.as_fd(), depth, None);
            return Ok(None);
        }
        let mut counts = Counts {
            visited: 1,
            ..Counts::default()
        };
        fix_dir(fd, st.st_mode, st.st_gid, self.gid, &mut counts);
        self.add(&counts);
        let (contents, more) = self.list(fd.as_fd(), depth, buf)?;
        Ok(Some((st.st_ino, contents, more)))
    }

    /// Reads the next chunk of `fd`'s entries, from where the last read
    /// left the fd's offset: at least CHUNK non-directory entries, or to the
    /// end (false: nothing more). Only where a getdents buffer ends, so no
    /// entry read is dropped.
    fn list(
        &self,
        fd: BorrowedFd<'_>,
        depth: u64,
        buf: &mut [MaybeUninit<u8>],
    ) -> Result<(Contents, bool), Error> {
        let mut contents = Contents::default();
        let mut dir = RawDir::new(fd, buf);
        while let Some(entry) = dir.next() {
            let entry = entry.map_err(|e| self.read_dir_error(fd, depth, None, e))?;
            let name = entry.file_name();
            if name != c"." && name != c".." {
                match entry.file_type() {
                    FileType::Directory => contents.subdirs.push(name.into()),
                    _ => contents.others.push(entry.ino(), name),
                }
            }
            if contents.others.len() >= CHUNK && dir.is_buffer_empty() {
                contents.others.sort_by_inode();
                return Ok((contents, true));
            }
        }
        contents.others.sort_by_inode();
        Ok((contents, false))
    }

    /// Fixes and lists an open directory, hands out its subdirectories and
    /// batches of its other entries, and does the first batch.
    fn opened(&self, fd: OwnedFd, depth: u64, buf: &mut [MaybeUninit<u8>]) -> Result<(), Error> {
        let Some((ino, contents, more)) = self.fix_and_list(&fd, depth, buf)? else {
            return Ok(());
        };
        if !contents.subdirs.is_empty() && HELD_DIRS.load(Ordering::Relaxed) >= self.limits.dir_fds
        {
            return self.alone(fd, depth, ino, (contents, more), buf);
        }
        self.hand_out(Arc::new(DirFd::new(fd, depth)), contents, more)
    }

    /// The next chunk of a directory listed in part.
    fn more(&self, dir: Arc<DirFd>, buf: &mut [MaybeUninit<u8>]) -> Result<(), Error> {
        let (contents, more) = self.list(dir.fd.as_fd(), dir.depth, buf)?;
        self.hand_out(dir, contents, more)
    }

    /// Hands out a chunk of `dir`'s entries: its subdirectories, batches of
    /// the rest, and (if `more`) the reading of the next chunk, which goes
    /// below them on the stack so this chunk's batches are done first; does
    /// the first batch.
    fn hand_out(&self, dir: Arc<DirFd>, contents: Contents, more: bool) -> Result<(), Error> {
        let n = contents.others.len();
        let listing = Arc::new(Listing {
            dir: Arc::clone(&dir),
            names: contents.others,
        });
        let mut items: Vec<Item> = Vec::new();
        if more {
            items.push(Item::More(Arc::clone(&dir)));
        }
        items.extend(contents.subdirs.into_iter().map(|name| Item::Dir {
            parent: Arc::clone(&dir),
            name,
        }));
        drop(dir);
        items.extend(
            (BATCH..n)
                .step_by(BATCH)
                .map(|i| Item::Batch(Arc::clone(&listing), i..n.min(i + BATCH))),
        );
        self.push(items);
        self.batch(&listing, 0..n.min(BATCH))
    }

    /// A batch of non-directory entries; directories found among them
    /// (filesystems without d_type) become items of their own.
    fn batch(&self, listing: &Arc<Listing>, range: Range<usize>) -> Result<(), Error> {
        let dir = &listing.dir;
        let mut subdirs = Vec::new();
        let done = self.entries(
            dir.fd.as_fd(),
            dir.depth,
            &listing.names,
            range,
            &mut subdirs,
        );
        self.push(
            subdirs
                .into_iter()
                .map(|name| Item::Dir {
                    parent: Arc::clone(&listing.dir),
                    name,
                })
                .collect(),
        );
        done
    }

    /// Finishes the subtree of `top` (at `depth`, inode `ino`, already fixed
    /// and listed as `contents`) on this worker alone, depth first, with at
    /// most three fds: `top`, the directory at hand, and its child being
    /// opened. Going back up is by `..`, which must lead to the inode left;
    /// if it does not (a directory was moved meanwhile), the directory is
    /// found again by name from `top`, and what cannot be found is counted
    /// as errors.
    fn alone(
        &self,
        top: OwnedFd,
        depth: u64,
        ino: u64,
        first: (Contents, bool),
        buf: &mut [MaybeUninit<u8>],
    ) -> Result<(), Error> {
        let subdirs = self.drain(top.as_fd(), depth, first, buf)?;
        let mut stack = vec![Frame {
            name: c"".into(),
            ino,
            subdirs,
        }];
        // The directory at hand when below `top`.
        let mut here: Option<OwnedFd> = None;
        loop {
            self.check_cancel()?;
            if self.stopping.load(Ordering::Relaxed) {
                return Ok(());
            }
            self.maybe_progress();
            let level = depth + stack.len() as u64 - 1;
            let Some(frame) = stack.last_mut() else {
                return Ok(());
            };
            if let Some(name) = frame.subdirs.pop() {
                let at = here.as_ref().unwrap_or(&top).as_fd();
                let Some(fd) = self.open_child(at, level, &name)? else {
                    continue;
                };
                let Some((ino, contents, more)) = self.fix_and_list(&fd, level + 1, buf)? else {
                    continue;
                };
                let subdirs = self.drain(fd.as_fd(), level + 1, (contents, more), buf)?;
                if !subdirs.is_empty() {
                    stack.push(Frame { name, ino, subdirs });
                    here = Some(fd);
                }
                continue;
            }
            stack.pop();
            here = match stack.len() {
                0 => return Ok(()),
                1 => None,
                _ => self.up(here.take(), &top, depth, &mut stack)?,
            };
        }
    }

    /// From `from` (just left) to the directory of the last frame of
    /// `stack`: by `..`, if it leads to that inode; else by name from `top`.
    /// Frames that cannot be found again are dropped, their pending
    /// subdirectories counted as errors. `None`: back at `top`.
    fn up(
        &self,
        from: Option<OwnedFd>,
        top: &OwnedFd,
        depth: u64,
        stack: &mut Vec<Frame>,
    ) -> Result<Option<OwnedFd>, Error> {
        let want = stack.last().map_or(0, |f| f.ino);
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let level = depth + stack.len() as u64;
        if let Some(from) = from {
            match rustix::fs::openat(&from, c"..", flags, Mode::empty()) {
                Ok(fd) => {
                    if let Ok(st) = rustix::fs::fstat(&fd) {
                        if (st.st_dev, st.st_ino) == (self.dev, want) {
                            return Ok(Some(fd));
                        }
                    }
                }
                Err(e @ (Errno::MFILE | Errno::NFILE)) => {
                    return Err(self.read_dir_error(from.as_fd(), level, Some(c".."), e))
                }
                Err(_) => {}
            }
        }
        // Down again from `top`, each step checked against the inode seen.
        let mut at: Option<OwnedFd> = None;
        for i in 1..stack.len() {
            let here = at.as_ref().unwrap_or(top).as_fd();
            let found = match self.open_child(here, depth + i as u64 - 1, &stack[i].name)? {
                Some(fd) => match rustix::fs::fstat(&fd) {
                    Ok(st) if (st.st_dev, st.st_ino) == (self.dev, stack[i].ino) => Some(fd),
                    _ => None,
                },
                None => None,
            };
            match found {
                Some(fd) => at = Some(fd),
                None => {
                    let lost: usize = stack[i..].iter().map(|f| f.subdirs.len()).sum();
                    self.errors.fetch_add(lost as u64, Ordering::Relaxed);
                    stack.truncate(i);
                    return Ok(at);
                }
            }
        }
        Ok(at)
    }

    /// Does every non-directory entry of `dir`, chunk by chunk from `first`
    /// on, and gives back its subdirectories.
    fn drain(
        &self,
        dir: BorrowedFd<'_>,
        depth: u64,
        first: (Contents, bool),
        buf: &mut [MaybeUninit<u8>],
    ) -> Result<Vec<Box<CStr>>, Error> {
        let (mut contents, mut more) = first;
        let mut subdirs = Vec::new();
        loop {
            subdirs.append(&mut contents.subdirs);
            self.all_entries(dir, depth, &contents.others, &mut subdirs)?;
            if !more {
                return Ok(subdirs);
            }
            self.check_cancel()?;
            (contents, more) = self.list(dir, depth, buf)?;
        }
    }

    /// All non-directory entries of a directory, in batches with a look at
    /// the cancel token between them.
    fn all_entries(
        &self,
        dir: BorrowedFd<'_>,
        depth: u64,
        names: &Names,
        subdirs: &mut Vec<Box<CStr>>,
    ) -> Result<(), Error> {
        let n = names.len();
        for i in (0..n).step_by(BATCH) {
            if i > 0 {
                self.check_cancel()?;
            }
            self.entries(dir, depth, names, i..n.min(i + BATCH), subdirs)?;
        }
        Ok(())
    }

    fn add(&self, c: &Counts) {
        self.visited.fetch_add(c.visited, Ordering::Relaxed);
        self.changed.fetch_add(c.changed, Ordering::Relaxed);
        self.errors.fetch_add(c.errors, Ordering::Relaxed);
    }

    /// Non-directory entries `range` of `names` in `dir` (`depth` levels
    /// down, for messages): `entries::fix_entries`, its counts added to the
    /// walk's.
    fn entries(
        &self,
        dir: BorrowedFd<'_>,
        depth: u64,
        names: &Names,
        range: Range<usize>,
        subdirs: &mut Vec<Box<CStr>>,
    ) -> Result<(), Error> {
        let mut counts = Counts::default();
        let owner = Owner {
            gid: self.gid,
            dev: self.dev,
        };
        let mut mounts = Vec::new();
        let done = fix_entries(dir, names, range, owner, subdirs, &mut counts, &mut mounts);
        self.add(&counts);
        for name in mounts {
            self.mount_point(dir, depth, Some(name));
        }
        done.map_err(|e| Error::OutOfFds {
            gid: self.gid,
            dir: self.path_of(dir, depth, Some(e.name)),
            source: e.source,
        })
    }
}

#[cfg(test)]
// Random test trees index small arrays with small numbers.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    use std::fs;
    use std::path::PathBuf;

    use rustix::fs::AtFlags;

    use crate::cancel::{Token, Why};
    use crate::code::Code;
    use crate::ownership::budget::{DIR_FD_BUDGET, HELPERS};
    use crate::ownership::entries::NO_FCHMODAT2;
    use crate::ownership::mounts::NAMED;
    use crate::ownership::rules::{PERM_BITS, RW, S_ISGID, X};
    use std::os::unix::fs::{lchown, symlink, MetadataExt, PermissionsExt};

    use crust_testkit::{needs, LoopDisk, Mounted};

    const GID: u32 = 4321;

    /// A walk of `root` (fsGroup GID, Always) within `limits`.
    fn walk_in(
        root: &Path,
        every: Duration,
        progress: &(dyn Fn(&Report) + Sync),
        cancel: &Cancel,
        limits: Limits,
    ) -> Result<(Report, usize), Error> {
        walk(
            &Walk {
                open_at: root,
                shown: root,
                gid: GID,
                policy: Policy::Always,
                read_only: false,
                every,
                progress,
                cancel,
            },
            limits,
        )
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_directory_larger_than_a_chunk_is_read_in_chunks_and_walked_whole() {
        needs::root();
        let t = Tmpfs::new();
        let files = 2 * CHUNK + 777;
        for (name, limits) in [
            ("shared", Limits::for_this_machine()),
            (
                "alone",
                Limits {
                    dir_fds: 0,
                    ..Limits::for_this_machine()
                },
            ),
        ] {
            let root = t.path().join(name);
            fs::create_dir(&root).unwrap();
            // Subdirectories among the files, so chunks hand out both.
            for i in 0..files {
                if i % (CHUNK / 2) == 0 {
                    fs::create_dir(root.join(format!("sub{i}"))).unwrap();
                    fs::write(root.join(format!("sub{i}/x")), b"").unwrap();
                }
                fs::write(root.join(format!("f{i}")), b"").unwrap();
            }
            let subdirs = files.div_ceil(CHUNK / 2) as u64;
            let entries = 1 + files as u64 + 2 * subdirs;
            let (r, _) = walk_in(&root, Duration::MAX, &|_| {}, &Cancel::never(), limits).unwrap();
            assert_eq!(counts(&r), (entries, entries, 0), "{name}: {r:?}");
        }
    }

    fn mode_of(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().mode() & PERM_BITS
    }

    fn gid_of(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().gid()
    }

    fn set_mode(p: &Path, mode: u32) {
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// The fixture tree; returns how many entries the walk must visit.
    /// `outside` is a file outside the tree, `mnt` gets a tmpfs mounted by the caller.
    fn build_tree(root: &Path, outside: &Path) -> u64 {
        set_mode(root, 0o755);
        fs::write(root.join("file"), b"x").unwrap();
        set_mode(&root.join("file"), 0o644);
        fs::write(root.join("private"), b"x").unwrap();
        set_mode(&root.join("private"), 0o600);
        fs::write(root.join("suid"), b"x").unwrap();
        set_mode(&root.join("suid"), 0o4755);
        fs::write(root.join("sgid"), b"x").unwrap();
        set_mode(&root.join("sgid"), 0o2750);
        fs::create_dir(root.join("dir")).unwrap();
        set_mode(&root.join("dir"), 0o700);
        fs::create_dir_all(root.join("dir/nested/deep")).unwrap();
        fs::write(root.join("dir/nested/deep/f"), b"x").unwrap();
        fs::write(root.join("dir/nested/owned"), b"x").unwrap();
        lchown(root.join("dir/nested/owned"), Some(1000), None).unwrap();
        symlink(outside, root.join("link")).unwrap();
        symlink("dir", root.join("dirlink")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("fifo"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        fs::create_dir(root.join("mnt")).unwrap();
        // root file private suid sgid dir nested deep f owned link dirlink fifo
        13
    }

    /// Detaches a test mount even when an assertion fails first.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }

    fn mount_tmpfs(p: &Path) {
        rustix::mount::mount(
            "tmpfs",
            p,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            c"mode=0700",
        )
        .unwrap();
        fs::write(p.join("inner"), b"x").unwrap();
        set_mode(&p.join("inner"), 0o600);
    }

    fn check_tree(root: &Path) {
        let outside = root.parent().unwrap().join("outside");
        fs::write(&outside, b"secret").unwrap();
        set_mode(&outside, 0o600);
        let want_visited = build_tree(root, &outside);
        mount_tmpfs(&root.join("mnt"));
        let _guard = Unmount(root.join("mnt"));

        let r = apply(root, GID, Policy::Always, false).unwrap();
        assert!(!r.skipped);
        assert_eq!(counts(&r), (want_visited, want_visited, 0), "{r:?}");
        assert_eq!(
            (r.mounts_skipped, r.skipped_mount_points.clone()),
            (1, vec![PathBuf::from("mnt")]),
            "the mount point is counted and named"
        );

        let expect: &[(&str, u32)] = &[
            ("", 0o2775),
            ("file", 0o664),
            ("private", 0o660),
            ("suid", 0o4775),
            ("sgid", 0o2770),
            ("dir", 0o2770),
            ("dir/nested", 0o2775),
            ("dir/nested/deep", 0o2775),
            ("dir/nested/deep/f", 0o664),
            ("fifo", 0o660),
        ];
        for (rel, mode) in expect {
            let p = root.join(rel);
            assert_eq!(mode_of(&p), *mode, "mode of {rel:?}: {:o}", mode_of(&p));
            assert_eq!(gid_of(&p), GID, "gid of {rel:?}");
        }
        let owned = fs::symlink_metadata(root.join("dir/nested/owned")).unwrap();
        assert_eq!((owned.uid(), owned.gid()), (1000, GID), "uid untouched");
        assert_eq!(
            gid_of(&root.join("link")),
            GID,
            "the symlink itself is lchown'ed"
        );
        assert_eq!(gid_of(&root.join("dirlink")), GID);
        assert_eq!(
            (mode_of(&outside), gid_of(&outside)),
            (0o600, 0),
            "the symlink's target is untouched"
        );
        // The submount: neither its root nor its content.
        let mnt = root.join("mnt");
        assert_eq!((mode_of(&mnt), gid_of(&mnt)), (0o700, 0));
        assert_eq!(
            (mode_of(&mnt.join("inner")), gid_of(&mnt.join("inner"))),
            (0o600, 0)
        );

        // Again: only reads.
        let r2 = apply(root, GID, Policy::Always, false).unwrap();
        assert_eq!(
            (r2.visited, r2.changed, r2.errors),
            (want_visited, 0, 0),
            "{r2:?}"
        );

        // OnRootMismatch: the root is right now.
        let r3 = apply(root, GID, Policy::OnRootMismatch, false).unwrap();
        assert!(r3.skipped);
        assert_eq!((r3.visited, r3.changed), (0, 0));
        // A wrong file below does not matter to OnRootMismatch…
        set_mode(&root.join("file"), 0o600);
        assert!(
            apply(root, GID, Policy::OnRootMismatch, false)
                .unwrap()
                .skipped
        );
        assert_eq!(mode_of(&root.join("file")), 0o600);
        // …but a root without setgid makes it walk.
        set_mode(root, 0o775);
        let r4 = apply(root, GID, Policy::OnRootMismatch, false).unwrap();
        assert!(!r4.skipped);
        assert_eq!((r4.visited, r4.changed), (want_visited, 2), "{r4:?}");
        assert_eq!(mode_of(&root.join("file")), 0o660);
        assert_eq!(mode_of(root), 0o2775);
        // A different group: walk, everything changes.
        let r5 = apply(root, GID + 1, Policy::OnRootMismatch, false).unwrap();
        assert_eq!((r5.visited, r5.changed), (want_visited, want_visited));
        assert_eq!(
            mode_of(&root.join("suid")),
            0o4775,
            "setuid survives a chown"
        );
        assert_eq!(
            mode_of(&root.join("sgid")),
            0o2770,
            "setgid survives a chown"
        );
        // The read-only mask: 0550 suffices then.
        set_mode(root, 0o2550);
        assert!(
            apply(root, GID + 1, Policy::OnRootMismatch, true)
                .unwrap()
                .skipped
        );
        assert!(
            !apply(root, GID + 1, Policy::OnRootMismatch, false)
                .unwrap()
                .skipped
        );
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn walks_a_tmpdir() {
        needs::root();
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("vol");
        fs::create_dir(&root).unwrap();
        check_tree(&root);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn walks_a_loop_ext4() {
        needs::loop_devices();
        let disk = LoopDisk::new(64, Some("ext4"));
        let mnt = Mounted::new(&disk.device, "ext4", "");
        let root = mnt.path.join("vol");
        fs::create_dir(&root).unwrap();
        check_tree(&root);
        // And the mount's own root, with lost+found.
        let r = apply(&mnt.path, GID, Policy::Always, false).unwrap();
        assert_eq!(r.errors, 0);
        assert_eq!(gid_of(&mnt.path.join("lost+found")), GID);
        assert_eq!(mode_of(&mnt.path.join("lost+found")), 0o2770);
    }

    /// A file bind-mounted over `p` (an existing file), detached on drop.
    fn bind_file(from: &Path, p: &Path) -> Unmount {
        rustix::mount::mount_bind(from, p).unwrap();
        Unmount(p.to_path_buf())
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn mount_points_not_entered_are_counted_and_named_and_keep_their_group() {
        needs::root();
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("vol");
        // Nested, a file mounted over an entry, and more than NAMED in all.
        fs::create_dir_all(root.join("a/b/deep")).unwrap();
        mount_tmpfs(&root.join("a/b/deep"));
        let mut guards = vec![Unmount(root.join("a/b/deep"))];
        fs::write(d.path().join("other"), b"x").unwrap();
        fs::write(root.join("a/over"), b"x").unwrap();
        guards.push(bind_file(&d.path().join("other"), &root.join("a/over")));
        let many = NAMED + 4;
        for i in 0..many {
            let m = root.join(format!("m{i:02}"));
            fs::create_dir(&m).unwrap();
            mount_tmpfs(&m);
            guards.push(Unmount(m));
        }
        let total = many as u64 + 2;
        for limits in [
            Limits::for_this_machine(),
            // The subtree walked alone past the fd budget finds them too.
            Limits {
                dir_fds: 0,
                ..Limits::for_this_machine()
            },
        ] {
            let (r, _) = walk_in(&root, Duration::MAX, &|_| {}, &Cancel::never(), limits).unwrap();
            // vol a b: the mount points and their content are not visited.
            assert_eq!(r.visited, 3, "{r:?}");
            assert_eq!(r.mounts_skipped, total, "all are counted: {r:?}");
            let names = &r.skipped_mount_points;
            assert_eq!(names.len(), NAMED, "{names:?}");
            let mut sorted = names.clone();
            sorted.sort();
            assert_eq!(&sorted, names, "sorted");
            for n in names {
                let rel = n.to_str().unwrap();
                let ok = rel == "a/b/deep"
                    || rel == "a/over"
                    || (rel.len() == 3 && rel.starts_with('m'));
                assert!(ok, "relative to the root: {rel:?} in {names:?}");
            }
            // Below the mount points, the files kept their group.
            assert_eq!(gid_of(&root.join("a/b")), GID);
            assert_eq!(gid_of(&root.join("a/b/deep/inner")), 0);
            assert_eq!(gid_of(&root.join("a/b/deep")), 0);
            assert_eq!(gid_of(&root.join("a/over")), 0);
            assert_eq!(gid_of(&root.join("m00/inner")), 0);
        }
        // With 16 or fewer, every one is named.
        drop(guards.split_off(4));
        let (r, _) = walk_in(
            &root,
            Duration::MAX,
            &|_| {},
            &Cancel::never(),
            Limits::for_this_machine(),
        )
        .unwrap();
        assert_eq!(r.mounts_skipped, 4, "{r:?}");
        let names: Vec<&str> = r
            .skipped_mount_points
            .iter()
            .map(|p| p.to_str().unwrap())
            .collect();
        assert_eq!(names, ["a/b/deep", "a/over", "m00", "m01"]);
    }

    #[test]
    fn refuses_a_file_root() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("f");
        fs::write(&f, b"").unwrap();
        let e = apply(&f, GID, Policy::Always, false).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        let e = apply(&d.path().join("missing"), GID, Policy::Always, false).unwrap_err();
        assert_eq!(e.code(), Code::Internal);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn splits_a_big_directory_into_batches() {
        needs::root();
        let d = tempfile::tempdir().unwrap();
        let n = BATCH * 4 + 17;
        for i in 0..n {
            fs::write(d.path().join(format!("f{i}")), b"").unwrap();
            set_mode(&d.path().join(format!("f{i}")), 0o640);
        }
        let r = apply(d.path(), GID, Policy::Always, false).unwrap();
        assert_eq!(counts(&r), (n as u64 + 1, n as u64 + 1, 0));
        for i in 0..n {
            let p = d.path().join(format!("f{i}"));
            assert_eq!((gid_of(&p), mode_of(&p)), (GID, 0o660), "f{i}");
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn reports_progress_without_changing_the_result() {
        needs::root();
        let d = tempfile::tempdir().unwrap();
        let (a, b) = twins(d.path(), |t| bench_tree(t, 5000));
        let every = Duration::from_millis(1);
        let calls = Mutex::new(Vec::new());
        let record = |p: &Report| calls.lock().unwrap().push(p.clone());
        let r = run(&Walk {
            open_at: &a,
            shown: &a,
            gid: GID,
            policy: Policy::Always,
            read_only: false,
            every,
            progress: &record,
            cancel: &Cancel::never(),
        })
        .unwrap();
        let plain = apply(&b, GID, Policy::Always, false).unwrap();
        assert_eq!(
            (r.skipped, r.visited, r.changed, r.errors),
            (plain.skipped, plain.visited, plain.changed, plain.errors)
        );
        // The root, d0..d9, and the 5000 below them.
        assert_eq!(counts(&r), (5011, 5011, 0), "{r:?}");
        assert_eq!(snapshot(&a), snapshot(&b));

        let calls = calls.into_inner().unwrap();
        assert!(!calls.is_empty(), "no progress during {:?}", r.duration);
        // At most one call per period.
        let periods = r.duration.as_nanos() / every.as_nanos();
        assert!(
            calls.len() as u128 <= periods,
            "{} calls in {:?}",
            calls.len(),
            r.duration
        );
        for c in &calls {
            assert!(!c.skipped);
            assert!(c.duration >= every, "{c:?}");
            assert!(c.visited > 0 && c.visited <= r.visited, "{c:?}");
            assert!(c.changed <= c.visited && c.errors == 0, "{c:?}");
        }
        for w in calls.windows(2) {
            assert!(
                w[0].visited <= w[1].visited
                    && w[0].changed <= w[1].changed
                    && w[0].duration + every <= w[1].duration,
                "{:?} then {:?}",
                w[0],
                w[1]
            );
        }
        let (first, last) = (&calls[0], &calls[calls.len() - 1]);
        if calls.len() > 1 {
            assert!(last.visited > first.visited, "{first:?} … {last:?}");
        }
    }

    /// Two trees `a` and `b` in `dir`, each made by `make`.
    fn twins(dir: &Path, make: impl Fn(&Path)) -> (PathBuf, PathBuf) {
        let (a, b) = (dir.join("a"), dir.join("b"));
        for t in [&a, &b] {
            fs::create_dir(t).unwrap();
            make(t);
        }
        (a, b)
    }

    /// A small deterministic pseudo-random generator (no rand crate).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// A random tree of files, dirs and symlinks with assorted modes and groups.
    fn random_tree(root: &Path, seed: u64, entries: usize) {
        let mut rng = Lcg(seed);
        let mut dirs = vec![root.to_path_buf()];
        const MODES: [u32; 8] = [0o600, 0o644, 0o755, 0o700, 0o4755, 0o2711, 0o1777, 0o000];
        for i in 0..entries {
            let parent = dirs[rng.next(dirs.len() as u64) as usize].clone();
            let p = parent.join(format!("e{i}"));
            match rng.next(10) {
                0..=2 => {
                    fs::create_dir(&p).unwrap();
                    dirs.push(p.clone());
                }
                3 => {
                    symlink(format!("../e{}", rng.next(entries as u64)), &p).unwrap();
                    continue;
                }
                _ => fs::write(&p, b"x").unwrap(),
            }
            let mode = MODES[rng.next(8) as usize];
            let gid = [0, GID, 77][rng.next(3) as usize];
            lchown(&p, None, Some(gid)).unwrap();
            set_mode(&p, mode);
        }
    }

    /// kubelet's walk, serially, by path (the reference semantics).
    fn reference_walk(p: &Path, gid: u32) {
        let md = fs::symlink_metadata(p).unwrap();
        lchown(p, None, Some(gid)).unwrap();
        if md.file_type().is_symlink() {
            return;
        }
        let mut mode = md.mode() & PERM_BITS | RW;
        if md.is_dir() {
            mode |= X | S_ISGID;
        }
        set_mode(p, mode);
        if md.is_dir() {
            let mut names: Vec<_> = fs::read_dir(p)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            names.sort();
            for n in names {
                reference_walk(&n, gid);
            }
        }
    }

    fn snapshot(root: &Path) -> Vec<(PathBuf, u32, u32, u32)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(p) = stack.pop() {
            let md = fs::symlink_metadata(&p).unwrap();
            let mode = if md.file_type().is_symlink() {
                0
            } else {
                md.mode() & PERM_BITS
            };
            out.push((
                p.strip_prefix(root).unwrap().to_path_buf(),
                mode,
                md.uid(),
                md.gid(),
            ));
            if md.is_dir() {
                stack.extend(fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
            }
        }
        out.sort();
        out
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn parallel_walk_matches_the_serial_reference() {
        needs::root();
        let d = tempfile::tempdir().unwrap();
        let (a, b) = twins(d.path(), |t| random_tree(t, 7, 600));
        assert_eq!(snapshot(&a), snapshot(&b));
        let before = snapshot(&a);
        let r = apply(&a, GID, Policy::Always, false).unwrap();
        reference_walk(&b, GID);
        let after = snapshot(&a);
        assert_eq!(after, snapshot(&b));
        assert_eq!(r.visited, 601);
        assert_eq!(r.errors, 0);
        let differ = before.iter().zip(&after).filter(|(x, y)| x != y).count() as u64;
        assert_eq!(
            r.changed, differ,
            "changed counts exactly the entries that changed"
        );
        assert_eq!(apply(&a, GID, Policy::Always, false).unwrap().changed, 0);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn the_walk_before_fchmodat2_matches_the_serial_reference() {
        needs::root();
        // What the walk does on the 6.1 guest. (Once set, other tests' walks
        // in this process take that way too, which is just as right.)
        NO_FCHMODAT2.store(true, Ordering::Relaxed);
        let d = Tmpfs::new();
        let (a, b) = twins(d.path(), |t| random_tree(t, 11, 600));
        let before = snapshot(&a);
        let r = apply(&a, GID, Policy::Always, false).unwrap();
        reference_walk(&b, GID);
        let after = snapshot(&a);
        assert_eq!(after, snapshot(&b));
        assert_eq!((r.visited, r.errors), (601, 0));
        let differ = before.iter().zip(&after).filter(|(x, y)| x != y).count() as u64;
        assert_eq!(r.changed, differ);
    }

    /// Directories of 100 files (mode 0644) each, `entries` in all.
    fn bench_tree(root: &Path, entries: usize) {
        let mut n = 0;
        let mut d = 0;
        while n < entries {
            let dir = root.join(format!("d{}/s{d}", d % 10));
            fs::create_dir_all(&dir).unwrap();
            n += 1;
            for f in 0..100.min(entries - n) {
                fs::write(dir.join(format!("f{f}")), b"").unwrap();
                n += 1;
            }
            d += 1;
        }
    }

    /// Parallel walk against the serial kubelet-style walk on a loop ext4.
    /// `CRUST_BENCH_ENTRIES=100000 cargo test --release --lib ownership::walk::tests::bench -- --ignored --nocapture`
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn bench_against_serial_kubelet_walk() {
        needs::loop_devices();
        let entries: usize = std::env::var("CRUST_BENCH_ENTRIES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000);
        let inodes = (entries * 2 + 10_000).to_string();
        let disk = LoopDisk::with_mkfs(2 << 10, Some("ext4"), &["-N", &inodes]);
        let mnt = Mounted::new(&disk.device, "ext4", "");
        let (a, b) = twins(&mnt.path, |t| bench_tree(t, entries));
        rustix::fs::sync();

        let cpu = || {
            let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
            Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
        };
        let (t, c) = (Instant::now(), cpu());
        reference_walk(&a, GID);
        let serial_fresh = t.elapsed();
        let serial_cpu = cpu() - c;
        let c = cpu();
        let r = apply(&b, GID, Policy::Always, false).unwrap();
        let parallel_fresh = r.duration;
        eprintln!(
            "fresh: CPU time serial {serial_cpu:?}, parallel {:?}",
            cpu() - c
        );
        assert_eq!(r.changed, r.visited);

        let t = Instant::now();
        reference_walk(&a, GID);
        let serial_again = t.elapsed();
        let r2 = apply(&b, GID, Policy::Always, false).unwrap();
        assert_eq!(r2.changed, 0);
        let r3 = apply(&b, GID, Policy::OnRootMismatch, false).unwrap();
        assert!(r3.skipped);
        eprintln!(
            "{} entries, {} workers: fresh serial {:?} parallel {:?} ({:.2}x); correct serial {:?} parallel {:?} ({:.2}x); OnRootMismatch {:?}",
            r.visited,
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            serial_fresh,
            parallel_fresh,
            serial_fresh.as_secs_f64() / parallel_fresh.as_secs_f64(),
            serial_again,
            r2.duration,
            serial_again.as_secs_f64() / r2.duration.as_secs_f64(),
            r3.duration
        );
    }

    /// A tmpfs of the test's own: fds into it can be told from the fds of
    /// the tests running alongside in this process.
    struct Tmpfs {
        dir: tempfile::TempDir,
        dev: u64,
    }

    impl Tmpfs {
        fn new() -> Tmpfs {
            let dir = tempfile::tempdir().unwrap();
            rustix::mount::mount(
                "tmpfs",
                dir.path(),
                "tmpfs",
                rustix::mount::MountFlags::empty(),
                c"mode=0755,nr_inodes=0",
            )
            .unwrap();
            let dev = rustix::fs::stat(dir.path()).unwrap().st_dev;
            Tmpfs { dir, dev }
        }

        /// A tmpfs with an empty directory `vol` on it, a volume's root.
        fn with_vol() -> (Tmpfs, PathBuf) {
            let t = Tmpfs::new();
            let root = t.path().join("vol");
            fs::create_dir(&root).unwrap();
            (t, root)
        }

        fn path(&self) -> &Path {
            self.dir.path()
        }
    }

    /// A walk's counts: (visited, changed, errors).
    fn counts(r: &Report) -> (u64, u64, u64) {
        (r.visited, r.changed, r.errors)
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(self.dir.path(), rustix::mount::UnmountFlags::DETACH);
        }
    }

    /// How many of this process's fds are open on filesystem `dev`.
    fn fds_on(dev: u64) -> usize {
        fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| rustix::fs::stat(e.ok()?.path()).ok())
            .filter(|st| st.st_dev == dev)
            .count()
    }

    fn open_dir(p: &Path) -> OwnedFd {
        rustix::fs::open(p, OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap()
    }

    /// `levels` nested directories `name` below `root`, built by fd (the
    /// paths outgrow PATH_MAX). Each level (the root included) also holds a
    /// file `f` (0600) and, for a comb, an empty directory `s` (0700), so
    /// that every level has a pending sibling while the walk goes deeper.
    /// Returns the entries below and including `root`.
    fn deep_tree(root: &Path, levels: usize, name: &CStr, comb: bool) -> u64 {
        let mut dir = open_dir(root);
        for _ in 0..levels {
            rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o755)).unwrap();
            let flags = OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC;
            drop(rustix::fs::openat(&dir, c"f", flags, Mode::from_raw_mode(0o600)).unwrap());
            if comb {
                rustix::fs::mkdirat(&dir, c"s", Mode::from_raw_mode(0o700)).unwrap();
            }
            dir = rustix::fs::openat(
                &dir,
                name,
                OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .unwrap();
        }
        1 + levels as u64 * if comb { 3 } else { 2 }
    }

    /// The names of the subdirectories of `dir`, in the order it lists them.
    fn listed_subdirs(dir: &OwnedFd) -> Vec<std::ffi::CString> {
        rustix::fs::Dir::read_from(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_type() == FileType::Directory && e.file_name().to_bytes()[0] != b'.')
            .map(|e| e.file_name().to_owned())
            .collect()
    }

    /// One level of `comb_holding_fds` in `dir`: an empty sibling and the
    /// next level, named and made in an order that lists the next level
    /// last. Returns its name; `newest_first` says which order worked, to
    /// try it first at the next level.
    fn comb_level(dir: &OwnedFd, newest_first: &mut bool) -> std::ffi::CString {
        let mk = |n: &CStr| rustix::fs::mkdirat(dir, n, Mode::from_raw_mode(0o755)).unwrap();
        let rm = |n: &CStr| rustix::fs::unlinkat(dir, n, AtFlags::REMOVEDIR).unwrap();
        let name = |s: String| std::ffi::CString::new(s).unwrap();
        for newest in [*newest_first, !*newest_first] {
            *newest_first = newest;
            if newest {
                // Listed newest first: the next level, then a sibling.
                let next = name("d".into());
                mk(&next);
                for k in 0..64 {
                    let sibling = name(format!("s{k}"));
                    mk(&sibling);
                    if listed_subdirs(dir).last() == Some(&next) {
                        return next;
                    }
                    rm(&sibling);
                }
                rm(&next);
            } else {
                // In creation order, or hashed: the sibling, then names for
                // the next level until one is listed last.
                mk(c"s");
                for k in 0..64 {
                    let next = name(format!("d{k}"));
                    mk(&next);
                    if listed_subdirs(dir).last() == Some(&next) {
                        return next;
                    }
                    rm(&next);
                }
                rm(c"s");
            }
        }
        panic!("this filesystem lists no name after another");
    }

    /// A comb `levels` deep that makes a walk hold one fd per level unless
    /// it bounds them: each level has an empty sibling directory and the
    /// next level, which is listed last — so the walk takes it first (LIFO)
    /// and leaves the sibling pending, holding the level open — whatever the
    /// filesystem's listing order. Returns the entries below and including `root`.
    fn comb_holding_fds(root: &Path, levels: usize) -> u64 {
        let mut dir = open_dir(root);
        let mut newest_first = false;
        for _ in 0..levels {
            let next = comb_level(&dir, &mut newest_first);
            dir = rustix::fs::openat(
                &dir,
                &next,
                OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .unwrap();
        }
        1 + 2 * levels as u64
    }

    /// Every entry below and including `root`, read back by fd (any depth):
    /// how many there are, and the first few not right for fsGroup `gid`.
    fn read_back(root: &Path, gid: u32) -> (u64, Vec<String>) {
        let mut n = 0;
        let mut bad = Vec::new();
        let mut check = |what: String, st: &rustix::fs::Stat| {
            n += 1;
            let kind = FileType::from_raw_mode(st.st_mode);
            let mode = st.st_mode & PERM_BITS;
            let ok = st.st_gid == gid
                && match kind {
                    FileType::Symlink => true,
                    FileType::Directory => mode & 0o2770 == 0o2770,
                    _ => mode & 0o660 == 0o660,
                };
            if !ok && bad.len() < 5 {
                bad.push(format!("{what}: gid {} mode {mode:o}", st.st_gid));
            }
        };
        let top = open_dir(root);
        check("root".into(), &rustix::fs::fstat(&top).unwrap());
        // Depth first by fd: (directory, its depth).
        let mut stack = vec![(top, 0u64)];
        while let Some((dir, depth)) = stack.pop() {
            let mut subdirs = Vec::new();
            for e in rustix::fs::Dir::read_from(&dir).unwrap() {
                let e = e.unwrap();
                let name = e.file_name().to_owned();
                if name.as_bytes() == b"." || name.as_bytes() == b".." {
                    continue;
                }
                let st = rustix::fs::statat(&dir, &name, AtFlags::SYMLINK_NOFOLLOW).unwrap();
                check(format!("{name:?} at depth {}", depth + 1), &st);
                if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                    subdirs.push(name);
                }
            }
            for name in subdirs {
                let sub = rustix::fs::openat(
                    &dir,
                    &name,
                    OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .unwrap();
                stack.push((sub, depth + 1));
            }
        }
        (n, bad)
    }

    /// `walk` with a progress call every `every`, which records the most fds
    /// open on `dev` at any of them (`None`: all fds of the process, which
    /// is cheaper to count and, with other tests running, only more).
    fn walk_counting_fds(
        root: &Path,
        dev: Option<u64>,
        limits: Limits,
        every: Duration,
    ) -> (Report, usize) {
        let most = AtomicUsize::new(0);
        let count = |_: &Report| {
            let n = match dev {
                Some(dev) => fds_on(dev),
                None => fs::read_dir("/proc/self/fd").unwrap().count(),
            };
            most.fetch_max(n, Ordering::Relaxed);
        };
        let (r, _) = walk_in(root, every, &count, &Cancel::never(), limits).unwrap();
        (r, most.into_inner())
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn depth_and_path_length_do_not_matter() {
        needs::root();
        let (t, root) = Tmpfs::with_vol();
        // 3,000 levels of "dir/": paths of 12,000 bytes, three times PATH_MAX.
        let entries = deep_tree(&root, 3000, c"dir", false);
        let limits = Limits::for_this_machine();
        let (r, most) = walk_counting_fds(&root, Some(t.dev), limits, Duration::ZERO);
        assert_eq!(counts(&r), (entries, entries, 0), "{r:?}");
        let (n, bad) = read_back(&root, GID);
        assert_eq!((n, bad), (entries, vec![]));
        // A pure chain holds O(1) fds however deep it is: per worker, the
        // directory it lists, the child it opens, and (before Linux 6.6) an
        // entry pinned for chmod; none once done.
        assert!(
            most <= 3 * limits.workers,
            "{most} fds open at once on a chain with {} workers",
            limits.workers
        );
        assert_eq!(fds_on(t.dev), 0);
        // Again: only reads.
        let r = apply(&root, GID, Policy::Always, false).unwrap();
        assert_eq!(counts(&r), (entries, 0, 0), "{r:?}");
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_deep_comb_stays_within_the_fd_budget() {
        needs::root();
        let (t, root) = Tmpfs::with_vol();
        let entries = comb_holding_fds(&root, 1500);
        // Without the budget the comb costs an fd per level (one worker: no
        // other takes the pending siblings meanwhile)…
        let one = Limits {
            workers: 1,
            helpers: 64,
            dir_fds: usize::MAX,
        };
        let (r, most) = walk_counting_fds(&root, None, one, Duration::from_millis(2));
        assert_eq!(counts(&r), (entries, entries, 0), "{r:?}");
        assert!(
            most > 500,
            "only {most} fds open at once without the budget"
        );
        assert_eq!(fds_on(t.dev), 0);
        // …with it, the budget plus what each worker may hold on its own: the
        // directory at hand, its child, and the top of a subtree walked alone
        // or a directory it is listing, and an entry pinned for chmod.
        for workers in [1, 4] {
            let limits = Limits {
                workers,
                dir_fds: 8,
                ..one
            };
            let (r, most) = walk_counting_fds(&root, Some(t.dev), limits, Duration::ZERO);
            assert_eq!((r.visited, r.errors), (entries, 0), "{r:?}");
            assert!(
                most <= 8 + 4 * workers,
                "{most} fds open at once, {workers} workers"
            );
            assert_eq!(fds_on(t.dev), 0);
        }
        assert_eq!(read_back(&root, GID), (entries, vec![]));
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_directory_moved_during_a_lone_walk_is_found_again() {
        needs::root();
        let (_t, root) = Tmpfs::with_vol();
        let entries = deep_tree(&root, 60, c"d", true);
        // A budget of 0: the root's subtree is walked alone, depth first,
        // going back up by "..", one progress call per directory.
        let limits = Limits {
            workers: 2,
            helpers: 64,
            dir_fds: 0,
        };
        let calls = AtomicUsize::new(0);
        let mover = |_: &Report| {
            // Well below level 3 by now: move level 3 (and all below it)
            // to the root, so ".." from level 3 leads to the root, not level 2.
            if calls.fetch_add(1, Ordering::Relaxed) == 40 {
                fs::rename(root.join("d/d/d"), root.join("moved")).unwrap();
            }
        };
        let (r, _) = walk_in(&root, Duration::ZERO, &mover, &Cancel::never(), limits).unwrap();
        assert!(calls.load(Ordering::Relaxed) > 40);
        assert!(root.join("moved").is_dir());
        // Nothing lost: the moved subtree was walked through its fds, the
        // rest found again by name from the top.
        assert_eq!(counts(&r), (entries, entries, 0), "{r:?}");
        let (n, bad) = read_back(&root, GID);
        assert_eq!((n, bad), (entries, vec![]));
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_directory_swapped_for_a_symlink_is_not_followed() {
        needs::root();
        let t = Tmpfs::new();
        let root = t.path().join("vol");
        let outside = t.path().join("outside");
        for d in [&root, &outside, &root.join("a"), &root.join("b")] {
            fs::create_dir(d).unwrap();
            set_mode(d, 0o700);
        }
        fs::write(outside.join("secret"), b"x").unwrap();
        set_mode(&outside.join("secret"), 0o600);
        // One worker: the root is listed first, then its subdirectories are
        // opened from its fd. In between, both become symlinks to outside.
        let one = Limits {
            workers: 1,
            helpers: 0,
            dir_fds: DIR_FD_BUDGET,
        };
        let calls = AtomicUsize::new(0);
        let swap = |_: &Report| {
            if calls.fetch_add(1, Ordering::Relaxed) == 0 {
                for d in ["a", "b"] {
                    fs::rename(root.join(d), t.path().join(format!("{d}-moved"))).unwrap();
                    symlink(&outside, root.join(d)).unwrap();
                }
            }
        };
        let (r, _) = walk_in(&root, Duration::ZERO, &swap, &Cancel::never(), one).unwrap();
        // The root changed; a and b were refused (ELOOP), each an error.
        assert_eq!(counts(&r), (1, 1, 2), "{r:?}");
        for p in [&outside, &outside.join("secret")] {
            assert_eq!(gid_of(p), 0, "{p:?} outside the volume was changed");
        }
        assert_eq!(mode_of(&outside), 0o700);
        assert_eq!(mode_of(&outside.join("secret")), 0o600);
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn stops_within_a_second_of_a_token_firing() {
        needs::root();
        let t = Tmpfs::new();
        let wide = t.path().join("wide");
        let comb = t.path().join("comb");
        fs::create_dir(&wide).unwrap();
        fs::create_dir(&comb).unwrap();
        bench_tree(&wide, 30_000);
        let comb_entries = deep_tree(&comb, 2000, c"d", true);
        let lone = Limits {
            dir_fds: 0,
            ..Limits::for_this_machine()
        };
        for (root, total, limits) in [
            (&wide, 30_011, Limits::for_this_machine()),
            (&comb, comb_entries, lone),
        ] {
            let token = Token::new(Why::Shutdown);
            let cancel = Cancel::never().with_token(&token);
            let fired = Mutex::new(None);
            // Fire on the first progress call: the walk is under way then.
            let fire = |_: &Report| {
                let mut f = fired.lock().unwrap();
                if f.is_none() {
                    token.fire();
                    *f = Some(Instant::now());
                }
            };
            let every = Duration::from_millis(2);
            let e = walk_in(root, every, &fire, &cancel, limits).unwrap_err();
            let after = fired.lock().unwrap().expect("fired").elapsed();
            assert!(
                after < Duration::from_secs(1),
                "stopped {after:?} after the token fired"
            );
            let Error::Stopped(s) = &e else {
                panic!("not stopped: {e}")
            };
            assert_eq!(s.why, Why::Shutdown);
            assert_eq!(e.code(), Code::FailedPrecondition);
            assert!(e.to_string().contains("keep their new group"), "{e}");
            // What was changed stays changed; the rest was left alone.
            let (n, bad) = read_back(root, GID);
            assert_eq!(n, total);
            let right = n - bad.len() as u64;
            assert!(!bad.is_empty(), "the walk finished before it was stopped");
            assert!(right > 0 || gid_of(root) == GID, "nothing changed");
            // A retry completes it.
            let r = apply(root, GID, Policy::Always, false).unwrap();
            assert_eq!((r.visited, r.errors), (total, 0));
            assert_eq!(read_back(root, GID), (total, vec![]));
        }
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn helper_threads_are_capped_across_walks() {
        needs::root();
        let d = Tmpfs::new();
        let (a, b) = twins(d.path(), |t| bench_tree(t, 3000));
        let limits = Limits {
            workers: 4,
            helpers: 4,
            dir_fds: DIR_FD_BUDGET,
        };
        // Walk A holds its helpers (its first progress call waits) until walk
        // B is done: B gets only what is left of the cap of 4 helpers.
        let b_done = (Mutex::new(false), Condvar::new());
        let wait_for_b = |_: &Report| {
            let mut done = b_done.0.lock().unwrap();
            while !*done {
                done = b_done.1.wait(done).unwrap();
            }
        };
        let (ra, rb) = std::thread::scope(|s| {
            let ta = s.spawn(|| {
                walk_in(&a, Duration::ZERO, &wait_for_b, &Cancel::never(), limits).unwrap()
            });
            // B starts once A is under way (has made its first progress call).
            while HELPERS.load(Ordering::Relaxed) == 0 && !ta.is_finished() {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(20));
            let rb = walk_in(&b, Duration::MAX, &|_| {}, &Cancel::never(), limits).unwrap();
            *b_done.0.lock().unwrap() = true;
            b_done.1.notify_all();
            (ta.join().unwrap(), rb)
        });
        let (helpers_a, helpers_b) = (ra.1 - 1, rb.1 - 1);
        assert!(
            helpers_a + helpers_b <= 4,
            "{helpers_a} + {helpers_b} helpers"
        );
        for (t, r) in [(&a, &ra.0), (&b, &rb.0)] {
            assert_eq!((r.visited, r.errors), (3011, 0), "{r:?}");
            assert_eq!(read_back(t, GID), (3011, vec![]));
        }
        // No helper free at all: the walk runs on its caller's thread alone.
        let none = Limits {
            helpers: 0,
            ..limits
        };
        let c = d.path().join("c");
        fs::create_dir(&c).unwrap();
        bench_tree(&c, 1000);
        let (r, threads) = walk_in(&c, Duration::MAX, &|_| {}, &Cancel::never(), none).unwrap();
        assert_eq!((threads, r.visited, r.errors), (1, 1011, 0));
        assert_eq!(read_back(&c, GID), (1011, vec![]));
    }

    /// The part of `fails_clearly_when_out_of_fds` run in its child process,
    /// with a small RLIMIT_NOFILE that must not hit the tests running alongside.
    fn out_of_fds_in_child(root: PathBuf) {
        let open_now = fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        let lim = rustix::process::Rlimit {
            current: Some(open_now + 20),
            maximum: rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum,
        };
        rustix::process::setrlimit(rustix::process::Resource::Nofile, lim).unwrap();
        // A budget far above the limit: the comb needs one fd per level.
        let limits = Limits {
            workers: 1,
            helpers: 0,
            dir_fds: 100_000,
        };
        let e = walk_in(&root, Duration::MAX, &|_| {}, &Cancel::never(), limits).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        println!("CHILD-ERROR: {e}");
    }

    #[test]
    fn fails_clearly_when_out_of_fds() {
        if crust_testkit::child::is_child() {
            let root = std::env::var_os("CRUST_OUT_OF_FDS_ROOT").unwrap();
            out_of_fds_in_child(PathBuf::from(root));
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("vol");
        fs::create_dir(&root).unwrap();
        comb_holding_fds(&root, 200);
        let (passed, stdout) = crust_testkit::child::rerun(&[("CRUST_OUT_OF_FDS_ROOT", &root)]);
        assert!(passed, "{stdout}");
        let line = stdout
            .lines()
            .find(|l| l.starts_with("CHILD-ERROR: "))
            .unwrap_or_else(|| panic!("the child did not run: {stdout}"));
        assert!(line.contains("ran out of file descriptors"), "{line}");
        assert!(line.contains("/vol/d"), "names the directory: {line}");
    }
}

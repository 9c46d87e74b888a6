//! The scene of the attack and chaos tests: an agent process whose root lives
//! in a scratch directory, a sentinel tree beside that root which nothing may
//! touch, and the one invariant that must hold whenever the agent is idle.
//! Teardown kills the agent and detaches every mount beneath the scratch
//! directory, so a failed test leaves nothing behind for the next one.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{agent_bin, ctx, pb, publish_req, run, unpublish_req, LoopDisk};
use crust_agent::validate::{FREEZES_DIR, STATE_DIR};
use crust_protocols::crust_ttrpc::AgentClient;

/// One line of the mount table, as the procfs crate reads it.
pub type Mount = procfs::process::MountInfo;

/// This process's mount table (the agent runs in the same mount namespace).
/// Read as bytes, line by line: a mount whose path is not UTF-8 (a test
/// makes some, in a mount namespace of its own) is kept, its name decoded
/// lossily, instead of failing the whole table as procfs's reader does.
pub fn mount_table() -> Vec<Mount> {
    let text = std::fs::read("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    text.split(|&c| c == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| Mount::from_line(&String::from_utf8_lossy(l)).expect("a mountinfo line"))
        .collect()
}

/// "major:minor" of a block device node, as mountinfo spells it.
pub fn majmin(device: &Path) -> String {
    let st = rustix::fs::stat(device).unwrap_or_else(|e| panic!("stat {}: {e}", device.display()));
    format!(
        "{}:{}",
        rustix::fs::major(st.st_rdev),
        rustix::fs::minor(st.st_rdev)
    )
}

/// "major:minor" of the disk a mount is of: its filesystem's device, or,
/// for a bind of a block device's node (a block volume: mountinfo shows
/// devtmpfs), the device the node is of.
pub fn disk_majmin(m: &Mount) -> String {
    use std::os::unix::fs::FileTypeExt;
    if m.fs_type == "devtmpfs" {
        if let Ok(md) = std::fs::metadata(&m.mount_point) {
            if md.file_type().is_block_device() {
                return format!(
                    "{}:{}",
                    rustix::fs::major(md.rdev()),
                    rustix::fs::minor(md.rdev())
                );
            }
        }
    }
    m.majmin.clone()
}

/// A test disk as the invariant knows it.
#[derive(Clone, Debug)]
pub struct Disk {
    /// "/dev/loop3".
    pub path: String,
    /// "7:3".
    pub majmin: String,
    /// "ext4" or "xfs", or "block" for a disk published as a block volume.
    pub fs: String,
}

impl Disk {
    pub fn of(d: &LoopDisk, fs: &str) -> Disk {
        Disk {
            path: d.path(),
            majmin: majmin(&d.device),
            fs: fs.to_string(),
        }
    }
}

/// A loop disk with `fs` holding `a/`, `b/c/` and a file `f` (the subpaths
/// the tests bind), plus `files` small files under `tree/` for fsGroup walks.
pub fn disk_with_tree(size_mb: u64, fs: &str, files: usize) -> LoopDisk {
    let disk = LoopDisk::new(size_mb, Some(fs));
    let m = disk.scratch("fill");
    run("mount", &[&disk.path(), m.to_str().unwrap()]);
    std::fs::create_dir_all(m.join("a")).unwrap();
    std::fs::create_dir_all(m.join("b/c")).unwrap();
    std::fs::write(m.join("f"), b"file").unwrap();
    for i in 0..files {
        let dir = m.join(format!("tree/d{}", i / 100));
        if i % 100 == 0 {
            std::fs::create_dir_all(&dir).unwrap();
        }
        std::fs::write(dir.join(format!("f{i}")), b"x").unwrap();
    }
    run("umount", &[m.to_str().unwrap()]);
    disk
}

/// Everything about a tree that an attack could change: kind, owner, mode,
/// size, content or link target of every entry, by relative path.
type Tree = BTreeMap<PathBuf, String>;

fn snapshot_tree(dir: &Path) -> Tree {
    fn walk(base: &Path, dir: &Path, out: &mut Tree) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(base).unwrap().to_path_buf();
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                out.insert(rel, "vanished while read".into());
                continue;
            };
            let ft = md.file_type();
            let what = if ft.is_symlink() {
                format!("symlink -> {:?}", std::fs::read_link(&p).ok())
            } else if ft.is_dir() {
                "dir".to_string()
            } else if ft.is_file() {
                let text = std::fs::read(&p).map(|b| String::from_utf8_lossy(&b).into_owned());
                format!("file {:?}", text.ok())
            } else {
                format!("other {:o}", md.mode())
            };
            out.insert(
                rel,
                format!(
                    "{what} uid={} gid={} mode={:o} dev={:x}",
                    md.uid(),
                    md.gid(),
                    md.mode(),
                    md.dev()
                ),
            );
            if ft.is_dir() {
                walk(base, &p, out);
            }
        }
    }
    let mut out = Tree::new();
    if let Ok(md) = std::fs::symlink_metadata(dir) {
        out.insert(
            PathBuf::from("."),
            format!(
                "uid={} gid={} mode={:o} dev={:x}",
                md.uid(),
                md.gid(),
                md.mode(),
                md.dev()
            ),
        );
    }
    walk(dir, dir, &mut out);
    out
}

/// What must stay as it is outside the agent's root.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sentinel {
    /// The sentinel tree (crossing into its own tmpfs).
    tree: Tree,
    /// Names directly in the scratch directory.
    names: BTreeSet<String>,
    /// Mounts beneath the scratch directory but outside the root: (point, id, majmin, root, fs).
    mounts: BTreeSet<(PathBuf, i32, String, String, String)>,
}

/// An agent on a unix socket with its root in a scratch directory, and the
/// sentinel beside it. Field order matters for Drop: the process is killed
/// and the mounts detached before the scratch directory is removed.
pub struct Rig {
    /// The canonical scratch directory.
    pub work: PathBuf,
    /// The `--root` the agent is given.
    pub root_arg: PathBuf,
    /// The same root, canonical: how mountinfo spells paths beneath it.
    pub root: PathBuf,
    /// The sentinel tree beside the root (`work/outside`): files, a symlink,
    /// an empty `victim/` directory for attacks to aim at, and `mnt/`, a tmpfs
    /// of its own.
    pub outside: PathBuf,
    pub sock: PathBuf,
    pub log: PathBuf,
    child: Option<Child>,
    sentinel: Option<Sentinel>,
    /// Mount points outside the root that a test made on purpose.
    allowed_outside: BTreeSet<PathBuf>,
    _dir: tempfile::TempDir,
}

impl Rig {
    /// A scene whose root is `<scratch>/root`; the agent is not started yet.
    pub fn new() -> Rig {
        Rig::with_root(|work| work.join("root"))
    }

    /// A scene whose `--root` is what `root` makes of the scratch directory
    /// (it may create directories and symlinks there first).
    pub fn with_root(root: impl FnOnce(&Path) -> PathBuf) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().canonicalize().unwrap();
        std::fs::create_dir(work.join("run")).unwrap();
        let root_arg = root(&work);
        let parent = root_arg.parent().unwrap();
        std::fs::create_dir_all(parent).unwrap();
        let root = parent
            .canonicalize()
            .unwrap()
            .join(root_arg.file_name().unwrap());
        let outside = work.join("outside");
        let mut rig = Rig {
            sock: work.join("run/agent.sock"),
            log: work.join("run/agent.log"),
            work,
            root_arg,
            root,
            outside,
            child: None,
            sentinel: None,
            allowed_outside: BTreeSet::new(),
            _dir: dir,
        };
        rig.make_sentinel();
        rig.resnapshot();
        rig
    }

    fn make_sentinel(&self) {
        let o = &self.outside;
        std::fs::create_dir_all(o.join("dir/sub")).unwrap();
        std::fs::create_dir_all(o.join("victim")).unwrap();
        std::fs::write(o.join("file.txt"), b"sentinel: must not change").unwrap();
        std::fs::write(o.join("dir/sub/deep.txt"), b"deep").unwrap();
        std::os::unix::fs::symlink("file.txt", o.join("link")).unwrap();
        std::fs::create_dir(o.join("mnt")).unwrap();
        run(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                "size=1m",
                "crust-sentinel",
                o.join("mnt").to_str().unwrap(),
            ],
        );
        std::fs::create_dir(o.join("mnt/t")).unwrap();
        std::fs::write(o.join("mnt/inside.txt"), b"in the sentinel's own mount").unwrap();
    }

    fn sentinel_now(&self) -> Sentinel {
        // The root itself comes and goes with the agent: not the sentinel's business.
        let root_top = self
            .root
            .strip_prefix(&self.work)
            .ok()
            .and_then(|r| r.iter().next());
        let names = std::fs::read_dir(&self.work)
            .unwrap()
            .flatten()
            .filter(|e| Some(e.file_name().as_os_str()) != root_top)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let mounts = mount_table()
            .into_iter()
            .filter(|m| {
                m.mount_point.starts_with(&self.work) && !m.mount_point.starts_with(&self.root)
            })
            .map(|m| (m.mount_point, m.mnt_id, m.majmin, m.root, m.fs_type))
            .collect();
        Sentinel {
            tree: snapshot_tree(&self.outside),
            names,
            mounts,
        }
    }

    /// Takes the sentinel's picture again, after a test changed what is
    /// outside the root on purpose.
    pub fn resnapshot(&mut self) {
        self.sentinel = Some(self.sentinel_now());
    }

    /// A mount point outside the root that the test made itself (holding a
    /// test device, say): not counted as the agent's doing.
    pub fn allow_outside_mount(&mut self, path: &Path) {
        self.allowed_outside.insert(path.to_path_buf());
    }

    // -- the agent process ----------------------------------------------

    /// Starts the agent and waits until it answers (recovery is done by then).
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "the agent is already running");
        // A soak logs a line per request: keep the last 16 MiB or so.
        if std::fs::metadata(&self.log).is_ok_and(|m| m.len() > 16 << 20) {
            let _ = std::fs::rename(&self.log, self.log.with_extension("log.old"));
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(agent_bin())
            .args([
                "--listen",
                &format!("unix://{}", self.sock.display()),
                "--root",
                self.root_arg.to_str().unwrap(),
                "--log-level",
                "debug",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if !self.alive() {
                panic!("the agent exited at start-up; log:\n{}", self.log_tail(40));
            }
            // The agent listens only once recovery is done.
            if std::os::unix::net::UnixStream::connect(&self.sock).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "the agent did not listen on {} within 20 s; log:\n{}",
            self.sock.display(),
            self.log_tail(40)
        );
    }

    pub fn addr(&self) -> String {
        format!("unix://{}", self.sock.display())
    }

    pub fn client(&self) -> AgentClient {
        super::connect(&self.addr()).expect("connect to the agent")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Whether the agent process is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// SIGKILL: mounts and state stay as they are.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits (up to 30 s) for the exit; SIGKILL and a panic if
    /// it does not come.
    pub fn sigterm(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("the agent is running");
        let pid = rustix::process::Pid::from_raw(c.id() as i32).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
        panic!(
            "the agent did not exit within 30 s of SIGTERM; log:\n{}",
            self.log_tail(40)
        );
    }

    /// The last `n` lines of the agent's log (every run of it, appended).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    // -- paths ------------------------------------------------------------

    /// The canonical guest path of a volume.
    pub fn guest_path(&self, id: &str) -> PathBuf {
        self.root.join("volumes").join(id)
    }

    /// Every regular file beneath `<root>/state/` with its content (format-agnostic).
    pub fn state_files(&self) -> Vec<(PathBuf, Vec<u8>)> {
        fn walk(dir: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let p = e.path();
                match std::fs::symlink_metadata(&p) {
                    Ok(m) if m.is_dir() => walk(&p, out),
                    Ok(m) if m.is_file() => {
                        if let Ok(b) = std::fs::read(&p) {
                            out.push((p, b));
                        }
                    }
                    _ => {}
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.root.join(STATE_DIR), &mut out);
        out.sort();
        out
    }

    // -- the invariant ----------------------------------------------------

    /// What disagrees between mountinfo, ListVolumes, the state directory and
    /// the sentinel, with the agent idle:
    /// (a) every mount of a test disk beneath the root is the guest path of a
    ///     listed volume of that disk (mounted at the filesystem's root) or a
    ///     listed bind target of it (with a root in `bind_roots`, when given);
    ///     every listed guest path and bind target is really mounted so;
    ///     the state directory (beside its freeze records) names exactly
    ///     the listed volumes among `ids`;
    /// (b) no two mounts at one mount point beneath the root;
    /// (c) the sentinel beside the root is unchanged, no test disk is mounted
    ///     outside the root, and nothing listed lies outside it;
    /// (e) no disk is mounted at two guest paths or listed under two ids;
    /// (f) the freeze records agree with the list: a volume listed frozen
    ///     has its freeze's record, and a record that says a volume may be
    ///     frozen names a volume listed frozen by that freeze; at most the
    ///     last 256 ended freezes are kept.
    pub fn problems(
        &self,
        c: &AgentClient,
        disks: &[Disk],
        ids: &[&str],
        bind_roots: Option<&[&str]>,
    ) -> Vec<String> {
        let list = match c.list_volumes(ctx(), &pb::ListVolumesRequest::new()) {
            Ok(l) => l.volumes,
            Err(e) => return vec![format!("ListVolumes failed: {e:?}")],
        };
        let table: Vec<Mount> = mount_table()
            .into_iter()
            .map(|mut m| {
                m.majmin = disk_majmin(&m);
                m
            })
            .collect();
        let s = Seen { list, table, disks };
        let mut bad = self.mounts_accounted_for(&s, bind_roots);
        bad.extend(self.listed_are_mounted(&s));
        bad.extend(self.no_stacked_mounts(&s));
        bad.extend(self.one_disk_one_path_one_id(&s));
        bad.extend(self.state_names_the_listed(&s, ids));
        // (c) the sentinel.
        bad.extend(self.sentinel_problems());
        bad
    }

    /// (a) and (c): every mount of a test disk is accounted for.
    fn mounts_accounted_for(&self, s: &Seen<'_>, bind_roots: Option<&[&str]>) -> Vec<String> {
        let Seen { list, table, disks } = s;
        let by_majmin: BTreeMap<&str, &Disk> =
            disks.iter().map(|d| (d.majmin.as_str(), d)).collect();
        let listed_summary: Vec<String> = list
            .iter()
            .map(|v| {
                format!(
                    "{} {} at {} binds {:?}",
                    v.volume_id, v.device, v.guest_path, v.bind_targets
                )
            })
            .collect();
        let mut bad = Vec::new();
        for m in table {
            let Some(d) = by_majmin.get(m.majmin.as_str()) else {
                continue;
            };
            if !m.mount_point.starts_with(&self.root) {
                if !self.allowed_outside.contains(&m.mount_point) {
                    bad.push(format!(
                        "(c) test disk {} is mounted outside the root: {}",
                        d.path,
                        describe(m)
                    ));
                }
                continue;
            }
            let point = m.mount_point.to_string_lossy();
            let as_guest = list.iter().find(|v| v.guest_path == point);
            // Several owners of one target are reported below as (b).
            let owners: Vec<&pb::VolumeInfo> = list
                .iter()
                .filter(|v| v.bind_targets.iter().any(|t| *t == point))
                .collect();
            let as_bind = owners
                .iter()
                .find(|v| v.device == d.path)
                .or(owners.first())
                .copied();
            match (as_guest, as_bind) {
                (Some(v), _) => {
                    if v.device != d.path {
                        bad.push(format!(
                            "(a) {} is the guest path of volume {}, which ListVolumes says is on {}",
                            describe(m),
                            v.volume_id,
                            v.device
                        ));
                    }
                    if m.root != "/" && !is_block(v) {
                        bad.push(format!(
                            "(a) guest path of volume {} is a mount of a subdirectory: {}",
                            v.volume_id,
                            describe(m)
                        ));
                    }
                }
                (None, Some(v)) => {
                    if v.device != d.path {
                        bad.push(format!(
                            "(a) {} is a bind target of volume {}, which ListVolumes says is on {}",
                            describe(m),
                            v.volume_id,
                            v.device
                        ));
                    }
                    if let Some(roots) = bind_roots.filter(|_| !is_block(v)) {
                        if !roots.contains(&m.root.as_str()) {
                            bad.push(format!(
                                "(a) bind of volume {} has a root no request named (expected one of {roots:?}): {}",
                                v.volume_id,
                                describe(m)
                            ));
                        }
                    }
                }
                (None, None) => bad.push(format!(
                    "(a) {} belongs to no listed volume: neither a guest path nor a bind target (ListVolumes: {listed_summary:?})",
                    describe(m)
                )),
            }
        }
        bad
    }

    /// (a) and (c): everything listed is mounted as listed, beneath the root.
    fn listed_are_mounted(&self, s: &Seen<'_>) -> Vec<String> {
        let Seen { list, table, .. } = s;
        let volumes_dir = self.root.join("volumes");
        let mut bad = Vec::new();
        let top = |p: &str| table.iter().rev().find(|m| m.mount_point == Path::new(p));
        for v in list {
            let want_gp = volumes_dir.join(&v.volume_id);
            if Path::new(&v.guest_path) != want_gp {
                bad.push(format!(
                    "(a) volume {} is listed at {}, not at {}",
                    v.volume_id,
                    v.guest_path,
                    want_gp.display()
                ));
            }
            let want = std::fs::metadata(&v.device)
                .ok()
                .map(|_| majmin(Path::new(&v.device)));
            match (top(&v.guest_path), &want) {
                (None, _) => bad.push(format!(
                    "(a) volume {} is listed at {} on {}, but nothing is mounted there",
                    v.volume_id, v.guest_path, v.device
                )),
                (Some(m), Some(w)) if &m.majmin != w => bad.push(format!(
                    "(a) volume {} is listed on {} ({w}), but at its guest path is {}",
                    v.volume_id,
                    v.device,
                    describe(m)
                )),
                (_, None) => bad.push(format!(
                    "(a) volume {} is listed on {}, which is not a device node",
                    v.volume_id, v.device
                )),
                _ => {}
            }
            for t in &v.bind_targets {
                if !Path::new(t).starts_with(&self.root) {
                    bad.push(format!(
                        "(c) volume {} lists bind target {t} outside the root {}",
                        v.volume_id,
                        self.root.display()
                    ));
                }
                match (top(t), &want) {
                    (None, _) => bad.push(format!(
                        "(a) volume {} lists bind target {t}, but nothing is mounted there",
                        v.volume_id
                    )),
                    (Some(m), Some(w)) if &m.majmin != w => bad.push(format!(
                        "(a) volume {} lists bind target {t}, but there is {} (not {w})",
                        v.volume_id,
                        describe(m)
                    )),
                    _ => {}
                }
                let owners: Vec<&str> = list
                    .iter()
                    .filter(|o| o.bind_targets.contains(t))
                    .map(|o| o.volume_id.as_str())
                    .collect();
                if owners.len() > 1 && owners[0] == v.volume_id {
                    bad.push(format!(
                        "(b) bind target {t} is listed by several volumes: {owners:?}"
                    ));
                }
            }
        }
        bad
    }

    /// (b) no stacked mounts beneath the root.
    fn no_stacked_mounts(&self, s: &Seen<'_>) -> Vec<String> {
        let table = &s.table;
        let mut bad = Vec::new();
        let mut at: BTreeMap<&Path, Vec<&Mount>> = BTreeMap::new();
        for m in table
            .iter()
            .filter(|m| m.mount_point.starts_with(&self.root))
        {
            at.entry(m.mount_point.as_path()).or_default().push(m);
        }
        for (p, ms) in &at {
            if ms.len() > 1 {
                let all: Vec<String> = ms.iter().map(|m| describe(m)).collect();
                bad.push(format!(
                    "(b) {} mounts stacked at {}: {all:?}",
                    ms.len(),
                    p.display()
                ));
            }
        }
        bad
    }

    /// (e) one disk, one guest path, one id.
    fn one_disk_one_path_one_id(&self, s: &Seen<'_>) -> Vec<String> {
        let Seen { list, table, disks } = s;
        let volumes_dir = self.root.join("volumes");
        let mut bad = Vec::new();
        for d in disks.iter() {
            let guests: Vec<&Mount> = table
                .iter()
                .filter(|m| m.majmin == d.majmin && m.mount_point.parent() == Some(&volumes_dir))
                .collect();
            if guests.len() > 1 {
                let all: Vec<String> = guests.iter().map(|m| describe(m)).collect();
                bad.push(format!(
                    "(e) test disk {} is mounted at {} guest paths: {all:?}",
                    d.path,
                    guests.len()
                ));
            }
        }
        let mut listed_devices: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for v in list {
            listed_devices
                .entry(v.device.as_str())
                .or_default()
                .push(v.volume_id.as_str());
        }
        for (dev, ids) in listed_devices {
            if ids.len() > 1 {
                bad.push(format!(
                    "(e) device {dev} is listed under several volume ids: {ids:?}"
                ));
            }
        }
        bad
    }

    /// (a) the state directory names exactly the listed volumes among `ids`
    /// (by id, in file names or contents: the format is the agent's
    /// business), the freezes' records apart: they are history, and name
    /// volumes long gone.
    fn state_names_the_listed(&self, s: &Seen<'_>, ids: &[&str]) -> Vec<String> {
        let list = &s.list;
        let mut bad = Vec::new();
        let freezes = self.root.join(FREEZES_DIR);
        let (records, state): (Vec<_>, Vec<_>) = self
            .state_files()
            .into_iter()
            .partition(|(p, _)| p.starts_with(&freezes));
        bad.extend(freeze_problems(list, &records));
        let listed: BTreeSet<&str> = list.iter().map(|v| v.volume_id.as_str()).collect();
        for id in ids {
            let holders: Vec<String> = state
                .iter()
                .filter(|(p, b)| {
                    mentions(&p.to_string_lossy(), id) || mentions(&String::from_utf8_lossy(b), id)
                })
                .map(|(p, _)| p.display().to_string())
                .collect();
            match (listed.contains(id), holders.is_empty()) {
                (true, true) => bad.push(format!(
                    "(a) volume {id} is listed, but nothing in {}/state names it: a restart would lose it",
                    self.root.display()
                )),
                (false, false) => bad.push(format!(
                    "(a) volume {id} is not listed, but the state directory still names it in {holders:?}"
                )),
                _ => {}
            }
        }
        bad
    }

    /// (c): what changed beside the root since the last snapshot.
    pub fn sentinel_problems(&self) -> Vec<String> {
        let mut bad = Vec::new();
        let was = self.sentinel.as_ref().expect("a sentinel snapshot");
        let now = self.sentinel_now();
        if now.names != was.names {
            bad.push(format!(
                "(c) the scratch directory beside the root changed: {:?} → {:?}",
                was.names, now.names
            ));
        }
        for (k, v) in &was.tree {
            match now.tree.get(k) {
                None => bad.push(format!(
                    "(c) {} was deleted (it was {v})",
                    self.outside.join(k).display()
                )),
                Some(n) if n != v => bad.push(format!(
                    "(c) {} changed: {v} → {n}",
                    self.outside.join(k).display()
                )),
                _ => {}
            }
        }
        for (k, v) in &now.tree {
            if !was.tree.contains_key(k) {
                bad.push(format!(
                    "(c) {} appeared outside the root: {v}",
                    self.outside.join(k).display()
                ));
            }
        }
        for m in was.mounts.difference(&now.mounts) {
            bad.push(format!(
                "(c) a mount outside the root is gone: {} (id {}, {} {}, root {})",
                m.0.display(),
                m.1,
                m.4,
                m.2,
                m.3
            ));
        }
        for m in now.mounts.difference(&was.mounts) {
            bad.push(format!(
                "(c) a mount appeared outside the root: {} (id {}, {} {}, root {})",
                m.0.display(),
                m.1,
                m.4,
                m.2,
                m.3
            ));
        }
        bad
    }

    /// Panics with every problem of the invariant, numbered, and the agent's log tail.
    pub fn assert_invariant(
        &self,
        when: &str,
        c: &AgentClient,
        disks: &[Disk],
        ids: &[&str],
        bind_roots: Option<&[&str]>,
    ) {
        let bad = self.problems(c, disks, ids, bind_roots);
        if !bad.is_empty() {
            panic!("{}", self.report(when, &bad));
        }
    }

    /// A failure report: what disagrees, the mounts beneath the root, the log tail.
    pub fn report(&self, when: &str, bad: &[String]) -> String {
        const SHOWN: usize = 15;
        let mut numbered: Vec<String> = bad
            .iter()
            .take(SHOWN)
            .enumerate()
            .map(|(i, b)| format!("  {}. {b}", i + 1))
            .collect();
        if bad.len() > SHOWN {
            numbered.push(format!("  … and {} more", bad.len() - SHOWN));
        }
        let mounts: Vec<String> = mount_table()
            .iter()
            .filter(|m| m.mount_point.starts_with(&self.work))
            .map(|m| {
                format!(
                    "  {} {} {} root={} at {}",
                    m.mnt_id,
                    m.majmin,
                    m.fs_type,
                    m.root,
                    m.mount_point.display()
                )
            })
            .collect();
        format!(
            "invariant broken {when}:\n{}\nmounts beneath {}:\n{}\nagent log (tail):\n{}",
            numbered.join("\n"),
            self.work.display(),
            mounts.join("\n"),
            self.log_tail(25)
        )
    }

    /// (d): every listed volume can be unpublished (was_published true, and
    /// then nothing of it is mounted), then every disk published again under
    /// its own id (no orphan makes the device "mounted elsewhere").
    pub fn manageability_problems(&self, c: &AgentClient, disks: &[(&str, &Disk)]) -> Vec<String> {
        let mut bad = Vec::new();
        let list = match c.list_volumes(ctx(), &pb::ListVolumesRequest::new()) {
            Ok(l) => l.volumes,
            Err(e) => return vec![format!("ListVolumes failed: {e:?}")],
        };
        for v in &list {
            match c.unpublish_volume(ctx(), &unpublish_req(v.volume_id.clone())) {
                Ok(r) if r.was_published => {}
                Ok(_) => bad.push(format!(
                    "(d) volume {} is listed, but UnpublishVolume answered was_published=false",
                    v.volume_id
                )),
                Err(e) => bad.push(format!(
                    "(d) UnpublishVolume of listed volume {} failed: {e:?}",
                    v.volume_id
                )),
            }
            let table = mount_table();
            for p in std::iter::once(&v.guest_path).chain(&v.bind_targets) {
                if let Some(m) = table.iter().find(|m| m.mount_point == Path::new(p)) {
                    bad.push(format!(
                        "(d) after unpublishing volume {}, {} is still mounted ({} root {})",
                        v.volume_id, p, m.majmin, m.root
                    ));
                }
            }
        }
        let table = mount_table();
        for (id, d) in disks {
            let left: Vec<String> = table
                .iter()
                .filter(|m| {
                    disk_majmin(m) == d.majmin && !self.allowed_outside.contains(&m.mount_point)
                })
                .map(|m| format!("{} (root {})", m.mount_point.display(), m.root))
                .collect();
            if !left.is_empty() {
                bad.push(format!(
                    "(d) with every volume unpublished, test disk {} is still mounted at {left:?}",
                    d.path
                ));
            }
            match c.publish_volume(ctx(), &publish_req(id, &d.path, &d.fs)) {
                Ok(r) if !r.already_published => {}
                Ok(_) => bad.push(format!(
                    "(d) publishing {} as {id} after unpublishing everything answered already_published=true",
                    d.path
                )),
                Err(e) => bad.push(format!(
                    "(d) {} cannot be published as {id} after unpublishing everything: {e:?}",
                    d.path
                )),
            }
        }
        bad
    }

    /// After the agent exited on SIGTERM (or Shutdown): nothing of a test
    /// disk is mounted anywhere (save what the test mounted outside on
    /// purpose), nothing is mounted beneath the root.
    pub fn exit_problems(&self, disks: &[Disk]) -> Vec<String> {
        let mut bad = Vec::new();
        for m in mount_table() {
            let ours = disks.iter().find(|d| d.majmin == disk_majmin(&m));
            if let Some(d) = ours {
                if !self.allowed_outside.contains(&m.mount_point) {
                    bad.push(format!(
                        "test disk {} is still mounted at {} (root {}) after the agent exited",
                        d.path,
                        m.mount_point.display(),
                        m.root
                    ));
                }
            } else if m.mount_point.starts_with(&self.root) {
                bad.push(format!(
                    "{} ({} {}) is still mounted beneath the root after the agent exited",
                    m.mount_point.display(),
                    m.fs_type,
                    m.majmin
                ));
            }
        }
        bad
    }
}

/// Whether a listed volume is a block volume (its mounts are binds of a
/// device node, whose mountinfo root is the node's name, not "/").
/// What `problems` compares: the agent's list, the kernel's mount table
/// (each mount with its disk's major:minor) and the test's disks.
struct Seen<'a> {
    list: Vec<pb::VolumeInfo>,
    table: Vec<Mount>,
    disks: &'a [Disk],
}

/// A mount, for messages.
fn describe(m: &Mount) -> String {
    format!(
        "mount {} of {} ({}, root {}) at {}",
        m.mnt_id,
        m.majmin,
        m.mount_source.as_deref().unwrap_or("?"),
        m.root,
        m.mount_point.display()
    )
}

fn is_block(v: &pb::VolumeInfo) -> bool {
    v.volume_mode == pb::VolumeMode::BLOCK.into()
}

/// Whether `text` names `id` as a whole token, not as part of a longer id
/// (a dot ends it: "v1.vol" names "v1"; the tests' ids have no dots).
/// (f) of [`Rig::problems`]: the freeze records against the list.
fn freeze_problems(list: &[pb::VolumeInfo], records: &[(PathBuf, Vec<u8>)]) -> Vec<String> {
    let mut bad = Vec::new();
    let text = |p: &Path| {
        records
            .iter()
            .find(|(r, _)| r == p)
            .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
    };
    for v in list.iter().filter(|v| !v.freeze_id.is_empty()) {
        let p = records
            .first()
            .and_then(|(r, _)| r.parent())
            .map(|d| d.join(format!("{}.freeze", v.freeze_id)));
        if p.as_deref().and_then(text).is_none() {
            bad.push(format!(
                "(f) volume {} is listed frozen by {}, which has no record",
                v.volume_id, v.freeze_id
            ));
        }
    }
    let ended = records
        .iter()
        .filter(|(_, b)| !String::from_utf8_lossy(b).contains("\tpending"))
        .count();
    if ended > 256 {
        bad.push(format!("(f) {ended} ended freezes are kept, more than 256"));
    }
    for (p, b) in records {
        let b = String::from_utf8_lossy(b);
        let freeze = b
            .lines()
            .find_map(|l| l.strip_prefix("freeze="))
            .unwrap_or("?");
        for vol in b
            .lines()
            .filter_map(|l| l.strip_prefix("volume=")?.strip_suffix("\tpending"))
        {
            let held = list
                .iter()
                .any(|v| v.volume_id == vol && v.freeze_id == freeze);
            if !held {
                bad.push(format!(
                    "(f) {} says volume {vol} may be frozen by {freeze}, but the list does not",
                    p.display()
                ));
            }
        }
    }
    bad
}

pub fn mentions(text: &str, id: &str) -> bool {
    let is_id = |c: char| c.is_ascii_alphanumeric() || "_-".contains(c);
    text.match_indices(id).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + id.len()..].chars().next();
        !before.is_some_and(is_id) && !after.is_some_and(is_id)
    })
}

/// Detaches every mount beneath `dir`, deepest first, lazily (a busy mount
/// of a killed agent must not keep the scratch directory alive).
pub fn detach_all_beneath(dir: &Path) {
    for _ in 0..8 {
        let mut points: Vec<PathBuf> = mount_table()
            .into_iter()
            .filter(|m| m.mount_point.starts_with(dir))
            .map(|m| m.mount_point)
            .collect();
        if points.is_empty() {
            return;
        }
        points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in points {
            detach(&p);
        }
    }
}

/// `umount -l`, also for a mount point whose path is longer than PATH_MAX
/// (reached through a chain of directory fds).
pub fn detach(point: &Path) {
    use rustix::fs::{Mode, OFlags};
    use rustix::mount::{unmount, UnmountFlags};
    use std::os::fd::AsRawFd;
    if unmount(point, UnmountFlags::DETACH).is_ok() {
        return;
    }
    let (Some(parent), Some(last)) = (point.parent(), point.file_name()) else {
        return;
    };
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let Ok(mut fd) = rustix::fs::open("/", flags, Mode::empty()) else {
        return;
    };
    for comp in parent.iter().skip(1) {
        match rustix::fs::openat(&fd, comp, flags, Mode::empty()) {
            Ok(next) => fd = next,
            Err(_) => return,
        }
    }
    let via = Path::new("/proc/self/fd")
        .join(fd.as_raw_fd().to_string())
        .join(last);
    let _ = unmount(&via, UnmountFlags::DETACH);
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.kill9();
        detach_all_beneath(&self.work);
        // A failed test keeps the agent's log (the scratch directory goes).
        if std::thread::panicking() {
            let keep = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
                "crust-agent-{}-{}.log",
                std::thread::current()
                    .name()
                    .unwrap_or("test")
                    .replace("::", "-"),
                std::process::id()
            ));
            if std::fs::copy(&self.log, &keep).is_ok() {
                eprintln!("the agent's log is kept in {}", keep.display());
            }
        }
    }
}

//! The on-disk record of each volume, `<root>/state/<id>.vol`: `key=value`
//! lines, values percent-escaped, written atomically through the state
//! directory's fd (temp file, fsync, rename, fsync of the directory).
//! A record is not trusted: decoding applies the same rules as a request
//! (ids, options, targets beneath the root, subpaths), and anything that
//! does not pass is refused whole.
//!
//! Versions: 1 had no mount ids; 2 added them; 3 is a block volume's record
//! (`mode=block`, `ro_set=`). A filesystem volume is still written as
//! version 2, so an older agent reads it; an older agent refuses a block
//! record whole (it sets it aside and takes its bind down) rather than
//! misread it as a filesystem. Every older version still reads. An
//! idmapped bind adds a `bind_idmap=` line (idmap.rs), a key older agents
//! skip, in any version.

use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crust_protocols::sync::LockExt;
use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;

use super::encrypted;
use super::error::Error;
use super::idmap;
use super::phase::Phase;
use super::request::{FsGroup, Options, Source, Spec};
use super::volume::{Bind, Volume};
use crate::luks2::mapping::{tag_of, Owner};
use crate::model::{Device, FsType, MountId, Policy, RecursiveReadOnly, VolumeMode};
use crate::mount::options::BadOption;
use crate::sys::beneath;
use crate::sys::error::SysError;
use crate::sys::mountinfo::shown;
use crate::sys::sysfs::parse_devnum;
use crate::validate::{self, STATE_DIR, VOLUMES_DIR};

/// A state directory, opened once beneath the root.
#[derive(Debug)]
pub(crate) struct Store {
    /// `<root>/state`, for messages.
    path: PathBuf,
    /// Opened for reading (readdir) and fsync, not O_PATH.
    dir: OwnedFd,
    /// Why the last write to the state directory failed; None once one
    /// succeeds again (GetAgentInfo's `state_problem`).
    problem: Mutex<Option<String>>,
    /// The tag of this directory's identity, which the mappings of the
    /// agent that holds it carry (`mapping::Owner`).
    owner: Owner,
}

/// What a listing of the state directory holds.
pub(crate) enum Record {
    /// A record that decoded.
    Good(Box<Volume>),
    /// A record that does not decode: its file name (bytes, as listed) and why.
    Bad(Vec<u8>, BadRecord),
}

/// Why a volume's record is refused whole (recovery sets it aside).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BadRecord {
    #[error("its name is not UTF-8")]
    NameNotUtf8,
    #[error("unreadable: {0}")]
    Unreadable(std::io::Error),
    #[error("it names volume {named}, not {file}")]
    OtherVolume {
        /// The volume the record names.
        named: String,
        /// The volume its file name says.
        file: String,
    },
    #[error("line {0:?} is not key=value")]
    NotKeyValue(String),
    #[error("version {0} is not one this agent knows")]
    Version(String),
    #[error("no {0}")]
    Missing(&'static str),
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
    /// A value of the wrong shape, after the key that holds it.
    #[error("{key} {value:?}")]
    Value {
        /// The key (or part of it).
        key: &'static str,
        /// What the record holds.
        value: String,
    },
    #[error("{0:?} is not true or false")]
    NotBoolean(String),
    #[error("device name {0:?} is not a block device's name")]
    DeviceName(String),
    #[error("bind {0:?} has the wrong number of fields")]
    BindFields(String),
    #[error("bind target {} is too long", shown(.0))]
    TargetTooLong(PathBuf),
    #[error("bind target {} is outside the root", shown(.0))]
    TargetOutside(PathBuf),
    #[error("bind target {} is not UTF-8 beneath the root; no request names such a target", shown(.0))]
    TargetNotUtf8(PathBuf),
    #[error("a block volume with a filesystem, mount options or an fsGroup")]
    BlockWithFilesystem,
    #[error("a block volume in a version {0} record")]
    BlockInVersion(u32),
    #[error("ro_set on a volume that is not a read-only block volume")]
    RoSetNotBlock,
    #[error("a block volume's bind with a subpath or recursive read-only")]
    BlockBindNotPlain,
    #[error("a trim schedule on a block or read-only volume")]
    TrimNotTrimmable,
    /// A field a request would have had refused.
    #[error(transparent)]
    Invalid(#[from] validate::Invalid),
    #[error(transparent)]
    Options(#[from] BadOption),
    #[error(transparent)]
    Encrypted(#[from] encrypted::Bad),
    #[error("its mapping {mapping:?} is another agent's: this agent's names end in @{owner}")]
    OtherOwner { mapping: String, owner: String },
    #[error(transparent)]
    Idmap(#[from] idmap::Bad),
}

/// A value of the wrong shape.
fn value(key: &'static str, value: &str) -> BadRecord {
    BadRecord::Value {
        key,
        value: value.to_string(),
    }
}

/// A state write that failed: ENOSPC and EDQUOT say the state's filesystem
/// is full, EROFS that it is read-only; anything else is unexpected.
fn write_error(call: &'static str, path: &Path, e: std::io::Error) -> crate::error::Error {
    let full = |e: &std::io::Error| {
        e.raw_os_error()
            .is_some_and(|n| n == libc::ENOSPC || n == libc::EDQUOT)
    };
    if full(&e) {
        Error::StateFull {
            path: path.to_path_buf(),
        }
        .into()
    } else if e.raw_os_error() == Some(libc::EROFS) {
        Error::StateReadOnly {
            path: path.to_path_buf(),
        }
        .into()
    } else {
        SysError::new(call, shown(path), e).into()
    }
}

impl Store {
    /// Opens `<root>/state` (creating it 0700), refusing a symlink there.
    pub(crate) fn open(root: &beneath::Root) -> Result<Store, SysError> {
        Store::open_dir(root, STATE_DIR)
    }

    /// Opens the state directory `rel` beneath the root (creating it 0700),
    /// refusing a symlink anywhere on the way: the volumes' records are in
    /// [`STATE_DIR`], the freezes' in [`validate::FREEZES_DIR`].
    pub(crate) fn open_dir(root: &beneath::Root, rel: &str) -> Result<Store, SysError> {
        root.own_dir(rel, 0o700)?;
        let path = root.join(Path::new(rel));
        let dir = beneath::open_with(
            root.fd(),
            Path::new(rel),
            OFlags::RDONLY | OFlags::DIRECTORY,
            beneath::strict(),
        )
        .map_err(|e| SysError::new("openat2", shown(&path), e))?;
        let st = rustix::fs::fstat(&dir).map_err(|e| SysError::new("fstat", shown(&path), e))?;
        Ok(Store {
            path,
            dir,
            problem: Mutex::new(None),
            owner: Owner::of_dir(st.st_dev, st.st_ino),
        })
    }

    fn file(id: &str) -> String {
        format!("{id}.vol")
    }

    /// Whose mappings the records name: the agent's that holds this
    /// directory, the only agent that makes, sweeps or closes them.
    pub(crate) fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Why the last write to the state directory failed, if it did.
    pub(crate) fn problem(&self) -> Option<String> {
        self.problem.locked().clone()
    }

    /// Notes how a write ended: a failure is kept for GetAgentInfo; a
    /// record written (`cleared`: not a mere unlink, which works on a full
    /// filesystem too) shows the state is writable again.
    fn note<T>(&self, r: crate::error::Result<T>, cleared: bool) -> crate::error::Result<T> {
        match &r {
            Err(e) => *self.problem.locked() = Some(e.to_string()),
            Ok(_) if cleared => *self.problem.locked() = None,
            Ok(_) => {}
        }
        r
    }

    /// Writes the volume's record atomically. A write that fails leaves the
    /// record as it was and no temp file behind: ENOSPC or EDQUOT answer
    /// RESOURCE_EXHAUSTED (`Error::StateFull`), EROFS FAILED_PRECONDITION.
    pub(crate) fn save(&self, vol: &Volume) -> crate::error::Result<()> {
        self.write(&Store::file(vol.id()), &encode(vol))
    }

    /// Removes volume `id`'s frozen mark; a missing one is fine.
    pub(crate) fn clear_frozen(&self, id: &str) -> crate::error::Result<()> {
        self.unlink(&format!("{id}.frozen"))
    }

    /// The volume ids that have a frozen mark (names that are not UTF-8
    /// are no mark of the agent's).
    pub(crate) fn frozen_marks(&self) -> Vec<String> {
        self.names()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|raw| {
                let id = raw.strip_suffix(b".frozen")?;
                std::str::from_utf8(id).ok().map(str::to_string)
            })
            .collect()
    }

    /// Writes `name` atomically (temp file `<name>.tmp`, fsync, rename,
    /// fsync of the directory); a write that fails leaves no temp file behind.
    pub(crate) fn write(&self, name: &str, text: &str) -> crate::error::Result<()> {
        let tmp = format!("{name}.tmp");
        let shown_path = self.path.join(name);
        let write = || -> std::io::Result<()> {
            let fd = rustix::fs::openat(
                &self.dir,
                tmp.as_str(),
                OFlags::CREATE
                    | OFlags::TRUNC
                    | OFlags::WRONLY
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )?;
            let mut f = std::fs::File::from(fd);
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            rustix::fs::renameat(&self.dir, tmp.as_str(), &self.dir, name)?;
            // The rename is durable once the directory is.
            rustix::fs::fsync(&self.dir)?;
            Ok(())
        };
        let r = write().map_err(|e| {
            // A half-written temp file holds space the next write needs.
            let _ = rustix::fs::unlinkat(&self.dir, tmp.as_str(), AtFlags::empty());
            write_error("write", &shown_path, e)
        });
        self.note(r, true)
    }

    /// Unlinks `name`; a missing one is fine. Needs no space.
    pub(crate) fn unlink(&self, name: &str) -> crate::error::Result<()> {
        let r = match rustix::fs::unlinkat(&self.dir, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(write_error("unlink", &self.path.join(name), e.into())),
        };
        self.note(r, false)
    }

    /// Removes the volume's record; a missing one is fine. Needs no space,
    /// so it works on a full state filesystem.
    pub(crate) fn remove(&self, id: &str) -> crate::error::Result<()> {
        self.unlink(&Store::file(id))
    }

    /// Sets aside a record that does not decode (`<name>.bad`), for a
    /// human to look at; it no longer stands for a volume. Where even that
    /// rename fails (a full or read-only state filesystem), the record is
    /// left as it is: it is refused again at the next start.
    pub(crate) fn set_aside(&self, name: &[u8]) -> PathBuf {
        let mut bad = name.to_vec();
        bad.extend_from_slice(b".bad");
        let (name, bad) = (OsStr::from_bytes(name), OsStr::from_bytes(&bad));
        let _ = rustix::fs::renameat(&self.dir, name, &self.dir, bad);
        self.path.join(bad)
    }

    /// The names in the state directory, as bytes, sorted.
    pub(crate) fn names(&self) -> Result<Vec<Vec<u8>>, SysError> {
        let dir = rustix::fs::openat(
            &self.dir,
            c".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| SysError::new("open", shown(&self.path), e))?;
        let mut entries = rustix::fs::Dir::new(dir)
            .map_err(|e| SysError::new("readdir", shown(&self.path), e))?;
        let mut names = Vec::new();
        while let Some(entry) = entries.read() {
            let entry = entry.map_err(|e| SysError::new("readdir", shown(&self.path), e))?;
            names.push(entry.file_name().to_bytes().to_vec());
        }
        names.sort();
        Ok(names)
    }

    /// The file `name`, at most `max` bytes of it: a regular file, read
    /// without following a symlink or blocking on a FIFO.
    pub(crate) fn read(&self, name: &[u8], max: u64) -> std::io::Result<Vec<u8>> {
        read_at(self.dir.as_fd(), OsStr::from_bytes(name), max)
    }

    /// Every record, decoded against `root`; half-written temp files are
    /// removed. Names are bytes: a file named so that it is not UTF-8 is
    /// not a record of the agent's, and is refused like any bad record.
    pub(crate) fn load(&self, root: &Path) -> Result<Vec<Record>, SysError> {
        let mut out = Vec::new();
        for raw in self.names()? {
            let name = OsStr::from_bytes(&raw);
            if raw.ends_with(b".tmp") {
                let _ = rustix::fs::unlinkat(&self.dir, name, AtFlags::empty());
                continue;
            }
            let Some(id) = raw.strip_suffix(b".vol") else {
                continue;
            };
            let Ok(id) = std::str::from_utf8(id) else {
                out.push(Record::Bad(raw.clone(), BadRecord::NameNotUtf8));
                continue;
            };
            let record = match read_at(self.dir.as_fd(), name, 1 << 20) {
                Err(e) => Record::Bad(raw.clone(), BadRecord::Unreadable(e)),
                Ok(text) => match decode(&text, root) {
                    Ok(v) if v.id() == id => self.own(raw.clone(), v),
                    Ok(v) => Record::Bad(
                        raw.clone(),
                        BadRecord::OtherVolume {
                            named: v.id().to_string(),
                            file: id.to_string(),
                        },
                    ),
                    Err(why) => Record::Bad(raw.clone(), why),
                },
            };
            out.push(record);
        }
        Ok(out)
    }

    /// Record `raw` of `vol`, refused when it names a mapping another
    /// agent's tag marks (an untagged name is an older agent's: adopted).
    fn own(&self, raw: Vec<u8>, vol: Volume) -> Record {
        match &vol.encrypted {
            Some(e) if tag_of(&e.mapping.name).is_some() && !self.owner.owns(&e.mapping.name) => {
                let mapping = e.mapping.name.clone();
                let owner = self.owner.to_string();
                Record::Bad(raw, BadRecord::OtherOwner { mapping, owner })
            }
            _ => Record::Good(Box::new(vol)),
        }
    }
}

/// Reads a small record through the directory fd, as bytes, without
/// following a symlink and without blocking on a FIFO.
fn read_at(dir: std::os::fd::BorrowedFd<'_>, name: &OsStr, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let st = rustix::fs::fstat(&fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut text = Vec::new();
    // A record is a few hundred bytes; anything past `max` is not one of ours.
    std::fs::File::from(fd).take(max).read_to_end(&mut text)?;
    Ok(text)
}

/// Escapes a value for a record line: `%`, newline, tab and carriage return
/// (the reader drops a CR before a line's end, so a value ending in one would
/// lose it), and every byte that is not part of valid UTF-8 (a path's bytes
/// are kept exactly). A value without a CR that is UTF-8 is written as older
/// agents wrote it.
fn esc_bytes(b: &[u8]) -> String {
    let mut o = String::with_capacity(b.len());
    for chunk in b.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '%' => o.push_str("%25"),
                '\n' => o.push_str("%0A"),
                '\t' => o.push_str("%09"),
                '\r' => o.push_str("%0D"),
                c => o.push(c),
            }
        }
        for x in chunk.invalid() {
            o.push_str(&format!("%{x:02X}"));
        }
    }
    o
}

fn esc(s: &str) -> String {
    esc_bytes(s.as_bytes())
}

fn esc_path(p: &Path) -> String {
    esc_bytes(p.as_os_str().as_bytes())
}

/// Undoes `esc_bytes`: `%XX` is the byte XX; a `%` not followed by two hex
/// digits is itself (older agents escaped only `%`, newline and tab, which
/// this reads the same way).
fn unesc_bytes(v: &[u8]) -> Vec<u8> {
    let hex = |c: u8| (c as char).to_digit(16).and_then(|d| u8::try_from(d).ok());
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        if v[i] == b'%' && i + 2 < v.len() {
            if let (Some(h), Some(l)) = (hex(v[i + 1]), hex(v[i + 2])) {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
        }
        out.push(v[i]);
        i += 1;
    }
    out
}

/// A value that must be text (ids, serials, options, names).
fn unesc(v: &[u8], what: &'static str) -> Result<String, BadRecord> {
    String::from_utf8(unesc_bytes(v)).map_err(|_| BadRecord::NotUtf8(what))
}

/// A value that is a path: bytes.
fn unesc_path(v: &[u8]) -> PathBuf {
    PathBuf::from(std::ffi::OsString::from_vec(unesc_bytes(v)))
}

fn rro_name(r: RecursiveReadOnly) -> &'static str {
    match r {
        RecursiveReadOnly::Disabled => "disabled",
        RecursiveReadOnly::IfPossible => "if-possible",
        RecursiveReadOnly::Enabled => "enabled",
    }
}

fn rro_parse(s: &str) -> Option<RecursiveReadOnly> {
    Some(match s {
        "disabled" => RecursiveReadOnly::Disabled,
        "if-possible" => RecursiveReadOnly::IfPossible,
        "enabled" => RecursiveReadOnly::Enabled,
        _ => return None,
    })
}

/// The record of `v`.
pub(crate) fn encode(v: &Volume) -> String {
    let mut o = match (v.mode(), v.encrypted.is_some()) {
        (VolumeMode::Filesystem(_), false) => String::from("version=2\n"),
        (VolumeMode::Block, false) => String::from("version=3\nmode=block\n"),
        (VolumeMode::Filesystem(_), true) => String::from("version=4\n"),
        (VolumeMode::Block, true) => String::from("version=4\nmode=block\n"),
    };
    o += &format!("id={}\n", esc(v.id()));
    match &v.spec.source {
        Source::Serial(s) => o += &format!("serial={}\n", esc(s)),
        Source::Path(p) => o += &format!("device_path={}\n", esc_path(p)),
    }
    o += &format!("device={}\n", esc_path(&v.device.path));
    o += &format!("name={}\n", esc(&v.device.name));
    o += &format!("devnum={}:{}\n", v.device.major, v.device.minor);
    if let Some(s) = &v.device.serial {
        o += &format!("device_serial={}\n", esc(s));
    }
    match v.mode() {
        VolumeMode::Filesystem(fs) => o += &format!("fs={}\n", fs.name()),
        VolumeMode::Block => o += &format!("ro_set={}\n", v.ro_set()),
    }
    for opt in v.spec.options.given() {
        o += &format!("option={}\n", esc(opt));
    }
    o += &format!("read_only={}\n", v.spec.options.read_only_flag());
    if let Some(g) = v.spec.fs_group {
        let p = match g.policy {
            Policy::Always => "always",
            Policy::OnRootMismatch => "on-root-mismatch",
        };
        o += &format!("fs_group={}:{p}\n", g.gid);
    }
    if let (Some(asked), Some(enc)) = (&v.spec.encryption, &v.encrypted) {
        o += &encrypted::encode(asked, enc, esc);
    }
    // Only when set: a record without it reads as no schedule, and an
    // older agent skips the key.
    if v.spec.trim_interval_s != 0 {
        o += &format!("trim_interval_s={}\n", v.spec.trim_interval_s);
    }
    o += &format!("mount_id={}\n", recorded(v.phase.mount_id()));
    o += &format!("complete={}\n", v.phase.complete());
    for b in &v.binds {
        o += &format!(
            "bind={}\t{}\t{}\t{}\t{}\t{}\n",
            b.read_only,
            rro_name(b.rro),
            b.rro_applied,
            esc_path(&b.subpath),
            esc_path(&b.target),
            recorded(b.mount_id)
        );
    }
    for b in &v.binds {
        o += &idmap::encode(b, esc_path);
    }
    o
}

/// A mount id as a record holds it: 0 for none (how records without ids,
/// version 1, read).
fn recorded(id: Option<MountId>) -> u64 {
    id.map_or(0, |id| id.0)
}

/// A mount id from a record: 0 is none.
fn mount_id(v: &str, what: &'static str) -> Result<Option<MountId>, BadRecord> {
    let n: u64 = v.parse().map_err(|_| value(what, v))?;
    Ok((n != 0).then_some(MountId(n)))
}

/// A device's kernel name from a record: a name sysfs could give a block
/// device, since recovery joins it into sysfs paths (and into the devtmpfs
/// node it looks for): not empty, not `.` or `..`, no `/`, no control
/// character (NUL among them), at most NAME_MAX bytes.
fn device_name(name: String) -> Result<String, BadRecord> {
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name.len() > validate::NAME_MAX
        || name.contains('/')
        || name.chars().any(char::is_control);
    if bad {
        return Err(BadRecord::DeviceName(name));
    }
    Ok(name)
}

fn boolean(v: &str) -> Result<bool, BadRecord> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(BadRecord::NotBoolean(v.to_string())),
    }
}

/// The lines of a record, each made text: a byte that is not part of valid
/// UTF-8 (a record edited by hand) becomes its `%XX` escape, which decodes
/// back to that byte where a path may hold it and is refused elsewhere.
fn lines(text: &[u8]) -> impl Iterator<Item = String> + '_ {
    let text = text.strip_suffix(b"\n").unwrap_or(text);
    text.split(|&c| c == b'\n')
        .filter(move |_| !text.is_empty())
        .map(|l| esc_invalid(l.strip_suffix(b"\r").unwrap_or(l)))
}

fn esc_invalid(b: &[u8]) -> String {
    let mut o = String::with_capacity(b.len());
    for chunk in b.utf8_chunks() {
        o.push_str(chunk.valid());
        for x in chunk.invalid() {
            o.push_str(&format!("%{x:02X}"));
        }
    }
    o
}

/// A bind target from a record: what a request's target would have to be
/// (validate.rs's rules) and where it is relative to `root`. A root whose
/// canonical path is not UTF-8 (reached through such a symlink) makes a
/// target that is not either: the part beneath the root is what a request
/// named, so that part is checked.
fn bind_target(root: &Path, target: &Path) -> Result<(PathBuf, PathBuf), BadRecord> {
    let target = match target.to_str() {
        Some(t) if root.to_str().is_some() => validate::target(root, t)?,
        _ => {
            if target.as_os_str().len() >= validate::PATH_MAX {
                return Err(BadRecord::TargetTooLong(target.to_path_buf()));
            }
            let rel = target
                .strip_prefix(root)
                .map_err(|_| BadRecord::TargetOutside(target.to_path_buf()))?;
            let rel = rel
                .to_str()
                .ok_or_else(|| BadRecord::TargetNotUtf8(target.to_path_buf()))?;
            let t = validate::target(Path::new("/"), &format!("/{rel}"))?;
            root.join(t.strip_prefix("/").unwrap_or(&t))
        }
    };
    let rel = match target.strip_prefix(root) {
        Ok(rel) => rel.to_path_buf(),
        Err(_) => return Err(BadRecord::TargetOutside(target)),
    };
    Ok((target, rel))
}

/// The fields of a record as read, before they are checked together.
#[derive(Default)]
struct Fields {
    version: u32,
    id: Option<String>,
    source: Option<Source>,
    device: Option<PathBuf>,
    name: Option<String>,
    devnum: Option<(u32, u32)>,
    device_serial: Option<String>,
    fs: Option<FsType>,
    options: Vec<String>,
    read_only: bool,
    fs_group: Option<FsGroup>,
    /// 0 when the record has no `trim_interval_s` line.
    trim_interval_s: u32,
    block: bool,
    ro_set: bool,
    mount_id: Option<MountId>,
    /// A record says `complete=false` while its fsGroup walk was unfinished.
    incomplete: bool,
    binds: Vec<Bind>,
    /// The `bind_idmap=` lines: a bind's target and its mappings.
    idmaps: Vec<(PathBuf, crate::model::IdMap)>,
    /// An encrypted volume's lines.
    enc: encrypted::Fields,
}

impl Fields {
    /// Takes one `key=value` line; unknown keys are left for newer agents.
    fn take(&mut self, k: &str, v: &str, root: &Path) -> Result<(), BadRecord> {
        if self.enc.take(k, v, |s| unesc(s.as_bytes(), "value").ok())? {
            return Ok(());
        }
        match k {
            "version" => {
                self.version = match v {
                    "1" => 1,
                    "2" => 2,
                    "3" => 3,
                    "4" => 4,
                    _ => return Err(BadRecord::Version(v.to_string())),
                }
            }
            "id" => self.id = Some(unesc(v.as_bytes(), "id")?),
            "serial" => {
                let s = unesc(v.as_bytes(), "serial")?;
                validate::serial(&s)?;
                self.source = Some(Source::Serial(s));
            }
            "device_path" => {
                let p = unesc(v.as_bytes(), "device_path")?;
                self.source = Some(Source::Path(validate::device_path(&p)?))
            }
            "device" => {
                let p = unesc(v.as_bytes(), "device")?;
                self.device = Some(validate::device_path(&p)?)
            }
            "name" => self.name = Some(unesc(v.as_bytes(), "name")?),
            "devnum" => self.devnum = Some(parse_devnum(v).ok_or_else(|| value("devnum", v))?),
            "device_serial" => self.device_serial = Some(unesc(v.as_bytes(), "device_serial")?),
            "fs" => self.fs = Some(FsType::parse(v).ok_or_else(|| value("fs", v))?),
            "option" => self.options.push(unesc(v.as_bytes(), "option")?),
            "read_only" => self.read_only = boolean(v)?,
            "fs_group" => self.fs_group = Some(fs_group(v)?),
            "trim_interval_s" => {
                let n = v.parse().map_err(|_| value("trim_interval_s", v))?;
                self.trim_interval_s = validate::trim_interval(n)?;
            }
            "mode" => {
                self.block = match v {
                    "block" => true,
                    "filesystem" => false,
                    _ => return Err(value("mode", v)),
                }
            }
            "ro_set" => self.ro_set = boolean(v)?,
            "mount_id" => self.mount_id = mount_id(v, "mount_id")?,
            "complete" => self.incomplete = !boolean(v)?,
            "bind" => self.binds.push(bind(self.version, v, root)?),
            "bind_idmap" => self
                .idmaps
                .push(idmap::decode(v, |t| unesc_path(t.as_bytes()))?),
            _ => {}
        }
        Ok(())
    }

    /// The volume the fields describe, checked as a request would be.
    fn volume(mut self, root: &Path) -> Result<Volume, BadRecord> {
        use BadRecord::Missing;
        if self.version == 0 {
            return Err(Missing("version line"));
        }
        let id: String = self.id.ok_or(Missing("id"))?;
        validate::volume_id(&id)?;
        let (major, minor) = self.devnum.ok_or(Missing("devnum"))?;
        let name = device_name(self.name.ok_or(Missing("device name"))?)?;
        let block = self.block;
        // A block record has none of a filesystem's parameters, as a request would not.
        let mode = match (block, self.fs) {
            (false, Some(fs)) => VolumeMode::Filesystem(fs),
            (false, None) => return Err(Missing("fs")),
            (true, None) if self.options.is_empty() && self.fs_group.is_none() => VolumeMode::Block,
            (true, _) => return Err(BadRecord::BlockWithFilesystem),
        };
        if block && self.version < 3 {
            return Err(BadRecord::BlockInVersion(self.version));
        }
        if self.ro_set && !(block && self.read_only) {
            return Err(BadRecord::RoSetNotBlock);
        }
        let plain =
            |b: &Bind| b.subpath.as_os_str().is_empty() && b.rro == RecursiveReadOnly::Disabled;
        if block && !self.binds.iter().all(plain) {
            return Err(BadRecord::BlockBindNotPlain);
        }
        if self.trim_interval_s != 0 && (block || self.read_only) {
            return Err(BadRecord::TrimNotTrimmable);
        }
        idmap::attach(&mut self.binds, self.idmaps, block)?;
        let device = Device {
            name,
            path: self.device.ok_or(Missing("device"))?,
            major,
            minor,
            serial: self.device_serial,
        };
        let enc = self.enc.finish(&id, &device)?;
        if let Some((_, e)) = &enc {
            if self.version < 4 {
                return Err(BadRecord::Version(format!(
                    "{} with encryption",
                    self.version
                )));
            }
            validate::device_path(&e.disk.path.to_string_lossy())?;
            device_name(e.disk.name.clone())?;
        }
        let (encryption, encrypted) = enc.map_or((None, None), |(a, e)| (Some(a), Some(e)));
        let spec = Spec {
            volume_id: id,
            source: self.source.ok_or(Missing("source"))?,
            mode,
            options: Options::parse(self.options, self.read_only)?,
            fs_group: self.fs_group,
            encryption,
            trim_interval_s: self.trim_interval_s,
        };
        let guest_path = root.join(VOLUMES_DIR).join(&spec.volume_id);
        let mut vol = Volume::recorded(
            spec,
            device,
            guest_path,
            self.ro_set,
            Phase::from_record(self.mount_id, !self.incomplete),
            self.binds,
        );
        vol.encrypted = encrypted;
        Ok(vol)
    }
}

/// A record's `fs_group=GID:POLICY`.
fn fs_group(v: &str) -> Result<FsGroup, BadRecord> {
    let (g, p) = v.split_once(':').ok_or_else(|| value("fs_group", v))?;
    let policy = match p {
        "always" => Policy::Always,
        "on-root-mismatch" => Policy::OnRootMismatch,
        _ => return Err(value("fs_group policy", p)),
    };
    let gid = g.parse().map_err(|_| value("fs_group gid", g))?;
    Ok(FsGroup {
        gid: validate::gid(gid)?,
        policy,
    })
}

/// A record's `bind=…` line (tab-separated; version 1 had no mount id).
fn bind(version: u32, v: &str, root: &Path) -> Result<Bind, BadRecord> {
    let f: Vec<&str> = v.split('\t').collect();
    let (ro, rro, applied, sub, target, id) = match (version, f.as_slice()) {
        (1, [a, b, c, d, e]) => (*a, *b, *c, *d, *e, "0"),
        (2..=4, [a, b, c, d, e, g]) => (*a, *b, *c, *d, *e, *g),
        _ => return Err(BadRecord::BindFields(v.to_string())),
    };
    let (target, rel) = bind_target(root, &unesc_path(target.as_bytes()))?;
    let rro = rro_parse(rro).ok_or_else(|| value("recursive_read_only", rro))?;
    let read_only = boolean(ro)?;
    validate::recursive_read_only(read_only, rro)?;
    Ok(Bind {
        read_only,
        rro,
        rro_applied: boolean(applied)?,
        subpath: validate::subpath(&unesc(sub.as_bytes(), "subpath")?)?,
        target,
        rel,
        mount_id: mount_id(id, "bind mount id")?,
        idmap: None,
    })
}

/// Decodes a record (bytes, as read), checking every field as a request's
/// would be checked against `root` (the canonical root). The error says
/// what is wrong.
pub(crate) fn decode(text: &(impl AsRef<[u8]> + ?Sized), root: &Path) -> Result<Volume, BadRecord> {
    let mut f = Fields::default();
    for line in lines(text.as_ref()) {
        let Some((k, v)) = line.split_once('=') else {
            return Err(BadRecord::NotKeyValue(line));
        };
        f.take(k, v, root)?;
    }
    f.volume(root)
}

/// The fuzz target's way in (`crust_agent::fuzz::state_record`): decodes
/// `text` as a restart would and, when it decodes, checks that the record
/// written for it decodes to the same volume (panics on any difference).
/// Whether `text` decoded.
#[cfg(feature = "fuzz")]
pub(crate) fn fuzz_record(text: &[u8], root: &Path) -> bool {
    let Ok(v) = decode(text, root) else {
        return false;
    };
    let written = encode(&v);
    match decode(&written, root) {
        Ok(back) => assert_eq!(
            format!("{back:?}"),
            format!("{v:?}"),
            "the record written for a decoded record reads back differently:\n{written}"
        ),
        Err(why) => {
            panic!("the record written for a decoded record does not decode ({why}):\n{written}")
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volumes::volume::tests::{block_sample, sample};

    #[test]
    fn records_round_trip() {
        let v = sample();
        let back = decode(&encode(&v), Path::new("/r")).unwrap();
        assert_eq!(back.info(), v.info());
        assert_eq!(back.spec, v.spec);
        assert_eq!(back.spec.options.mount(), v.spec.options.mount());
        assert_eq!(back.binds, v.binds);
        assert_eq!(back.device, v.device);
        let recorded = |v: &Volume| (v.phase.mount_id(), v.phase.complete());
        assert_eq!(recorded(&back), (Some(MountId(77)), true));
        let mut half = v.clone();
        half.phase = Phase::Mounted(MountId(77));
        let back = decode(&encode(&half), Path::new("/r")).unwrap();
        assert_eq!(recorded(&back), (Some(MountId(77)), false));
        assert!(encode(&half).contains("\nmount_id=77\ncomplete=false\n"));
        // Before its mount: no id, not complete, as agents always wrote it.
        half.phase = Phase::Recorded;
        assert!(encode(&half).contains("\nmount_id=0\ncomplete=false\n"));
        let back = decode(&encode(&half), Path::new("/r")).unwrap();
        assert!(matches!(back.phase, Phase::Recorded));
    }

    /// An idmapped bind's mappings round-trip in a `bind_idmap=` line after
    /// the bind lines, which keep their shape for older agents; a line
    /// that names no bind refuses the record.
    #[test]
    fn idmapped_binds_round_trip() {
        let mut v = sample();
        let r = |c, h, l| crate::model::IdRange {
            container_id: c,
            host_id: h,
            length: l,
        };
        let mut plain = v.binds[0].clone();
        plain.target = "/r/pods/plain".into();
        plain.rel = "pods/plain".into();
        v.binds[0].idmap = Some(crate::model::IdMap {
            uids: vec![r(0, 100000, 65536)],
            gids: vec![r(0, 100000, 1000), r(1000, 5, 1)],
        });
        v.binds.push(plain);
        let text = encode(&v);
        assert!(text.starts_with("version=2\n"), "{text}");
        assert!(
            text.ends_with("\nbind_idmap=/r/pods/a b\t0:100000:65536\t0:100000:1000,1000:5:1\n"),
            "{text}"
        );
        let back = decode(&text, Path::new("/r")).unwrap();
        assert_eq!(back.binds, v.binds);
        assert_eq!(back.info(), v.info());
        let stray = text.replace("bind_idmap=/r/pods/a b", "bind_idmap=/r/pods/none");
        assert!(matches!(
            decode(&stray, Path::new("/r")),
            Err(BadRecord::Idmap(_))
        ));
        let half = text.replace("\t0:100000:1000,1000:5:1", "\t");
        assert!(decode(&half, Path::new("/r")).is_err());
    }

    /// A value ending in a carriage return (a request's option, a disk's
    /// serial) reads back with it: the reader drops one CR before each line
    /// end, for records edited by hand, so the writer must escape it. Found
    /// by the state_record fuzz target (fuzz/corpus/state_record/finding-trailing-cr).
    #[test]
    fn a_carriage_return_ending_a_value_survives_a_rewrite() {
        let mut v = sample();
        v.spec.options =
            Options::parse(vec!["noatime\r".into(), "a\r\rb\r\r".into()], false).unwrap();
        v.device.serial = Some("ser\r".into());
        v.spec.source = Source::Path("/dev/vdb\r".into());
        let back = decode(&encode(&v), Path::new("/r")).unwrap();
        assert_eq!(back.spec, v.spec);
        assert_eq!(back.spec.options.mount(), v.spec.options.mount());
        assert_eq!(back.device, v.device);
        // A record whose lines end in CRLF still reads.
        let crlf = encode(&sample()).replace('\n', "\r\n");
        assert_eq!(decode(&crlf, Path::new("/r")).unwrap().spec, sample().spec);
    }

    /// A trim schedule is a key of its own, written only when set: a
    /// record without it (any older agent's) reads as no schedule, and one
    /// a request would have refused is refused.
    #[test]
    fn a_trim_schedule_round_trips_and_older_records_have_none() {
        let mut v = sample();
        assert!(!encode(&v).contains("trim_interval_s"));
        v.spec.trim_interval_s = 3600;
        let text = encode(&v);
        assert!(text.starts_with("version=2\n") && text.contains("\ntrim_interval_s=3600\n"));
        assert_eq!(decode(&text, Path::new("/r")).unwrap().spec, v.spec);
        let old = text.replace("trim_interval_s=3600\n", "");
        assert_eq!(
            decode(&old, Path::new("/r")).unwrap().spec.trim_interval_s,
            0
        );
        for bad in [
            "trim_interval_s=5\n",
            "trim_interval_s=x\n",
            "trim_interval_s=-1\n",
        ] {
            let t = text.replace("trim_interval_s=3600\n", bad);
            assert!(decode(&t, Path::new("/r")).is_err(), "{bad}");
        }
        let ro = text.replace("read_only=false", "read_only=true");
        let e = decode(&ro, Path::new("/r")).unwrap_err();
        assert!(matches!(e, BadRecord::TrimNotTrimmable), "{e}");
    }

    /// An `ro` among the options is read-only, and reads back so.
    #[test]
    fn an_ro_option_reads_back_read_only() {
        let mut v = sample();
        v.spec.options = Options::parse(vec!["noatime,ro".into()], false).unwrap();
        let back = decode(&encode(&v), Path::new("/r")).unwrap();
        assert!(back.mounted_read_only());
    }

    #[test]
    fn block_records_round_trip_and_say_so() {
        let v = block_sample();
        let text = encode(&v);
        assert!(text.starts_with("version=3\nmode=block\n"), "{text}");
        assert!(!text.contains("fs="), "{text}");
        let back = decode(&text, Path::new("/r")).unwrap();
        assert_eq!(back.mode(), VolumeMode::Block);
        assert!(back.ro_set() && back.spec.options.read_only_flag() && back.mounted_read_only());
        assert_eq!(back.binds, v.binds);
        assert_eq!(back.info(), v.info());
        // A filesystem volume keeps the version older agents read.
        assert!(encode(&sample()).starts_with("version=2\n"));
    }

    #[test]
    fn block_records_are_checked_like_block_requests() {
        let root = Path::new("/r");
        let good = encode(&block_sample());
        for (from, to, what) in [
            (
                "ro_set=true",
                "ro_set=true\nfs=ext4",
                "a block volume with a filesystem",
            ),
            (
                "ro_set=true",
                "ro_set=true\noption=noatime",
                "a block volume with options",
            ),
            (
                "ro_set=true",
                "ro_set=true\nfs_group=5:always",
                "a block volume with an fsGroup",
            ),
            (
                "version=3",
                "version=2",
                "a block volume in an older version",
            ),
            ("mode=block", "mode=tape", "an unknown mode"),
            (
                "read_only=true",
                "read_only=false",
                "ro_set on a read-write volume",
            ),
            (
                "bind=true\tdisabled\tfalse\t\t",
                "bind=true\tdisabled\tfalse\tdata\t",
                "a bind with a subpath",
            ),
        ] {
            assert!(good.contains(from), "{from} in {good}");
            let text = good.replacen(from, to, 1);
            assert!(decode(&text, root).is_err(), "{what} must be refused");
        }
        // A filesystem record may not claim a flag only block volumes have.
        let fs = encode(&sample()).replace("complete=true", "complete=true\nro_set=true");
        assert!(decode(&fs, root).is_err());
    }

    #[test]
    fn paths_in_records_are_bytes() {
        // A root reached through a name that is not UTF-8: the guest path
        // and bind targets beneath it keep their exact bytes, and the record
        // holds them as escapes, so it stays text.
        let root = Path::new(OsStr::from_bytes(b"/r\xff"));
        let mut v = sample();
        v.guest_path = root.join("volumes/vol-1");
        v.binds[0].target = root.join("pods/a b");
        let text = encode(&v);
        assert!(text.contains("\t/r%FF/pods/a b\t"), "{text}");
        assert!(std::str::from_utf8(text.as_bytes()).is_ok());
        let back = decode(&text, root).unwrap();
        assert_eq!(back.binds, v.binds);
        assert_eq!(back.guest_path, v.guest_path);
        // The same byte written raw, as a hand-edited record might hold it, reads the same.
        let raw = text.replace("/r%FF/", "/r\u{1}/").into_bytes();
        let raw: Vec<u8> = raw.iter().map(|&c| if c == 1 { 0xff } else { c }).collect();
        assert_eq!(decode(&raw, root).unwrap().binds, v.binds);
        // Beneath a root that is not UTF-8, the target is still checked as a request's.
        for bad in [
            "/r%FF/state/x",
            "/r%FF/../etc",
            "/r%FF",
            "/etc/x",
            "/r%FF/pods/%FF",
        ] {
            let t = text.replace("/r%FF/pods/a b", bad);
            assert!(decode(&t, root).is_err(), "{bad} must be refused");
        }
        // Text fields must be text.
        let t = encode(&sample()).replace("id=vol-1", "id=vol-%FF");
        assert!(matches!(
            decode(&t, Path::new("/r")),
            Err(BadRecord::NotUtf8("id"))
        ));
    }

    #[test]
    fn escapes_read_as_older_agents_wrote_them() {
        // Older agents escaped only %, newline and tab; a bare % stays itself.
        assert_eq!(unesc_bytes(b"a%25b%0Ac%09d"), b"a%b\nc\td");
        assert_eq!(unesc_bytes(b"100%"), b"100%");
        assert_eq!(unesc_bytes(b"%zz%4"), b"%zz%4");
        assert_eq!(esc_bytes(b"x%\n\t\xc3\xa9\xff"), "x%25%0A%09\u{e9}%FF");
        for b in [&b"plain"[..], b"%41", b"\xff\xfe/\xc3(", b"\n%\t"] {
            assert_eq!(unesc_bytes(esc_bytes(b).as_bytes()), b, "{b:?}");
        }
    }

    #[test]
    fn version_1_records_still_read() {
        let text = "version=1\nid=old\nserial=s1\ndevice=/dev/vdb\nname=vdb\ndevnum=254:16\n\
                    fs=ext4\nread_only=false\nbind=false\tdisabled\tfalse\t\t/r/pods/x\n";
        let v = decode(text, Path::new("/r")).unwrap();
        assert_eq!((v.phase.mount_id(), v.phase.complete()), (None, true));
        assert_eq!(v.binds[0].rel, PathBuf::from("pods/x"));
        assert_eq!(v.binds[0].mount_id, None);
    }

    /// Recovery joins a record's device name into sysfs paths (ext4's error
    /// count, the devtmpfs node of a block volume): only a name the kernel
    /// could give a block device reads back; `.`, `..`, control characters
    /// and NUL are refused like `/` always was.
    #[test]
    fn device_names_must_be_names_the_kernel_gives() {
        let root = Path::new("/r");
        let good = encode(&sample());
        assert!(good.contains("name=vdb\n"), "{good}");
        let long = "x".repeat(256);
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "vd\0b",
            "vd\nb",
            "\u{1}",
            "vdb\u{7f}",
            &long,
        ] {
            let text = good.replacen("name=vdb\n", &format!("name={}\n", esc(bad)), 1);
            let e = decode(&text, root).expect_err(bad);
            assert!(matches!(e, BadRecord::DeviceName(_)), "{bad:?}: {e}");
        }
        for fine in ["vdb", "loop3p1", "nvme0n1", "cciss!c0d0", "dm-0"] {
            let text = good.replacen("name=vdb\n", &format!("name={fine}\n"), 1);
            assert_eq!(decode(&text, root).unwrap().device.name, fine);
        }
    }

    #[test]
    fn records_are_checked_like_requests() {
        let root = Path::new("/r");
        assert!(decode("", root).is_err());
        assert!(decode("version=4\nid=a\n", root).is_err());
        assert!(decode("no equals sign", root).is_err());
        let good = encode(&sample());
        for (from, to, what) in [
            ("id=vol-1", "id=../../etc", "an id that escapes the root"),
            (
                "option=noatime",
                "option=remount",
                "an option publishing refuses",
            ),
            ("option=noatime", "option=errors=panic", "errors=panic"),
            (
                "\t/r/pods/a b\t",
                "\t/etc/cron.d\t",
                "a bind target outside the root",
            ),
            (
                "\t/r/pods/a b\t",
                "\t/r/state/x\t",
                "a bind target in state/",
            ),
            ("\t/r/pods/a b\t", "\t/r/../etc\t", "a bind target with .."),
            ("data/x", "../../etc", "a subpath that climbs out"),
            (
                "device=/dev/vdb",
                "device=/etc/passwd",
                "a device outside /dev",
            ),
            ("name=vdb", "name=../vdb", "a device name with a slash"),
            ("serial=vol-0123", "serial=a b", "a malformed serial"),
            ("read_only=false", "read_only=maybe", "a malformed boolean"),
            ("mount_id=77", "mount_id=x", "a malformed mount id"),
        ] {
            assert!(good.contains(from), "{from}");
            let text = good.replace(from, to);
            assert!(decode(&text, root).is_err(), "{what} must be refused");
        }
    }

    /// An encrypted volume's part of its record (encrypted.rs).
    mod encrypted {
        use std::path::Path;

        use super::super::*;
        use crate::luks2::mapping::{Mapping, Owner};
        use crate::model::Device;
        use crate::volumes::request::Encryption;
        use crate::volumes::volume::tests::sample;
        use crate::volumes::volume::{Encrypted, Volume};

        /// Volume `vol-1` of `sample()`, encrypted: its device the mapping.
        fn encrypted() -> Volume {
            let mut v = sample();
            let disk = v.device.clone();
            v.device = Device {
                name: "dm-3".into(),
                path: "/dev/dm-3".into(),
                major: 253,
                minor: 3,
                serial: None,
            };
            v.spec.encryption = Some(Encryption {
                allow_discards: true,
                format_if_blank: false,
                integrity: None,
            });
            v.encrypted = Some(Encrypted {
                disk,
                mapping: Mapping {
                    name: "crust-vol-1".into(),
                    dm_uuid: "CRYPT-LUKS2-0123456789abcdef0123456789abcdef-crust-vol-1".into(),
                    dev: (253, 3),
                    luks_uuid: "01234567-89ab-cdef-0123-456789abcdef".into(),
                    cipher: "aes-xts-plain64".into(),
                    key_bits: 512,
                    integrity: None,
                    allow_discards: true,
                    log_from: 0,
                },
            });
            v
        }

        #[test]
        fn an_encrypted_record_round_trips_and_is_version_4() {
            let v = encrypted();
            let text = encode(&v);
            assert!(text.starts_with("version=4\n"), "{text}");
            let back = decode(&text, Path::new("/r")).unwrap();
            assert_eq!(back.spec, v.spec);
            assert_eq!(back.encrypted, v.encrypted);
            assert_eq!(back.device, v.device);
            assert_eq!(back.info(), v.info());
            assert_eq!(back.disk().serial.as_deref(), Some("vol-0123"));
        }

        /// A record cannot point the agent at a mapping it did not make for
        /// the volume, nor carry encryption in an older version, nor half of it.
        #[test]
        fn records_naming_another_mapping_or_half_an_encryption_are_refused() {
            let text = encode(&encrypted());
            let root = Path::new("/r");
            for (from, to, why) in [
                (
                    "mapping=crust-vol-1\t",
                    "mapping=crust-other\t",
                    "not the one",
                ),
                (
                    "CRYPT-LUKS2-0123456789abcdef0123456789abcdef-crust-vol-1",
                    "CRYPT-LUKS2-0123456789abcdef0123456789abcdef-crust-other",
                    "not the one",
                ),
                ("version=4\n", "version=2\n", "version"),
                ("encryption=luks2\ttrue\tfalse\n", "", "no encryption line"),
                (
                    "encryption=luks2\ttrue\tfalse\n",
                    "encryption=luks1\ttrue\tfalse\n",
                    "encryption",
                ),
            ] {
                assert!(text.contains(from), "{from:?} not in {text}");
                let bad = text.replacen(from, to, 1);
                let e = decode(&bad, root)
                    .err()
                    .unwrap_or_else(|| panic!("{from:?} → {to:?} decoded"));
                assert!(e.to_string().contains(why), "{from:?} → {to:?}: {e}");
            }
        }

        /// A record names its mapping as its agent does (tagged with the
        /// store's owner) or as agents before owners did (untagged); one
        /// tagged with another owner is refused whole, when loaded.
        #[test]
        fn a_record_naming_another_owners_mapping_is_refused() {
            let dir = tempfile::tempdir().unwrap();
            let root = beneath::Root::open(dir.path()).unwrap();
            let store = Store::open(&root).unwrap();
            let other = Owner::of_dir(1, 2);
            for (owner, good) in [
                (None, true),
                (Some(store.owner()), true),
                (Some(&other), false),
            ] {
                let mut v = encrypted();
                v.binds.clear(); // beneath "/r", not this root
                let m = &mut v.encrypted.as_mut().unwrap().mapping;
                if let Some(o) = owner {
                    m.name = o.name_for("vol-1");
                    m.dm_uuid = format!("CRYPT-LUKS2-0123456789abcdef0123456789abcdef-{}", m.name);
                }
                store.save(&v).unwrap();
                let loaded = store.load(root.path()).unwrap();
                match (&loaded[..], good) {
                    ([Record::Good(back)], true) => assert_eq!(back.encrypted, v.encrypted),
                    ([Record::Bad(_, e @ BadRecord::OtherOwner { .. })], false) => {
                        assert!(e.to_string().contains(&store.owner().to_string()), "{e}");
                    }
                    ([Record::Bad(_, e)], _) => panic!("{owner:?}: {e}"),
                    _ => panic!("{owner:?}: loaded as it should not be"),
                }
            }
        }

        /// The integrity a volume was asked to be made with is a line of
        /// its own, written only when asked: a record without it (an older
        /// agent's) asks none, and one with a value the agent does not make,
        /// or without the encryption line, is refused.
        #[test]
        fn the_integrity_asked_is_recorded_only_when_asked() {
            use crate::luks2::format::Mac;
            let root = Path::new("/r");
            let plain = encode(&encrypted());
            assert!(!plain.contains("format_integrity"), "{plain}");
            let mut v = encrypted();
            let enc = v.spec.encryption.as_mut().unwrap();
            enc.format_if_blank = true;
            enc.allow_discards = false;
            enc.integrity = Some(Mac::HmacSha256);
            let text = encode(&v);
            assert!(text.contains("\nformat_integrity=hmac-sha256\n"), "{text}");
            let back = decode(&text, root).unwrap();
            assert_eq!(back.spec, v.spec);
            let older = text.replace("format_integrity=hmac-sha256\n", "");
            let back = decode(&older, root).unwrap();
            assert_eq!(back.spec.encryption.unwrap().integrity, None);
            for (to, why) in [
                ("format_integrity=hmac-sha512\n", "format_integrity"),
                ("format_integrity=\n", "format_integrity"),
            ] {
                let bad = text.replace("format_integrity=hmac-sha256\n", to);
                let e = decode(&bad, root).err().unwrap();
                assert!(e.to_string().contains(why), "{to:?}: {e}");
            }
            let half = text.replace("encryption=luks2\ttrue\tfalse\n", "");
            let half = half.replace("encryption=luks2\tfalse\ttrue\n", "");
            assert!(decode(&half, root).is_err(), "{half}");
        }
    }
}

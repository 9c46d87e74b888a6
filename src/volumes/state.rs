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
//! misread it as a filesystem. Every older version still reads.

use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags};

use super::{Bind, FsGroup, Source, Volume, VolumeMode};
use crate::beneath;
use crate::device::Device;
use crate::errors::SysError;
use crate::mount::{self, RecursiveReadOnly};
use crate::ownership::Policy;
use crate::probe::FsType;
use crate::validate;

/// The state directory, opened once beneath the root.
#[derive(Debug)]
pub(super) struct Store {
    /// `<root>/state`, for messages.
    path: PathBuf,
    /// Opened for reading (readdir) and fsync, not O_PATH.
    dir: OwnedFd,
}

/// What a listing of the state directory holds.
pub(super) enum Record {
    /// A record that decoded.
    Good(Box<Volume>),
    /// A record that does not decode: its volume id (from the file name) and why.
    Bad(String, String),
}

impl Store {
    /// Opens `<root>/state` (creating it 0700), refusing a symlink there.
    pub(super) fn open(root: &beneath::Root) -> Result<Store, SysError> {
        root.own_dir("state", 0o700)?;
        let path = root.join(Path::new("state"));
        let dir = beneath::open_with(
            root.fd(),
            Path::new("state"),
            OFlags::RDONLY | OFlags::DIRECTORY,
            beneath::strict(),
        )
        .map_err(|e| SysError::new("openat2", path.display(), e))?;
        Ok(Store { path, dir })
    }

    fn file(id: &str) -> String {
        format!("{id}.vol")
    }

    /// Writes the volume's record atomically.
    pub(super) fn save(&self, vol: &Volume) -> Result<(), SysError> {
        let name = Store::file(&vol.id);
        let tmp = format!("{}.tmp", vol.id);
        let shown = self.path.join(&name);
        let text = encode(vol);
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
            rustix::fs::renameat(&self.dir, tmp.as_str(), &self.dir, name.as_str())?;
            // The rename is durable once the directory is.
            rustix::fs::fsync(&self.dir)?;
            Ok(())
        };
        write().map_err(|e| SysError::new("write", shown.display(), e))
    }

    /// Removes the volume's record; a missing one is fine.
    pub(super) fn remove(&self, id: &str) -> Result<(), SysError> {
        let name = Store::file(id);
        match rustix::fs::unlinkat(&self.dir, name.as_str(), AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(SysError::new("unlink", self.path.join(name).display(), e)),
        }
    }

    /// Sets aside a record that does not decode (`<id>.vol.bad`), for a
    /// human to look at; it no longer stands for a volume.
    pub(super) fn set_aside(&self, id: &str) -> PathBuf {
        let name = Store::file(id);
        let bad = format!("{name}.bad");
        let _ = rustix::fs::renameat(&self.dir, name.as_str(), &self.dir, bad.as_str());
        self.path.join(bad)
    }

    /// Every record, decoded against `root`; half-written temp files are removed.
    pub(super) fn load(&self, root: &Path) -> Result<Vec<Record>, SysError> {
        let mut out = Vec::new();
        let dir = rustix::fs::openat(
            &self.dir,
            c".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| SysError::new("open", self.path.display(), e))?;
        let mut entries = rustix::fs::Dir::new(dir)
            .map_err(|e| SysError::new("readdir", self.path.display(), e))?;
        let mut names = Vec::new();
        while let Some(entry) = entries.read() {
            let entry = entry.map_err(|e| SysError::new("readdir", self.path.display(), e))?;
            names.push(entry.file_name().to_bytes().to_vec());
        }
        names.sort();
        for raw in names {
            let name = OsStr::from_bytes(&raw).to_string_lossy().into_owned();
            if name.ends_with(".tmp") {
                let _ = rustix::fs::unlinkat(&self.dir, name.as_str(), AtFlags::empty());
                continue;
            }
            let Some(id) = name.strip_suffix(".vol") else {
                continue;
            };
            let text = read_at(self.dir.as_fd(), &name);
            let record = match text {
                Err(e) => Record::Bad(id.to_string(), format!("unreadable: {e}")),
                Ok(text) => match decode(&text, root) {
                    Ok(v) if v.id == id => Record::Good(Box::new(v)),
                    Ok(v) => Record::Bad(
                        id.to_string(),
                        format!("it names volume {}, not {id}", v.id),
                    ),
                    Err(why) => Record::Bad(id.to_string(), why),
                },
            };
            out.push(record);
        }
        Ok(out)
    }
}

/// Reads a small record through the directory fd, without following a symlink.
fn read_at(dir: std::os::fd::BorrowedFd<'_>, name: &str) -> std::io::Result<String> {
    use std::io::Read;
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut text = String::new();
    // A record is a few hundred bytes; anything past 1 MiB is not one of ours.
    std::fs::File::from(fd)
        .take(1 << 20)
        .read_to_string(&mut text)?;
    Ok(text)
}

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => o.push_str("%25"),
            '\n' => o.push_str("%0A"),
            '\t' => o.push_str("%09"),
            c => o.push(c),
        }
    }
    o
}

fn unesc(s: &str) -> String {
    s.replace("%0A", "\n")
        .replace("%09", "\t")
        .replace("%25", "%")
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
pub(super) fn encode(v: &Volume) -> String {
    let mut o = match v.mode {
        VolumeMode::Filesystem(_) => String::from("version=2\n"),
        VolumeMode::Block => String::from("version=3\nmode=block\n"),
    };
    o += &format!("id={}\n", esc(&v.id));
    match &v.source {
        Source::Serial(s) => o += &format!("serial={}\n", esc(s)),
        Source::Path(p) => o += &format!("device_path={}\n", esc(&p.to_string_lossy())),
    }
    o += &format!("device={}\n", esc(&v.device.path.to_string_lossy()));
    o += &format!("name={}\n", esc(&v.device.name));
    o += &format!("devnum={}:{}\n", v.device.major, v.device.minor);
    if let Some(s) = &v.device.serial {
        o += &format!("device_serial={}\n", esc(s));
    }
    match v.mode {
        VolumeMode::Filesystem(fs) => o += &format!("fs={}\n", fs.name()),
        VolumeMode::Block => o += &format!("ro_set={}\n", v.ro_set),
    }
    for opt in &v.options {
        o += &format!("option={}\n", esc(opt));
    }
    o += &format!("read_only={}\n", v.read_only);
    if let Some(g) = v.fs_group {
        let p = match g.policy {
            Policy::Always => "always",
            Policy::OnRootMismatch => "on-root-mismatch",
        };
        o += &format!("fs_group={}:{p}\n", g.gid);
    }
    o += &format!("mount_id={}\n", v.mount_id);
    o += &format!("complete={}\n", v.complete);
    for b in &v.binds {
        o += &format!(
            "bind={}\t{}\t{}\t{}\t{}\t{}\n",
            b.read_only,
            rro_name(b.rro),
            b.rro_applied,
            esc(&b.subpath.to_string_lossy()),
            esc(&b.target.to_string_lossy()),
            b.mount_id
        );
    }
    o
}

fn boolean(v: &str) -> Result<bool, String> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("{v:?} is not true or false")),
    }
}

/// Decodes a record, checking every field as a request's would be checked
/// against `root` (the canonical root). The error says what is wrong.
pub(super) fn decode(text: &str, root: &Path) -> Result<Volume, String> {
    let (mut id, mut source, mut dev, mut name, mut devnum, mut dserial, mut fs) =
        (None, None, None, None, None, None, None);
    let (mut options, mut read_only, mut fs_group, mut binds) =
        (Vec::new(), false, None, Vec::new());
    let (mut version, mut mount_id, mut complete) = (0, 0u64, true);
    let (mut block, mut ro_set) = (false, false);
    for line in text.lines() {
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| format!("line {line:?} is not key=value"))?;
        match k {
            "version" => {
                version = match v {
                    "1" => 1,
                    "2" => 2,
                    "3" => 3,
                    _ => return Err(format!("version {v} is not one this agent knows")),
                }
            }
            "id" => id = Some(unesc(v)),
            "serial" => {
                let s = unesc(v);
                validate::serial(&s).map_err(|e| e.0)?;
                source = Some(Source::Serial(s));
            }
            "device_path" => {
                source = Some(Source::Path(
                    validate::device_path(&unesc(v)).map_err(|e| e.0)?,
                ))
            }
            "device" => dev = Some(validate::device_path(&unesc(v)).map_err(|e| e.0)?),
            "name" => name = Some(unesc(v)),
            "devnum" => {
                devnum =
                    Some(crate::device::parse_devnum(v).ok_or_else(|| format!("devnum {v:?}"))?)
            }
            "device_serial" => dserial = Some(unesc(v)),
            "fs" => fs = Some(FsType::parse(v).ok_or_else(|| format!("fs {v:?}"))?),
            "option" => options.push(unesc(v)),
            "read_only" => read_only = boolean(v)?,
            "fs_group" => {
                let (g, p) = v.split_once(':').ok_or_else(|| format!("fs_group {v:?}"))?;
                let policy = match p {
                    "always" => Policy::Always,
                    "on-root-mismatch" => Policy::OnRootMismatch,
                    _ => return Err(format!("fs_group policy {p:?}")),
                };
                let gid = g.parse().map_err(|_| format!("fs_group gid {g:?}"))?;
                fs_group = Some(FsGroup {
                    gid: validate::gid(gid).map_err(|e| e.0)?,
                    policy,
                });
            }
            "mode" => {
                block = match v {
                    "block" => true,
                    "filesystem" => false,
                    _ => return Err(format!("mode {v:?}")),
                }
            }
            "ro_set" => ro_set = boolean(v)?,
            "mount_id" => mount_id = v.parse().map_err(|_| format!("mount_id {v:?}"))?,
            "complete" => complete = boolean(v)?,
            "bind" => {
                let f: Vec<&str> = v.split('\t').collect();
                let (ro, rro, applied, sub, target, id) = match (version, f.as_slice()) {
                    (1, [a, b, c, d, e]) => (*a, *b, *c, *d, *e, "0"),
                    (2 | 3, [a, b, c, d, e, g]) => (*a, *b, *c, *d, *e, *g),
                    _ => return Err(format!("bind {v:?} has the wrong number of fields")),
                };
                let target = validate::target(root, &unesc(target)).map_err(|e| e.0)?;
                let rel = target
                    .strip_prefix(root)
                    .map_err(|_| format!("bind target {} is outside the root", target.display()))?
                    .to_path_buf();
                let rro = rro_parse(rro).ok_or_else(|| format!("recursive_read_only {rro:?}"))?;
                let read_only = boolean(ro)?;
                validate::recursive_read_only(read_only, rro).map_err(|e| e.0)?;
                binds.push(Bind {
                    read_only,
                    rro,
                    rro_applied: boolean(applied)?,
                    subpath: validate::subpath(&unesc(sub)).map_err(|e| e.0)?,
                    target,
                    rel,
                    mount_id: id.parse().map_err(|_| format!("bind mount id {id:?}"))?,
                });
            }
            _ => {}
        }
    }
    if version == 0 {
        return Err("no version line".into());
    }
    let id: String = id.ok_or("no id")?;
    validate::volume_id(&id).map_err(|e| e.0)?;
    let (major, minor) = devnum.ok_or("no devnum")?;
    let name: String = name.ok_or("no device name")?;
    if name.is_empty() || name.contains('/') {
        return Err(format!("device name {name:?}"));
    }
    // A block record has none of a filesystem's parameters, as a request would not.
    let mode = match (block, fs) {
        (false, Some(fs)) => VolumeMode::Filesystem(fs),
        (false, None) => return Err("no fs".into()),
        (true, None) if options.is_empty() && fs_group.is_none() => VolumeMode::Block,
        (true, _) => {
            return Err("a block volume with a filesystem, mount options or an fsGroup".into())
        }
    };
    if block && version < 3 {
        return Err(format!("a block volume in a version {version} record"));
    }
    if ro_set && !(block && read_only) {
        return Err("ro_set on a volume that is not a read-only block volume".into());
    }
    for b in &binds {
        if block && (!b.subpath.as_os_str().is_empty() || b.rro != RecursiveReadOnly::Disabled) {
            return Err("a block volume's bind with a subpath or recursive read-only".into());
        }
    }
    Ok(Volume {
        guest_path: root.join("volumes").join(&id),
        id,
        source: source.ok_or("no source")?,
        device: Device {
            name,
            path: dev.ok_or("no device")?,
            major,
            minor,
            serial: dserial,
        },
        mode,
        mount: mount::parse_options(&options, read_only).map_err(|e| e.to_string())?,
        options,
        read_only,
        fs_group,
        mount_id,
        complete,
        ro_set,
        binds,
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(crate) fn sample() -> Volume {
        let options = vec!["noatime".into(), "weird%opt\twith\nbreaks".into()];
        Volume {
            id: "vol-1".into(),
            source: Source::Serial("vol-0123".into()),
            device: Device {
                name: "vdb".into(),
                path: "/dev/vdb".into(),
                major: 254,
                minor: 16,
                serial: Some("vol-0123".into()),
            },
            mode: VolumeMode::Filesystem(FsType::Xfs),
            mount: mount::parse_options(&options, false).unwrap(),
            options,
            read_only: false,
            fs_group: Some(FsGroup {
                gid: 2000,
                policy: Policy::OnRootMismatch,
            }),
            guest_path: "/r/volumes/vol-1".into(),
            mount_id: 77,
            complete: true,
            ro_set: false,
            binds: vec![Bind {
                target: "/r/pods/a b".into(),
                rel: "pods/a b".into(),
                subpath: "data/x".into(),
                read_only: true,
                rro: RecursiveReadOnly::IfPossible,
                rro_applied: true,
                mount_id: 78,
            }],
        }
    }

    #[test]
    fn records_round_trip() {
        let v = sample();
        let back = decode(&encode(&v), Path::new("/r")).unwrap();
        assert_eq!(back.info(), v.info());
        assert_eq!(back.options, v.options);
        assert_eq!(back.mount, v.mount);
        assert_eq!(back.fs_group, v.fs_group);
        assert_eq!(back.binds, v.binds);
        assert_eq!(back.device, v.device);
        assert_eq!(back.source, v.source);
        assert_eq!((back.mount_id, back.complete), (77, true));
        let mut half = v.clone();
        half.complete = false;
        assert!(!decode(&encode(&half), Path::new("/r")).unwrap().complete);
    }

    /// A read-only block volume with one bind, as recorded.
    pub(crate) fn block_sample() -> Volume {
        let mut v = sample();
        v.id = "blk-1".into();
        v.guest_path = "/r/volumes/blk-1".into();
        v.mode = VolumeMode::Block;
        v.options = Vec::new();
        v.read_only = true;
        v.mount = mount::parse_options(&[], true).unwrap();
        v.fs_group = None;
        v.ro_set = true;
        v.binds[0].subpath = PathBuf::new();
        v.binds[0].rro = RecursiveReadOnly::Disabled;
        v.binds[0].rro_applied = false;
        v
    }

    #[test]
    fn block_records_round_trip_and_say_so() {
        let v = block_sample();
        let text = encode(&v);
        assert!(text.starts_with("version=3\nmode=block\n"), "{text}");
        assert!(!text.contains("fs="), "{text}");
        let back = decode(&text, Path::new("/r")).unwrap();
        assert_eq!(back.mode, VolumeMode::Block);
        assert!(back.ro_set && back.read_only && back.mounted_read_only());
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
    fn version_1_records_still_read() {
        let text = "version=1\nid=old\nserial=s1\ndevice=/dev/vdb\nname=vdb\ndevnum=254:16\n\
                    fs=ext4\nread_only=false\nbind=false\tdisabled\tfalse\t\t/r/pods/x\n";
        let v = decode(text, Path::new("/r")).unwrap();
        assert_eq!((v.mount_id, v.complete), (0, true));
        assert_eq!(v.binds[0].rel, PathBuf::from("pods/x"));
        assert_eq!(v.binds[0].mount_id, 0);
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
}

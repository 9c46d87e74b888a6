//! /proc/self/mountinfo, parsed: which paths are mount points, of which
//! device, with which options. Read-only; used by the volume table, the
//! condition checks and the bind/unmount logic.
//!
//! The table is the kernel's bytes: anyone can mount at a path that is not
//! UTF-8, so it is read and split as bytes, and paths stay bytes
//! (`PathBuf`). Only what is shown (source, options, type) is decoded, and
//! `shown` escapes a path for a message or a log line.

use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use crate::model::MountId;
use crate::sys::error::SysError;

/// One line of mountinfo (proc(5)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: MountId,
    pub parent_id: MountId,
    /// Device major number of the filesystem.
    pub major: u32,
    /// Device minor number of the filesystem.
    pub minor: u32,
    /// Path inside the filesystem that forms the root of this mount ("/" for a whole fs).
    pub root: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Per-mount options ("rw,nosuid,relatime").
    pub mount_options: String,
    /// Filesystem type ("ext4").
    pub fs_type: String,
    /// Mount source ("/dev/vdb").
    pub source: String,
    /// Per-superblock options ("rw,errors=remount-ro").
    pub super_options: String,
}

impl MountEntry {
    /// True when the mount itself is read-only.
    pub fn read_only(&self) -> bool {
        self.mount_options.split(',').any(|o| o == "ro")
    }

    /// True when the mount is idmapped (Linux 5.12+ says `idmapped` among
    /// its options; which mappings, mountinfo does not say).
    pub fn idmapped(&self) -> bool {
        self.mount_options.split(',').any(|o| o == "idmapped")
    }

    /// True when the superblock is read-only (as after ext4 errors=remount-ro).
    pub fn super_read_only(&self) -> bool {
        self.super_options.split(',').any(|o| o == "ro")
    }
}

/// The kernel escapes space, tab, newline and backslash in paths as \ooo;
/// every other byte is itself.
fn unescape(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            // The kernel escapes single bytes: anything larger is not an escape.
            match u8::try_from(v) {
                Ok(byte) => out.push(byte),
                Err(_) => out.extend_from_slice(&b[i..i + 4]),
            }
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn path(field: &[u8]) -> PathBuf {
    PathBuf::from(OsString::from_vec(unescape(field)))
}

/// Decoded for showing and for comparing with ASCII names ("ext4", "ro").
fn text(field: &[u8]) -> String {
    String::from_utf8_lossy(&unescape(field)).into_owned()
}

fn number(field: &[u8]) -> Option<u32> {
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// Parses one mountinfo line; None for a line that does not have the documented shape.
pub fn parse_line(line: &[u8]) -> Option<MountEntry> {
    let sep = line.windows(3).position(|w| w == b" - ")?;
    let (pre, post) = (&line[..sep], &line[sep + 3..]);
    let mut f = pre.split(|&c| c == b' ');
    let mount_id = MountId(std::str::from_utf8(f.next()?).ok()?.parse().ok()?);
    let parent_id = MountId(std::str::from_utf8(f.next()?).ok()?.parse().ok()?);
    let devnum = f.next()?;
    let colon = devnum.iter().position(|&c| c == b':')?;
    let (major, minor) = (number(&devnum[..colon])?, number(&devnum[colon + 1..])?);
    let root = path(f.next()?);
    let mount_point = path(f.next()?);
    let mount_options = text(f.next()?);
    let mut p = post.split(|&c| c == b' ');
    let fs_type = text(p.next()?);
    let source = text(p.next()?);
    let super_options = p.next().map(text).unwrap_or_default();
    Some(MountEntry {
        mount_id,
        parent_id,
        major,
        minor,
        root,
        mount_point,
        mount_options,
        fs_type,
        source,
        super_options,
    })
}

/// Parses a whole mountinfo text (bytes; a `&str` will do).
pub fn parse(text: impl AsRef<[u8]>) -> Vec<MountEntry> {
    text.as_ref()
        .split(|&c| c == b'\n')
        .filter_map(parse_line)
        .collect()
}

/// Reads this process's mount table, as bytes.
pub fn read() -> Result<Vec<MountEntry>, SysError> {
    let text = std::fs::read("/proc/self/mountinfo")
        .map_err(|e| SysError::new("read", "/proc/self/mountinfo", e))?;
    Ok(parse(text))
}

/// `p` for a message or a log line: UTF-8 as it is, every other byte as
/// `\xNN`, so a name that is not UTF-8 is shown without loss (the log
/// escapes control characters on its own).
pub fn shown(p: &Path) -> String {
    let mut out = String::new();
    for chunk in p.as_os_str().as_bytes().utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// The topmost mount at exactly `path` (the last one listed wins, as the kernel stacks them).
pub fn mount_at<'a>(table: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    table.iter().rev().find(|m| m.mount_point == path)
}

/// The mount with id `id` (as statx's stx_mnt_id gives it).
pub fn by_id(table: &[MountEntry], id: MountId) -> Option<&MountEntry> {
    table.iter().find(|m| m.mount_id == id)
}

/// Every mount below the mount `id` in the mount tree (its children, their
/// children, …), by parent ids, not by path: the mounts that must come off
/// before it can.
pub fn descendants(table: &[MountEntry], id: MountId) -> Vec<&MountEntry> {
    let mut out: Vec<&MountEntry> = Vec::new();
    let mut frontier = vec![id];
    while let Some(p) = frontier.pop() {
        for m in table.iter().filter(|m| m.parent_id == p && m.mount_id != p) {
            if !out.iter().any(|o| o.mount_id == m.mount_id) {
                out.push(m);
                frontier.push(m.mount_id);
            }
        }
    }
    out
}

/// Every mount at or below `path`, deepest first: the order to unmount them in.
pub fn mounts_under<'a>(table: &'a [MountEntry], path: &Path) -> Vec<&'a MountEntry> {
    let mut v: Vec<&MountEntry> = table
        .iter()
        .filter(|m| m.mount_point.starts_with(path))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.mount_point.components().count()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
36 22 7:3 / /run/crust/volumes/vol\\0401 rw,nosuid - ext4 /dev/loop3 rw
37 36 7:3 /data /run/crust/binds/a ro,relatime shared:5 master:1 - ext4 /dev/loop3 ro,errors=remount-ro
38 36 0:45 / /run/crust/volumes/vol\\0401/sub rw - tmpfs tmpfs rw
";

    #[test]
    fn parses_fields_and_escapes() {
        let t = parse(SAMPLE);
        assert_eq!(t.len(), 4);
        assert_eq!(t[1].mount_point, PathBuf::from("/run/crust/volumes/vol 1"));
        assert_eq!((t[1].major, t[1].minor), (7, 3));
        assert_eq!(t[2].root, PathBuf::from("/data"));
        assert_eq!(t[2].fs_type, "ext4");
        assert!(t[2].read_only() && t[2].super_read_only());
        assert!(!t[1].read_only());
        assert_eq!(t[0].super_options, "rw,errors=remount-ro");
    }

    #[test]
    fn rejects_malformed_lines() {
        assert!(parse_line(b"").is_none());
        assert!(parse_line(b"1 2 3").is_none());
        assert!(parse_line(b"x 1 8:1 / / rw - ext4 /dev/sda rw").is_none());
        assert!(parse_line(b"1 1 81 / / rw - ext4 /dev/sda rw").is_none());
        assert!(parse_line(b"1 1 8:\xff / / rw - ext4 /dev/sda rw").is_none());
    }

    #[test]
    fn finds_mounts_and_orders_for_unmount() {
        let t = parse(SAMPLE);
        let root = Path::new("/run/crust/volumes/vol 1");
        assert_eq!(mount_at(&t, root).unwrap().mount_id, MountId(36));
        assert!(mount_at(&t, Path::new("/run/crust")).is_none());
        let under: Vec<u64> = mounts_under(&t, root)
            .iter()
            .map(|m| m.mount_id.0)
            .collect();
        assert_eq!(under, vec![38, 36]);
        assert_eq!(by_id(&t, MountId(37)).unwrap().root, PathBuf::from("/data"));
        assert!(by_id(&t, MountId(99)).is_none());
        let below: Vec<u64> = descendants(&t, MountId(36))
            .iter()
            .map(|m| m.mount_id.0)
            .collect();
        assert_eq!(below, vec![37, 38]);
        assert!(descendants(&t, MountId(38)).is_empty());
    }

    #[test]
    fn paths_that_are_not_utf8_are_kept_as_bytes() {
        // A foreign mount anywhere may be named so: the table still parses,
        // every other line with it, and the path keeps its exact bytes.
        let mut text = SAMPLE.as_bytes().to_vec();
        text.extend_from_slice(b"40 22 0:50 / /tmp/x\xff\xfe\\040y rw - tmpfs t\xe9mp rw\n");
        text.extend_from_slice(
            b"41 36 7:3 /a\x80 /run/crust/pods/\xc3(/t rw - ext4 /dev/loop3 rw\n",
        );
        let t = parse(&text);
        assert_eq!(t.len(), 6);
        assert_eq!(t[4].mount_point.as_os_str().as_bytes(), b"/tmp/x\xff\xfe y");
        assert_eq!(t[4].source, "t\u{fffd}mp", "shown, not compared");
        assert_eq!(t[5].root.as_os_str().as_bytes(), b"/a\x80");
        let rel = t[5].mount_point.strip_prefix("/run/crust").unwrap();
        assert_eq!(rel.as_os_str().as_bytes(), b"pods/\xc3(/t");
        assert_eq!(shown(&t[4].mount_point), "/tmp/x\\xff\\xfe y");
        assert_eq!(shown(&t[5].mount_point), "/run/crust/pods/\\xc3(/t");
        assert_eq!(shown(Path::new("/plain/äö")), "/plain/äö");
    }

    #[test]
    fn reads_the_live_table() {
        let t = read().unwrap();
        assert!(t.iter().any(|m| m.mount_point == Path::new("/")));
    }
}

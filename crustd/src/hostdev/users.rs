//! What on the host uses a block device, read from the host's own tables:
//! mounts (this mount namespace's mountinfo, as bytes), holders in sysfs
//! (device-mapper, md), swap (/proc/swaps), loop devices over it.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use rustix::fs as rfs;

use super::place::{loop_devices, parse_dev, read_trim, Host, Place};

/// What on the host uses any of `devices`, in words: mounts (this mount
/// namespace's table), holders in sysfs, swap, loop devices over them.
pub(super) fn users(h: &Host, devices: &[Place]) -> io::Result<Vec<String>> {
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

/// The processes, other than this one, with an open file that is the block
/// device `rdev`, in words. Looks at every process's fds (stat, never open).
pub(super) fn openers(h: &Host, rdev: u64) -> Vec<String> {
    let me = std::process::id().to_string();
    let Ok(procs) = fs::read_dir(&h.proc) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in procs.flatten() {
        let pid = p.file_name().to_string_lossy().into_owned();
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let has = fds.flatten().any(|fd| {
            fs::metadata(fd.path())
                .is_ok_and(|m| m.file_type().is_block_device() && m.rdev() == rdev)
        });
        if has {
            let comm = fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            out.push(format!("process {pid} ({})", comm.trim()));
        }
    }
    out.sort();
    out
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

#[cfg(test)]
mod tests {
    use super::super::place::{place, sharing, tests::fake_host};
    use super::*;

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
}

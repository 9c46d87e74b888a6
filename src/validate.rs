//! Request validation in one place: every malformed field of api.md §2 is
//! refused here with INVALID_ARGUMENT, before anything touches the system.
//! The checks are lexical; what needs the kernel (is it a block device, does
//! the subpath escape through a symlink) is judged where the syscall is made.

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use crate::model::{FsType, IdMap, IdRange, RecursiveReadOnly};
use crate::sys::userns;

/// Where the agent mounts its volumes, beneath its root.
pub const VOLUMES_DIR: &str = "volumes";
/// The state directory's name, written once for the two paths below.
macro_rules! state_dir {
    () => {
        "state"
    };
}
/// Where the agent keeps its records (the volumes', then [`FREEZES_DIR`]), beneath its root.
pub const STATE_DIR: &str = state_dir!();
/// Where the freezes' records are, beneath the root.
pub const FREEZES_DIR: &str = concat!(state_dir!(), "/freezes");

/// A malformed request: the message says which field and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// Whether a path has `.` or `..` segments (checked on the string, since
/// `Path::components` silently drops inner `.`).
fn has_dots(s: &str) -> bool {
    s.split('/').any(|seg| seg == "." || seg == "..")
}

/// The kernel's PATH_MAX, terminating NUL included: longer paths cannot be
/// named to a syscall at all.
pub const PATH_MAX: usize = 4096;
/// The kernel's NAME_MAX: the longest single path component.
pub const NAME_MAX: usize = 255;

/// Refuses a path the kernel could not take: PATH_MAX or longer, or with a
/// component longer than NAME_MAX.
pub(crate) fn fits_the_kernel(field: &str, s: &str) -> Result<(), Invalid> {
    if s.len() >= PATH_MAX {
        return Err(invalid(format!(
            "{field} is {} bytes long; paths must be shorter than {PATH_MAX} bytes",
            s.len()
        )));
    }
    if let Some(long) = s.split('/').find(|c| c.len() > NAME_MAX) {
        let mut end = 32.min(long.len());
        while !long.is_char_boundary(end) {
            end -= 1;
        }
        return Err(invalid(format!(
            "{field} has a component of {} bytes ({:?}…); each may be at most {NAME_MAX}",
            long.len(),
            &long[..end]
        )));
    }
    Ok(())
}

/// How long to wait for a device when the request says 0.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(10_000);

/// The longest wait a request can ask for: a larger `timeout_ms` is capped
/// here, so no request holds a worker and a volume for days.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(300);

/// `volume_id`: `[A-Za-z0-9][A-Za-z0-9._-]{0,127}`.
pub fn volume_id(id: &str) -> Result<(), Invalid> {
    let b = id.as_bytes();
    if b.is_empty() {
        return Err(invalid(
            "volume_id is empty; name the volume with 1 to 128 characters from [A-Za-z0-9._-]",
        ));
    }
    if b.len() > 128 {
        return Err(invalid(format!(
            "volume_id is {} bytes long; at most 128 are allowed",
            b.len()
        )));
    }
    if !b[0].is_ascii_alphanumeric() {
        return Err(invalid(format!(
            "volume_id {id:?} must start with a letter or a digit"
        )));
    }
    // The charset of every name the contracts carry (crust-protocols' `names`).
    if let Some(c) = id
        .chars()
        .find(|c| !u8::try_from(*c).is_ok_and(crust_protocols::names::is_name_byte))
    {
        return Err(invalid(format!(
            "volume_id {id:?} contains {c:?}; only [A-Za-z0-9._-] are allowed"
        )));
    }
    Ok(())
}

/// A BLOCK publish carries none of a filesystem's parameters: `fs_type`,
/// `mount_options` and `fs_group` must be empty (a device has no
/// filesystem to name, mount or chown).
pub fn block_publish(
    volume_id: &str,
    fs_type: &str,
    mount_options: &[String],
    fs_group: bool,
) -> Result<(), Invalid> {
    let field = if !fs_type.is_empty() {
        format!("fs_type {fs_type:?}")
    } else if !mount_options.is_empty() {
        format!("mount_options {mount_options:?}")
    } else if fs_group {
        "fs_group".to_string()
    } else {
        return Ok(());
    };
    Err(invalid(format!(
        "volume {volume_id} is published as a BLOCK volume, which has no filesystem: {field} must be empty"
    )))
}

/// A virtio-blk serial: 1 to 20 bytes of `[A-Za-z0-9._-]` (the rule is
/// crust-protocols' `names::serial`, shared with the host crates).
pub fn serial(s: &str) -> Result<(), Invalid> {
    crust_protocols::names::serial(s).map_err(|e| invalid(e.to_string()))
}

/// `fs_type`: "ext4" or "xfs".
pub fn fs_type(s: &str) -> Result<FsType, Invalid> {
    FsType::parse(s).ok_or_else(|| {
        if s.is_empty() {
            invalid("fs_type is empty; say which filesystem the disk holds: ext4 or xfs")
        } else {
            invalid(format!(
                "fs_type {s:?} is not supported; the agent mounts ext4 and xfs"
            ))
        }
    })
}

/// `device_path`: an absolute, normalised path under /dev. Whether it is a
/// block device is checked when it is opened.
pub fn device_path(s: &str) -> Result<PathBuf, Invalid> {
    let p = Path::new(s);
    if s.is_empty() || !p.is_absolute() {
        return Err(invalid(format!(
            "device_path {s:?} must be an absolute path under /dev"
        )));
    }
    fits_the_kernel("device_path", s)?;
    if s.contains('\0') || has_dots(s) {
        return Err(invalid(format!(
            "device_path {s:?} must be a plain path under /dev, without . or .."
        )));
    }
    if !p.starts_with("/dev") || p == Path::new("/dev") {
        return Err(invalid(format!(
            "device_path {s:?} is not under /dev; give the disk's device node"
        )));
    }
    Ok(p.to_path_buf())
}

/// `subpath`: relative to the volume root, without `..`; "" is the root.
/// Returns the normalised relative path ("." components dropped).
pub fn subpath(s: &str) -> Result<PathBuf, Invalid> {
    if s.contains('\0') {
        return Err(invalid("subpath contains a NUL byte"));
    }
    fits_the_kernel("subpath", s)?;
    let p = Path::new(s);
    if p.is_absolute() {
        return Err(invalid(format!(
            "subpath {s:?} is absolute; give it relative to the volume's root"
        )));
    }
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(invalid(format!(
                    "subpath {s:?} contains '..'; it must stay inside the volume"
                )))
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(invalid(format!(
                    "subpath {s:?} is absolute; give it relative to the volume's root"
                )))
            }
        }
    }
    Ok(out)
}

/// A bind or unmount `target`: absolute, without `.`/`..`, strictly beneath
/// the agent's root and outside the agent's own `volumes/` and `state/`.
pub fn target(root: &Path, s: &str) -> Result<PathBuf, Invalid> {
    let p = Path::new(s);
    if s.is_empty() || !p.is_absolute() {
        return Err(invalid(format!(
            "target {s:?} must be an absolute path beneath the agent's root {}",
            root.display()
        )));
    }
    fits_the_kernel("target", s)?;
    if s.contains('\0') || has_dots(s) {
        return Err(invalid(format!(
            "target {s:?} must be a plain path, without . or .."
        )));
    }
    let p: PathBuf = p.components().collect();
    if !p.starts_with(root) || p == root {
        return Err(invalid(format!(
            "target {s:?} is outside the agent's root {}; binds live beneath it",
            root.display()
        )));
    }
    for own in [VOLUMES_DIR, STATE_DIR] {
        if p.starts_with(root.join(own)) {
            return Err(invalid(format!(
                "target {s:?} is inside the agent's own {}/ directory; choose another place beneath {}",
                own,
                root.display()
            )));
        }
    }
    Ok(p)
}

/// `recursive_read_only` other than DISABLED needs `read_only`.
pub fn recursive_read_only(read_only: bool, rro: RecursiveReadOnly) -> Result<(), Invalid> {
    if rro != RecursiveReadOnly::Disabled && !read_only {
        return Err(invalid(
            "recursive_read_only needs read_only: a recursively read-only bind must be read-only itself",
        ));
    }
    Ok(())
}

/// The most ranges one of an idmapped bind's mappings may have: the
/// kernel's (UID_GID_MAP_MAX_EXTENTS).
pub const MAX_ID_RANGES: usize = 340;

/// An idmapped bind's `uid_mappings` and `gid_mappings`: neither (None: a
/// plain bind) or both; each at most [`MAX_ID_RANGES`] ranges, none empty,
/// none running past the last id (4294967294) on either side, no two
/// overlapping on either side, and written out short enough for the
/// kernel's one write of less than a page (4096 bytes).
pub fn id_map(uids: Vec<IdRange>, gids: Vec<IdRange>) -> Result<Option<IdMap>, Invalid> {
    match (uids.is_empty(), gids.is_empty()) {
        (true, true) => return Ok(None),
        (false, false) => {}
        (u, _) => {
            let (given, missing) = if u { ("gid", "uid") } else { ("uid", "gid") };
            return Err(invalid(format!(
                "{given}_mappings is given without {missing}_mappings; an idmapped bind needs both (a user-namespace pod has both)"
            )));
        }
    }
    id_ranges("uid_mappings", &uids)?;
    id_ranges("gid_mappings", &gids)?;
    Ok(Some(IdMap { uids, gids }))
}

/// One of [`id_map`]'s lists, as the kernel's uid_map/gid_map would take it.
fn id_ranges(field: &str, ranges: &[IdRange]) -> Result<(), Invalid> {
    if ranges.len() > MAX_ID_RANGES {
        return Err(invalid(format!(
            "{field} has {} ranges; the kernel takes at most {MAX_ID_RANGES}",
            ranges.len()
        )));
    }
    let end = |id: u32, r: &IdRange| u64::from(id) + u64::from(r.length);
    for (i, r) in ranges.iter().enumerate() {
        if r.length == 0 {
            return Err(invalid(format!(
                "{field}[{i}] has length 0; a range maps at least one id"
            )));
        }
        for (side, id) in [("container_id", r.container_id), ("host_id", r.host_id)] {
            if end(id, r) > u64::from(u32::MAX) {
                return Err(invalid(format!(
                    "{field}[{i}] runs past the last id: {side} {id} + length {} passes 4294967295 (not an id)",
                    r.length
                )));
            }
        }
        for (j, o) in ranges[..i].iter().enumerate() {
            for (side, a, b) in [
                ("container", r.container_id, o.container_id),
                ("host", r.host_id, o.host_id),
            ] {
                if u64::from(a) < end(b, o) && u64::from(b) < end(a, r) {
                    return Err(invalid(format!(
                        "{field}[{i}] and {field}[{j}] overlap on the {side} side; each id may be mapped once"
                    )));
                }
            }
        }
    }
    let len = userns::map_text(ranges).len();
    if len >= userns::MAP_TEXT_MAX {
        return Err(invalid(format!(
            "{field} written out is {len} bytes; the kernel takes a map in one write of less than {} bytes: use fewer ranges",
            userns::MAP_TEXT_MAX
        )));
    }
    Ok(())
}

/// `required_bytes`: not negative (0 means the device's size).
pub fn required_bytes(n: i64) -> Result<u64, Invalid> {
    u64::try_from(n).map_err(|_| {
        invalid(format!(
            "required_bytes is {n}; it must be 0 (the device's size) or more"
        ))
    })
}

/// `fs_group.gid`: any gid but 4294967295, which chown reads as "leave alone".
pub fn gid(g: u32) -> Result<u32, Invalid> {
    if g == u32::MAX {
        return Err(invalid(
            "fs_group.gid 4294967295 is not a group id (chown reads it as 'no change')",
        ));
    }
    Ok(g)
}

/// A `timeout_ms` field: 0 means the default; anything above `MAX_TIMEOUT` is capped.
pub fn timeout(ms: u32) -> Duration {
    if ms == 0 {
        DEFAULT_TIMEOUT
    } else {
        Duration::from_millis(ms.into()).min(MAX_TIMEOUT)
    }
}

/// The shortest trim schedule: a trim every 10 s already returns freed
/// blocks as fast as a workload frees them; a shorter one only burns CPU.
pub const MIN_TRIM_INTERVAL_S: u32 = 10;
/// The longest: 30 days (util-linux's fstrim.timer runs weekly).
pub const MAX_TRIM_INTERVAL_S: u32 = 30 * 24 * 3600;

/// A `trim_interval_s` field: 0 (no schedule), or `MIN_TRIM_INTERVAL_S` to
/// `MAX_TRIM_INTERVAL_S`.
pub fn trim_interval(s: u32) -> Result<u32, Invalid> {
    if s == 0 || (MIN_TRIM_INTERVAL_S..=MAX_TRIM_INTERVAL_S).contains(&s) {
        return Ok(s);
    }
    Err(Invalid(format!(
        "trim_interval_s {s} is out of range: 0 (no scheduled trim), or {MIN_TRIM_INTERVAL_S} to {MAX_TRIM_INTERVAL_S} seconds (30 days)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trim_intervals_are_off_or_within_bounds() {
        for ok in [0, 10, 3600, MAX_TRIM_INTERVAL_S] {
            assert_eq!(trim_interval(ok).unwrap(), ok);
        }
        for bad in [1, 9, MAX_TRIM_INTERVAL_S + 1, u32::MAX] {
            let e = trim_interval(bad).unwrap_err().to_string();
            assert!(
                e.contains("trim_interval_s") && e.contains(&bad.to_string()),
                "{e}"
            );
        }
    }

    #[test]
    fn volume_ids() {
        let long = "a".repeat(128);
        for good in ["a", "A", "0", "vol-1", "pvc_1.2-x", long.as_str()] {
            assert_eq!(volume_id(good), Ok(()), "{good}");
        }
        let too_long = "a".repeat(129);
        for bad in [
            "",
            "-a",
            ".a",
            "_a",
            "a/b",
            "a b",
            "ä",
            "a\0",
            "../x",
            too_long.as_str(),
        ] {
            assert!(volume_id(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn serials() {
        for good in [
            "vol-0123456789abcdef",
            "a",
            "A.b_c-d",
            "12345678901234567890",
        ] {
            assert_eq!(serial(good), Ok(()), "{good}");
        }
        for bad in ["", "123456789012345678901", "a b", "a/b", "a\n", "ü"] {
            assert!(serial(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn device_paths() {
        assert_eq!(device_path("/dev/vdb").unwrap(), PathBuf::from("/dev/vdb"));
        assert!(device_path("/dev/disk/by-id/virtio-x").is_ok());
        for bad in [
            "",
            "dev/vdb",
            "vdb",
            "/dev",
            "/dev/",
            "/tmp/disk",
            "/dev/../etc/passwd",
            "/dev/./vdb",
            "/devx/vdb",
        ] {
            assert!(device_path(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn subpaths() {
        assert_eq!(subpath("").unwrap(), PathBuf::new());
        assert_eq!(subpath("a/b").unwrap(), PathBuf::from("a/b"));
        assert_eq!(subpath("./a//b/.").unwrap(), PathBuf::from("a/b"));
        for bad in ["/a", "..", "a/../b", "a/..", "a\0b"] {
            assert!(subpath(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn targets() {
        let root = Path::new("/run/crust");
        assert_eq!(
            target(root, "/run/crust/binds/a").unwrap(),
            PathBuf::from("/run/crust/binds/a")
        );
        assert_eq!(
            target(root, "/run/crust//pods/x/").unwrap(),
            PathBuf::from("/run/crust/pods/x")
        );
        for bad in [
            "",
            "binds/a",
            "/run/crust",
            "/run/crust/",
            "/run/crustx/a",
            "/tmp/a",
            "/run/crust/../etc",
            "/run/crust/./a",
            "/run/crust/volumes/v1",
            "/run/crust/volumes",
            "/run/crust/state/x",
        ] {
            assert!(target(root, bad).is_err(), "{bad:?} accepted");
        }
        // Too long for the kernel: refused here, before anything is created.
        let long = format!("/run/crust/{}", "d/".repeat(2100));
        let e = target(root, &long).unwrap_err();
        assert!(e.0.contains("shorter than 4096"), "{e}");
        let five_k = format!("/run/crust/{}", "x".repeat(5000));
        assert!(target(root, &five_k).is_err());
        let name = format!("/run/crust/{}", "n".repeat(256));
        assert!(target(root, &name).unwrap_err().0.contains("at most 255"));
        assert!(target(root, &format!("/run/crust/{}", "n".repeat(255))).is_ok());
        assert!(subpath(&"s/".repeat(2100)).is_err());
        assert!(device_path(&format!("/dev/{}", "x".repeat(300))).is_err());
    }

    #[test]
    fn numbers() {
        assert_eq!(required_bytes(0), Ok(0));
        assert_eq!(required_bytes(1 << 40), Ok(1 << 40));
        assert!(required_bytes(-1).is_err());
        assert_eq!(gid(0), Ok(0));
        assert!(gid(u32::MAX).is_err());
        assert_eq!(timeout(0), DEFAULT_TIMEOUT);
        assert_eq!(timeout(250), Duration::from_millis(250));
        assert_eq!(timeout(u32::MAX), MAX_TIMEOUT, "49 days is capped");
    }

    fn r(container_id: u32, host_id: u32, length: u32) -> IdRange {
        IdRange {
            container_id,
            host_id,
            length,
        }
    }

    /// The mapping rules: both or neither, no empty range, none past the
    /// last id, no overlap on either side, at most 340 ranges that the
    /// kernel can take in one write.
    #[test]
    fn id_maps() {
        assert_eq!(id_map(vec![], vec![]), Ok(None));
        let pod = vec![r(0, 100000, 65536)];
        let m = id_map(pod.clone(), pod.clone()).unwrap().unwrap();
        assert_eq!((m.uids, m.gids), (pod.clone(), pod.clone()));
        // The edges that still hold: the last id, adjacent ranges, the
        // whole space but 4294967295 (an identity map), 340 short ranges.
        let edges = [
            vec![r(4294967294, 4294967294, 1)],
            vec![r(0, 10, 5), r(5, 15, 5)],
            vec![r(0, 0, u32::MAX)],
            (0..340).map(|i| r(i, i + 1000, 1)).collect(),
        ];
        for good in edges {
            assert!(id_map(good.clone(), pod.clone()).is_ok(), "{good:?}");
            assert!(id_map(pod.clone(), good.clone()).is_ok(), "{good:?}");
        }
        let bad: Vec<(Vec<IdRange>, &str)> = vec![
            (vec![r(0, 1, 0)], "length 0"),
            (vec![r(4294967295, 1, 1)], "runs past the last id"),
            (vec![r(1, 4294967295, 1)], "runs past the last id"),
            (vec![r(1, 0, u32::MAX)], "runs past the last id"),
            (
                vec![r(0, 100, 10), r(9, 200, 1)],
                "overlap on the container side",
            ),
            (
                vec![r(0, 100, 10), r(20, 105, 10)],
                "overlap on the host side",
            ),
            (
                vec![r(20, 105, 10), r(0, 100, 10)],
                "overlap on the host side",
            ),
            (vec![r(0, 0, 1); 2], "overlap on the container side"),
            ((0..341).map(|i| r(i, i, 1)).collect(), "at most 340"),
            (
                (0..300)
                    .map(|i| r(4_000_000_000 + i, 4_100_000_000 + i, 1))
                    .collect(),
                "less than 4096 bytes",
            ),
        ];
        for (ranges, why) in bad {
            let e = id_map(ranges.clone(), pod.clone()).unwrap_err();
            assert!(
                e.0.contains(why) && e.0.starts_with("uid_mappings"),
                "{why}: {e}"
            );
            let e = id_map(pod.clone(), ranges).unwrap_err();
            assert!(
                e.0.contains(why) && e.0.starts_with("gid_mappings"),
                "{why}: {e}"
            );
        }
        let e = id_map(pod.clone(), vec![]).unwrap_err();
        assert!(
            e.0.contains("uid_mappings is given without gid_mappings"),
            "{e}"
        );
        let e = id_map(vec![], pod).unwrap_err();
        assert!(
            e.0.contains("gid_mappings is given without uid_mappings"),
            "{e}"
        );
    }
}

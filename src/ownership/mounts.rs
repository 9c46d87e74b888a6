//! The mount points a walk did not enter, for its report: all counted, the
//! first `NAMED` named, each name relative to the volume's root and at most
//! `NAME_BYTES` long. The walk keeps no paths, so a name is built when a
//! mount point is met, from where `/proc/self/fd` says its directory is.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crust_protocols::sync::LockExt;

/// Mount points named in a report; the rest are only counted.
pub const NAMED: usize = 16;
/// A name longer than this many bytes is cut in the middle with "…".
pub const NAME_BYTES: usize = 256;
const ELLIPSIS: &str = "…";

/// The mount points met so far, shared by the walk's workers.
#[derive(Default)]
pub(crate) struct Skipped {
    /// All of them.
    count: AtomicU64,
    /// The first `NAMED`, relative to the root and bounded.
    names: Mutex<Vec<PathBuf>>,
}

impl Skipped {
    /// Counts one mount point; `name` builds its name, called only while
    /// fewer than `NAMED` are named (it reads /proc).
    pub(crate) fn add(&self, name: impl FnOnce() -> Vec<u8>) {
        let before = self.count.fetch_add(1, Ordering::Relaxed);
        if usize::try_from(before).is_ok_and(|n| n < NAMED) {
            let name = bounded(name());
            let mut names = self.names.locked();
            if names.len() < NAMED {
                names.push(PathBuf::from(OsString::from_vec(name)));
            }
        }
    }

    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The names so far, sorted (workers meet them in no fixed order).
    pub(crate) fn names(&self) -> Vec<PathBuf> {
        let mut names = self.names.locked().clone();
        names.sort();
        names
    }
}

/// Where a mount point is, relative to the root: `dir` is where
/// /proc/self/fd says its directory is (`None`: it could not say, the path
/// being past PATH_MAX), `depth` levels below the root, which /proc/self/fd
/// names `root`; `name` is the entry in it (`None`: `dir` is the mount point
/// itself). A directory no longer below the root (moved out meanwhile) is
/// named as /proc says, absolute.
pub(crate) fn relative(
    root: Option<&[u8]>,
    dir: Option<&[u8]>,
    depth: u64,
    name: Option<&[u8]>,
) -> Vec<u8> {
    let mut out = match (root, dir) {
        (Some(root), Some(dir)) => match below(root, dir) {
            Some(rest) => rest.to_vec(),
            None => dir.to_vec(),
        },
        (None, Some(dir)) => dir.to_vec(),
        (_, None) => format!("…({depth} levels down)…").into_bytes(),
    };
    if let Some(name) = name {
        if !out.is_empty() && !out.ends_with(b"/") {
            out.push(b'/');
        }
        out.extend_from_slice(name);
    }
    if out.is_empty() {
        out.push(b'.');
    }
    out
}

/// `path` relative to `root` if it is `root` or below it.
fn below<'p>(root: &[u8], path: &'p [u8]) -> Option<&'p [u8]> {
    let rest = path.strip_prefix(root)?;
    if root.ends_with(b"/") {
        return Some(rest);
    }
    match rest {
        [] => Some(rest),
        [b'/', rest @ ..] => Some(rest),
        _ => None, // /vol2 is not below /vol
    }
}

/// `name` cut to at most `NAME_BYTES`: its head and tail, the middle
/// replaced by "…", each cut moved off the middle of a UTF-8 character.
pub(crate) fn bounded(name: Vec<u8>) -> Vec<u8> {
    if name.len() <= NAME_BYTES {
        return name;
    }
    let keep = NAME_BYTES - ELLIPSIS.len();
    let mut head = keep / 2;
    let mut tail = name.len() - (keep - head);
    while head > 0 && is_continuation(name[head]) {
        head -= 1;
    }
    while tail < name.len() && is_continuation(name[tail]) {
        tail += 1;
    }
    let mut out = Vec::with_capacity(NAME_BYTES);
    out.extend_from_slice(&name[..head]);
    out.extend_from_slice(ELLIPSIS.as_bytes());
    out.extend_from_slice(&name[tail..]);
    out
}

/// A byte inside a UTF-8 character, not at its start.
fn is_continuation(b: u8) -> bool {
    b & 0b1100_0000 == 0b1000_0000
}

/// The names for a log line or a message: joined, with how many more there were.
pub fn listed(names: &[PathBuf], count: u64) -> String {
    let mut out = names
        .iter()
        .map(|p| crate::sys::mountinfo::shown(p))
        .collect::<Vec<_>>()
        .join(", ");
    let more = count.saturating_sub(names.len() as u64);
    if more > 0 {
        out.push_str(&format!(", and {more} more"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    fn bytes(p: &std::path::Path) -> &[u8] {
        p.as_os_str().as_bytes()
    }

    #[test]
    fn names_are_relative_to_the_root() {
        type Bytes<'a> = Option<&'a [u8]>;
        // root, directory, name → the name shown.
        let table: &[(Bytes, Bytes, Bytes, &[u8])] = &[
            (Some(b"/vol"), Some(b"/vol/a/b"), Some(b"m"), b"a/b/m"),
            (Some(b"/vol"), Some(b"/vol"), Some(b"m"), b"m"),
            (Some(b"/vol"), Some(b"/vol/a"), None, b"a"),
            (Some(b"/vol"), Some(b"/vol"), None, b"."),
            // A detached mount: /proc names its root "/".
            (Some(b"/"), Some(b"/a"), Some(b"m"), b"a/m"),
            (Some(b"/"), Some(b"/"), Some(b"m"), b"m"),
            // Not below the root (a sibling with the same prefix, or moved out).
            (Some(b"/vol"), Some(b"/vol2/a"), Some(b"m"), b"/vol2/a/m"),
            (None, Some(b"/x/y"), Some(b"m"), b"/x/y/m"),
            // /proc could not say (past PATH_MAX).
            (
                Some(b"/vol"),
                None,
                Some(b"m"),
                "…(7 levels down)…/m".as_bytes(),
            ),
        ];
        for (root, dir, name, want) in table {
            let got = relative(*root, *dir, 7, *name);
            assert_eq!(
                String::from_utf8_lossy(&got),
                String::from_utf8_lossy(want),
                "{root:?} {dir:?} {name:?}"
            );
        }
    }

    #[test]
    fn long_names_are_cut_in_the_middle_and_short_ones_kept() {
        let exact = vec![b'a'; NAME_BYTES];
        assert_eq!(bounded(exact.clone()), exact);
        let long: Vec<u8> = [vec![b'h'; 300], vec![b't'; 300]].concat();
        let cut = bounded(long);
        assert_eq!(cut.len(), NAME_BYTES);
        let s = String::from_utf8(cut).unwrap();
        assert!(
            s.starts_with("hhh") && s.ends_with("ttt") && s.contains("h…t"),
            "{s}"
        );
        // Multi-byte characters are not split, on either side of the cut.
        let wide = "é".repeat(400).into_bytes();
        let cut = bounded(wide);
        assert!(cut.len() <= NAME_BYTES, "{}", cut.len());
        let s = String::from_utf8(cut).expect("no character split");
        assert!(s.starts_with('é') && s.ends_with('é') && s.contains('…'));
        // Bytes that are not UTF-8 are cut as bytes.
        let raw = vec![0xff; 1000];
        let cut = bounded(raw);
        assert_eq!(cut.len(), NAME_BYTES);
    }

    #[test]
    fn all_are_counted_and_the_first_named() {
        let s = Skipped::default();
        let built = AtomicU64::new(0);
        for i in 0..40 {
            s.add(|| {
                built.fetch_add(1, Ordering::Relaxed);
                format!("m{i:02}").into_bytes()
            });
        }
        assert_eq!(s.count(), 40);
        let names = s.names();
        assert_eq!(names.len(), NAMED);
        assert_eq!(bytes(&names[0]), b"m00");
        assert_eq!(bytes(&names[NAMED - 1]), b"m15");
        assert_eq!(
            built.load(Ordering::Relaxed),
            NAMED as u64,
            "no /proc read past 16"
        );
        assert_eq!(listed(&names[..2], 40), "m00, m01, and 38 more");
        assert_eq!(listed(&names[..2], 2), "m00, m01");
    }
}

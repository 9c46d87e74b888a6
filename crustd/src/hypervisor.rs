//! Whose VM a hypervisor process runs, as far as crustd can tell from the
//! host: its command line, read from `/proc` with a bound (the process
//! wrote it), and whether that line names the sandbox as Kata starts its
//! QEMU. Kata's Go runtime names sandbox `<id>`'s QEMU `sandbox-<id>`
//! (`src/runtime/virtcontainers/qemu.go`: `Name: fmt.Sprintf("sandbox-%s",
//! q.id)`, `q.id` the sandbox's id), passed as `-name sandbox-<id>`, with
//! `,debug-threads=on` when Kata debugs (`src/runtime/pkg/govmm/qemu/
//! qemu.go`, `appendName`). A file in Kata's runtime directory can be
//! copied from another sandbox's; the command line of the process behind a
//! socket cannot be written by whoever writes there.

use std::fmt;
use std::io::{self, Read};
use std::sync::Arc;

/// The most of a command line crustd reads (Kata's QEMU's is a few KiB).
pub const MAX_CMDLINE: u64 = 256 << 10;
/// How many `-name` values a refusal quotes, and how much of each.
const QUOTED: usize = 4;
const QUOTED_LEN: usize = 160;

/// The name Kata gives sandbox `id`'s QEMU.
pub fn kata_name(id: &str) -> String {
    format!("sandbox-{id}")
}

/// Why a process's command line does not name the sandbox.
#[derive(Debug, Clone)]
pub enum NotNamed {
    /// It could not be read (the process is gone, say).
    Unread(Arc<io::Error>),
    /// Empty: a process that has exited, or a kernel thread.
    Empty,
    /// It has no `-name`.
    Missing,
    /// Its `-name` values (some of them, cut), one of them not the sandbox's.
    Other(Vec<String>),
    /// Longer than [`MAX_CMDLINE`]: what lies past it is not known.
    TooLong,
}

impl fmt::Display for NotNamed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotNamed::Unread(e) => write!(f, "its command line cannot be read ({e})"),
            NotNamed::Empty => write!(f, "its command line is empty"),
            NotNamed::Missing => write!(f, "its command line has no -name"),
            NotNamed::Other(names) => {
                write!(f, "its command line has -name {}", names.join(", -name "))
            }
            NotNamed::TooLong => write!(
                f,
                "its command line is longer than the {MAX_CMDLINE} bytes crustd reads"
            ),
        }
    }
}

/// Whether process `pid`'s command line names it `name` ([`names`]).
pub fn named(pid: u32, name: &str) -> Result<(), NotNamed> {
    names(
        &cmdline(pid).map_err(|e| NotNamed::Unread(Arc::new(e)))?,
        name,
    )
}

/// Process `pid`'s command line as the kernel shows it (arguments ended by
/// NUL bytes), at most one byte past [`MAX_CMDLINE`].
fn cmdline(pid: u32) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    std::fs::File::open(format!("/proc/{pid}/cmdline"))?
        .take(MAX_CMDLINE + 1)
        .read_to_end(&mut buf)?;
    Ok(buf)
}

/// Whether the command line `line` (arguments ended by NUL bytes, as
/// `/proc/<pid>/cmdline` holds them) names the VM `name` as QEMU reads it:
/// a `-name` (or `--name`) argument, and each one's value `name` itself or
/// `name` followed by QEMU's options (`name,debug-threads=on`; a doubled
/// comma is part of the name in QEMU's syntax, so `name,,x` names another).
pub fn names(line: &[u8], name: &str) -> Result<(), NotNamed> {
    if u64::try_from(line.len()).unwrap_or(u64::MAX) > MAX_CMDLINE {
        return Err(NotNamed::TooLong);
    }
    if line.is_empty() {
        return Err(NotNamed::Empty);
    }
    let line = line.strip_suffix(b"\0").unwrap_or(line);
    let args: Vec<&[u8]> = line.split(|&b| b == 0).collect();
    let values: Vec<&[u8]> = args
        .windows(2)
        .filter(|w| matches!(w[0], b"-name" | b"--name"))
        .map(|w| w[1])
        .collect();
    if values.is_empty() {
        return Err(NotNamed::Missing);
    }
    let is_name = |v: &[u8]| match v.strip_prefix(name.as_bytes()) {
        Some(rest) => rest.is_empty() || (rest.starts_with(b",") && !rest.starts_with(b",,")),
        None => false,
    };
    if values.iter().all(|v| is_name(v)) {
        return Ok(());
    }
    Err(NotNamed::Other(
        values
            .iter()
            .take(QUOTED)
            .map(|v| crate::freezes::cut(&String::from_utf8_lossy(v), QUOTED_LEN))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(args: &[&str]) -> Vec<u8> {
        args.iter()
            .flat_map(|a| [a.as_bytes(), b"\0"].concat())
            .collect()
    }

    #[test]
    fn only_the_sandboxs_own_name_names_it() {
        let n = kata_name("0f3c");
        let ok = |args: &[&str]| names(&line(args), &n).is_ok();
        assert!(ok(&[
            "qemu-system-x86_64",
            "-name",
            "sandbox-0f3c",
            "-m",
            "2G"
        ]));
        assert!(ok(&["qemu", "-name", "sandbox-0f3c,debug-threads=on"]));
        assert!(ok(&["qemu", "--name", "sandbox-0f3c"]));
        for bad in [
            &["qemu", "-name", "sandbox-0f3cd"][..],
            &["qemu", "-name", "sandbox-0f3c,,x"],
            &["qemu", "-name", "sandbox-0f"],
            &["qemu", "-name", "sandbox-b", "-name", "sandbox-0f3c"],
            &["qemu", "-name", "sandbox-0f3c", "-name", "sandbox-b"],
            &["qemu", "-append", "-name sandbox-0f3c"],
            &["qemu", "-name=sandbox-0f3c"],
            &["qemu", "sandbox-0f3c"],
            &["qemu", "-name"],
        ] {
            assert!(!ok(bad), "{bad:?}");
        }
        assert!(matches!(names(b"", &n), Err(NotNamed::Empty)));
        assert!(matches!(
            names(&line(&["sh", "-c", "x"]), &n),
            Err(NotNamed::Missing)
        ));
        let e = names(&line(&["qemu", "-name", "sandbox-b,debug-threads=on"]), &n).unwrap_err();
        assert_eq!(
            e.to_string(),
            "its command line has -name sandbox-b,debug-threads=on"
        );
        // Without the last NUL (a process that rewrote its arguments).
        assert!(names(b"qemu\0-name\0sandbox-0f3c", &n).is_ok());
        let long = vec![b'x'; usize::try_from(MAX_CMDLINE).unwrap() + 1];
        assert!(matches!(names(&long, &n), Err(NotNamed::TooLong)));
    }

    #[test]
    fn this_process_is_read_from_proc() {
        let me = std::process::id();
        assert!(!cmdline(me).unwrap().is_empty());
        assert!(matches!(
            named(me, "sandbox-x"),
            Err(NotNamed::Missing | NotNamed::Other(_))
        ));
        assert!(matches!(named(0, "sandbox-x"), Err(NotNamed::Unread(_))));
    }
}

//! Mount options: the runc table of fstab-style names → MS_* flags, the
//! options publishing refuses, and the data string left for the filesystem.
//! Pure: parsed once per request and unit-tested against tables of inputs.
//! Written once here for the agent (which mounts with it) and crustd (which
//! refuses a direct-volume record's bad option before anything is plugged).

/// An option publishing forbids, or a malformed option list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mount option {option:?} is not accepted: {why}")]
pub struct BadOption {
    /// The offending option, as given.
    pub option: String,
    /// Why it is refused and what to do instead.
    pub why: &'static str,
}

/// Mount flags and the filesystem-specific data string, ready for mount(2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// MS_* bits.
    pub flags: u64,
    /// Comma-separated options the filesystem itself interprets ("discard,nouuid").
    pub data: String,
}

impl MountOptions {
    /// The data string mount(2) gets for `fs_type`: the request's, and for
    /// ext4 (which also mounts ext2 and ext3) DEFAULT_ERRORS unless the
    /// request chose an error behaviour itself. Options given to mount(2)
    /// override the superblock's (s_errors and s_mount_opts alike), so this is
    /// what decides what an error on the disk does, not the disk.
    pub fn kernel_data(&self, fs_type: &str) -> String {
        let chose = self
            .data
            .split(',')
            .any(|o| o.split_once('=').is_some_and(|(k, _)| k == "errors"));
        match (fs_type, chose) {
            ("ext4", false) if self.data.is_empty() => DEFAULT_ERRORS.to_string(),
            ("ext4", false) => format!("{},{DEFAULT_ERRORS}", self.data),
            _ => self.data.clone(),
        }
    }
}

/// Bits of mount(2)'s flags, as u64 (libc spells them c_ulong, 32 bits on
/// 32-bit targets, hence the casts).
#[allow(clippy::unnecessary_cast)]
const MS_RDONLY: u64 = libc::MS_RDONLY as u64;

/// The runc table: option name, MS_* flag, and whether the option sets (true)
/// or clears (false) it. Later options override earlier ones.
#[allow(clippy::unnecessary_cast)]
const FLAG_TABLE: &[(&str, u64, bool)] = &[
    ("ro", libc::MS_RDONLY as u64, true),
    ("rw", libc::MS_RDONLY as u64, false),
    ("nosuid", libc::MS_NOSUID as u64, true),
    ("suid", libc::MS_NOSUID as u64, false),
    ("nodev", libc::MS_NODEV as u64, true),
    ("dev", libc::MS_NODEV as u64, false),
    ("noexec", libc::MS_NOEXEC as u64, true),
    ("exec", libc::MS_NOEXEC as u64, false),
    ("sync", libc::MS_SYNCHRONOUS as u64, true),
    ("async", libc::MS_SYNCHRONOUS as u64, false),
    ("dirsync", libc::MS_DIRSYNC as u64, true),
    ("noatime", libc::MS_NOATIME as u64, true),
    ("atime", libc::MS_NOATIME as u64, false),
    ("nodiratime", libc::MS_NODIRATIME as u64, true),
    ("diratime", libc::MS_NODIRATIME as u64, false),
    ("relatime", libc::MS_RELATIME as u64, true),
    ("norelatime", libc::MS_RELATIME as u64, false),
    ("strictatime", libc::MS_STRICTATIME as u64, true),
    ("nostrictatime", libc::MS_STRICTATIME as u64, false),
    ("lazytime", libc::MS_LAZYTIME as u64, true),
    ("nolazytime", libc::MS_LAZYTIME as u64, false),
    ("iversion", libc::MS_I_VERSION as u64, true),
    ("noiversion", libc::MS_I_VERSION as u64, false),
    ("mand", libc::MS_MANDLOCK as u64, true),
    ("nomand", libc::MS_MANDLOCK as u64, false),
    ("silent", libc::MS_SILENT as u64, true),
    ("loud", libc::MS_SILENT as u64, false),
    ("nosymfollow", libc::MS_NOSYMFOLLOW as u64, true),
];

/// Options that change what kind of mount this is; publishing mounts a block
/// filesystem and nothing else.
const FORBIDDEN: &[(&str, &str)] = &[
    (
        "bind",
        "publishing mounts a filesystem, not a bind; use BindMount for binds",
    ),
    (
        "rbind",
        "publishing mounts a filesystem, not a bind; use BindMount for binds",
    ),
    (
        "remount",
        "publishing never remounts; unpublish and publish again",
    ),
    ("move", "publishing never moves mounts"),
    ("loop", "the agent mounts block devices, not image files"),
    (
        "shared",
        "propagation is the agent's business, not an option",
    ),
    (
        "rshared",
        "propagation is the agent's business, not an option",
    ),
    (
        "private",
        "propagation is the agent's business, not an option",
    ),
    (
        "rprivate",
        "propagation is the agent's business, not an option",
    ),
    (
        "slave",
        "propagation is the agent's business, not an option",
    ),
    (
        "rslave",
        "propagation is the agent's business, not an option",
    ),
    (
        "unbindable",
        "propagation is the agent's business, not an option",
    ),
    (
        "runbindable",
        "propagation is the agent's business, not an option",
    ),
];

/// Filesystem options (by key, the text before the first `=`) a request may
/// not set, and why. Each either lets a filesystem error take the whole guest
/// down, or points the kernel at another device than the volume's disk.
const FORBIDDEN_KEYS: &[(&str, &str)] = &[
    (
        "journal_dev",
        "an external journal lives on another device, which the agent does not publish with the volume; use a filesystem with an internal journal",
    ),
    (
        "journal_path",
        "an external journal lives on another device, which the agent does not publish with the volume; use a filesystem with an internal journal",
    ),
    (
        "logdev",
        "an external log lives on another device, which the agent does not publish with the volume; use a filesystem with an internal log",
    ),
    (
        "rtdev",
        "a realtime section lives on another device, which the agent does not publish with the volume",
    ),
    (
        "sb",
        "the agent checks the primary superblock before it mounts; mounting from a backup one would skip that check (repair the disk on the host with e2fsck instead)",
    ),
    (
        "source",
        "the agent names the device itself, from the request's serial or device_path",
    ),
];

/// What `errors=` may say, and what it may not.
const ERRORS_ALLOWED: &[&str] = &["continue", "remount-ro"];
const ERRORS_PANIC: &str = "a filesystem error would panic the guest kernel and end the whole sandbox; use errors=remount-ro (the agent's default) or errors=continue";
const ERRORS_OTHER: &str = "errors= takes remount-ro (the agent's default) or continue";

/// The error behaviour the agent gives an ext4 (and the ext2/ext3 the ext4
/// driver mounts) unless the request chose one of ERRORS_ALLOWED: whatever
/// its superblock says (s_errors, or errors= among s_mount_opts), an error
/// never panics the guest.
pub const DEFAULT_ERRORS: &str = "errors=remount-ro";

/// Longest single option, and longest data string: mount(2) copies at most a page.
const MAX_OPTION_LEN: usize = 1024;
const MAX_DATA_LEN: usize = 4000;

/// The start of an overlong option, for the message (cut on a char boundary).
fn head(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Turns fstab-style options into flags and a data string. Pure.
pub fn parse_options(options: &[String], read_only: bool) -> Result<MountOptions, BadOption> {
    let bad = |option: &str, why| BadOption {
        option: option.to_string(),
        why,
    };
    let mut flags = 0u64;
    let mut data: Vec<&str> = Vec::new();
    for element in options {
        if element.len() > MAX_OPTION_LEN {
            return Err(bad(
                head(element),
                "it is unreasonably long (over 1024 bytes)",
            ));
        }
        if element.contains('\0') {
            return Err(bad(element, "it contains a NUL byte"));
        }
        for opt in element.split(',') {
            if opt.is_empty() {
                return Err(bad(
                    element,
                    "it is empty or has an empty item between commas",
                ));
            }
            if opt == "defaults" {
                continue;
            }
            if opt.starts_with("loop=") {
                return Err(bad(opt, "the agent mounts block devices, not image files"));
            }
            if let Some((_, why)) = FORBIDDEN.iter().find(|(n, _)| *n == opt) {
                return Err(bad(opt, why));
            }
            // The kernel splits an option at its first '=' (vfs_parse_fs_string).
            let (key, value) = match opt.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (opt, None),
            };
            if let Some((_, why)) = FORBIDDEN_KEYS.iter().find(|(k, _)| *k == key) {
                return Err(bad(opt, why));
            }
            if key == "errors" && !value.is_some_and(|v| ERRORS_ALLOWED.contains(&v)) {
                let why = if value == Some("panic") {
                    ERRORS_PANIC
                } else {
                    ERRORS_OTHER
                };
                return Err(bad(opt, why));
            }
            match FLAG_TABLE.iter().find(|(n, _, _)| *n == opt) {
                Some((_, flag, true)) => flags |= flag,
                Some((_, flag, false)) => flags &= !flag,
                None => data.push(opt),
            }
        }
    }
    if read_only {
        flags |= MS_RDONLY;
    }
    let data = data.join(",");
    if data.len() > MAX_DATA_LEN {
        return Err(bad(
            head(&data),
            "the filesystem options together are unreasonably long (over 4000 bytes)",
        ));
    }
    Ok(MountOptions { flags, data })
}

#[cfg(test)]
#[allow(clippy::unnecessary_cast)]
mod tests {
    use super::*;

    fn opts(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    const RO: u64 = libc::MS_RDONLY as u64;
    const NOSUID: u64 = libc::MS_NOSUID as u64;
    const NOATIME: u64 = libc::MS_NOATIME as u64;
    const NODEV: u64 = libc::MS_NODEV as u64;

    #[test]
    fn parses_good_options() {
        let table: &[(&[&str], bool, u64, &str)] = &[
            (&[], false, 0, ""),
            (&[], true, RO, ""),
            (&["defaults"], false, 0, ""),
            (&["ro"], false, RO, ""),
            (&["ro", "rw"], false, 0, ""),
            (&["rw"], true, RO, ""),
            (&["rw", "ro"], false, RO, ""),
            (&["noatime,nosuid"], false, NOATIME | NOSUID, ""),
            (&["nosuid", "suid"], false, 0, ""),
            (&["nodev", "discard"], false, NODEV, "discard"),
            (
                &["discard", "nouuid", "data=ordered"],
                false,
                0,
                "discard,nouuid,data=ordered",
            ),
            (
                &["errors=remount-ro,noatime,defaults"],
                false,
                NOATIME,
                "errors=remount-ro",
            ),
            (&["atime", "noatime", "atime"], false, 0, ""),
            (&["errors=continue"], false, 0, "errors=continue"),
            (
                &["logbufs=8", "usrjquota="],
                false,
                0,
                "logbufs=8,usrjquota=",
            ),
            (&["nosymfollow"], false, libc::MS_NOSYMFOLLOW as u64, ""),
            (
                &["lazytime", "iversion", "dirsync", "sync"],
                false,
                (libc::MS_LAZYTIME | libc::MS_I_VERSION | libc::MS_DIRSYNC | libc::MS_SYNCHRONOUS)
                    as u64,
                "",
            ),
            (&["sync", "async"], false, 0, ""),
            (
                &["relatime", "strictatime", "norelatime"],
                false,
                libc::MS_STRICTATIME as u64,
                "",
            ),
            (
                &["silent", "mand", "nomand"],
                false,
                libc::MS_SILENT as u64,
                "",
            ),
            (
                &["noexec", "exec", "noexec"],
                false,
                libc::MS_NOEXEC as u64,
                "",
            ),
        ];
        for (input, ro, flags, data) in table {
            let got = parse_options(&opts(input), *ro).unwrap_or_else(|e| panic!("{input:?}: {e}"));
            assert_eq!(
                got,
                MountOptions {
                    flags: *flags,
                    data: data.to_string()
                },
                "{input:?} ro={ro}"
            );
        }
    }

    #[test]
    fn errors_panic_says_why() {
        let e = parse_options(&opts(&["errors=panic"]), false).unwrap_err();
        assert!(e.to_string().contains("panic the guest kernel"), "{e}");
        let e = parse_options(&opts(&["journal_dev=2049"]), false).unwrap_err();
        assert!(e.to_string().contains("another device"), "{e}");
    }

    #[test]
    fn ext4_gets_remount_ro_unless_the_request_chose() {
        let table: &[(&[&str], &str, &str)] = &[
            (&[], "ext4", "errors=remount-ro"),
            (&["noatime"], "ext4", "errors=remount-ro"),
            (&["discard"], "ext4", "discard,errors=remount-ro"),
            (&["errors=continue"], "ext4", "errors=continue"),
            (
                &["discard,errors=remount-ro"],
                "ext4",
                "discard,errors=remount-ro",
            ),
            // An option merely containing the word is not a choice.
            (
                &["noerrors_here"],
                "ext4",
                "noerrors_here,errors=remount-ro",
            ),
            // xfs has no errors= option; its data string is left alone.
            (&[], "xfs", ""),
            (&["nouuid"], "xfs", "nouuid"),
        ];
        for (input, fs, want) in table {
            let o = parse_options(&opts(input), false).unwrap();
            assert_eq!(o.kernel_data(fs), *want, "{input:?} on {fs}");
        }
    }

    #[test]
    fn refuses_bad_options() {
        let long = "x".repeat(2000);
        let long_utf8 = "é".repeat(1000);
        let many_utf8: Vec<String> = (0..500).map(|i| format!("o{i}=ééééé")).collect();
        let many: Vec<String> = (0..500).map(|i| format!("opt{i}=abcdef")).collect();
        let table: Vec<Vec<String>> = vec![
            opts(&["bind"]),
            opts(&["rbind"]),
            opts(&["noatime,remount"]),
            opts(&["move"]),
            opts(&["loop"]),
            opts(&["loop=/dev/loop0"]),
            opts(&["shared"]),
            opts(&["rshared"]),
            opts(&["private"]),
            opts(&["rprivate"]),
            opts(&["slave"]),
            opts(&["rslave"]),
            opts(&["unbindable"]),
            opts(&["runbindable"]),
            opts(&["errors=panic"]),
            opts(&["noatime,errors=panic"]),
            opts(&["errors=remount-ro,errors=panic"]),
            opts(&["errors="]),
            opts(&["errors"]),
            opts(&["errors=Panic"]),
            opts(&["errors=remount-ro "]),
            opts(&["journal_dev=2049"]),
            opts(&["journal_path=/dev/vdc"]),
            opts(&["logdev=/dev/vdc"]),
            opts(&["rtdev=/dev/vdc"]),
            opts(&["sb=8193"]),
            opts(&["source=/dev/vdc"]),
            opts(&[""]),
            opts(&["noatime,,nosuid"]),
            opts(&["noatime,"]),
            opts(&["disc\0ard"]),
            vec![long],
            vec![long_utf8],
            many,
            many_utf8,
        ];
        for input in table {
            let err =
                parse_options(&input, false).expect_err(&format!("{input:?} must be refused"));
            assert!(
                err.to_string().starts_with("mount option "),
                "{input:?}: {err}"
            );
        }
    }
}

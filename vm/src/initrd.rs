//! The guest image: a newc cpio holding the agent as `/init` and only the
//! kernel modules it needs (with a trimmed `modules.dep` and the boot list),
//! written byte-for-byte reproducibly (sorted, mtime 0, fixed owners and inodes).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::Error;

/// The modules the agent needs from a Debian cloud kernel (virtio PCI, disks,
/// vsock, xfs, and dm-crypt with the AES-XTS it asks for, which the kernel
/// cannot load itself in a guest with no modprobe); their dependencies are
/// added from `modules.dep`.
pub const DEFAULT_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_blk",
    "vmw_vsock_virtio_transport",
    "xfs",
    "dm_crypt",
    "xts",
    "aesni_intel",
];

/// The modules shipped but not loaded at boot: the agent loads them when a
/// LUKS2 volume with integrity needs them (`system::load_integrity_modules`).
pub const DEFAULT_ON_DEMAND: &[&str] = &["dm_integrity", "authenc"];

/// The file, beside `modules.dep`, that tells the agent which modules to load.
pub const MODULE_LIST: &str = "crust.modules";

/// One member of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A directory.
    Dir { mode: u32 },
    /// A regular file with its contents.
    File { mode: u32, data: Vec<u8> },
    /// A character device node.
    CharDev { mode: u32, major: u32, minor: u32 },
}

/// Writes a newc ("070701") archive of `entries` (path without leading `/`
/// → entry). Paths come out sorted, so a directory precedes its contents;
/// inode numbers follow that order; owner root, mtime 0.
pub fn write_newc(entries: &BTreeMap<String, Entry>) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, (path, entry)) in entries.iter().enumerate() {
        let (mode, nlink, data, rmaj, rmin): (u32, u32, &[u8], u32, u32) = match entry {
            Entry::Dir { mode } => (0o040000 | mode, 2, &[], 0, 0),
            Entry::File { mode, data } => (0o100000 | mode, 1, data, 0, 0),
            Entry::CharDev { mode, major, minor } => (0o020000 | mode, 1, &[], *major, *minor),
        };
        push_header(
            &mut out,
            &Header {
                ino: newc(i + 1),
                mode,
                nlink,
                size: newc(data.len()),
                rdev: (rmaj, rmin),
            },
            path,
        );
        out.extend_from_slice(data);
        pad4(&mut out);
    }
    let trailer = Header {
        ino: 0,
        mode: 0,
        nlink: 1,
        size: 0,
        rdev: (0, 0),
    };
    push_header(&mut out, &trailer, "TRAILER!!!");
    out
}

/// A count in a newc header: 32 bits. The initrd holds a few files of a
/// few MiB; anything that does not fit is a bug in what was put in.
fn newc(n: usize) -> u32 {
    u32::try_from(n).expect("a cpio newc field holds at most 32 bits")
}

/// The fields of a newc header that vary (owner root, mtime 0, no device).
struct Header {
    ino: u32,
    mode: u32,
    nlink: u32,
    size: u32,
    /// A device node's major and minor.
    rdev: (u32, u32),
}

fn push_header(out: &mut Vec<u8>, h: &Header, name: &str) {
    let fields = [
        h.ino,
        h.mode,
        0,
        0,
        h.nlink,
        0,
        h.size,
        0,
        0,
        h.rdev.0,
        h.rdev.1,
        newc(name.len() + 1),
        0,
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
}

fn pad4(out: &mut Vec<u8>) {
    while out.len() & 3 != 0 {
        out.push(0);
    }
}

/// gzip with a fixed header (no name, mtime 0), so equal input gives equal output.
pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(3)
        .write(Vec::new(), flate2::Compression::best());
    // Writing into a Vec cannot fail.
    let _ = enc.write_all(data);
    enc.finish().unwrap_or_default()
}

/// The name of a module as modules.dep keys it: file stem, `-` as `_`.
fn module_name(s: &str) -> String {
    let base = s.rsplit('/').next().unwrap_or(s);
    base.split(".ko").next().unwrap_or(base).replace('-', "_")
}

/// Parses modules.dep: name → (relative path, dependency names).
fn parse_modules_dep(text: &str) -> HashMap<String, (String, Vec<String>)> {
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(p, _)| !p.trim().is_empty())
        .map(|(p, r)| {
            let p = p.trim();
            (
                module_name(p),
                (
                    p.to_string(),
                    r.split_whitespace().map(module_name).collect(),
                ),
            )
        })
        .collect()
}

/// The modules `roots` need, themselves included (names), or the first root
/// or dependency modules.dep does not know.
pub fn module_closure(modules_dep: &str, roots: &[String]) -> Result<BTreeSet<String>, String> {
    let deps = parse_modules_dep(modules_dep);
    let mut out = BTreeSet::new();
    let mut stack: Vec<String> = roots.iter().map(|r| module_name(r)).collect();
    while let Some(m) = stack.pop() {
        if out.contains(&m) {
            continue;
        }
        let (_, ds) = deps.get(&m).ok_or_else(|| m.clone())?;
        stack.extend(ds.iter().cloned());
        out.insert(m);
    }
    Ok(out)
}

/// What goes into the guest image.
#[derive(Debug, Clone)]
pub struct InitrdSpec {
    /// The static agent binary, to become `/init`.
    pub agent: PathBuf,
    /// The extracted kernel package: holds `lib/modules/<version>/` with a
    /// full `modules.dep` (from `depmod -b`).
    pub kernel_root: PathBuf,
    /// The kernel release, e.g. `6.1.0-28-cloud-amd64`.
    pub version: String,
    /// The modules to load at boot; dependencies are added.
    pub modules: Vec<String>,
    /// Modules shipped (with their dependencies) but left out of the boot
    /// list, for the agent to load on first use (`init::load_named`).
    pub on_demand: Vec<String>,
    /// gzip the archive.
    pub compress: bool,
}

/// Builds the image bytes from `spec`.
pub fn build(spec: &InitrdSpec) -> Result<Vec<u8>, Error> {
    let rel_dir = format!("lib/modules/{}", spec.version);
    let mod_dir = spec.kernel_root.join(&rel_dir);
    let dep_text = String::from_utf8_lossy(&read(&mod_dir.join("modules.dep"))?).into_owned();
    let all: Vec<String> = spec
        .modules
        .iter()
        .chain(&spec.on_demand)
        .cloned()
        .collect();
    let closure = module_closure(&dep_text, &all).map_err(|m| {
        Error::Initrd(format!(
            "module {m} is not in {}/modules.dep: check the module list against this kernel ({} built in?)",
            mod_dir.display(),
            m
        ))
    })?;

    let mut entries = skeleton(&read(&spec.agent)?);
    let trimmed = add_modules(&mut entries, &dep_text, &closure, &mod_dir, &rel_dir)?;
    entries.insert(
        format!("{rel_dir}/modules.dep"),
        Entry::File {
            mode: 0o644,
            data: trimmed.into_bytes(),
        },
    );
    let list: String = spec.modules.iter().map(|m| module_name(m) + "\n").collect();
    entries.insert(
        format!("{rel_dir}/{MODULE_LIST}"),
        Entry::File {
            mode: 0o644,
            data: list.into_bytes(),
        },
    );

    let cpio = write_newc(&entries);
    Ok(if spec.compress { gzip(&cpio) } else { cpio })
}

fn read(p: &Path) -> Result<Vec<u8>, Error> {
    fs::read(p).map_err(|e| Error::Io(format!("cannot read {}", p.display()), e))
}

/// Adds `path` and each directory above it, as 0755 directories.
fn add_dirs(entries: &mut BTreeMap<String, Entry>, path: &str) {
    let mut acc = String::new();
    for part in path.split('/').filter(|p| !p.is_empty()) {
        if !acc.is_empty() {
            acc.push('/');
        }
        acc.push_str(part);
        entries
            .entry(acc.clone())
            .or_insert(Entry::Dir { mode: 0o755 });
    }
}

/// What every image holds: the mount points, the console, and the agent
/// (`agent`, its bytes) as `/init`.
fn skeleton(agent: &[u8]) -> BTreeMap<String, Entry> {
    let mut entries = BTreeMap::new();
    for d in ["dev", "proc", "sys", "run", "tmp"] {
        add_dirs(&mut entries, d);
    }
    entries.insert(
        "dev/console".into(),
        Entry::CharDev {
            mode: 0o600,
            major: 5,
            minor: 1,
        },
    );
    entries.insert(
        "init".into(),
        Entry::File {
            mode: 0o755,
            data: agent.to_vec(),
        },
    );
    entries
}

/// Adds the modules of `closure` from `mod_dir` under `rel_dir`, and
/// answers the lines of modules.dep (`dep_text`) for them, in depmod's order.
fn add_modules(
    entries: &mut BTreeMap<String, Entry>,
    dep_text: &str,
    closure: &BTreeSet<String>,
    mod_dir: &Path,
    rel_dir: &str,
) -> Result<String, Error> {
    let mut trimmed = String::new();
    for line in dep_text.lines() {
        let Some((p, _)) = line.split_once(':') else {
            continue;
        };
        if closure.contains(&module_name(p.trim())) {
            let p = p.trim();
            let parent = Path::new(p)
                .parent()
                .map(|x| x.to_string_lossy().into_owned())
                .unwrap_or_default();
            add_dirs(entries, &format!("{rel_dir}/{parent}"));
            entries.insert(
                format!("{rel_dir}/{p}"),
                Entry::File {
                    mode: 0o644,
                    data: read(&mod_dir.join(p))?,
                },
            );
            trimmed.push_str(line);
            trimmed.push('\n');
        }
    }
    Ok(trimmed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn newc_layout_matches_the_format() {
        let mut e = BTreeMap::new();
        e.insert(
            "init".to_string(),
            Entry::File {
                mode: 0o755,
                data: b"abcde".to_vec(),
            },
        );
        e.insert("dev".to_string(), Entry::Dir { mode: 0o755 });
        let a = write_newc(&e);
        // First entry is "dev" (sorted): header 110 bytes + "dev\0" = 114 → padded to 116.
        assert_eq!(&a[..6], b"070701");
        assert_eq!(&a[6..14], b"00000001"); // ino
        assert_eq!(&a[14..22], b"000041ed"); // dir 0755
        assert_eq!(&a[110..114], b"dev\0");
        let second = 116;
        assert_eq!(&a[second + 14..second + 22], b"000081ed");
        assert_eq!(&a[second + 54..second + 62], b"00000005"); // filesize
        assert_eq!(&a[second + 110..second + 115], b"init\0");
        // Name ends at 116+115=231 → data at 232, 5 bytes, padded to 240.
        assert_eq!(&a[232..237], b"abcde");
        assert_eq!(&a[240..246], b"070701");
        assert_eq!(&a[240 + 110..240 + 121], b"TRAILER!!!\0");
        assert_eq!(a.len() % 4, 0);
    }

    #[test]
    fn archive_is_reproducible_and_readable_by_cpio() {
        let mut e = BTreeMap::new();
        e.insert(
            "b/c".to_string(),
            Entry::File {
                mode: 0o644,
                data: vec![7; 1000],
            },
        );
        e.insert("b".to_string(), Entry::Dir { mode: 0o755 });
        e.insert(
            "a".to_string(),
            Entry::File {
                mode: 0o755,
                data: vec![],
            },
        );
        let one = gzip(&write_newc(&e));
        let two = gzip(&write_newc(&e.clone()));
        assert_eq!(one, two);

        // The system's cpio lists the same members.
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("x.cpio");
        fs::write(&img, write_newc(&e)).unwrap();
        let out = std::process::Command::new("cpio")
            .args(["-it", "--quiet", "-F"])
            .arg(&img)
            .output()
            .expect("cpio is installed");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a\nb\nb/c\n");
    }

    #[test]
    fn closure_adds_dependencies_and_names_the_missing() {
        let dep = "k/xfs.ko: k/libcrc32c.ko\nk/libcrc32c.ko:\nk/virtio-blk.ko: k/virtio.ko\nk/virtio.ko:\nk/bad.ko: k/gone.ko\n";
        type Case<'a> = (&'a [&'a str], Result<&'a [&'a str], &'a str>);
        let cases: &[Case] = &[
            (&[], Ok(&[])),
            (&["xfs"], Ok(&["libcrc32c", "xfs"])),
            (
                &["virtio_blk", "xfs"],
                Ok(&["libcrc32c", "virtio", "virtio_blk", "xfs"]),
            ),
            (&["nope"], Err("nope")),
            (&["bad"], Err("gone")),
        ];
        for (roots, want) in cases {
            let got = module_closure(dep, &s(roots));
            let want = want
                .map(|w| w.iter().map(|x| x.to_string()).collect::<BTreeSet<_>>())
                .map_err(|e| e.to_string());
            assert_eq!(got, want, "roots {roots:?}");
        }
    }
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn build_ships_the_closure_and_lists_the_boot_set() {
        // cpio makes the archive's dev/console with mknod.
        crust_testkit::needs::root();
        let root = tempfile::tempdir().unwrap();
        let md = root.path().join("lib/modules/9.9-test");
        fs::create_dir_all(md.join("k")).unwrap();
        let dep = "k/xfs.ko: k/libcrc32c.ko\nk/libcrc32c.ko:\nk/virtio_blk.ko: k/virtio.ko\nk/virtio.ko:\nk/other.ko:\n";
        fs::write(md.join("modules.dep"), dep).unwrap();
        for m in ["xfs", "libcrc32c", "virtio_blk", "virtio", "other"] {
            fs::write(md.join(format!("k/{m}.ko")), m).unwrap();
        }
        let agent = root.path().join("agent");
        fs::write(&agent, b"\x7fELF").unwrap();
        let spec = InitrdSpec {
            agent,
            kernel_root: root.path().to_path_buf(),
            version: "9.9-test".into(),
            modules: s(&["virtio_blk"]),
            on_demand: s(&["xfs"]),
            compress: false,
        };
        let img = build(&spec).unwrap();
        assert_eq!(img, build(&spec).unwrap(), "reproducible");
        let out = root.path().join("x");
        fs::create_dir(&out).unwrap();
        let mut child = std::process::Command::new("cpio")
            .args(["-id", "--quiet"])
            .current_dir(&out)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&img).unwrap();
        assert!(child.wait().unwrap().success());
        let md = out.join("lib/modules/9.9-test");
        assert_eq!(fs::read(out.join("init")).unwrap(), b"\x7fELF");
        assert_eq!(
            fs::read_to_string(md.join(MODULE_LIST)).unwrap(),
            "virtio_blk\n"
        );
        assert_eq!(
            fs::read_to_string(md.join("modules.dep")).unwrap(),
            "k/xfs.ko: k/libcrc32c.ko\nk/libcrc32c.ko:\nk/virtio_blk.ko: k/virtio.ko\nk/virtio.ko:\n"
        );
        for m in ["xfs", "libcrc32c", "virtio_blk", "virtio"] {
            assert_eq!(fs::read_to_string(md.join(format!("k/{m}.ko"))).unwrap(), m);
        }
        assert!(!md.join("k/other.ko").exists());

        // A module this kernel lacks is named in the error.
        let bad = InitrdSpec {
            modules: s(&["zfs"]),
            ..spec
        };
        let err = build(&bad).unwrap_err().to_string();
        assert!(err.contains("module zfs is not in"), "{err}");
    }
}

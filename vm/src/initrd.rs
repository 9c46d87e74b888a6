//! The guest image: a newc cpio holding the agent as `/init`, only the
//! kernel modules it needs (with a trimmed `modules.dep` and the boot list),
//! and the build host's `mke2fs` and `mkfs.xfs` with exactly their libraries
//! and interpreter in `usr/lib/crust/mkfs/` (the agent makes the filesystem
//! of a new encrypted volume with them), written byte-for-byte reproducibly
//! (sorted, mtime 0, fixed owners and inodes).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::elf;
use crate::Error;

/// The modules the agent needs from a Debian cloud kernel (virtio PCI, disks,
/// vsock, xfs, and dm-crypt with the AES-XTS it asks for, dm-integrity and
/// the authenc that authenticated encryption asks for, none of which the
/// kernel can load itself in a guest with no modprobe); their dependencies
/// are added from `modules.dep`. All but the vsock stack load after the
/// agent listens, in the background.
pub const DEFAULT_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_blk",
    "vmw_vsock_virtio_transport",
    "xfs",
    "dm_crypt",
    "xts",
    "aesni_intel",
    "dm_integrity",
    "authenc",
];

/// The modules shipped but not loaded at boot by default: none.
pub const DEFAULT_ON_DEMAND: &[&str] = &[];

/// The file, beside `modules.dep`, that tells the agent which modules to load.
pub const MODULE_LIST: &str = "crust.modules";

/// Where the image keeps the mkfs programs, their libraries and their
/// interpreter: the agent's `mkfs::PRIVATE_DIR`, without its leading `/`.
pub const MKFS_DIR: &str = "usr/lib/crust/mkfs";

/// The interpreter's name there, which the agent runs the programs through:
/// x86-64 glibc's.
pub const MKFS_INTERPRETER: &str = "ld-linux-x86-64.so.2";

/// The programs shipped unless told otherwise, from the build host.
pub const DEFAULT_MKFS: &[&str] = &["mke2fs", "mkfs.xfs"];

/// Where the build host's programs are looked for.
const HOST_PROGRAM_DIRS: &[&str] = &["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// Where their libraries are looked for: the loader's own search on Debian
/// x86-64 (multiarch first).
pub const HOST_LIB_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// The programs to ship in [`MKFS_DIR`], and where their libraries are.
#[derive(Debug, Clone)]
pub struct Mkfs {
    /// Dynamically linked x86-64 programs; each is shipped under its file name.
    pub programs: Vec<PathBuf>,
    /// Searched in order for each `DT_NEEDED` name.
    pub lib_dirs: Vec<PathBuf>,
}

impl Mkfs {
    /// [`DEFAULT_MKFS`] and [`HOST_LIB_DIRS`] of the build host, which is
    /// Debian as the guest's kernel is.
    pub fn from_host() -> Result<Mkfs, Error> {
        let programs = DEFAULT_MKFS
            .iter()
            .map(|name| {
                HOST_PROGRAM_DIRS
                    .iter()
                    .map(|d| Path::new(d).join(name))
                    .find(|p| p.is_file())
                    .ok_or_else(|| {
                        Error::Initrd(format!(
                            "the build host has no {name} in {}: apt-get install e2fsprogs xfsprogs, or pack the image with --no-mkfs (the agent then cannot format an encrypted volume)",
                            HOST_PROGRAM_DIRS.join(", ")
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Mkfs {
            programs,
            lib_dirs: HOST_LIB_DIRS.iter().map(PathBuf::from).collect(),
        })
    }
}

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
    /// The programs to ship in [`MKFS_DIR`]; None ships none.
    pub mkfs: Option<Mkfs>,
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

    if let Some(m) = &spec.mkfs {
        add_dirs(&mut entries, MKFS_DIR);
        for (name, data) in mkfs_files(m)? {
            entries.insert(
                format!("{MKFS_DIR}/{name}"),
                Entry::File { mode: 0o755, data },
            );
        }
    }

    let cpio = write_newc(&entries);
    Ok(if spec.compress { gzip(&cpio) } else { cpio })
}

/// The files of [`MKFS_DIR`], by name: each program, every library it
/// needs (theirs too, by the `DT_NEEDED` name the loader looks for), and
/// the interpreter as [`MKFS_INTERPRETER`]. Symlinks are followed: each is
/// a file of its own in the image.
pub fn mkfs_files(m: &Mkfs) -> Result<BTreeMap<String, Vec<u8>>, Error> {
    let mut files = BTreeMap::new();
    // (library, the file that needs it)
    let mut wanted: Vec<(String, String)> = Vec::new();
    for p in &m.programs {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| Error::Initrd(format!("{} names no file", p.display())))?;
        let data = read(p)?;
        let needs = needs_of(p, &data)?;
        let interp = needs.interpreter.ok_or_else(|| {
            Error::Initrd(format!(
                "{} has no interpreter: ship a dynamically linked program",
                p.display()
            ))
        })?;
        if Path::new(&interp).file_name() != Some(OsStr::new(MKFS_INTERPRETER)) {
            return Err(Error::Initrd(format!(
                "{} asks for the interpreter {interp}; the agent runs the programs through {MKFS_INTERPRETER} (x86-64 glibc)",
                p.display()
            )));
        }
        if !files.contains_key(MKFS_INTERPRETER) {
            files.insert(MKFS_INTERPRETER.to_string(), read(Path::new(&interp))?);
        }
        wanted.extend(needs.libraries.into_iter().map(|l| (l, name.clone())));
        if files.insert(name.clone(), data).is_some() {
            return Err(Error::Initrd(format!("two files to ship are named {name}")));
        }
    }
    while let Some((lib, by)) = wanted.pop() {
        if files.contains_key(&lib) {
            continue;
        }
        let path = find_library(&lib, &by, &m.lib_dirs)?;
        let data = read(&path)?;
        let needs = needs_of(&path, &data)?;
        wanted.extend(needs.libraries.into_iter().map(|l| (l, lib.clone())));
        files.insert(lib, data);
    }
    Ok(files)
}

fn needs_of(p: &Path, data: &[u8]) -> Result<elf::Needs, Error> {
    elf::needs(data).map_err(|e| Error::Initrd(format!("{}: {e}", p.display())))
}

/// The first of `dirs` holding `lib` (a name `by` needs).
fn find_library(lib: &str, by: &str, dirs: &[PathBuf]) -> Result<PathBuf, Error> {
    if lib.contains('/') || lib.starts_with('.') {
        return Err(Error::Initrd(format!(
            "{by} needs {lib}, which is a path, not a library name"
        )));
    }
    dirs.iter()
        .map(|d| d.join(lib))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
            Error::Initrd(format!(
                "{lib}, which {by} needs, is in none of {}",
                dirs.join(", ")
            ))
        })
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
            mkfs: None,
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

    /// A newc archive's members, path → (mode, data): enough of the format for these tests.
    fn members(a: &[u8]) -> BTreeMap<String, (u32, Vec<u8>)> {
        let mut out = BTreeMap::new();
        let mut at = 0;
        loop {
            let field = |i: usize| {
                let hex = std::str::from_utf8(&a[at + 6 + 8 * i..at + 14 + 8 * i]).unwrap();
                usize::try_from(u32::from_str_radix(hex, 16).unwrap()).unwrap()
            };
            let (mode, size, namesize) = (field(1), field(6), field(11));
            let name = String::from_utf8(a[at + 110..at + 109 + namesize].to_vec()).unwrap();
            if name == "TRAILER!!!" {
                return out;
            }
            let data = (at + 110 + namesize + 3) & !3;
            out.insert(
                name,
                (u32::try_from(mode).unwrap(), a[data..data + size].to_vec()),
            );
            at = (data + size + 3) & !3;
        }
    }

    #[test]
    fn mkfs_files_are_the_programs_closed_under_dt_needed() {
        let root = tempfile::tempdir().unwrap();
        let (bin, lib) = (root.path().join("bin"), root.path().join("lib"));
        fs::create_dir_all(&bin).unwrap();
        fs::create_dir_all(&lib).unwrap();
        let interp = lib.join(MKFS_INTERPRETER);
        let put = |p: &Path, interp: Option<&Path>, needs: &[&str]| {
            let i = interp.map(|i| i.to_string_lossy().into_owned());
            fs::write(p, elf::fake(i.as_deref(), needs)).unwrap();
        };
        put(&interp, None, &[]);
        put(
            &bin.join("mke2fs"),
            Some(&interp),
            &["liba.so.1", "libc.so.6"],
        );
        put(&bin.join("mkfs.xfs"), Some(&interp), &["libc.so.6"]);
        put(&lib.join("liba.so.1"), None, &["libb.so.2", "libc.so.6"]);
        put(&lib.join("libb.so.2"), None, &[]);
        put(&lib.join("libc.so.6"), None, &[MKFS_INTERPRETER]);
        // A symlink is shipped as the file it points at, under the needed name.
        fs::rename(lib.join("libb.so.2"), lib.join("libb.so.2.4")).unwrap();
        std::os::unix::fs::symlink("libb.so.2.4", lib.join("libb.so.2")).unwrap();
        let m = Mkfs {
            programs: vec![bin.join("mke2fs"), bin.join("mkfs.xfs")],
            lib_dirs: vec![root.path().join("nowhere"), lib.clone()],
        };
        let files = mkfs_files(&m).unwrap();
        let names: Vec<&str> = files.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                MKFS_INTERPRETER,
                "liba.so.1",
                "libb.so.2",
                "libc.so.6",
                "mke2fs",
                "mkfs.xfs"
            ]
        );
        assert_eq!(
            files["libb.so.2"],
            fs::read(lib.join("libb.so.2.4")).unwrap()
        );

        // A library nowhere to be found is named, with who needs it.
        fs::remove_file(lib.join("libb.so.2")).unwrap();
        let e = mkfs_files(&m).unwrap_err().to_string();
        assert!(
            e.starts_with("libb.so.2, which liba.so.1 needs, is in none of "),
            "{e}"
        );
        // Another interpreter than the one the agent runs is refused.
        put(
            &bin.join("mkfs.xfs"),
            Some(&lib.join("ld-musl-x86_64.so.1")),
            &[],
        );
        let e = mkfs_files(&m).unwrap_err().to_string();
        assert!(e.contains("asks for the interpreter"), "{e}");
        // So is a static program, and a file that is not ELF.
        put(&bin.join("mkfs.xfs"), None, &[]);
        let e = mkfs_files(&m).unwrap_err().to_string();
        assert!(e.contains("has no interpreter"), "{e}");
        fs::write(bin.join("mkfs.xfs"), "#!/bin/sh\n").unwrap();
        let e = mkfs_files(&m).unwrap_err().to_string();
        assert!(e.ends_with("mkfs.xfs: not an ELF file"), "{e}");
    }

    /// The image as `make initrd` packs it, with the build host's programs.
    fn host_image() -> (tempfile::TempDir, BTreeMap<String, (u32, Vec<u8>)>) {
        crust_testkit::needs::tools(
            &["mke2fs", "mkfs.xfs"],
            "apt-get install e2fsprogs xfsprogs",
        );
        let root = tempfile::tempdir().unwrap();
        let md = root.path().join("lib/modules/9.9-test");
        fs::create_dir_all(md.join("k")).unwrap();
        fs::write(md.join("modules.dep"), "k/virtio.ko:\n").unwrap();
        fs::write(md.join("k/virtio.ko"), "m").unwrap();
        let agent = root.path().join("agent");
        fs::write(&agent, b"\x7fELF").unwrap();
        let spec = InitrdSpec {
            agent,
            kernel_root: root.path().to_path_buf(),
            version: "9.9-test".into(),
            modules: s(&["virtio"]),
            on_demand: vec![],
            mkfs: Some(Mkfs::from_host().unwrap()),
            compress: false,
        };
        let img = build(&spec).unwrap();
        assert_eq!(img, build(&spec).unwrap(), "reproducible");
        (root, members(&img))
    }

    #[test]
    #[ignore = "needs e2fsprogs and xfsprogs: make test runs it"]
    fn the_image_ships_the_host_mkfs_closed_under_dt_needed() {
        let (_root, image) = host_image();
        assert_eq!(image[MKFS_DIR].0, 0o040755);
        let dir: BTreeMap<&str, &(u32, Vec<u8>)> = image
            .iter()
            .filter_map(|(p, e)| Some((p.strip_prefix(MKFS_DIR)?.strip_prefix('/')?, e)))
            .collect();
        for name in [MKFS_INTERPRETER, "mke2fs", "mkfs.xfs"] {
            assert!(dir.contains_key(name), "{name} in {:?}", dir.keys());
        }
        for (name, (mode, data)) in &dir {
            assert_eq!(*mode, 0o100755, "{name}");
            for lib in elf::needs(data).unwrap().libraries {
                assert!(
                    dir.contains_key(lib.as_str()),
                    "{name} needs {lib}, not shipped"
                );
            }
        }
        let host_ld = fs::read("/lib64/ld-linux-x86-64.so.2").unwrap();
        assert!(*dir[MKFS_INTERPRETER].1 == host_ld);
        let total: usize = dir.values().map(|(_, d)| d.len()).sum();
        eprintln!("{MKFS_DIR}: {} files, {total} bytes", dir.len());
    }

    /// The shipped directory alone in a root of its own: the programs run
    /// through the shipped interpreter as the agent runs them, with no /lib
    /// to fall back on, and the host's checkers accept what they made.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn the_shipped_programs_run_with_nothing_else_beside_them() {
        crust_testkit::needs::root();
        crust_testkit::needs::tools(
            &["chroot", "e2fsck", "xfs_repair"],
            "apt-get install coreutils e2fsprogs xfsprogs",
        );
        let (_root, image) = host_image();
        let guest = tempfile::tempdir().unwrap();
        for (path, (mode, data)) in &image {
            if path.starts_with(MKFS_DIR) && mode & 0o100000 != 0 {
                let to = guest.path().join(path);
                fs::create_dir_all(to.parent().unwrap()).unwrap();
                fs::write(&to, data).unwrap();
                let exec = <fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755);
                fs::set_permissions(&to, exec).unwrap();
            }
        }
        assert!(!guest.path().join("lib").exists() && !guest.path().join("lib64").exists());
        let dir = format!("/{MKFS_DIR}");
        for (program, args, check) in [
            (
                "mke2fs",
                &[
                    "-t",
                    "ext4",
                    "-q",
                    "-F",
                    "-E",
                    "nodiscard,lazy_itable_init=1,lazy_journal_init=1",
                ][..],
                &["e2fsck", "-f", "-n"][..],
            ),
            (
                "mkfs.xfs",
                &["-q", "-f", "-K"][..],
                &["xfs_repair", "-n", "-f"][..],
            ),
        ] {
            let img = guest.path().join("disk.img");
            fs::File::create(&img).unwrap().set_len(320 << 20).unwrap();
            let out = std::process::Command::new("chroot")
                .arg(guest.path())
                .arg(format!("{dir}/{MKFS_INTERPRETER}"))
                .args(["--library-path", &dir, &format!("{dir}/{program}")])
                .args(args)
                .arg("/disk.img")
                .env_clear()
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .env("LC_ALL", "C")
                .output()
                .unwrap();
            crust_testkit::disks::succeeded(&out, format_args!("{program} in a root of its own"));
            let mut check = check.to_vec();
            let img = img.to_str().unwrap();
            check.push(img);
            crust_testkit::disks::run(check[0], &check[1..]);
        }
    }
}

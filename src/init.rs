//! PID 1 duties: the early mounts, the kernel command line, kernel modules in
//! dependency order, reaping and signals, the panic hook and power-off.
//! Everything here is a syscall. The only programs the initrd holds are the
//! mkfs ones (src/mkfs.rs), whose children the reaper leaves to their owner
//! (sys::children).

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use rustix::mount::MountFlags;

/// The file of the initrd that lists, one per line, the modules to load at
/// boot (their dependencies come from `modules.dep`). Without it, every
/// module of `modules.dep` is loaded.
pub const MODULE_LIST: &str = "crust.modules";

/// `finit_module` flag: the file is compressed and the kernel decompresses it.
const MODULE_INIT_COMPRESSED_FILE: i32 = 4;

/// One early mount: what, where, which filesystem, flags, options.
struct EarlyMount {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: MountFlags,
    data: &'static str,
}

fn early_mount_table() -> [EarlyMount; 6] {
    let nsn = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    [
        EarlyMount {
            source: "proc",
            target: "/proc",
            fstype: "proc",
            flags: nsn,
            data: "",
        },
        EarlyMount {
            source: "sysfs",
            target: "/sys",
            fstype: "sysfs",
            flags: nsn,
            data: "",
        },
        EarlyMount {
            source: "devtmpfs",
            target: "/dev",
            fstype: "devtmpfs",
            flags: MountFlags::NOSUID | MountFlags::NOEXEC,
            data: "mode=0755",
        },
        EarlyMount {
            source: "devpts",
            target: "/dev/pts",
            fstype: "devpts",
            flags: MountFlags::NOSUID | MountFlags::NOEXEC,
            data: "mode=0620,ptmxmode=0666",
        },
        EarlyMount {
            source: "shm",
            target: "/dev/shm",
            fstype: "tmpfs",
            flags: nsn,
            data: "mode=1777",
        },
        EarlyMount {
            source: "run",
            target: "/run",
            fstype: "tmpfs",
            flags: MountFlags::NOSUID | MountFlags::NODEV,
            data: "mode=0755",
        },
    ]
}

/// True when `path` is already a mount point: it lives on another device
/// than its parent. (A second proc or devtmpfs mount would stack silently
/// rather than fail with EBUSY, so we look before mounting.)
fn is_mount_point(path: &Path) -> bool {
    let parent = path.parent().unwrap_or(Path::new("/"));
    match (fs::metadata(path), fs::metadata(parent)) {
        (Ok(p), Ok(q)) => p.dev() != q.dev(),
        _ => false,
    }
}

/// Mounts /proc, /sys, /dev (devtmpfs), /dev/pts, /dev/shm and /run.
/// Whatever is already mounted is left as it is; failures are returned as
/// warnings to log, since the agent may still serve without some of them.
pub fn early_mounts() -> Vec<String> {
    let mut warnings = Vec::new();
    for m in early_mount_table() {
        let target = Path::new(m.target);
        if let Err(e) = rustix::fs::mkdir(target, Mode::from_raw_mode(0o755)) {
            if e != rustix::io::Errno::EXIST {
                warnings.push(format!("cannot create mount point {}: {e}", m.target));
                continue;
            }
        }
        if is_mount_point(target) {
            continue;
        }
        let data = CString::new(m.data).unwrap_or_default();
        match rustix::mount::mount(m.source, target, m.fstype, m.flags, data.as_c_str()) {
            Ok(()) => {}
            Err(rustix::io::Errno::BUSY) => {}
            Err(e) => warnings.push(format!("cannot mount {} on {}: {e}", m.fstype, m.target)),
        }
    }
    warnings
}

/// What the agent reads from the kernel command line (`crust.*=`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Settings {
    /// `crust.listen=ADDR`, repeatable.
    pub listen: Vec<String>,
    /// `crust.root=DIR`.
    pub root: Option<String>,
    /// `crust.log=debug|info|warn`.
    pub log: Option<String>,
    /// `crust.log_format=text|json`.
    pub log_format: Option<String>,
    /// `crust.modules=a,b`: extra modules to load, repeatable.
    pub modules: Vec<String>,
    /// `crust.vsock_peers=host|any|CID,…`: which vsock peers may connect.
    pub vsock_peers: Option<String>,
    /// `crust.notify=ADDR`: where to announce readiness (notify.rs).
    pub notify: Option<String>,
    /// `crust.cdh_socket=PATH`: the Confidential Data Hub's socket (keys).
    pub cdh_socket: Option<String>,
    /// `crust.key_dir=DIR`: where `file:///` keys are read from.
    pub key_dir: Option<String>,
    /// `systemd.set_credential=vmm.notify_socket:ADDR`: systemd's spelling of
    /// the same, for VMMs that wait for systemd guests.
    pub vmm_notify_socket: Option<String>,
}

/// Splits a kernel command line into words the way the kernel does:
/// whitespace separates, double quotes group (and are dropped).
fn cmdline_words(cmdline: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut any = false;
    for c in cmdline.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    words.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(cur);
    }
    words
}

/// Reads the agent's settings from the kernel command line. Unknown
/// `crust.*` keys and empty values are ignored; the last scalar wins.
pub fn kernel_settings(cmdline: &str) -> Settings {
    let mut s = Settings::default();
    for word in cmdline_words(cmdline) {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        if value.is_empty() {
            continue;
        }
        match key {
            "crust.listen" => s.listen.push(value.to_string()),
            "crust.root" => s.root = Some(value.to_string()),
            "crust.log" => s.log = Some(value.to_string()),
            "crust.log_format" => s.log_format = Some(value.to_string()),
            "crust.modules" => s
                .modules
                .extend(value.split(',').filter(|m| !m.is_empty()).map(module_name)),
            "crust.vsock_peers" => s.vsock_peers = Some(value.to_string()),
            "crust.notify" => s.notify = Some(value.to_string()),
            "crust.cdh_socket" => s.cdh_socket = Some(value.to_string()),
            "crust.key_dir" => s.key_dir = Some(value.to_string()),
            "systemd.set_credential" => {
                if let Some(("vmm.notify_socket", addr)) = value.split_once(':') {
                    if !addr.is_empty() {
                        s.vmm_notify_socket = Some(addr.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    s
}

/// The canonical name of a module: its file name without `.ko[.xz|.zst|.gz]`,
/// with `-` read as `_` (as modprobe does).
fn module_name(s: &str) -> String {
    let base = s.rsplit('/').next().unwrap_or(s);
    let base = base.split(".ko").next().unwrap_or(base);
    base.replace('-', "_")
}

/// What `load_modules` did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ModuleReport {
    /// Modules now in the kernel (loaded here, or already there), in load order.
    pub loaded: Vec<String>,
    /// Modules that could not be loaded, with why.
    pub failed: Vec<(String, String)>,
}

/// The load plan: files to load, dependencies first, and wanted names that
/// `modules.dep` does not know.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LoadPlan {
    /// (module name, path relative to the modules directory), in load order.
    pub order: Vec<(String, String)>,
    /// Wanted modules absent from `modules.dep`.
    pub missing: Vec<String>,
}

/// Orders `wanted` and their dependencies from the text of `modules.dep`
/// (`path: dep1 dep2 …`, where each line lists the full closure, nearest
/// first, as depmod writes it). Each module appears once, after all of its
/// dependencies; `wanted` keeps its order otherwise.
pub fn load_order(modules_dep: &str, wanted: &[String]) -> LoadPlan {
    let mut deps: HashMap<String, (String, Vec<String>)> = HashMap::new();
    for line in modules_dep.lines() {
        let Some((path, rest)) = line.split_once(':') else {
            continue;
        };
        let path = path.trim();
        if path.is_empty() {
            continue;
        }
        let list = rest.split_whitespace().map(module_name).collect();
        deps.insert(module_name(path), (path.to_string(), list));
    }

    let mut plan = LoadPlan::default();
    let mut done: HashSet<String> = HashSet::new();
    let mut missing: HashSet<String> = HashSet::new();
    for w in wanted {
        let w = module_name(w);
        visit(
            &w,
            &deps,
            &mut done,
            &mut HashSet::new(),
            &mut plan.order,
            &mut missing,
            &mut plan.missing,
        );
    }
    plan
}

fn visit(
    name: &str,
    deps: &HashMap<String, (String, Vec<String>)>,
    done: &mut HashSet<String>,
    in_progress: &mut HashSet<String>,
    order: &mut Vec<(String, String)>,
    missing_set: &mut HashSet<String>,
    missing: &mut Vec<String>,
) {
    if done.contains(name) || in_progress.contains(name) {
        return;
    }
    let Some((path, list)) = deps.get(name) else {
        if missing_set.insert(name.to_string()) {
            missing.push(name.to_string());
        }
        return;
    };
    in_progress.insert(name.to_string());
    // depmod lists the nearest dependency first; modprobe loads the list
    // from its end, so the deepest ones go in first.
    for d in list.iter().rev() {
        visit(d, deps, done, in_progress, order, missing_set, missing);
    }
    in_progress.remove(name);
    done.insert(name.to_string());
    order.push((name.to_string(), path.clone()));
}

/// The modules the initrd asks for: `crust.modules` in `modules_dir`, one
/// name per line (`#` comments allowed), or every module of `modules.dep`.
fn initrd_module_list(modules_dir: &Path, modules_dep: &str) -> Vec<String> {
    match fs::read_to_string(modules_dir.join(MODULE_LIST)) {
        Ok(text) => text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .map(module_name)
            .collect(),
        Err(_) => modules_dep
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(p, _)| module_name(p.trim()))
            .collect(),
    }
}

/// Loads the initrd's modules plus `extra` with `finit_module`, dependencies
/// first, each once. A module already in the kernel counts as loaded; a
/// missing or failing one is reported and the rest still load.
pub fn load_modules(modules_dir: &Path, extra: &[String]) -> ModuleReport {
    load(modules_dir, extra, true)
}

/// Loads just `names` (and their dependencies), not the boot list: for
/// modules the initrd ships but leaves to be loaded on first use (e.g. xfs,
/// which costs about half a second at boot under TCG).
pub fn load_named(modules_dir: &Path, names: &[String]) -> ModuleReport {
    load(modules_dir, names, false)
}

fn load(modules_dir: &Path, extra: &[String], with_boot_list: bool) -> ModuleReport {
    let mut report = ModuleReport::default();
    let dep_path = modules_dir.join("modules.dep");
    let modules_dep = match fs::read_to_string(&dep_path) {
        Ok(t) => t,
        Err(e) => {
            let why = format!("cannot read {}: {e}", dep_path.display());
            for m in extra {
                report.failed.push((module_name(m), why.clone()));
            }
            if extra.is_empty() {
                report.failed.push(("modules.dep".to_string(), why));
            }
            return report;
        }
    };
    let mut wanted = if with_boot_list {
        initrd_module_list(modules_dir, &modules_dep)
    } else {
        Vec::new()
    };
    wanted.extend(extra.iter().map(|m| module_name(m)));
    let plan = load_order(&modules_dep, &wanted);
    for m in plan.missing {
        report.failed.push((
            m.clone(),
            format!("module {m} is not in {}", dep_path.display()),
        ));
    }
    let mut failed_names: HashSet<String> = HashSet::new();
    let dep_lists: HashMap<String, Vec<String>> = modules_dep
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(p, r)| {
            (
                module_name(p.trim()),
                r.split_whitespace().map(module_name).collect(),
            )
        })
        .collect();
    for (name, rel) in plan.order {
        // A module whose dependency failed would fail with unresolved symbols.
        if let Some(d) = dep_lists
            .get(&name)
            .and_then(|ds| ds.iter().find(|d| failed_names.contains(*d)))
        {
            report
                .failed
                .push((name.clone(), format!("dependency {d} failed to load")));
            failed_names.insert(name);
            continue;
        }
        // Loaded by an earlier call (the agent loads the vsock stack first, the rest after listening).
        if Path::new("/sys/module")
            .join(&name)
            .join("initstate")
            .exists()
        {
            report.loaded.push(name);
            continue;
        }
        match finit(&modules_dir.join(&rel)) {
            Ok(()) => report.loaded.push(name),
            Err(e) => {
                report.failed.push((name.clone(), e));
                failed_names.insert(name);
            }
        }
    }
    report
}

/// Loads one module file; EEXIST (already loaded) is success.
fn finit(path: &PathBuf) -> Result<(), String> {
    let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let name = path.to_string_lossy();
    let flags = if name.ends_with(".ko") {
        0
    } else {
        MODULE_INIT_COMPRESSED_FILE
    };
    match rustix::system::finit_module(&fd, c"", flags) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
        Err(e) => Err(format!("finit_module({}) failed: {e}", path.display())),
    }
}

/// The signals PID 1 handles on its own thread.
fn handled_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset only write into the local set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        set
    }
}

/// Blocks SIGTERM, SIGINT and SIGCHLD in the calling thread. Call it first
/// in main, before any thread starts, so every thread inherits the mask and
/// only the signal thread of `start_reaper_and_signals` receives them.
pub fn block_signals() {
    let set = handled_signals();
    // SAFETY: `set` is a valid, initialised sigset; the old mask is not wanted.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Starts the thread that reaps children on SIGCHLD and calls `on_shutdown`
/// on SIGTERM or SIGINT. `block_signals` must have run before.
/// Ctrl-Alt-Del (or QEMU's `send-key ctrl-alt-delete`) then reaches us as
/// SIGINT, an orderly shutdown, instead of an immediate reboot.
pub fn start_reaper_and_signals(on_shutdown: impl Fn() + Send + 'static) {
    if rustix::process::getpid().is_init() {
        if let Err(e) = rustix::system::reboot(rustix::system::RebootCommand::CadOff) {
            console(&format!(
                "crust-agent: cannot turn Ctrl-Alt-Del into SIGINT: {e}"
            ));
        }
    }
    let spawned = std::thread::Builder::new()
        .name("init-signals".into())
        .spawn(move || {
            let set = handled_signals();
            loop {
                // SAFETY: `set` is a valid sigset; a null siginfo is allowed.
                let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
                match sig {
                    // Never the children their owners wait for (mkfs): sys::children.
                    libc::SIGCHLD => crate::sys::children::reap_others(),
                    libc::SIGTERM | libc::SIGINT => on_shutdown(),
                    _ => {} // EINTR and the like: wait again.
                }
            }
        });
    if let Err(e) = spawned {
        console(&format!("crust-agent: cannot start the signal thread: {e}"));
    }
}

/// Syncs and powers the machine off. If the kernel refuses, waits forever:
/// PID 1 returning would panic the kernel.
pub fn power_off() -> ! {
    rustix::fs::sync();
    if let Err(e) = rustix::system::reboot(rustix::system::RebootCommand::PowerOff) {
        console(&format!("crust-agent: reboot(POWER_OFF) failed: {e}"));
    }
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

/// Writes a line to the console (falling back to stderr), for the last words
/// of a dying init where no logger may be left.
fn console(msg: &str) {
    let line = format!("{msg}\n");
    match fs::OpenOptions::new().write(true).open("/dev/console") {
        Ok(mut c) => {
            let _ = c.write_all(line.as_bytes());
        }
        Err(_) => {
            let _ = io::stderr().write_all(line.as_bytes());
        }
    }
}

/// Makes a panic write its message and location to the console, so that the
/// reason is in the VM's console log before the kernel goes down with PID 1.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        let msg = if let Some(s) = info.payload().downcast_ref::<&str>() {
            (*s).to_string()
        } else if let Some(s) = info.payload().downcast_ref::<String>() {
            s.clone()
        } else {
            "(no message)".to_string()
        };
        let at = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "an unknown location".to_string());
        console(&format!(
            "crust-agent: panic in thread '{name}' at {at}: {msg}"
        ));
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn settings_from_cmdline() {
        let cases: &[(&str, Settings)] = &[
            ("", Settings::default()),
            ("console=ttyS0 quiet panic=-1", Settings::default()),
            (
                "console=ttyS0 crust.listen=vsock://-1:1024 crust.listen=unix:///run/a.sock crust.root=/srv",
                Settings {
                    listen: s(&["vsock://-1:1024", "unix:///run/a.sock"]),
                    root: Some("/srv".into()),
                    ..Default::default()
                },
            ),
            (
                "crust.log=debug crust.log=warn crust.log_format=json",
                Settings { log: Some("warn".into()), log_format: Some("json".into()), ..Default::default() },
            ),
            (
                "crust.modules=btrfs,,dm-mod crust.modules=loop",
                Settings { modules: s(&["btrfs", "dm_mod", "loop"]), ..Default::default() },
            ),
            // Empty values, unknown keys and bare words change nothing.
            ("crust.root= crust.bogus=1 crust.listen crust", Settings::default()),
            // Quotes group words and are dropped, as the kernel does.
            ("crust.root=\"/a b\" x", Settings { root: Some("/a b".into()), ..Default::default() }),
            ("\tcrust.root=/x\n", Settings { root: Some("/x".into()), ..Default::default() }),
            (
                "crust.vsock_peers=host,5 crust.notify=vsock-stream:2:1025",
                Settings {
                    vsock_peers: Some("host,5".into()),
                    notify: Some("vsock-stream:2:1025".into()),
                    ..Default::default()
                },
            ),
            (
                "crust.cdh_socket=/run/cdh.sock",
                Settings { cdh_socket: Some("/run/cdh.sock".into()), ..Default::default() },
            ),
            // systemd's credential for the VMM's notification socket; other credentials are not ours.
            (
                "systemd.set_credential=vmm.notify_socket:vsock-stream:2:9 systemd.set_credential=x:y",
                Settings { vmm_notify_socket: Some("vsock-stream:2:9".into()), ..Default::default() },
            ),
        ];
        for (line, want) in cases {
            assert_eq!(&kernel_settings(line), want, "cmdline {line:?}");
        }
    }

    const DEP: &str = "\
kernel/fs/xfs/xfs.ko: kernel/lib/libcrc32c.ko
kernel/lib/libcrc32c.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/virtio/virtio_pci_legacy_dev.ko:
kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_legacy_dev.ko kernel/drivers/virtio/virtio_pci_modern_dev.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/vmw_vsock/vsock.ko:
kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko: kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko kernel/net/vmw_vsock/vsock.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko: kernel/net/vmw_vsock/vsock.ko
kernel/drivers/md/dm-mod.ko.xz:
";

    fn names(plan: &LoadPlan) -> Vec<&str> {
        plan.order.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn load_order_puts_dependencies_first_once() {
        let cases: &[(&[&str], &[&str], &[&str])] = &[
            (&[], &[], &[]),
            (&["xfs"], &["libcrc32c", "xfs"], &[]),
            (
                &["virtio_pci", "virtio_blk"],
                &[
                    "virtio_ring",
                    "virtio",
                    "virtio_pci_modern_dev",
                    "virtio_pci_legacy_dev",
                    "virtio_pci",
                    "virtio_blk",
                ],
                &[],
            ),
            (
                &["vmw_vsock_virtio_transport", "vsock"],
                &[
                    "virtio_ring",
                    "virtio",
                    "vsock",
                    "vmw_vsock_virtio_transport_common",
                    "vmw_vsock_virtio_transport",
                ],
                &[],
            ),
            // Asked twice, by two spellings: loaded once.
            (
                &["dm-mod", "dm_mod", "kernel/drivers/md/dm-mod.ko.xz"],
                &["dm_mod"],
                &[],
            ),
            // Unknown modules are reported once and do not stop the rest.
            (&["nope", "xfs", "nope"], &["libcrc32c", "xfs"], &["nope"]),
        ];
        for (wanted, order, missing) in cases {
            let plan = load_order(DEP, &s(wanted));
            assert_eq!(names(&plan), *order, "wanted {wanted:?}");
            assert_eq!(plan.missing, s(missing), "wanted {wanted:?}");
        }
    }

    #[test]
    fn load_order_keeps_paths_and_survives_cycles() {
        let plan = load_order(DEP, &s(&["dm_mod"]));
        assert_eq!(
            plan.order,
            vec![(
                "dm_mod".to_string(),
                "kernel/drivers/md/dm-mod.ko.xz".to_string()
            )]
        );
        // A (malformed) cycle must terminate, each module once.
        let cyclic = "a.ko: b.ko\nb.ko: a.ko\n";
        let plan = load_order(cyclic, &s(&["a"]));
        assert_eq!(names(&plan), vec!["b", "a"]);
    }

    #[test]
    fn module_names_are_canonical() {
        for (input, want) in [
            ("xfs", "xfs"),
            ("kernel/fs/xfs/xfs.ko", "xfs"),
            ("dm-mod.ko.zst", "dm_mod"),
            ("virtio-blk", "virtio_blk"),
        ] {
            assert_eq!(module_name(input), want);
        }
    }

    #[test]
    fn load_modules_reports_missing_directory_and_modules() {
        let dir = tempfile::tempdir().unwrap();
        let r = load_modules(dir.path(), &s(&["xfs"]));
        assert!(r.loaded.is_empty());
        assert_eq!(r.failed.len(), 1);
        assert_eq!(r.failed[0].0, "xfs");

        // A list naming a module modules.dep lacks: reported, not fatal; a
        // present module whose file is missing fails with the open error.
        fs::write(dir.path().join("modules.dep"), "kernel/x/present.ko:\n").unwrap();
        fs::write(
            dir.path().join(MODULE_LIST),
            "# boot set\nabsent\npresent\n",
        )
        .unwrap();
        let r = load_modules(dir.path(), &[]);
        assert!(r.loaded.is_empty());
        let failed: Vec<&str> = r.failed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(failed, vec!["absent", "present"]);
        assert!(r.failed[1].1.contains("cannot open"), "{:?}", r.failed[1]);

        // load_named ignores the boot list.
        let r = load_named(dir.path(), &s(&["present"]));
        let failed: Vec<&str> = r.failed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(failed, vec!["present"]);
        assert!(load_named(dir.path(), &[]).failed.is_empty());
    }
}

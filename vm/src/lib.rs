//! crust-vm: boots the crust-agent guest (kernel + initrd) under QEMU with a
//! vhost-user vsock backend, waits until the agent says it is ready, and
//! drives the VMM side over QMP (hot-plug, resize, unplug) until a clean
//! power-off.
//!
//! Readiness is pushed, not polled: the guest's kernel command line carries
//! `crust.notify=vsock-stream:2:NOTIFY_PORT`, the agent connects to the host
//! on that port once it listens and writes `READY=1` (systemd's sd_notify
//! convention over AF_VSOCK), and vhost-device-vsock hands that connection
//! to the unix socket `DIR/vsock.sock_NOTIFY_PORT`, where `up` waits. Polling
//! the guest while it boots is what made boots hang under load:
//! vhost-device-vsock 0.3.0 ends its vring worker thread (and with it the
//! VM's vsock, for good) when a host connection arrives while the guest's
//! driver is still setting its queues up, or when a client closes a stream
//! whose CONNECT the guest has not answered yet. The host therefore
//! connects only once the guest has said it is ready, and never gives up on
//! a CONNECT it has sent (crust-client's hybrid vsock connect parks an
//! unanswered one until the backend answers).
//!
//! The connections are crust-client's, shared with crustd and crustctl:
//! the agent through [`crust_client::connect_until`], QEMU through
//! [`crust_client::qmp::Qmp`].

mod files;
pub mod initrd;

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crust_client::qmp::{BlockDisk, Qmp, QmpError, Source};
use crust_client::Address;
use crust_protocols::crust::{GetAgentInfoRequest, GetAgentInfoResponse, ShutdownRequest};
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::ttrpc;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The guest's vsock context id.
pub const GUEST_CID: u32 = 3;
/// The agent's default vsock port.
pub const AGENT_PORT: u32 = 1024;
/// The host port the agent announces readiness to (`crust.notify=`).
pub const NOTIFY_PORT: u32 = 1025;
/// Without a READY (an agent that does not announce, or `notify` off), the
/// agent is polled once the console shows it listening and this long has
/// passed: its vsock driver is up by then.
const POLL_AFTER_LISTENING: Duration = Duration::from_secs(3);
/// How long one GetAgentInfo may take once the agent is ready.
const INFO_TIMEOUT: Duration = Duration::from_secs(10);
/// The sandbox registry entry `up` writes in its directory, for crustd.
pub const SANDBOX_FILE: &str = "sandbox.json";

/// What can go wrong driving the VM; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O failure, with what was being done.
    #[error("{0}: {1}")]
    Io(String, #[source] io::Error),
    /// QEMU refused a QMP command or spoke nonsense.
    #[error("QMP: {0}")]
    Qmp(String),
    /// Something did not happen in time.
    #[error("{0}")]
    Timeout(String),
    /// The VM did not come up.
    #[error("{0}")]
    Boot(String),
    /// The guest image could not be built.
    #[error("{0}")]
    Initrd(String),
    /// A bad argument (serial, size, missing state).
    #[error("{0}")]
    Invalid(String),
}

/// Result with this crate's error.
pub type Result<T> = std::result::Result<T, Error>;

impl From<QmpError> for Error {
    fn from(e: QmpError) -> Error {
        Error::Qmp(e.to_string())
    }
}

/// A ttrpc context that gives up after `d`, for calls on [`Vm::agent`].
pub fn ctx(d: Duration) -> ttrpc::context::Context {
    ttrpc::context::with_duration(d)
}

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Software emulation: works everywhere, slower.
    Tcg,
    /// Hardware virtualization through /dev/kvm.
    Kvm,
}

impl Accel {
    fn name(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

/// How to boot the VM.
#[derive(Debug, Clone)]
pub struct VmOptions {
    /// Where sockets, logs and state live.
    pub dir: PathBuf,
    /// The guest kernel.
    pub kernel: PathBuf,
    /// The guest image (agent as /init + modules).
    pub initrd: PathBuf,
    /// Guest memory in MiB.
    pub memory_mib: u32,
    /// Guest vCPUs.
    pub cpus: u32,
    /// Extra kernel command line, after `console=ttyS0 quiet panic=-1`.
    pub append: String,
    /// Forced accelerator; None: `CRUST_VM_ACCEL`, else KVM if a probe shows it works, else TCG.
    pub accel: Option<Accel>,
    /// The agent's vsock port.
    pub port: u32,
    /// How long to wait for the agent to answer.
    pub boot_timeout: Duration,
    /// The guest's vsock context id.
    pub cid: u32,
    /// Wait for the agent's READY on [`NOTIFY_PORT`] (the default). Off, the
    /// agent is polled once the console shows it listening.
    pub notify: bool,
    /// An already running vhost-user-vsock backend to use (its `--socket`),
    /// instead of starting one; its `uds-path` for this guest must be
    /// `DIR/vsock.sock`. crust-vm then neither starts nor stops a backend
    /// (one vhost-device-vsock can serve several guests, which may then
    /// reach each other).
    pub vhost_socket: Option<PathBuf>,
}

impl VmOptions {
    /// Defaults: the workspace's `build/vmlinuz` and `build/initrd.img`, 256 MiB, 1 vCPU.
    pub fn new(dir: impl Into<PathBuf>) -> VmOptions {
        let build = default_build_dir();
        VmOptions {
            dir: dir.into(),
            kernel: build.join("vmlinuz"),
            initrd: build.join("initrd.img"),
            memory_mib: 256,
            cpus: 1,
            append: String::new(),
            accel: None,
            port: AGENT_PORT,
            boot_timeout: Duration::from_secs(90),
            cid: GUEST_CID,
            notify: true,
            vhost_socket: None,
        }
    }
}

/// `$CRUST_BUILD_DIR`, else the workspace's `build/` (where `make initrd` writes).
pub fn default_build_dir() -> PathBuf {
    match std::env::var_os("CRUST_BUILD_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../build"),
    }
}

/// One hot-plugged disk, as recorded in the state file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Disk {
    /// The raw image file on the host.
    pub image: PathBuf,
    /// QEMU's block node name.
    pub node: String,
    /// QEMU's device id.
    pub device: String,
    /// Attached read-only.
    pub read_only: bool,
}

/// What `DIR/state.json` holds, so another process can drive or stop the VM.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct State {
    qemu_pid: u32,
    /// 0 when the backend is not ours (`VmOptions::vhost_socket`).
    vhost_pid: u32,
    port: u32,
    disks: BTreeMap<String, Disk>,
}

/// How `up` learnt that the agent was ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The agent's `READY=1` on [`NOTIFY_PORT`].
    Notified,
    /// Polled, once the console showed the agent listening.
    Polled,
}

/// A running VM.
pub struct Vm {
    /// The VM's directory (absolute).
    dir: PathBuf,
    /// The directory, opened without following a symlink: every file crust-vm
    /// writes there is created relative to it.
    dir_fd: OwnedFd,
    /// Pids and disks.
    state: State,
    /// QEMU, when this process started it (so it can be reaped).
    qemu: Option<Child>,
    /// The vsock backend, when this process started it.
    vhost: Option<Child>,
    /// What the agent said when it first answered (only after `up`).
    boot_info: Option<GetAgentInfoResponse>,
    /// How readiness was learnt, and when (after QEMU started) (only after `up`).
    ready: Option<(Readiness, Duration)>,
    /// Set by `down` and `detach`: Drop leaves the processes alone.
    released: bool,
}

/// The `hvsock://` address of the agent of the VM in `dir`.
pub fn agent_address(dir: &Path, port: u32) -> String {
    format!("hvsock://{}:{port}", dir.join("vsock.sock").display())
}

/// Checks a virtio-blk serial by the rule the agent applies
/// (`crust_protocols::names::serial`: 1–20 bytes of `[A-Za-z0-9._-]`).
pub fn check_serial(serial: &str) -> Result<()> {
    crust_protocols::names::serial(serial)
        .map_err(|e| Error::Invalid(format!("{e}: choose another serial")))
}

/// QEMU names for a disk with `serial`: (block node, device id).
pub fn disk_names(serial: &str) -> (String, String) {
    (format!("crust-{serial}"), format!("dev-{serial}"))
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |e| Error::Io(what, e)
}

/// Finds a program: `$env_var`, then PATH, then ~/.cargo/bin.
fn find_program(name: &str, env_var: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var) {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// True while `pid` runs (not a zombie) and its command line mentions
/// `dir`, so a recycled pid is never taken for ours.
pub fn alive(pid: u32, dir: &Path) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next());
    if state == Some("Z") || state == Some("X") {
        return false;
    }
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let needle = dir.to_string_lossy();
    String::from_utf8_lossy(&cmdline).contains(needle.as_ref())
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill() has no memory effects; pid is one we started and checked alive.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A log file `name` in the VM's directory (files.rs), for a child's
/// stdout and stderr: one open file, so their lines do not overwrite each other.
fn log_file(dir_fd: &OwnedFd, dir: &Path, name: &str) -> Result<(Stdio, Stdio)> {
    let f = files::create(dir_fd, name)
        .map_err(io_err(format!("cannot create {name} in {}", dir.display())))?;
    let g = f
        .try_clone()
        .map_err(io_err(format!("cannot create {name} in {}", dir.display())))?;
    Ok((Stdio::from(f), Stdio::from(g)))
}

/// The descriptor QEMU gets the console file on.
const CONSOLE_FD: i32 = 3;

/// The unix socket the backend connects the guest's READY to.
fn notify_socket_name() -> String {
    format!("vsock.sock_{NOTIFY_PORT}")
}

/// Reads one notification (sd_notify: `KEY=VALUE` lines) and says whether
/// it holds `READY=1`. Bounded: 4 KiB, 5 s. The end of the message is its
/// newline, not the end of the stream (hybrid vsock relays no half-close).
fn ready_message(s: UnixStream) -> bool {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    let mut s = s;
    while buf.len() < 4096 {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if buf.split(|&b| b == b'\n').any(|l| l == b"READY=1") {
            return true;
        }
    }
    buf.split(|&b| b == b'\n').any(|l| l == b"READY=1")
}

/// Whether the guest console shows the agent's "listening" line (text or JSON log).
fn console_says_listening(console: &Path) -> bool {
    let text = tail(console, 64 << 10);
    text.contains(" INFO listening ") || text.contains("\"msg\":\"listening\"")
}

/// Reads the last `n` bytes of a log, for error messages.
fn tail(path: &Path, n: usize) -> String {
    let data = fs::read(path).unwrap_or_default();
    let start = data.len().saturating_sub(n);
    String::from_utf8_lossy(&data[start..]).into_owned()
}

/// Picks the accelerator: `CRUST_VM_ACCEL=tcg|kvm`, else KVM when a probe
/// boot prints on the console within a few seconds, else TCG. (On some hosts
/// /dev/kvm exists but a guest never runs; the probe catches that.)
pub fn choose_accel(kernel: &Path) -> Accel {
    match std::env::var("CRUST_VM_ACCEL").as_deref() {
        Ok("kvm") => return Accel::Kvm,
        Ok("tcg") => return Accel::Tcg,
        _ => {}
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Accel::Tcg;
    }
    // One probe per host boot.
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let cache = std::env::temp_dir().join(format!("crust-vm-kvm-probe-{}", boot_id.trim()));
    if let Ok(v) = fs::read_to_string(&cache) {
        return if v.trim() == "kvm" {
            Accel::Kvm
        } else {
            Accel::Tcg
        };
    }
    let accel = if kvm_probe(kernel) {
        Accel::Kvm
    } else {
        Accel::Tcg
    };
    let _ = fs::write(&cache, accel.name());
    accel
}

fn kvm_probe(kernel: &Path) -> bool {
    let child = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-m",
            "128",
            "-nodefaults",
            "-no-user-config",
        ])
        .args([
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "stdio",
            "-kernel",
        ])
        .arg(kernel)
        .args([
            "-append",
            "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else { return false };
    let Some(mut out) = child.stdout.take() else {
        return false;
    };
    // The real-mode boot stub prints ("Probing EDD") even where KVM then
    // hangs; only the kernel's own banner proves that the guest runs.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut b = [0u8; 256];
        while let Ok(n) = out.read(&mut b) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&b[..n]);
            if seen.windows(13).any(|w| w == b"Linux version") {
                let _ = tx.send(());
                break;
            }
        }
    });
    let ok = rx.recv_timeout(Duration::from_secs(3)).is_ok();
    let _ = child.kill();
    let _ = child.wait();
    ok
}

impl Vm {
    /// Starts the vsock backend and QEMU, waits until the agent says it is
    /// ready (module documentation), then asks it GetAgentInfo. On failure
    /// nothing is left running.
    pub fn up(opts: VmOptions) -> Result<Vm> {
        fs::create_dir_all(&opts.dir)
            .map_err(io_err(format!("cannot create {}", opts.dir.display())))?;
        let dir = fs::canonicalize(&opts.dir)
            .map_err(io_err(format!("cannot resolve {}", opts.dir.display())))?;
        let dir_fd =
            files::open_dir(&dir).map_err(io_err(format!("cannot open {}", dir.display())))?;
        if let Ok(old) = read_state(&dir) {
            if alive(old.qemu_pid, &dir) {
                return Err(Error::Invalid(format!(
                    "a VM already runs in {} (QEMU pid {}): run crust-vm down --dir {} first",
                    dir.display(),
                    old.qemu_pid,
                    dir.display()
                )));
            }
        }
        for f in [&opts.kernel, &opts.initrd] {
            if !f.is_file() {
                return Err(Error::Invalid(format!(
                    "{} does not exist: run make initrd first",
                    f.display()
                )));
            }
        }
        let notify_name = notify_socket_name();
        // What an earlier VM here left; a shared backend's sockets are its own.
        let ours: &[&str] = if opts.vhost_socket.is_some() {
            &[]
        } else {
            &["vhost.sock", "vsock.sock"]
        };
        for f in ours.iter().chain(&[
            "qmp.sock",
            "console.log",
            "state.json",
            SANDBOX_FILE,
            notify_name.as_str(),
        ]) {
            let _ = rustix::fs::unlinkat(&dir_fd, *f, rustix::fs::AtFlags::empty());
        }
        let vhost_bin = match opts.vhost_socket {
            Some(_) => None,
            None => Some(
                find_program("vhost-device-vsock", "CRUST_VHOST_DEVICE_VSOCK").ok_or_else(
                    || {
                        Error::Invalid(
                        "vhost-device-vsock not found: cargo install vhost-device-vsock --locked"
                            .into(),
                    )
                    },
                )?,
            ),
        };
        let accel = opts.accel.unwrap_or_else(|| choose_accel(&opts.kernel));

        // The agent's READY arrives here: the backend connects the guest's
        // connection to host port NOTIFY_PORT to `<uds-path>_NOTIFY_PORT`.
        let notify = if opts.notify {
            let l = UnixListener::bind(dir.join(&notify_name)).map_err(io_err(format!(
                "cannot listen on {}",
                dir.join(&notify_name).display()
            )))?;
            l.set_nonblocking(true)
                .map_err(io_err("cannot make the notify socket non-blocking"))?;
            Some(l)
        } else {
            None
        };

        let mut vm = Vm {
            dir: dir.clone(),
            dir_fd,
            state: State {
                port: opts.port,
                ..Default::default()
            },
            qemu: None,
            vhost: None,
            boot_info: None,
            ready: None,
            released: false,
        };
        let vhost_socket = match (&opts.vhost_socket, vhost_bin) {
            (Some(s), _) => s.clone(),
            (None, Some(bin)) => {
                let (out, err) = log_file(&vm.dir_fd, &dir, "vhost.log")?;
                let vhost = Command::new(&bin)
                    .arg("--guest-cid")
                    .arg(opts.cid.to_string())
                    .arg("--socket")
                    .arg(dir.join("vhost.sock"))
                    .arg("--uds-path")
                    .arg(dir.join("vsock.sock"))
                    .stdin(Stdio::null())
                    .stdout(out)
                    .stderr(err)
                    .process_group(0)
                    .spawn()
                    .map_err(io_err(format!("cannot start {}", bin.display())))?;
                vm.state.vhost_pid = vhost.id();
                vm.vhost = Some(vhost);
                // From here on, Drop stops whatever was started if we return early.
                vm.wait_for_socket(&dir.join("vhost.sock"), Duration::from_secs(10))?;
                dir.join("vhost.sock")
            }
            (None, None) => unreachable!("a backend program was found or given"),
        };

        let mem = format!("{}M", opts.memory_mib);
        let mut append = String::from("console=ttyS0 quiet panic=-1");
        if opts.notify {
            append.push_str(&format!(" crust.notify=vsock-stream:2:{NOTIFY_PORT}"));
        }
        if !opts.append.trim().is_empty() {
            append.push(' ');
            append.push_str(opts.append.trim());
        }
        // The console file is created here (no symlink followed) and handed to
        // QEMU as descriptor CONSOLE_FD, which it reopens by /proc/self/fd.
        let console = files::create(&vm.dir_fd, "console.log").map_err(io_err(format!(
            "cannot create console.log in {}",
            dir.display()
        )))?;
        let console_fd = console.as_raw_fd();
        let (qout, qerr) = log_file(&vm.dir_fd, &dir, "qemu.log")?;
        let mut qemu = Command::new("qemu-system-x86_64");
        qemu.args([
            "-name",
            "crust-vm",
            "-machine",
            "pc",
            "-accel",
            accel.name(),
        ])
        .args(["-cpu", if accel == Accel::Kvm { "host" } else { "max" }])
        .args(["-m", &mem, "-smp", &opts.cpus.to_string()])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-serial")
        .arg(format!("file:/proc/self/fd/{CONSOLE_FD}"))
        .arg("-kernel")
        .arg(&opts.kernel)
        .arg("-initrd")
        .arg(&opts.initrd)
        .arg("-append")
        .arg(&append)
        .arg("-object")
        .arg(format!("memory-backend-memfd,id=mem,size={mem},share=on"))
        .args(["-numa", "node,memdev=mem"])
        .arg("-chardev")
        .arg(format!("socket,id=vs,path={}", vhost_socket.display()))
        .args(["-device", "vhost-user-vsock-pci,chardev=vs"])
        .arg("-qmp")
        .arg(format!(
            "unix:{},server=on,wait=off",
            dir.join("qmp.sock").display()
        ))
        .stdin(Stdio::null())
        .stdout(qout)
        .stderr(qerr)
        .process_group(0);
        // SAFETY: between fork and exec the closure only calls dup2 and
        // fcntl, which are async-signal-safe, on a descriptor this process
        // keeps open until spawn returns.
        unsafe {
            qemu.pre_exec(move || {
                if console_fd == CONSOLE_FD {
                    if libc::fcntl(CONSOLE_FD, libc::F_SETFD, 0) == -1 {
                        return Err(io::Error::last_os_error());
                    }
                } else if libc::dup2(console_fd, CONSOLE_FD) == -1 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let qemu = qemu.spawn().map_err(io_err(
            "cannot start qemu-system-x86_64 (apt-get install qemu-system-x86)",
        ))?;
        drop(console);
        let started = Instant::now();
        vm.state.qemu_pid = qemu.id();
        vm.qemu = Some(qemu);
        vm.save()?;

        let deadline = started + opts.boot_timeout;
        let how = vm.wait_ready(notify.as_ref(), deadline, &opts, accel)?;
        vm.ready = Some((how, started.elapsed()));
        let info = vm.first_info(deadline, &opts, accel)?;
        vm.boot_info = Some(info);
        vm.write_sandbox_entry()?;
        drop(notify);
        let _ = rustix::fs::unlinkat(
            &vm.dir_fd,
            notify_name.as_str(),
            rustix::fs::AtFlags::empty(),
        );
        Ok(vm)
    }

    /// The boot failed: why, with what the guest printed last.
    fn boot_failure(&self, why: String) -> Error {
        Error::Timeout(format!(
            "{why}.\nconsole.log (end): {}",
            tail(&self.dir.join("console.log"), 3000)
        ))
    }

    fn qemu_exited(&self) -> Error {
        Error::Boot(format!(
            "QEMU exited before the agent was ready.\nqemu.log: {}\nconsole.log (end): {}",
            tail(&self.dir.join("qemu.log"), 2000),
            tail(&self.dir.join("console.log"), 3000)
        ))
    }

    /// Waits for the agent's READY on the notify socket; without one (an
    /// agent that does not announce, or `notify` off), polls the agent once
    /// the console has shown it listening for [`POLL_AFTER_LISTENING`],
    /// never before (module documentation).
    fn wait_ready(
        &mut self,
        notify: Option<&UnixListener>,
        deadline: Instant,
        opts: &VmOptions,
        accel: Accel,
    ) -> Result<Readiness> {
        let mut listening_since: Option<Instant> = None;
        let mut last_poll: Option<Instant> = None;
        loop {
            if !self.qemu_running() {
                return Err(self.qemu_exited());
            }
            if let Some(l) = notify {
                match l.accept() {
                    Ok((s, _)) => {
                        if ready_message(s) {
                            return Ok(Readiness::Notified);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(Error::Io("accept on the notify socket".into(), e)),
                }
            }
            if listening_since.is_none() && console_says_listening(&self.dir.join("console.log")) {
                listening_since = Some(Instant::now());
            }
            if listening_since.is_some_and(|t| t.elapsed() >= POLL_AFTER_LISTENING)
                && !matches!(last_poll, Some(t) if t.elapsed() < Duration::from_millis(200))
            {
                last_poll = Some(Instant::now());
                let addr = self.agent_addr(opts.port);
                let qemu_pid = self.state.qemu_pid;
                let dir = self.dir.clone();
                let mut up = || alive(qemu_pid, &dir);
                if crust_client::connect_stream_until(&addr, deadline, &mut up).is_ok() {
                    return Ok(Readiness::Polled);
                }
            }
            if Instant::now() > deadline {
                let seen = if listening_since.is_some() {
                    "the console shows the agent listening, but it never answered"
                } else if opts.notify {
                    "no READY came on the notify socket and the console never showed the agent listening"
                } else {
                    "the console never showed the agent listening"
                };
                return Err(self.boot_failure(format!(
                    "the agent was not ready within {:?} ({} accel): {seen} ({})",
                    opts.boot_timeout,
                    accel.name(),
                    agent_address(&self.dir, opts.port)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// GetAgentInfo from an agent known to be ready: each connection waits
    /// for its answer (never abandoned: crust-client), each call gets
    /// [`INFO_TIMEOUT`], until `deadline`.
    fn first_info(
        &mut self,
        deadline: Instant,
        opts: &VmOptions,
        accel: Accel,
    ) -> Result<GetAgentInfoResponse> {
        loop {
            if !self.qemu_running() {
                return Err(self.qemu_exited());
            }
            let last;
            let addr = self.agent_addr(opts.port);
            let qemu_pid = self.state.qemu_pid;
            let dir = self.dir.clone();
            let mut up = || alive(qemu_pid, &dir);
            match crust_client::connect_until(&addr, deadline, &mut up).map(AgentClient::new) {
                Ok(client) => {
                    match client.get_agent_info(ctx(INFO_TIMEOUT), &GetAgentInfoRequest::new()) {
                        Ok(info) => return Ok(info),
                        Err(e) => last = format!("GetAgentInfo: {e}"),
                    }
                }
                Err(e) => last = e.to_string(),
            }
            if Instant::now() > deadline {
                return Err(self.boot_failure(format!(
                    "the agent said it was ready but did not answer on {} within {:?} ({} accel): {last}",
                    agent_address(&self.dir, opts.port),
                    opts.boot_timeout,
                    accel.name()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Takes over the VM running in `dir` (started by another process).
    pub fn attach(dir: &Path) -> Result<Vm> {
        let dir =
            fs::canonicalize(dir).map_err(io_err(format!("cannot resolve {}", dir.display())))?;
        let state = read_state(&dir)?;
        let dir_fd =
            files::open_dir(&dir).map_err(io_err(format!("cannot open {}", dir.display())))?;
        Ok(Vm {
            dir,
            dir_fd,
            state,
            qemu: None,
            vhost: None,
            boot_info: None,
            ready: None,
            released: true,
        })
    }

    /// Leaves the processes running when this value is dropped (the CLI's `up`).
    pub fn detach(mut self) {
        self.released = true;
    }

    /// The VM's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The agent's address, `hvsock://DIR/vsock.sock:PORT`.
    pub fn address(&self) -> String {
        agent_address(&self.dir, self.state.port)
    }

    /// The hybrid-vsock Unix socket.
    pub fn vsock_path(&self) -> PathBuf {
        self.dir.join("vsock.sock")
    }

    /// Guest port `port` through the hybrid-vsock socket.
    fn agent_addr(&self, port: u32) -> Address {
        Address::Hvsock {
            path: self.vsock_path(),
            port,
        }
    }

    /// The console log of the guest.
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// What the agent answered first (set by `up`).
    pub fn boot_info(&self) -> Option<&GetAgentInfoResponse> {
        self.boot_info.as_ref()
    }

    /// How `up` learnt the agent was ready, and how long after QEMU started.
    pub fn readiness(&self) -> Option<(Readiness, Duration)> {
        self.ready
    }

    /// Pids of QEMU and the vsock backend.
    pub fn pids(&self) -> (u32, u32) {
        (self.state.qemu_pid, self.state.vhost_pid)
    }

    /// A fresh ttrpc client for the agent.
    pub fn agent(&self) -> Result<AgentClient> {
        crust_client::connect(&self.agent_addr(self.state.port), Duration::from_secs(5))
            .map(AgentClient::new)
            .map_err(|e| {
                Error::Io(
                    format!("cannot reach the agent at {}", self.address()),
                    io::Error::other(e),
                )
            })
    }

    /// The disks hot-plugged so far, by serial.
    pub fn disks(&self) -> &BTreeMap<String, Disk> {
        &self.state.disks
    }

    /// Runs one QMP command (for checks beyond hotplug/resize/unplug).
    pub fn qmp_execute(
        &self,
        cmd: &str,
        args: Option<serde_json::Value>,
    ) -> Result<serde_json::Value> {
        Ok(self.qmp()?.execute(cmd, args)?)
    }

    fn qmp(&self) -> Result<Qmp> {
        Ok(Qmp::connect(
            &self.dir.join("qmp.sock"),
            Duration::from_secs(30),
        )?)
    }

    /// Writes `DIR/sandbox.json`, the entry crustd's sandbox registry reads
    /// (docs/crustd.md): `{"qmp": "DIR/qmp.sock", "agent": "hvsock://DIR/vsock.sock:PORT"}`.
    /// `crust-vm up --dir REGISTRY/<sandbox>` thus makes a CRUST sandbox.
    /// Written once the agent answers, so crustd never sees a VM still booting.
    /// Written atomically (files.rs: no planted symlink is followed).
    fn write_sandbox_entry(&self) -> Result<()> {
        let text = json!({
            "qmp": self.dir.join("qmp.sock"),
            "agent": self.address(),
        })
        .to_string();
        files::write_atomic(&self.dir_fd, SANDBOX_FILE, text.as_bytes()).map_err(io_err(format!(
            "cannot write {}",
            self.dir.join(SANDBOX_FILE).display()
        )))
    }

    fn save(&self) -> Result<()> {
        let text =
            serde_json::to_string_pretty(&self.state).map_err(|e| Error::Invalid(e.to_string()))?;
        files::write_atomic(&self.dir_fd, "state.json", text.as_bytes()).map_err(io_err(format!(
            "cannot write {}",
            self.dir.join("state.json").display()
        )))
    }

    fn wait_for_socket(&mut self, path: &Path, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !path.exists() {
            if Instant::now() > deadline || !self.vhost_running() {
                return Err(Error::Boot(format!(
                    "vhost-device-vsock did not create {}: {}",
                    path.display(),
                    tail(&self.dir.join("vhost.log"), 2000)
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn qemu_running(&mut self) -> bool {
        running(&mut self.qemu, self.state.qemu_pid, &self.dir)
    }

    fn vhost_running(&mut self) -> bool {
        running(&mut self.vhost, self.state.vhost_pid, &self.dir)
    }

    /// Attaches `image` as a virtio-blk disk with `serial`
    /// (blockdev-add, then device_add; the node is removed again if the device is refused).
    pub fn hotplug(&mut self, image: &Path, serial: &str, read_only: bool) -> Result<()> {
        check_serial(serial)?;
        if self.state.disks.contains_key(serial) {
            return Err(Error::Invalid(format!(
                "a disk with serial {serial} is already attached: unplug it first"
            )));
        }
        let image = fs::canonicalize(image)
            .map_err(io_err(format!("cannot find the image {}", image.display())))?;
        let (node, device) = disk_names(serial);
        let disk = BlockDisk {
            node: &node,
            device: &device,
            serial,
        };
        self.qmp()?.plug(&disk, Source::Image(&image), read_only)?;
        self.state.disks.insert(
            serial.to_string(),
            Disk {
                image,
                node,
                device,
                read_only,
            },
        );
        self.save()
    }

    /// Grows the disk with `serial` to `bytes`: the image file first, then
    /// QEMU (block_resize), which tells the guest. Shrinking is refused.
    pub fn resize(&mut self, serial: &str, bytes: u64) -> Result<()> {
        let disk = self.disk(serial)?.clone();
        let f = fs::OpenOptions::new()
            .write(true)
            .open(&disk.image)
            .map_err(io_err(format!("cannot open {}", disk.image.display())))?;
        let len = f
            .metadata()
            .map_err(io_err(format!("cannot stat {}", disk.image.display())))?
            .len();
        if bytes < len {
            return Err(Error::Invalid(format!(
                "disk {serial} is {len} bytes; shrinking to {bytes} would lose data: give a larger size"
            )));
        }
        f.set_len(bytes)
            .map_err(io_err(format!("cannot grow {}", disk.image.display())))?;
        self.qmp()?.grow(&disk.node, bytes)?.ok_or_else(|| {
            Error::Qmp(format!(
                "QEMU has no block node {} for disk {serial}: it was unplugged behind crust-vm's back",
                disk.node
            ))
        })?;
        Ok(())
    }

    /// Detaches the disk with `serial`: device_del, wait for DEVICE_DELETED
    /// (the guest has let go of it), then blockdev-del.
    pub fn unplug(&mut self, serial: &str) -> Result<()> {
        let disk = self.disk(serial)?.clone();
        let mut q = self.qmp()?;
        let id = disk.device.clone();
        let wait = Duration::from_secs(30);
        if q.request_unplug(&id)? && !q.wait_device_deleted(&id, wait)? {
            return Err(Error::Timeout(format!(
                "QEMU still has device {id} {wait:?} after device_del: has the guest let go of the disk?"
            )));
        }
        q.remove_node(&disk.node)?;
        self.state.disks.remove(serial);
        self.save()
    }

    fn disk(&self, serial: &str) -> Result<&Disk> {
        self.state.disks.get(serial).ok_or_else(|| {
            Error::Invalid(format!(
                "no disk with serial {serial} is attached to the VM in {}",
                self.dir.display()
            ))
        })
    }

    /// Stops the VM: asks the agent to Shutdown (it powers off), waits for
    /// QEMU to exit (QMP quit, then SIGKILL, if it will not), then stops the
    /// vsock backend. Leaves no process behind. Returns how it went down.
    pub fn down(&mut self) -> Result<String> {
        let mut how;
        if self.qemu_running() {
            match self.agent().and_then(|c| {
                c.shutdown(ctx(Duration::from_secs(10)), &ShutdownRequest::new())
                    .map_err(|e| Error::Qmp(format!("Shutdown: {e}")))
            }) {
                Ok(r) => {
                    how = format!(
                        "agent shut down ({} volumes unmounted)",
                        r.volumes_unmounted
                    )
                }
                Err(e) => how = format!("agent Shutdown failed ({e})"),
            }
            if !self.wait_exit(true, Duration::from_secs(20)) {
                let _ = self.qmp().map(|mut q| q.execute("quit", None));
                how.push_str("; QEMU did not power off, sent quit");
                if !self.wait_exit(true, Duration::from_secs(5)) {
                    signal(self.state.qemu_pid, libc::SIGKILL);
                    self.wait_exit(true, Duration::from_secs(5));
                    how.push_str("; killed QEMU");
                }
            }
        } else {
            how = "QEMU was not running".into();
        }
        if self.vhost_running() {
            signal(self.state.vhost_pid, libc::SIGTERM);
            if !self.wait_exit(false, Duration::from_secs(3)) {
                signal(self.state.vhost_pid, libc::SIGKILL);
                self.wait_exit(false, Duration::from_secs(3));
            }
        }
        let left: Vec<u32> = [(self.state.qemu_pid, true), (self.state.vhost_pid, false)]
            .into_iter()
            .filter(|(_, q)| {
                if *q {
                    self.qemu_running()
                } else {
                    self.vhost_running()
                }
            })
            .map(|(p, _)| p)
            .collect();
        if !left.is_empty() {
            return Err(Error::Timeout(format!(
                "processes {left:?} of the VM in {} would not end",
                self.dir.display()
            )));
        }
        // A shared backend (vhost_pid 0) keeps its sockets: it serves on.
        let backend: &[&str] = if self.state.vhost_pid == 0 {
            &[]
        } else {
            &["vhost.sock", "vsock.sock"]
        };
        for f in backend.iter().chain(&[
            SANDBOX_FILE,
            "qmp.sock",
            "state.json",
            notify_socket_name().as_str(),
        ]) {
            let _ = fs::remove_file(self.dir.join(f));
        }
        self.released = true;
        Ok(how)
    }

    /// Waits up to `timeout` for QEMU to end on its own (the guest powered
    /// off); true if it did.
    pub fn wait_powered_off(&mut self, timeout: Duration) -> bool {
        self.wait_exit(true, timeout)
    }

    fn wait_exit(&mut self, qemu: bool, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let up = if qemu {
                self.qemu_running()
            } else {
                self.vhost_running()
            };
            if !up {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Whether a process runs: through its Child when we have it (which also
/// reaps it), else by pid.
fn running(child: &mut Option<Child>, pid: u32, dir: &Path) -> bool {
    match child {
        Some(c) => matches!(c.try_wait(), Ok(None)),
        None => alive(pid, dir),
    }
}

fn read_state(dir: &Path) -> Result<State> {
    let path = dir.join("state.json");
    let text = fs::read_to_string(&path).map_err(io_err(format!(
        "no VM state in {} (was crust-vm up run with this --dir?)",
        dir.display()
    )))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Invalid(format!("{} is not valid VM state: {e}", path.display())))
}

impl Drop for Vm {
    /// A VM that was neither brought down nor detached is killed, so tests
    /// that fail halfway leave nothing running.
    fn drop(&mut self) {
        if self.released {
            return;
        }
        for (child, pid) in [
            (&mut self.qemu, self.state.qemu_pid),
            (&mut self.vhost, self.state.vhost_pid),
        ] {
            match child {
                Some(c) => {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                None if alive(pid, &self.dir) => signal(pid, libc::SIGKILL),
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials() {
        for (s, ok) in [
            ("vol-0123456789abcdef", true),
            ("a", true),
            ("A.b_c-9", true),
            ("", false),
            ("vol-0123456789abcdefg", false), // 21 bytes
            ("has space", false),
            ("comma,x", false),
            ("é", false),
        ] {
            assert_eq!(check_serial(s).is_ok(), ok, "{s:?}");
        }
        assert_eq!(
            disk_names("v1"),
            ("crust-v1".to_string(), "dev-v1".to_string())
        );
        // QEMU node names: at most 31 characters.
        assert!(disk_names("vol-0123456789abcdef").0.len() <= 31);
    }

    #[test]
    fn attach_without_state_explains() {
        let d = tempfile::tempdir().unwrap();
        let err = Vm::attach(d.path()).err().expect("no state");
        assert!(err.to_string().contains("crust-vm up"), "{err}");
    }
}

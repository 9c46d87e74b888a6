//! crust-vm: boots the crust-agent guest (kernel + initrd) under QEMU with a
//! vhost-user vsock backend, waits until the agent answers, and drives the
//! VMM side over QMP (hot-plug, resize, unplug) until a clean power-off.

pub mod hvsock;
pub mod initrd;
pub mod qmp;

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crust_protocols::crust::{GetAgentInfoRequest, GetAgentInfoResponse, ShutdownRequest};
use crust_protocols::crust_ttrpc::AgentClient;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The guest's vsock context id.
pub const GUEST_CID: u32 = 3;
/// The agent's default vsock port.
pub const AGENT_PORT: u32 = 1024;
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
    vhost_pid: u32,
    port: u32,
    disks: BTreeMap<String, Disk>,
}

/// A running VM.
pub struct Vm {
    /// The VM's directory (absolute).
    dir: PathBuf,
    /// Pids and disks.
    state: State,
    /// QEMU, when this process started it (so it can be reaped).
    qemu: Option<Child>,
    /// The vsock backend, when this process started it.
    vhost: Option<Child>,
    /// What the agent said when it first answered (only after `up`).
    boot_info: Option<GetAgentInfoResponse>,
    /// Set by `down` and `detach`: Drop leaves the processes alone.
    released: bool,
}

/// The `hvsock://` address of the agent of the VM in `dir`.
pub fn agent_address(dir: &Path, port: u32) -> String {
    format!("hvsock://{}:{port}", dir.join("vsock.sock").display())
}

/// Checks a virtio-blk serial: 1–20 bytes of `[A-Za-z0-9._-]`.
pub fn check_serial(serial: &str) -> Result<()> {
    let ok = !serial.is_empty()
        && serial.len() <= 20
        && serial
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "serial {serial:?} is not 1-20 characters of [A-Za-z0-9._-]: choose another serial"
        )))
    }
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
    /// Starts the vsock backend and QEMU, and waits until the agent answers
    /// GetAgentInfo over hybrid vsock. On failure nothing is left running.
    pub fn up(opts: VmOptions) -> Result<Vm> {
        fs::create_dir_all(&opts.dir)
            .map_err(io_err(format!("cannot create {}", opts.dir.display())))?;
        let dir = fs::canonicalize(&opts.dir)
            .map_err(io_err(format!("cannot resolve {}", opts.dir.display())))?;
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
        for f in [
            "vhost.sock",
            "vsock.sock",
            "qmp.sock",
            "console.log",
            "state.json",
        ] {
            let _ = fs::remove_file(dir.join(f));
        }
        let vhost_bin =
            find_program("vhost-device-vsock", "CRUST_VHOST_DEVICE_VSOCK").ok_or_else(|| {
                Error::Invalid(
                    "vhost-device-vsock not found: cargo install vhost-device-vsock --locked"
                        .into(),
                )
            })?;
        let accel = opts.accel.unwrap_or_else(|| choose_accel(&opts.kernel));

        let log = |name: &str| -> Result<Stdio> {
            let f = fs::File::create(dir.join(name))
                .map_err(io_err(format!("cannot create {name} in {}", dir.display())))?;
            Ok(Stdio::from(f))
        };
        let vhost = Command::new(&vhost_bin)
            .arg("--guest-cid")
            .arg(GUEST_CID.to_string())
            .arg("--socket")
            .arg(dir.join("vhost.sock"))
            .arg("--uds-path")
            .arg(dir.join("vsock.sock"))
            .stdin(Stdio::null())
            .stdout(log("vhost.log")?)
            .stderr(log("vhost.log")?)
            .process_group(0)
            .spawn()
            .map_err(io_err(format!("cannot start {}", vhost_bin.display())))?;
        let mut vm = Vm {
            dir: dir.clone(),
            state: State {
                vhost_pid: vhost.id(),
                port: opts.port,
                ..Default::default()
            },
            qemu: None,
            vhost: Some(vhost),
            boot_info: None,
            released: false,
        };
        // From here on, Drop stops whatever was started if we return early.
        vm.wait_for_socket(&dir.join("vhost.sock"), Duration::from_secs(10))?;

        let mem = format!("{}M", opts.memory_mib);
        let mut append = String::from("console=ttyS0 quiet panic=-1");
        if !opts.append.trim().is_empty() {
            append.push(' ');
            append.push_str(opts.append.trim());
        }
        let qemu = Command::new("qemu-system-x86_64")
            .args([
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
            .arg(format!("file:{}", dir.join("console.log").display()))
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
            .arg(format!(
                "socket,id=vs,path={}",
                dir.join("vhost.sock").display()
            ))
            .args(["-device", "vhost-user-vsock-pci,chardev=vs"])
            .arg("-qmp")
            .arg(format!(
                "unix:{},server=on,wait=off",
                dir.join("qmp.sock").display()
            ))
            .stdin(Stdio::null())
            .stdout(log("qemu.log")?)
            .stderr(log("qemu.log")?)
            .process_group(0)
            .spawn()
            .map_err(io_err(
                "cannot start qemu-system-x86_64 (apt-get install qemu-system-x86)",
            ))?;
        vm.state.qemu_pid = qemu.id();
        vm.qemu = Some(qemu);
        vm.save()?;

        let deadline = Instant::now() + opts.boot_timeout;
        let uds = dir.join("vsock.sock");
        loop {
            if !vm.qemu_running() {
                return Err(Error::Boot(format!(
                    "QEMU exited before the agent answered.\nqemu.log: {}\nconsole.log (end): {}",
                    tail(&dir.join("qemu.log"), 2000),
                    tail(&dir.join("console.log"), 3000)
                )));
            }
            if let Ok(client) = hvsock::agent_client(&uds, opts.port, Duration::from_secs(2)) {
                if let Ok(info) = client.get_agent_info(
                    hvsock::ctx(Duration::from_secs(5)),
                    &GetAgentInfoRequest::new(),
                ) {
                    vm.boot_info = Some(info);
                    vm.write_sandbox_entry()?;
                    return Ok(vm);
                }
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout(format!(
                    "the agent did not answer on {} within {:?} ({} accel).\nconsole.log (end): {}",
                    agent_address(&dir, opts.port),
                    opts.boot_timeout,
                    accel.name(),
                    tail(&dir.join("console.log"), 3000)
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Takes over the VM running in `dir` (started by another process).
    pub fn attach(dir: &Path) -> Result<Vm> {
        let dir =
            fs::canonicalize(dir).map_err(io_err(format!("cannot resolve {}", dir.display())))?;
        let state = read_state(&dir)?;
        Ok(Vm {
            dir,
            state,
            qemu: None,
            vhost: None,
            boot_info: None,
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

    /// The console log of the guest.
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// What the agent answered first (set by `up`).
    pub fn boot_info(&self) -> Option<&GetAgentInfoResponse> {
        self.boot_info.as_ref()
    }

    /// Pids of QEMU and the vsock backend.
    pub fn pids(&self) -> (u32, u32) {
        (self.state.qemu_pid, self.state.vhost_pid)
    }

    /// A fresh ttrpc client for the agent.
    pub fn agent(&self) -> Result<AgentClient> {
        hvsock::agent_client(&self.vsock_path(), self.state.port, Duration::from_secs(5)).map_err(
            io_err(format!("cannot reach the agent at {}", self.address())),
        )
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
        self.qmp()?.execute(cmd, args)
    }

    fn qmp(&self) -> Result<qmp::Qmp> {
        qmp::Qmp::connect(&self.dir.join("qmp.sock"), Duration::from_secs(30))
    }

    /// Writes `DIR/sandbox.json`, the entry crustd's sandbox registry reads
    /// (docs/crustd.md): `{"qmp": "DIR/qmp.sock", "agent": "hvsock://DIR/vsock.sock:PORT"}`.
    /// `crust-vm up --dir REGISTRY/<sandbox>` thus makes a CRUST sandbox.
    /// Written once the agent answers, so crustd never sees a VM still booting.
    fn write_sandbox_entry(&self) -> Result<()> {
        let path = self.dir.join(SANDBOX_FILE);
        let tmp = self.dir.join("sandbox.json.tmp");
        let text = json!({
            "qmp": self.dir.join("qmp.sock"),
            "agent": self.address(),
        })
        .to_string();
        fs::write(&tmp, text).map_err(io_err(format!("cannot write {}", tmp.display())))?;
        fs::rename(&tmp, &path).map_err(io_err(format!("cannot write {}", path.display())))
    }

    fn save(&self) -> Result<()> {
        let path = self.dir.join("state.json");
        let tmp = self.dir.join("state.json.tmp");
        let text =
            serde_json::to_string_pretty(&self.state).map_err(|e| Error::Invalid(e.to_string()))?;
        fs::write(&tmp, text).map_err(io_err(format!("cannot write {}", tmp.display())))?;
        fs::rename(&tmp, &path).map_err(io_err(format!("cannot write {}", path.display())))
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
        let mut q = self.qmp()?;
        q.execute(
            "blockdev-add",
            Some(json!({
                "node-name": node, "driver": "raw", "read-only": read_only,
                "file": { "driver": "file", "filename": image },
            })),
        )?;
        let added = q.execute(
            "device_add",
            Some(json!({ "driver": "virtio-blk-pci", "drive": node, "id": device, "serial": serial })),
        );
        if let Err(e) = added {
            let _ = q.execute("blockdev-del", Some(json!({ "node-name": node })));
            return Err(e);
        }
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
        self.qmp()?.execute(
            "block_resize",
            Some(json!({ "node-name": disk.node, "size": bytes })),
        )?;
        Ok(())
    }

    /// Detaches the disk with `serial`: device_del, wait for DEVICE_DELETED
    /// (the guest has let go of it), then blockdev-del.
    pub fn unplug(&mut self, serial: &str) -> Result<()> {
        let disk = self.disk(serial)?.clone();
        let mut q = self.qmp()?;
        q.execute("device_del", Some(json!({ "id": disk.device })))?;
        let id = disk.device.clone();
        q.wait_event(
            "DEVICE_DELETED",
            |d| d["device"] == id.as_str(),
            Duration::from_secs(30),
        )?;
        q.execute("blockdev-del", Some(json!({ "node-name": disk.node })))?;
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
                c.shutdown(
                    hvsock::ctx(Duration::from_secs(10)),
                    &ShutdownRequest::new(),
                )
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
                let _ = self.qmp().and_then(|mut q| q.execute("quit", None));
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
        for f in [
            SANDBOX_FILE,
            "vhost.sock",
            "vsock.sock",
            "qmp.sock",
            "state.json",
        ] {
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

//! How a VM is booted, and the numbers both sides of its vsock agree on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::accel::Accel;

/// The guest's vsock context id.
pub const GUEST_CID: u32 = 3;
/// The agent's default vsock port.
pub const AGENT_PORT: u32 = crust_protocols::DEFAULT_PORT;
/// The host port the agent announces readiness to (`crust.notify=`).
pub const NOTIFY_PORT: u32 = 1025;
/// Without a READY (an agent that does not announce, or `notify` off), the
/// agent is polled once the console shows it listening and this long has
/// passed: its vsock driver is up by then.
pub(crate) const POLL_AFTER_LISTENING: Duration = Duration::from_secs(3);
/// How long one GetAgentInfo may take once the agent is ready.
pub(crate) const INFO_TIMEOUT: Duration = Duration::from_secs(10);
/// QEMU's `-name` unless the options give another.
pub const DEFAULT_NAME: &str = "crust-vm";
/// The sandbox registry entry `up` writes in its directory, for crustd.
pub const SANDBOX_FILE: &str = "sandbox.json";

/// How to boot the VM.
#[derive(Debug, Clone)]
pub struct VmOptions {
    /// Where sockets, logs and state live.
    pub dir: PathBuf,
    /// The VM's name, QEMU's `-name`: what its command line says it is.
    /// A runtime's own name for it stands in for that runtime's QEMU (Kata
    /// names sandbox `<id>`'s `sandbox-<id>`, which crustd requires).
    pub name: String,
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
    /// A root filesystem image to boot from (a raw disk, virtio-blk, the
    /// guest's `/dev/vda`, `root=/dev/vda rw` on the command line): a guest
    /// whose init is systemd (`make guest-image`) rather than the agent.
    /// Disks hot-plugged later come after it.
    pub root_disk: Option<PathBuf>,
}

impl VmOptions {
    /// Defaults: the workspace's `build/vmlinuz` and `build/initrd.img`, 256 MiB, 1 vCPU.
    pub fn new(dir: impl Into<PathBuf>) -> VmOptions {
        let build = default_build_dir();
        VmOptions {
            dir: dir.into(),
            name: DEFAULT_NAME.into(),
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
            root_disk: None,
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

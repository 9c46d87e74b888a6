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

mod accel;
mod elf;
mod error;
mod files;
mod hotplug;
pub mod initrd;
mod options;
mod process;
mod qemu;
mod ready;
mod up;
mod vm;

pub use accel::{choose_accel, Accel};
pub use error::{Error, Result};
pub use options::{
    default_build_dir, VmOptions, AGENT_PORT, DEFAULT_NAME, GUEST_CID, NOTIFY_PORT, SANDBOX_FILE,
};
pub use process::alive;
pub use vm::{agent_address, check_serial, ctx, disk_names, Disk, Readiness, Vm};

//! The QMP steps of a volume: plug (`blockdev-add` host_device with
//! O_DIRECT, then `device_add virtio-blk-pci` with the serial), unplug
//! (crust-client's, each step on a session of its own, so that the caller
//! waits for the guest without holding the sandbox's QMP lock), and growth
//! (`block_resize`). The commands and the session are
//! crust-client's, shared with crust-vm, each asking QEMU first so it can be
//! repeated after a crash or a restart; here their failures get crustd's
//! codes: QEMU's refusal is FAILED_PRECONDITION with QEMU's words, a
//! monitor that is missing, silent or broken is UNAVAILABLE.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crust_client::qmp::{BlockDisk, Qmp, QmpError, Source, Step};

use crate::hostdev::Names;

crust_protocols::coded_errors! {
/// A QMP step that failed, saying what was being done.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// QEMU refused the command: its words.
    #[code(FailedPrecondition)]
    #[error("QEMU refused {doing}: {desc} ({class})")]
    Refused { doing: Doing, class: String, desc: String },
    /// The monitor is missing, silent or broken.
    #[code(Unavailable)]
    #[error("{source}; while {doing}")]
    Lost { doing: Doing, source: Arc<QmpError> },
    /// No session could be opened.
    #[code(Unavailable)]
    #[error("{0}")]
    NoSession(Arc<QmpError>),
    #[code(FailedPrecondition)]
    #[error("QEMU has no block node {node}: the disk was unplugged behind crustd's back; unpublish and publish again")]
    NoNode { node: String },
    /// The guest kept the device past the wait (`timeout`, or the caller's deadline).
    #[code(Unavailable)]
    #[error("the guest did not release device {device} within {timeout:?} after device_del, or by the caller's deadline (is the guest kernel alive?); unpublish again to retry")]
    NotReleased { device: String, timeout: Duration },
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// What crustd was asking QEMU for, in the words of its messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Doing {
    /// Leaving negotiation mode, as a session begins.
    Capabilities,
    /// blockdev-add and device_add of this host device.
    Attach(PathBuf),
    /// device_del of this device.
    Detach(String),
    /// qom-list, whether the device is still there.
    List,
    /// blockdev-del of this node.
    RemoveNode(String),
    /// block_resize of this node to this many bytes.
    Grow { node: String, bytes: u64 },
}

impl fmt::Display for Doing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Doing::Capabilities => f.write_str("qmp_capabilities"),
            Doing::Attach(dev) => {
                write!(f, "to attach {} (blockdev-add, device_add)", dev.display())
            }
            Doing::Detach(device) => write!(f, "to detach {device} (device_del)"),
            Doing::List => f.write_str("listing devices (qom-list)"),
            Doing::RemoveNode(node) => write!(f, "to remove node {node} (blockdev-del)"),
            Doing::Grow { node, bytes } => {
                write!(f, "to grow {node} to {bytes} bytes (block_resize)")
            }
        }
    }
}

impl Doing {
    /// A QMP failure while doing this: QEMU's refusal, or a lost monitor.
    pub fn failed(self, e: QmpError) -> Error {
        match e {
            QmpError::Refused { class, desc, .. } => Error::Refused {
                doing: self,
                class,
                desc,
            },
            other => Error::Lost {
                doing: self,
                source: Arc::new(other),
            },
        }
    }

    /// The step of crust-client's unplug for the volume `names` names.
    pub fn of_step(step: Step, names: &Names) -> Doing {
        match step {
            Step::Detach => Doing::Detach(names.device.clone()),
            Step::Look => Doing::List,
            Step::RemoveNode => Doing::RemoveNode(names.node.clone()),
        }
    }
}

/// A session that could not be opened (the caller judged the process that
/// serves the monitor already: a veto is not this): QEMU refusing to leave
/// negotiation mode is FAILED_PRECONDITION, anything else UNAVAILABLE (the
/// VM gone, the monitor wedged or held by another client).
pub fn no_session(e: QmpError) -> Error {
    match e {
        e @ QmpError::Refused { .. } => Doing::Capabilities.failed(e),
        other => Error::NoSession(Arc::new(other)),
    }
}

pub use crust_client::qmp::Added;

/// QEMU's names for the volume `names` describes.
fn disk(names: &Names) -> BlockDisk<'_> {
    BlockDisk {
        node: &names.node,
        device: &names.device,
        serial: &names.serial,
    }
}

/// Attaches host device `dev` as node `names.node` and virtio-blk device
/// `names.device` with serial `names.serial`, adding only what QEMU does not
/// have yet (crust-client's `Qmp::plug`).
pub fn plug(q: &mut Qmp, names: &Names, dev: &Path, read_only: bool) -> Result<Added> {
    q.plug(&disk(names), Source::HostDevice(dev), read_only)
        .map_err(|e| Doing::Attach(dev.to_path_buf()).failed(e))
}

/// Removes the block node (blockdev-del) if QEMU still has it; answers whether it had it.
pub fn remove_node(q: &mut Qmp, names: &Names) -> Result<bool> {
    q.remove_node(&names.node)
        .map_err(|e| Doing::RemoveNode(names.node.clone()).failed(e))
}

/// Grows QEMU's view of `node` to `bytes` when it is smaller (the guest is
/// told by virtio's config change). Returns QEMU's size before.
pub fn grow(q: &mut Qmp, node: &str, bytes: u64) -> Result<u64> {
    q.grow(node, bytes)
        .map_err(|e| {
            Doing::Grow {
                node: node.to_string(),
                bytes,
            }
            .failed(e)
        })?
        .ok_or_else(|| Error::NoNode {
            node: node.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::code::Code;

    #[test]
    fn qemu_refusing_is_a_precondition_and_anything_else_unavailable() {
        let e = Doing::Attach("/dev/loop0".into()).failed(QmpError::Refused {
            command: "device_add".into(),
            class: "GenericError".into(),
            desc: "Bus 'pci.0' does not support hotplugging".into(),
            refusal: crust_client::qmp::Refusal::Other,
        });
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert_eq!(
            e.to_string(),
            "QEMU refused to attach /dev/loop0 (blockdev-add, device_add): Bus 'pci.0' does not support hotplugging (GenericError)"
        );
        let e = Doing::List.failed(QmpError::Silent {
            path: "/vm/qmp.sock".into(),
            timeout: Duration::from_secs(10),
        });
        assert_eq!(e.code(), Code::Unavailable);
        let m = e.to_string();
        assert!(
            m.contains("/vm/qmp.sock") && m.ends_with("while listing devices (qom-list)"),
            "{m}"
        );
        // No monitor at all: UNAVAILABLE, saying the VM may be gone.
        let t = tempfile::tempdir().unwrap();
        let none = t.path().join("qmp.sock");
        let e = no_session(Qmp::connect(&none, Duration::from_secs(1)).unwrap_err());
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.to_string().contains("does not exist"), "{e}");
        // A monitor that accepts and never greets (busy with another client).
        let p = t.path().join("busy.sock");
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let e = no_session(Qmp::connect(&p, Duration::from_millis(300)).unwrap_err());
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.to_string().contains("did not greet"), "{e}");
    }
}

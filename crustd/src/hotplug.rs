//! The QMP steps of a volume: plug (`blockdev-add` host_device with
//! O_DIRECT, then `device_add virtio-blk-pci` with the serial), unplug
//! (crust-client's, each step on a session of its own, so that the caller
//! waits for the guest without holding the sandbox's QMP lock), and growth
//! (`block_resize`). The commands and the session are
//! crust-client's, shared with crust-vm, each asking QEMU first so it can be
//! repeated after a crash or a restart; here their failures get crustd's
//! codes: QEMU's refusal is FAILED_PRECONDITION with QEMU's words, a
//! monitor that is missing, silent or broken is UNAVAILABLE.

use std::path::Path;
use std::time::Duration;

use crust_client::qmp::{BlockDisk, Qmp, QmpError, Socket, Source, Step, UnplugError};

use crate::error::{Error, Result};
use crate::hostdev::Names;

/// A QMP failure as crustd's error, saying what was being done.
trait During {
    /// `what`: "to attach /dev/x (device_add)", "listing devices (qom-list)".
    fn during(self, what: &str) -> Error;
}

impl During for QmpError {
    fn during(self, what: &str) -> Error {
        match self {
            QmpError::Refused { class, desc, .. } => {
                Error::precondition(format!("QEMU refused {what}: {desc} ({class})"))
            }
            other => Error::unavailable(other.to_string()).and(format!("while {what}")),
        }
    }
}

/// A QMP session on `socket`, greeted and in command mode, every step
/// bounded by `timeout`, once `vet` has accepted the process that listens
/// there (monitor.rs judges it); FAILED_PRECONDITION when `vet` refuses it
/// (nothing sent), UNAVAILABLE when there is no session (the VM gone, the
/// monitor wedged or held by another client).
pub fn connect(
    socket: Socket<'_>,
    timeout: Duration,
    vet: impl FnOnce(u32) -> std::result::Result<(), String>,
) -> Result<Qmp> {
    Qmp::connect_vetted(socket, timeout, vet).map_err(|e| match e {
        QmpError::Refused { .. } => e.during("qmp_capabilities"),
        QmpError::Vetoed { why, .. } => Error::precondition(why),
        other => Error::unavailable(other.to_string()),
    })
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
        .map_err(|e| {
            e.during(&format!(
                "to attach {} (blockdev-add, device_add)",
                dev.display()
            ))
        })
}

/// An unplug's failure (crust-client's `unplug` or `remove_node_until`,
/// each step on a session from crustd's factory) as crustd's error: the
/// factory's own, QEMU's for the step that failed, or UNAVAILABLE when the
/// guest did not let go within `timeout` or the caller's deadline.
pub fn unplug_error(e: UnplugError<Error>, names: &Names, timeout: Duration) -> Error {
    match e {
        UnplugError::Session(e) => e,
        UnplugError::Qmp { step, error } => match step {
            Step::Detach => error.during(&format!("to detach {} (device_del)", names.device)),
            Step::Look => error.during("listing devices (qom-list)"),
            Step::RemoveNode => {
                error.during(&format!("to remove node {} (blockdev-del)", names.node))
            }
        },
        UnplugError::NotReleased => Error::unavailable(format!(
            "the guest did not release device {} within {timeout:?} after device_del, or by the caller's deadline (is the guest kernel alive?); unpublish again to retry",
            names.device
        )),
    }
}

/// Removes the block node (blockdev-del) if QEMU still has it; answers whether it had it.
pub fn remove_node(q: &mut Qmp, names: &Names) -> Result<bool> {
    q.remove_node(&names.node)
        .map_err(|e| e.during(&format!("to remove node {} (blockdev-del)", names.node)))
}

/// Grows QEMU's view of `node` to `bytes` when it is smaller (the guest is
/// told by virtio's config change). Returns QEMU's size before.
pub fn grow(q: &mut Qmp, node: &str, bytes: u64) -> Result<u64> {
    q.grow(node, bytes)
        .map_err(|e| e.during(&format!("to grow {node} to {bytes} bytes (block_resize)")))?
        .ok_or_else(|| {
            Error::precondition(format!(
                "QEMU has no block node {node}: the disk was unplugged behind crustd's back; unpublish and publish again"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    #[test]
    fn qemu_refusing_is_a_precondition_and_anything_else_unavailable() {
        let e = QmpError::Refused {
            command: "device_add".into(),
            class: "GenericError".into(),
            desc: "Bus 'pci.0' does not support hotplugging".into(),
            refusal: crust_client::qmp::Refusal::Other,
        }
        .during("to attach /dev/loop0 (device_add)");
        assert_eq!(e.code, Code::FailedPrecondition);
        assert_eq!(
            e.message,
            "QEMU refused to attach /dev/loop0 (device_add): Bus 'pci.0' does not support hotplugging (GenericError)"
        );
        let e = QmpError::Silent {
            path: "/vm/qmp.sock".into(),
            timeout: Duration::from_secs(10),
        }
        .during("listing devices (qom-list)");
        assert_eq!(e.code, Code::Unavailable);
        assert!(
            e.message.contains("/vm/qmp.sock")
                && e.message.ends_with("while listing devices (qom-list)"),
            "{e}"
        );
        // No monitor at all: UNAVAILABLE, saying the VM may be gone.
        let t = tempfile::tempdir().unwrap();
        let none = t.path().join("qmp.sock");
        let e = connect(Socket::Path(&none), Duration::from_secs(1), |_| Ok(())).unwrap_err();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("does not exist"), "{e}");
        // A monitor that accepts and never greets (busy with another client).
        let p = t.path().join("busy.sock");
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let e = connect(Socket::Path(&p), Duration::from_millis(300), |_| Ok(())).unwrap_err();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("did not greet"), "{e}");
        // A process the caller refuses: its words, FAILED_PRECONDITION.
        let e = connect(Socket::Path(&p), Duration::from_secs(5), |pid| {
            Err(format!("not {pid}"))
        })
        .unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition);
        assert_eq!(e.message, format!("not {}", std::process::id()));
    }
}

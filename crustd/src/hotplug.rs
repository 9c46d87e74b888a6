//! The QMP steps of a volume, each one asking QEMU first so it can be
//! repeated after a crash or a restart without plugging anything twice:
//! plug (`blockdev-add` host_device with O_DIRECT, then `device_add
//! virtio-blk-pci` with the serial), unplug (`device_del`, wait for
//! `DEVICE_DELETED`, then `blockdev-del`), and growth (`block_resize`).
//! The session itself (deadlines, bounded lines, events between replies)
//! is crust-client's, shared with crust-vm; here its failures get crustd's
//! codes: QEMU's refusal is FAILED_PRECONDITION with QEMU's words, a
//! monitor that is missing, silent or broken is UNAVAILABLE.

use std::path::Path;
use std::time::{Duration, Instant};

use crust_client::qmp::{Qmp, QmpError};
use serde_json::{json, Value};

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

/// A QMP session on `path`, greeted and in command mode, every step bounded
/// by `timeout`; UNAVAILABLE when there is none (the VM gone, the monitor
/// wedged or held by another client).
pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp> {
    Qmp::connect(path, timeout).map_err(|e| match e {
        QmpError::Refused { .. } => e.during("qmp_capabilities"),
        other => Error::unavailable(other.to_string()),
    })
}

/// What one `plug` call added (what an undo must take away).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Added {
    /// This call ran blockdev-add.
    pub node: bool,
    /// This call ran device_add.
    pub device: bool,
}

/// Whether QEMU has a device with id `id` (qdev ids live under /machine/peripheral).
pub fn device_present(q: &mut Qmp, id: &str) -> Result<bool> {
    let list = q
        .execute("qom-list", Some(json!({ "path": "/machine/peripheral" })))
        .map_err(|e| e.during("listing devices (qom-list)"))?;
    Ok(list
        .as_array()
        .is_some_and(|a| a.iter().any(|p| p["name"] == id)))
}

/// QEMU's block node `node`, if it exists.
fn node_info(q: &mut Qmp, node: &str) -> Result<Option<Value>> {
    let list = q
        .execute("query-named-block-nodes", Some(json!({ "flat": true })))
        .map_err(|e| e.during("listing block nodes (query-named-block-nodes)"))?;
    Ok(list
        .as_array()
        .and_then(|a| a.iter().find(|n| n["node-name"] == node).cloned()))
}

/// The size QEMU (and so the guest) sees for `node`, in bytes.
pub fn node_size(q: &mut Qmp, node: &str) -> Result<Option<u64>> {
    Ok(node_info(q, node)?.and_then(|n| n["image"]["virtual-size"].as_u64()))
}

/// Attaches `dev` as node `names.node` and virtio-blk device `names.device`
/// with serial `names.serial`, adding only what QEMU does not have yet. A
/// device refused after this call added the node removes the node again.
pub fn plug(q: &mut Qmp, names: &Names, dev: &Path, read_only: bool) -> Result<Added> {
    let mut added = Added::default();
    if node_info(q, &names.node)?.is_none() {
        q.execute(
            "blockdev-add",
            Some(json!({
                "node-name": names.node,
                "driver": "host_device",
                "filename": dev,
                "cache": { "direct": true },
                "read-only": read_only,
            })),
        )
        .map_err(|e| e.during(&format!("to open {} (blockdev-add)", dev.display())))?;
        added.node = true;
    }
    if !device_present(q, &names.device)? {
        let r = q.execute(
            "device_add",
            Some(json!({
                "driver": "virtio-blk-pci",
                "drive": names.node,
                "id": names.device,
                "serial": names.serial,
            })),
        );
        if let Err(e) = r {
            let mut err = e.during(&format!("to attach {} (device_add)", dev.display()));
            if added.node {
                if let Err(e2) = q.execute("blockdev-del", Some(json!({ "node-name": names.node })))
                {
                    err = err.and(format!(
                        "and removing node {} again failed: {}",
                        names.node,
                        e2.during("blockdev-del")
                    ));
                }
            }
            return Err(err);
        }
        added.device = true;
    }
    Ok(added)
}

/// Detaches the device and removes the node, whichever of them QEMU still
/// has. The device is gone when QEMU says DEVICE_DELETED (the guest let go of
/// it) or no longer lists it; after `timeout` without that, UNAVAILABLE.
pub fn unplug(q: &mut Qmp, names: &Names, timeout: Duration) -> Result<()> {
    if device_present(q, &names.device)? {
        if let Err(e) = q.execute("device_del", Some(json!({ "id": names.device }))) {
            // Already on its way out (a device_del before a restart): just wait.
            let leaving = matches!(&e, QmpError::Refused { desc, .. } if desc.contains("in the process of unplug"));
            if !leaving {
                return Err(e.during(&format!("to detach {} (device_del)", names.device)));
            }
        }
        wait_deleted(q, &names.device, timeout)?;
    }
    if node_info(q, &names.node)?.is_some() {
        q.execute("blockdev-del", Some(json!({ "node-name": names.node })))
            .map_err(|e| e.during(&format!("to remove node {} (blockdev-del)", names.node)))?;
    }
    Ok(())
}

fn wait_deleted(q: &mut Qmp, id: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let slice = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(500));
        if q.wait_event("DEVICE_DELETED", |d| d["device"] == id, slice)
            .map_err(|e| e.during("waiting for DEVICE_DELETED"))?
            .is_some()
        {
            return Ok(());
        }
        // The event may have gone to an earlier session; ask.
        if !device_present(q, id)? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::unavailable(format!(
                "the guest did not release device {id} within {timeout:?} after device_del (is the guest kernel alive?); unpublish again to retry"
            )));
        }
    }
}

/// Asks QEMU to detach the device (device_del) if it still has it, without
/// waiting for the guest; answers whether it had it.
pub fn request_unplug(q: &mut Qmp, names: &Names) -> Result<bool> {
    if !device_present(q, &names.device)? {
        return Ok(false);
    }
    if let Err(e) = q.execute("device_del", Some(json!({ "id": names.device }))) {
        // Already on its way out (a device_del before a restart): just wait.
        let leaving = matches!(&e, QmpError::Refused { desc, .. } if desc.contains("in the process of unplug"));
        if !leaving {
            return Err(e.during(&format!("to detach {} (device_del)", names.device)));
        }
    }
    Ok(true)
}

/// Whether QEMU no longer lists the device (the guest let go of it).
pub fn device_gone(q: &mut Qmp, names: &Names) -> Result<bool> {
    Ok(!device_present(q, &names.device)?)
}

/// Removes the block node (blockdev-del) if QEMU still has it; answers whether it had it.
pub fn remove_node(q: &mut Qmp, names: &Names) -> Result<bool> {
    if node_info(q, &names.node)?.is_none() {
        return Ok(false);
    }
    q.execute("blockdev-del", Some(json!({ "node-name": names.node })))
        .map_err(|e| e.during(&format!("to remove node {} (blockdev-del)", names.node)))?;
    Ok(true)
}

/// Grows QEMU's view of `node` to `bytes` when it is smaller (the guest is
/// told by virtio's config change). Returns QEMU's size before.
pub fn grow(q: &mut Qmp, node: &str, bytes: u64) -> Result<u64> {
    let before = node_size(q, node)?.ok_or_else(|| {
        Error::precondition(format!(
            "QEMU has no block node {node}: the disk was unplugged behind crustd's back; unpublish and publish again"
        ))
    })?;
    if before < bytes {
        q.execute(
            "block_resize",
            Some(json!({ "node-name": node, "size": bytes })),
        )
        .map_err(|e| e.during(&format!("to grow {node} to {bytes} bytes (block_resize)")))?;
    }
    Ok(before)
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
        let e = connect(&t.path().join("qmp.sock"), Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("does not exist"), "{e}");
        // A monitor that accepts and never greets (busy with another client).
        let p = t.path().join("busy.sock");
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let e = connect(&p, Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("did not greet"), "{e}");
    }
}

//! QEMU's block commands for one hot-plugged virtio-blk disk, written once
//! for crustd and crust-vm: plug (`blockdev-add`, then `device_add`), unplug
//! (`device_del`, the guest's release, `blockdev-del`) and growth
//! (`block_resize`). Each step asks QEMU first (`query-named-block-nodes`,
//! `qom-list /machine/peripheral`), so it can be repeated after a crash or
//! a restart without adding anything twice or failing on what is gone.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::session::{Qmp, QmpError};

/// QEMU's names for one disk.
#[derive(Debug, Clone, Copy)]
pub struct BlockDisk<'a> {
    /// The block node (`node-name`).
    pub node: &'a str,
    /// The virtio-blk device (`id`).
    pub device: &'a str,
    /// The serial the guest finds the disk by.
    pub serial: &'a str,
}

/// What backs a disk.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// A host block device, opened with O_DIRECT (`host_device`, `cache.direct`).
    HostDevice(&'a Path),
    /// An image file, as a raw disk (`raw` over `file`).
    Image(&'a Path),
}

/// What one [`Qmp::plug`] added (what an undo must take away).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Added {
    /// This call ran blockdev-add.
    pub node: bool,
    /// This call ran device_add.
    pub device: bool,
}

impl Qmp {
    /// Whether QEMU has a device with id `id` (qdev ids live under /machine/peripheral).
    pub fn device_present(&mut self, id: &str) -> Result<bool, QmpError> {
        let list = self.execute("qom-list", Some(json!({ "path": "/machine/peripheral" })))?;
        Ok(list
            .as_array()
            .is_some_and(|a| a.iter().any(|p| p["name"] == id)))
    }

    /// QEMU's block node `node`, if it exists.
    fn node_info(&mut self, node: &str) -> Result<Option<Value>, QmpError> {
        let list = self.execute("query-named-block-nodes", Some(json!({ "flat": true })))?;
        Ok(list
            .as_array()
            .and_then(|a| a.iter().find(|n| n["node-name"] == node).cloned()))
    }

    /// The size QEMU (and so the guest) sees for `node`, in bytes; `None`
    /// when QEMU has no such node.
    pub fn node_size(&mut self, node: &str) -> Result<Option<u64>, QmpError> {
        Ok(self
            .node_info(node)?
            .and_then(|n| n["image"]["virtual-size"].as_u64()))
    }

    /// Attaches `source` as block node `disk.node` and virtio-blk device
    /// `disk.device` with serial `disk.serial`, adding only what QEMU lacks.
    /// A device refused after this call added the node removes the node
    /// again (a node an earlier call added is left).
    pub fn plug(
        &mut self,
        disk: &BlockDisk,
        source: Source,
        read_only: bool,
    ) -> Result<Added, QmpError> {
        let mut added = Added::default();
        if self.node_info(disk.node)?.is_none() {
            let args = match source {
                // discard "unmap": a guest's trim reaches the host's storage
                // (a hole punched in an image, a discard sent to a device);
                // QEMU's default ("ignore") drops it.
                Source::HostDevice(dev) => json!({
                    "node-name": disk.node,
                    "driver": "host_device",
                    "filename": dev,
                    "cache": { "direct": true },
                    "read-only": read_only,
                    "discard": if read_only { "ignore" } else { "unmap" },
                }),
                Source::Image(img) => json!({
                    "node-name": disk.node,
                    "driver": "raw",
                    "read-only": read_only,
                    "discard": if read_only { "ignore" } else { "unmap" },
                    "file": {
                        "driver": "file",
                        "filename": img,
                        "discard": if read_only { "ignore" } else { "unmap" },
                    },
                }),
            };
            self.execute("blockdev-add", Some(args))?;
            added.node = true;
        }
        if !self.device_present(disk.device)? {
            let r = self.execute(
                "device_add",
                Some(json!({
                    "driver": "virtio-blk-pci",
                    "drive": disk.node,
                    "id": disk.device,
                    "serial": disk.serial,
                })),
            );
            if let Err(e) = r {
                if added.node {
                    // Best effort: the refusal is what the caller must hear.
                    let _ = self.execute("blockdev-del", Some(json!({ "node-name": disk.node })));
                }
                return Err(e);
            }
            added.device = true;
        }
        Ok(added)
    }

    /// Asks QEMU to detach `device` (device_del) if it has it, without
    /// waiting for the guest; answers whether it had it. A device already
    /// on its way out (a device_del before a restart) is not an error.
    pub fn request_unplug(&mut self, device: &str) -> Result<bool, QmpError> {
        if !self.device_present(device)? {
            return Ok(false);
        }
        match self.execute("device_del", Some(json!({ "id": device }))) {
            Ok(_) => Ok(true),
            Err(QmpError::Refused { desc, .. }) if desc.contains("in the process of unplug") => {
                Ok(true)
            }
            Err(e) => Err(e),
        }
    }

    /// Waits on this session, at most `timeout`, for the guest to let go of
    /// `device`: QEMU's DEVICE_DELETED for it, or the device gone from its
    /// list (the event may have gone to an earlier session). Whether it did.
    pub fn wait_device_deleted(
        &mut self,
        device: &str,
        timeout: Duration,
    ) -> Result<bool, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(500));
            if self
                .wait_event("DEVICE_DELETED", |d| d["device"] == device, slice)?
                .is_some()
            {
                return Ok(true);
            }
            if !self.device_present(device)? {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }

    /// Removes block node `node` (blockdev-del) if QEMU has it; answers whether it had it.
    pub fn remove_node(&mut self, node: &str) -> Result<bool, QmpError> {
        if self.node_info(node)?.is_none() {
            return Ok(false);
        }
        self.execute("blockdev-del", Some(json!({ "node-name": node })))?;
        Ok(true)
    }

    /// Grows QEMU's view of `node` to `bytes` when it is smaller
    /// (block_resize; the guest hears of it through virtio's config change).
    /// Answers the size before, or `None` when QEMU has no such node.
    pub fn grow(&mut self, node: &str, bytes: u64) -> Result<Option<u64>, QmpError> {
        let Some(before) = self.node_size(node)? else {
            return Ok(None);
        };
        if before < bytes {
            self.execute(
                "block_resize",
                Some(json!({ "node-name": node, "size": bytes })),
            )?;
        }
        Ok(Some(before))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    /// What the stand-in QEMU holds: nodes (name → size) and devices (id → node).
    #[derive(Default)]
    struct Qemu {
        nodes: BTreeMap<String, u64>,
        devices: BTreeMap<String, String>,
        refuse_device_add: bool,
        leaving: bool,
    }

    /// A monitor that keeps nodes and devices the way QEMU does.
    fn qemu(path: &Path) -> (Arc<Mutex<Qemu>>, Arc<Mutex<Vec<String>>>) {
        let st = Arc::new(Mutex::new(Qemu::default()));
        let s = st.clone();
        let log = super::super::fake::serve(
            path,
            Box::new(move |cmd, a| {
                let mut q = s.lock().unwrap();
                let ok = json!({"return": {}});
                let err = |d: &str| json!({"error": {"class": "GenericError", "desc": d}});
                let name = |k: &str| a[k].as_str().unwrap_or_default().to_string();
                let reply = match cmd {
                    "qom-list" => {
                        json!({"return": q.devices.keys().map(|d| json!({"name": d})).collect::<Vec<_>>()})
                    }
                    "query-named-block-nodes" => {
                        json!({"return": q.nodes.iter().map(|(n, s)| json!({"node-name": n, "image": {"virtual-size": s}})).collect::<Vec<_>>()})
                    }
                    "blockdev-add" => {
                        q.nodes.insert(name("node-name"), 1 << 20);
                        ok
                    }
                    "device_add" if q.refuse_device_add => {
                        err("Bus 'pci.0' does not support hotplugging")
                    }
                    "device_add" => {
                        q.devices.insert(name("id"), name("drive"));
                        ok
                    }
                    "device_del" if q.leaving => {
                        err("Device d is already in the process of unplug")
                    }
                    "device_del" => {
                        q.devices.remove(&name("id"));
                        ok
                    }
                    "blockdev-del" => {
                        q.nodes.remove(&name("node-name"));
                        ok
                    }
                    "block_resize" => {
                        q.nodes
                            .insert(name("node-name"), a["size"].as_u64().unwrap());
                        ok
                    }
                    other => err(&format!("no {other}")),
                };
                (vec![], reply)
            }),
        );
        (st, log)
    }

    fn verbs(log: &Mutex<Vec<String>>) -> Vec<String> {
        std::mem::take(&mut *log.lock().unwrap())
            .into_iter()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .filter(|v| !matches!(v.as_str(), "qom-list" | "query-named-block-nodes"))
            .collect()
    }

    #[test]
    fn each_step_adds_or_takes_only_what_qemu_lacks_or_has() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let (st, log) = qemu(&p);
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        let d = BlockDisk {
            node: "n1",
            device: "d1",
            serial: "s1",
        };
        let src = Source::HostDevice(Path::new("/dev/loop9"));
        assert_eq!(
            q.plug(&d, src, false).unwrap(),
            Added {
                node: true,
                device: true
            }
        );
        assert_eq!(verbs(&log), ["blockdev-add", "device_add"]);
        // Again: nothing added.
        assert_eq!(q.plug(&d, src, false).unwrap(), Added::default());
        assert!(verbs(&log).is_empty());
        // Growth only when smaller; a missing node says so.
        assert_eq!(q.grow("n1", 1 << 30).unwrap(), Some(1 << 20));
        assert_eq!(q.grow("n1", 1 << 20).unwrap(), Some(1 << 30));
        assert_eq!(verbs(&log), ["block_resize"]);
        assert_eq!(q.grow("none", 1).unwrap(), None);
        // Unplug, twice: the second finds nothing to do.
        assert!(q.request_unplug("d1").unwrap());
        assert!(q.wait_device_deleted("d1", Duration::from_secs(2)).unwrap());
        assert!(q.remove_node("n1").unwrap());
        assert!(!q.request_unplug("d1").unwrap());
        assert!(!q.remove_node("n1").unwrap());
        assert_eq!(verbs(&log), ["device_del", "blockdev-del"]);
        // A device_del already under way is not an error.
        q.plug(&d, src, false).unwrap();
        st.lock().unwrap().leaving = true;
        assert!(q.request_unplug("d1").unwrap());
    }

    #[test]
    fn a_refused_device_takes_back_only_the_node_this_call_added() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let (st, log) = qemu(&p);
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        st.lock().unwrap().refuse_device_add = true;
        let d = BlockDisk {
            node: "n1",
            device: "d1",
            serial: "s1",
        };
        let img = Source::Image(Path::new("/tmp/x.img"));
        let e = q.plug(&d, img, true).unwrap_err();
        assert!(matches!(e, QmpError::Refused { .. }), "{e}");
        assert_eq!(verbs(&log), ["blockdev-add", "device_add", "blockdev-del"]);
        assert!(st.lock().unwrap().nodes.is_empty());
        // A node that was there before this call stays.
        st.lock().unwrap().nodes.insert("n1".into(), 1);
        q.plug(&d, img, true).unwrap_err();
        assert_eq!(verbs(&log), ["device_add"]);
        assert!(st.lock().unwrap().nodes.contains_key("n1"));
    }
}

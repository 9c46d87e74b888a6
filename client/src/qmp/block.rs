//! QEMU's block commands for one hot-plugged virtio-blk disk, written once
//! for crustd, crust-vm and the bench: plug (`blockdev-add`, then
//! `device_add`), the steps of an unplug (`device_del`, whether QEMU still
//! has the device, `blockdev-del`; `unplug.rs` waits between them) and
//! growth (`block_resize`). Each step asks QEMU first (`query-named-block-nodes`,
//! `qom-list /machine/peripheral`), so it can be repeated after a crash or
//! a restart without adding anything twice or failing on what is gone.

use std::path::Path;

use serde_json::{json, Value};

use super::refusal::Refusal;
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
            Err(e) if e.refusal() == Some(Refusal::UnplugPending) => Ok(true),
            Err(e) => Err(e),
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
    use super::super::fake::{qemu, Qemu};
    use super::super::unplug::{unplug, Patience, UnplugError};
    use super::*;
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    fn verbs(q: &Qemu) -> Vec<String> {
        std::mem::take(&mut q.lock().unwrap().log)
            .into_iter()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect()
    }

    /// A session per step, as crustd opens them.
    fn sessions(p: &Path) -> impl FnMut() -> Result<Qmp, QmpError> + '_ {
        move || Qmp::connect(p, Duration::from_secs(5))
    }

    const PATIENCE: Patience = Patience {
        each: Duration::from_secs(2),
        deadline: None,
    };

    /// The disk every test plugs.
    const D1: BlockDisk<'static> = BlockDisk {
        node: "n1",
        device: "d1",
        serial: "s1",
    };

    /// A fake QEMU at `<dir>/qmp.sock` and a file `<dir>/<name>` holding
    /// `bytes` to plug: (the directory, the socket, the file, QEMU's state).
    fn bed(name: &str, bytes: &[u8]) -> (tempfile::TempDir, PathBuf, PathBuf, Qemu) {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let file = t.path().join(name);
        std::fs::write(&file, bytes).unwrap();
        let st = qemu(&p);
        (t, p, file, st)
    }

    #[test]
    fn each_step_adds_or_takes_only_what_qemu_lacks_or_has() {
        let (_t, p, dev, st) = bed("disk", &vec![0u8; 1 << 20]);
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        let d = D1;
        let src = Source::HostDevice(&dev);
        assert_eq!(
            q.plug(&d, src, false).unwrap(),
            Added {
                node: true,
                device: true
            }
        );
        assert_eq!(verbs(&st), ["blockdev-add", "device_add"]);
        // Again: nothing added.
        assert_eq!(q.plug(&d, src, false).unwrap(), Added::default());
        assert!(verbs(&st).is_empty());
        // Growth only when smaller; a missing node says so.
        assert_eq!(q.grow("n1", 1 << 30).unwrap(), Some(1 << 20));
        assert_eq!(q.grow("n1", 1 << 20).unwrap(), Some(1 << 30));
        assert_eq!(verbs(&st), ["block_resize"]);
        assert_eq!(q.grow("none", 1).unwrap(), None);
        drop(q);
        // Unplug, twice: the second finds nothing to do.
        unplug(sessions(&p), "d1", "n1", PATIENCE).unwrap();
        assert_eq!(verbs(&st), ["device_del", "blockdev-del"]);
        assert!(st.lock().unwrap().open.is_empty(), "the file is closed");
        unplug(sessions(&p), "d1", "n1", PATIENCE).unwrap();
        assert!(verbs(&st).is_empty());
        // A device_del already under way is not an error.
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        q.plug(&d, src, false).unwrap();
        st.lock().unwrap().never_release = true;
        assert!(q.request_unplug("d1").unwrap());
        assert!(q.request_unplug("d1").unwrap());
        let refused = st.lock().unwrap().log.pop().unwrap();
        assert!(refused.starts_with("device_del"), "{refused}");
    }

    #[test]
    fn a_refused_device_takes_back_only_the_node_this_call_added() {
        let (_t, p, img, st) = bed("x.img", b"x");
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        st.lock().unwrap().refuse_device_add = true;
        let d = D1;
        let img = Source::Image(&img);
        let e = q.plug(&d, img, true).unwrap_err();
        assert_eq!(e.refusal(), Some(Refusal::Other), "{e}");
        assert_eq!(verbs(&st), ["blockdev-add", "device_add", "blockdev-del"]);
        assert!(st.lock().unwrap().nodes.is_empty());
        // A node that was there before this call stays.
        st.lock().unwrap().nodes.insert("n1".into(), 1);
        q.plug(&d, img, true).unwrap_err();
        assert_eq!(verbs(&st), ["device_add"]);
        assert!(st.lock().unwrap().nodes.contains_key("n1"));
    }

    /// QEMU says a node is in use for a moment after its device left: asked
    /// again, each time on a session of its own, none held in between.
    #[test]
    fn a_node_in_use_is_asked_for_again_until_the_deadline() {
        let (_t, p, dev, st) = bed("disk", b"x");
        let d = D1;
        let plug = |st: &Qemu| {
            let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
            q.plug(&d, Source::HostDevice(&dev), false).unwrap();
            verbs(st);
        };
        plug(&st);
        st.lock().unwrap().node_in_use = 3;
        let mut opened = 0;
        let open = || {
            opened += 1;
            Qmp::connect(&p, Duration::from_secs(5))
        };
        unplug(open, "d1", "n1", PATIENCE).unwrap();
        assert_eq!(
            verbs(&st),
            [
                "device_del",
                "blockdev-del",
                "blockdev-del",
                "blockdev-del",
                "blockdev-del"
            ]
        );
        // device_del, one look, four blockdev-del.
        assert_eq!(opened, 6);
        // Past the deadline, QEMU's refusal is the caller's.
        st.lock().unwrap().nodes.insert("n1".into(), 1);
        st.lock().unwrap().node_in_use = 1000;
        let t0 = Instant::now();
        let e = remove_node(&p, Instant::now() + Duration::from_millis(300)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5));
        match e {
            UnplugError::Qmp { step, error } => {
                assert_eq!(step, super::super::unplug::Step::RemoveNode);
                assert_eq!(error.refusal(), Some(Refusal::NodeInUse));
                assert_eq!(
                    error.to_string(),
                    "QEMU refused blockdev-del: Node n1 is in use (GenericError)"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    fn remove_node(p: &Path, until: Instant) -> Result<bool, UnplugError<QmpError>> {
        super::super::unplug::remove_node_until(sessions(p), "n1", until)
    }

    /// A guest that never lets go: the wait ends when the caller's patience
    /// does, and the node stays; a session the factory cannot open is the
    /// factory's error.
    #[test]
    fn a_guest_that_never_lets_go_ends_the_wait() {
        let (_t, p, dev, st) = bed("disk", b"x");
        let d = D1;
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        q.plug(&d, Source::HostDevice(&dev), false).unwrap();
        drop(q);
        st.lock().unwrap().never_release = true;
        let soon = Patience {
            each: Duration::from_secs(30),
            deadline: Some(Instant::now() + Duration::from_millis(300)),
        };
        let e = unplug(sessions(&p), "d1", "n1", soon).unwrap_err();
        assert!(matches!(e, UnplugError::NotReleased), "{e:?}");
        assert!(st.lock().unwrap().nodes.contains_key("n1"));
        let e = unplug(|| Err::<Qmp, _>("no monitor"), "d1", "n1", PATIENCE).unwrap_err();
        assert!(matches!(e, UnplugError::Session("no monitor")), "{e:?}");
    }
}

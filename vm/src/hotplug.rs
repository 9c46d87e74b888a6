//! Disks hot-plugged into the VM, grown and unplugged, through
//! crust-client's QMP block commands (the same as crustd's), and recorded
//! in the VM's state so another process can drive them.

use std::fs;
use std::path::Path;
use std::time::Duration;

use crust_client::qmp::{unplug, BlockDisk, Patience, Source, UnplugError};

use crate::error::{io_err, Error, Result};
use crate::vm::{check_serial, disk_names, Disk, Vm};

/// How long each wait of an unplug lasts: the guest's release of the
/// device, then QEMU's of the node.
const UNPLUG_WAIT: Duration = Duration::from_secs(30);

impl Vm {
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

    /// Detaches the disk with `serial`: device_del, the wait for the guest
    /// to let go, then blockdev-del (crust-client's unplug, each step on a
    /// session of its own), each wait at most 30 s.
    pub fn unplug(&mut self, serial: &str) -> Result<()> {
        let disk = self.disk(serial)?.clone();
        let patience = Patience {
            each: UNPLUG_WAIT,
            deadline: None,
        };
        unplug(|| self.qmp(), &disk.device, &disk.node, patience).map_err(|e| match e {
            UnplugError::Session(e) => e,
            UnplugError::Qmp { error, .. } => error.into(),
            UnplugError::NotReleased => Error::Timeout(format!(
                "QEMU still has device {} {UNPLUG_WAIT:?} after device_del: has the guest let go of the disk?",
                disk.device
            )),
        })?;
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
}

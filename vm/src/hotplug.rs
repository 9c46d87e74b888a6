//! Disks hot-plugged into the VM, grown and unplugged, through
//! crust-client's QMP block commands (the same as crustd's), and recorded
//! in the VM's state so another process can drive them.

use std::fs;
use std::path::Path;
use std::time::Duration;

use crust_client::qmp::{BlockDisk, Source};

use crate::error::{io_err, Error, Result};
use crate::vm::{check_serial, disk_names, Disk, Vm};

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
        // The device can leave QEMU's list a moment before its deferred
        // finalization lets go of the node: blockdev-del says "in use"
        // meanwhile (seen with crustd in CI), so it is asked again.
        let until = std::time::Instant::now() + wait;
        loop {
            match q.remove_node(&disk.node) {
                Err(crust_client::qmp::QmpError::Refused { desc, .. })
                    if desc.contains("is in use") && std::time::Instant::now() < until =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => {
                    other?;
                    break;
                }
            }
        }
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

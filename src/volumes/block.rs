//! Block volumes (KEP-565's `volumeMode: Block`): the disk itself, its node
//! bound onto an empty file at `<root>/volumes/<id>` as kubelet's block
//! publish does. Read-only is the kernel's device flag (BLKROSET) for as long
//! as the volume is published, since a read-only mount of a device node does
//! not stop writes to the device. The agent never reads or writes a block
//! volume's contents: no probe, no walk, no filesystem.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use slog::{info, warn, Logger};

use super::error::Error;
use super::kernel::Kernel;
use super::mounts::Mounts;
use super::request::{BindRequest, Expanded, VolumeInfo};
use super::rollback::{Rollback, Undo};
use super::volume::Volume;
use crate::cancel::Cancel;
use crate::device;
use crate::error::Result;
use crate::model::{Device, RecursiveReadOnly};
use crate::mount::bind::BindSpec;
use crate::stats::{self, Condition, Measured};
use crate::sys::beneath::Root;
use crate::sys::blockdev;
use crate::sys::sysfs::Sysfs;

/// Refuses what a bind of a block volume cannot be: a subpath, recursive
/// read-only, or read-only on a read-write volume (BindMount, api.md §2).
pub(crate) fn check_bind(vol: &Volume, req: &BindRequest) -> Result<()> {
    let invalid = |why| Error::BlockBindInvalid {
        id: vol.id().to_string(),
        why,
    };
    if !req.subpath.as_os_str().is_empty() {
        return Err(invalid(
            "a subpath needs a filesystem; bind the whole device (an empty subpath)",
        )
        .into());
    }
    if req.recursive_read_only != RecursiveReadOnly::Disabled {
        return Err(invalid(
            "recursive read-only applies to a tree of mounts, and a device is none; use DISABLED",
        )
        .into());
    }
    if req.idmap.is_some() {
        return Err(Error::BlockBindIdmapped {
            id: vol.id().to_string(),
        }
        .into());
    }
    if req.read_only && !vol.spec.options.read_only_flag() {
        return Err(Error::BlockBindReadOnly {
            id: vol.id().to_string(),
        }
        .into());
    }
    Ok(())
}

/// ListVolumes' live facts of a volume: the device's size, and for a block
/// volume whether the kernel refuses writes to it (BLKROGET). Left as they
/// are when the device cannot be opened (gone, or another disk now).
pub(crate) fn refresh<K: Kernel>(info: &mut VolumeInfo, dev: &Device, kernel: &K) {
    let Ok(f) = kernel.open_disk(dev) else {
        return;
    };
    if let Ok(bytes) = kernel.size(&f, dev) {
        info.device_bytes = bytes;
    }
    if info.block {
        if let Ok(ro) = kernel.read_only(&f, dev) {
            info.read_only = ro;
        }
    }
}

/// A block volume's prepare step, what its attach step takes: the
/// device's node (O_PATH), the device opened, and whether the agent is to
/// set it read-only (only a flag the agent set is the agent's to clear: a
/// disk the host attached read-only stays read-only).
pub(crate) struct Opened<D> {
    node: OwnedFd,
    dev: D,
    /// The agent sets the device's read-only flag (and clears it at Unpublish).
    pub(crate) ro_set: bool,
}

/// A block volume's prepare step: the device opened and its read-only flag
/// read (publish.rs has the steps). Nothing here reads or writes the disk.
pub(crate) fn prepare<K: Kernel>(
    device: &Device,
    read_only: bool,
    kernel: &K,
) -> Result<Opened<K::Disk>> {
    let node = kernel.open_node(device)?;
    let dev = kernel.open_disk(device)?;
    let ro_set = read_only && !kernel.read_only(&dev, device)?;
    Ok(Opened { node, dev, ro_set })
}

/// A block volume's attach step (publish.rs has the steps): the device
/// set read-only if asked and not already (its undo pushed), then its node
/// bound onto `file`, the guest path, through their fds.
pub(crate) fn attach<K: Kernel>(
    opened: Opened<K::Disk>,
    vol: &Volume,
    file: OwnedFd,
    mounts: Mounts<'_, K>,
    undo: &mut Rollback<'_, K>,
) -> Result<()> {
    if opened.ro_set {
        mounts
            .kernel
            .set_read_only(&opened.dev, &vol.device, true)?;
        undo.push(Undo::ReadOnly(opened.dev));
    }
    let bound = mounts.kernel.bind_node(
        &BindSpec {
            source_root: opened.node.as_fd(),
            source_path: &vol.device.path,
            subpath: Path::new(""),
            target_base: mounts.root.fd(),
            target_rel: &vol.rel(),
            target_path: &vol.guest_path,
            read_only: vol.spec.options.read_only_flag(),
            recursive_read_only: RecursiveReadOnly::Disabled,
            idmap: None,
        },
        &file,
    );
    drop(file);
    drop(opened.node);
    bound?;
    Ok(())
}

/// What a block volume's disk needs once its binds and its guest path's
/// bind are down: a flush, and its read-only flag cleared if the agent set
/// it. A disk already unplugged has nothing left to flush or clear.
pub(crate) fn release<K: Kernel>(vol: &Volume, kernel: &K, log: &Logger) -> Result<()> {
    match kernel.open_disk(&vol.device) {
        Ok(f) => {
            kernel.flush(&f, &vol.device)?;
            if vol.ro_set() {
                kernel.set_read_only(&f, &vol.device, false)?;
            }
        }
        Err(e @ (blockdev::Error::Gone { .. } | blockdev::Error::Replaced { .. })) => {
            warn!(log, "block volume's disk is gone: nothing to flush or make writable again";
                  "volume" => vol.id(), "error" => %e);
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// GetVolumeStats of a block volume: the device's size, and its condition.
pub(crate) fn stats(vol: &Volume, root: &Root, sysfs: &Sysfs) -> (Option<Measured>, Condition) {
    let rel = vol.rel();
    let (bytes, condition) = stats::check_block(
        sysfs,
        &stats::BlockExpected {
            volume: stats::judge::BlockVolume {
                path: &vol.guest_path,
                mount_id: vol.phase.mount_id(),
                device: &vol.device,
                read_only: vol.spec.options.read_only_flag(),
            },
            base: root.fd(),
            rel: &rel,
        },
    );
    (
        bytes.map(|device_bytes| Measured::Block { device_bytes }),
        condition,
    )
}

/// ExpandVolume of a block volume: no filesystem to grow, so it waits for
/// the guest to see a device of at least `required_bytes` (0: as it is)
/// and answers its size.
pub(crate) fn expand<K: Kernel>(
    vol: &Volume,
    kernel: &K,
    sysfs: &Sysfs,
    log: &Logger,
    required_bytes: u64,
    timeout: Duration,
    cancel: &Cancel,
) -> Result<Expanded> {
    let f = kernel.open_disk(&vol.device)?;
    let now = kernel.size(&f, &vol.device)?;
    let bytes = if required_bytes <= now {
        now
    } else {
        device::wait_for_size(sysfs, &vol.device, required_bytes, timeout, cancel)?
    };
    if bytes != now {
        info!(log, "block volume grew"; "volume" => vol.id(), "from" => now, "to" => bytes);
    }
    Ok(Expanded {
        capacity_bytes: bytes,
        device_bytes: bytes,
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::code::Code;
    use crate::volumes::volume::tests::block_sample;

    fn bind(subpath: &str, read_only: bool, rro: RecursiveReadOnly) -> BindRequest {
        BindRequest {
            volume_id: "blk-1".into(),
            subpath: PathBuf::from(subpath),
            target: "/r/pods/p/dev".into(),
            read_only,
            recursive_read_only: rro,
            idmap: None,
        }
    }

    #[test]
    fn binds_of_a_block_volume_take_no_subpath_rro_or_per_bind_read_only() {
        let mut ro = block_sample();
        ro.binds.clear();
        let mut rw = ro.clone();
        rw.spec.options = crate::volumes::request::Options::parse(Vec::new(), false).unwrap();
        let code = |v: &Volume, b: &BindRequest| check_bind(v, b).map_err(|e| e.code());
        let plain = bind("", false, RecursiveReadOnly::Disabled);
        let read_only = bind("", true, RecursiveReadOnly::Disabled);
        assert_eq!(code(&rw, &plain), Ok(()));
        assert_eq!(
            code(&ro, &plain),
            Ok(()),
            "a read-only volume's binds are read-only anyway"
        );
        assert_eq!(code(&ro, &read_only), Ok(()));
        assert_eq!(code(&rw, &read_only), Err(Code::FailedPrecondition));
        for v in [&ro, &rw] {
            assert_eq!(
                code(v, &bind("data", false, RecursiveReadOnly::Disabled)),
                Err(Code::InvalidArgument)
            );
            assert_eq!(
                code(v, &bind("", true, RecursiveReadOnly::IfPossible)),
                Err(Code::InvalidArgument)
            );
            assert_eq!(
                code(v, &bind("", true, RecursiveReadOnly::Enabled)),
                Err(Code::InvalidArgument)
            );
        }
        let msg = check_bind(&rw, &read_only).unwrap_err().to_string();
        assert!(msg.contains("publish the volume read-only"), "{msg}");
    }
}

//! What QEMU's refusal of a command means, decided here once from its error
//! `class` and `desc`, so that no caller reads QEMU's words to choose what
//! to do next. QEMU's texts are its source's (`blockdev.c`,
//! `qdev-monitor.c`); each has a test below.

/// A refusal that a caller acts on, or [`Refusal::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// blockdev-del of a node something still uses (`Node N is in use`,
    /// `Block device N is in use`): the device that had it lets go a
    /// moment after it leaves QEMU's list (its finalization is deferred),
    /// so asking again is the way.
    NodeInUse,
    /// device_del of a device already on its way out (`Device D is already
    /// in the process of unplug`): an earlier device_del, before a restart
    /// perhaps, is still waiting for the guest.
    UnplugPending,
    /// Anything else: QEMU's words say what.
    Other,
}

/// QEMU's class for the errors of the commands here: it says nothing more
/// precise for these.
const GENERIC: &str = "GenericError";

impl Refusal {
    /// What QEMU's error `class` with description `desc` means.
    pub fn of(class: &str, desc: &str) -> Refusal {
        if class != GENERIC {
            return Refusal::Other;
        }
        let in_use = desc.ends_with(" is in use")
            && (desc.starts_with("Node ") || desc.starts_with("Block device "));
        if in_use {
            Refusal::NodeInUse
        } else if desc.starts_with("Device ")
            && desc.ends_with(" is already in the process of unplug")
        {
            Refusal::UnplugPending
        } else {
            Refusal::Other
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// blockdev.c, `qmp_blockdev_del`: a node a BlockBackend still has.
    #[test]
    fn a_node_a_device_still_has_is_in_use() {
        assert_eq!(
            Refusal::of("GenericError", "Node crustd-00ff is in use"),
            Refusal::NodeInUse
        );
    }

    /// blockdev.c, `qmp_blockdev_del`: a node with another reference.
    #[test]
    fn a_block_device_referenced_elsewhere_is_in_use() {
        assert_eq!(
            Refusal::of("GenericError", "Block device crustd-00ff is in use"),
            Refusal::NodeInUse
        );
    }

    /// qdev-monitor.c, `qmp_device_del`: a second device_del before the guest answered the first.
    #[test]
    fn a_device_leaving_already_is_pending() {
        assert_eq!(
            Refusal::of(
                "GenericError",
                "Device crustd-dev-00ff is already in the process of unplug"
            ),
            Refusal::UnplugPending
        );
    }

    /// What the callers must not act on: a node that is not there, a device
    /// QEMU lacks, a busy node (a block job), a bus without hot-plug, and
    /// the same words under another class.
    #[test]
    fn anything_else_is_other() {
        for (class, desc) in [
            (
                "GenericError",
                "Failed to find node with node-name='crustd-00ff'",
            ),
            ("DeviceNotFound", "Device 'crustd-dev-00ff' not found"),
            (
                "GenericError",
                "Node 'crustd-00ff' is busy: block device is in use by block job: stream",
            ),
            ("GenericError", "Bus 'pci.0' does not support hotplugging"),
            (
                "CommandNotFound",
                "The command blockdev-del has not been found",
            ),
            ("DeviceNotFound", "Node crustd-00ff is in use"),
        ] {
            assert_eq!(Refusal::of(class, desc), Refusal::Other, "{class}: {desc}");
        }
    }
}

//! The leaves that talk to the kernel: each syscall and ioctl the layers
//! above share is wrapped once here, with its `// SAFETY:` note where it
//! needs one, and its failure is a [`error::SysError`] (or, for a block
//! device, the node's own refusals). Nothing here knows a request or a
//! volume.
//!
//! - `error`: SysError, INTERNAL with the call, the object and the errno;
//! - `beneath`: paths resolved beneath a root fd, mounts told by statx;
//! - `mountinfo`: /proc/self/mountinfo, as bytes;
//! - `sysfs`: every read of /sys, through one seam tests can point elsewhere;
//! - `uevents`: the kernel's hot-plug events;
//! - `blockdev`: a block device's node, size, read-only flag and flush;
//! - `features`: what this kernel and process can do, probed once;
//! - `dm`: device-mapper's ioctls on /dev/mapper/control, typed, and the
//!   `crypt` target line;
//! - `dm_integrity`: the dm-integrity superblock, line and status under a
//!   dm-crypt mapping with integrity;
//! - `kmsg`: the kernel's log records, read without waiting;
//! - `keyring`: logon keys in the kernel keyring, which dm-crypt reads and
//!   user space cannot;
//! - `children`: the children the agent waits for itself (mkfs, and the
//!   clone `userns` makes), which the reaper of every other child leaves alone;
//! - `userns`: user namespaces made to idmap a bind, with no process left.

pub mod beneath;
pub mod blockdev;
pub mod children;
pub mod dm;
pub mod dm_integrity;
pub mod error;
pub mod features;
pub mod keyring;
pub mod kmsg;
pub mod mountinfo;
pub mod sysfs;
pub mod uevents;
pub mod userns;

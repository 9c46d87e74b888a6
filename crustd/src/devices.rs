//! The one owner of whether a host device is free: the node-wide table of
//! devices crustd has claimed for a volume, where each one's bytes lie, and
//! crustd's exclusive (O_EXCL) hold on it. A device enters the table by
//! [`Devices::claim`] (a new volume) or [`Devices::adopt`] (a recorded one,
//! found again by number), and leaves it only by [`Devices::release`],
//! which first makes sure that no process but crustd still has it open: a
//! VM whose sandbox.json or monitor went missing may still be writing it,
//! and freeing it then could put one disk in two VMs, or under a host
//! mount. No other code closes a hold or forgets a claim.
//!
//! "One disk, one volume" is decided here, in memory, so the lock is held
//! only for a lookup and an insert: never across a file read, a QMP session
//! or an agent call.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crust_protocols::sync::LockExt;

use crate::hostdev::{self, Extent, Hold, HostDevice, Named};

crust_protocols::coded_errors! {
/// Why a device was not claimed, or not freed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Another volume has bytes of it.
    #[code(FailedPrecondition)]
    #[error("{0}")]
    Conflict(Box<Clash>),
    /// The host uses it, the kernel refused the hold, or sysfs could not place it.
    #[code(inner)]
    #[error(transparent)]
    Device(#[from] hostdev::Error),
    /// A process other than crustd has it open: `why` is why crustd
    /// thought it free ("its VM is gone"), each opener in words.
    #[code(FailedPrecondition)]
    #[error("{why}, yet {} still has host device {host_volume} ({rdev}) open: crustd does not free a device a process may still write; stop that process (or restore the VM's sandbox.json and QMP socket) and unpublish again", .openers.join(", "))]
    StillOpen {
        why: String,
        openers: Vec<String>,
        host_volume: String,
        rdev: String,
    },
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// One volume: (sandbox id, host_volume_id).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub sandbox: String,
    pub host_volume: String,
}

impl Key {
    pub fn new(sandbox: &str, host_volume: &str) -> Key {
        Key {
            sandbox: sandbox.to_string(),
            host_volume: host_volume.to_string(),
        }
    }
}

/// One claimed device.
#[derive(Debug)]
struct Claim {
    /// The device node, for messages.
    device: PathBuf,
    /// `MAJOR:MINOR`: whom [`Devices::release`] asks the processes about.
    rdev: String,
    /// Where its bytes lie; `None` when it was not found at a restart (it
    /// can then conflict with nothing).
    extent: Option<Extent>,
    /// crustd's O_EXCL hold; `None` while being taken, or when the kernel
    /// refused it at a restart (tried again at the next adopt).
    hold: Option<Hold>,
}

/// Who already has bytes of a device asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The volume that has them.
    pub holder: Key,
    pub device: PathBuf,
    /// The two extents are equal: the same device, not just shared bytes.
    pub same: bool,
}

impl Conflict {
    /// The refusal of `key` (device `device`) because of this conflict.
    pub fn refuse(&self, key: &Key, device: &Path) -> Error {
        Error::Conflict(Box::new(Clash {
            key: key.clone(),
            device: device.to_path_buf(),
            with: self.clone(),
        }))
    }
}

/// A volume refused because another has bytes of its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clash {
    /// The volume refused, and its device node.
    pub key: Key,
    pub device: PathBuf,
    /// Who has the bytes.
    pub with: Conflict,
}

impl fmt::Display for Clash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = if self.with.same {
            "is the same device as"
        } else {
            "shares sectors with"
        };
        let holder = &self.with.holder;
        write!(
            f,
            "host device {} {how} {}, already published in sandbox {}: one device, one volume",
            Named::new(&self.key.host_volume, &self.device),
            Named::new(&holder.host_volume, &self.with.device),
            holder.sandbox
        )?;
        if holder.sandbox != self.key.sandbox {
            f.write_str("; unpublish it there first")?;
        }
        Ok(())
    }
}

/// Why a claim was not made.
#[derive(Debug)]
pub enum Refusal {
    /// Another volume has bytes of the device.
    Conflict(Conflict),
    /// The host uses it, the kernel refused the hold, or sysfs could not place it.
    Other(hostdev::Error),
}

impl Refusal {
    /// The refusal of `key` (device `device`) as its error.
    pub fn error(self, key: &Key, device: &Path) -> Error {
        match self {
            Refusal::Conflict(c) => c.refuse(key, device),
            Refusal::Other(e) => e.into(),
        }
    }
}

/// How long [`Devices::release`] looks again at a device that some process
/// has open, for openers that only probe (udev's blkid after QEMU closed
/// the device, a `losetup` of another test) to let go.
const SETTLE: Duration = Duration::from_millis(1500);

/// The table; see the module doc.
#[derive(Debug, Default)]
pub struct Devices {
    table: Mutex<HashMap<Key, Claim>>,
}

impl Devices {
    /// Whether `key` has a claim, and whether that claim holds its device.
    pub fn held(&self, key: &Key) -> Option<bool> {
        self.table.locked().get(key).map(|c| c.hold.is_some())
    }

    /// Claims `dev` for the new volume `key`: refused when another volume,
    /// in any sandbox, has a byte of it ([`Refusal::Conflict`]), when the
    /// host uses it, or when the kernel refuses crustd's exclusive hold.
    /// On success the claim holds the device; on failure nothing of it is
    /// left. A claim already there for `key` is kept as it is.
    pub fn claim(&self, key: &Key, dev: &HostDevice) -> Result<(), Refusal> {
        if self.held(key) == Some(true) {
            return Ok(());
        }
        let extent = dev.extent().map_err(Refusal::Other)?;
        let fresh = self.reserve(key, &dev.path, &dev.rdev, Some(extent))?;
        // Outside the lock: sysfs, the mount table, the O_EXCL open.
        match dev.check_unused().and_then(|()| dev.hold()) {
            Ok(h) => {
                self.set_hold(key, h);
                Ok(())
            }
            Err(e) => {
                if fresh {
                    // Never held, never plugged: only the reservation to take back.
                    self.table.locked().remove(key);
                }
                Err(Refusal::Other(e))
            }
        }
    }

    /// Claims again the device of a recorded volume, found by its number
    /// `rdev` (at a restart, or for a record the table lacks), and takes its
    /// hold if the claim lacks one. A device that is gone is still claimed
    /// for `key` (it conflicts with nothing) and its error answered, as is
    /// a hold the kernel refuses (tried again next time).
    pub fn adopt(&self, key: &Key, rdev: &str) -> Result<(), Refusal> {
        if self.held(key) == Some(true) {
            return Ok(());
        }
        let dev = match hostdev::open_recorded(rdev) {
            Ok(d) => d,
            Err(e) => {
                let _ = self.reserve(key, Path::new(rdev), rdev, None);
                return Err(Refusal::Other(e));
            }
        };
        let extent = dev.extent().ok();
        self.reserve(key, &dev.path, rdev, extent)?;
        let h = dev.hold().map_err(Refusal::Other)?;
        self.set_hold(key, h);
        Ok(())
    }

    /// Reserves `extent` for `key` unless another claim has a byte of it.
    /// Answers whether the claim is new.
    fn reserve(
        &self,
        key: &Key,
        device: &Path,
        rdev: &str,
        extent: Option<Extent>,
    ) -> Result<bool, Refusal> {
        let mut t = self.table.locked();
        if let Some(e) = &extent {
            let hit = t
                .iter()
                .find(|(k, c)| *k != key && c.extent.as_ref().is_some_and(|o| o.overlaps(e)));
            if let Some((holder, c)) = hit {
                return Err(Refusal::Conflict(Conflict {
                    holder: holder.clone(),
                    device: c.device.clone(),
                    same: c.extent.as_ref() == Some(e),
                }));
            }
        }
        if let Some(c) = t.get_mut(key) {
            if c.extent.is_none() {
                c.extent = extent;
                c.device = device.to_path_buf();
            }
            return Ok(false);
        }
        t.insert(
            key.clone(),
            Claim {
                device: device.to_path_buf(),
                rdev: rdev.to_string(),
                extent,
                hold: None,
            },
        );
        Ok(true)
    }

    /// Gives `key`'s claim its hold (dropped, outside the lock, when the
    /// claim went meanwhile).
    fn set_hold(&self, key: &Key, hold: Hold) {
        let left = match self.table.locked().get_mut(key) {
            Some(c) => {
                c.hold = Some(hold);
                None
            }
            None => Some(hold),
        };
        drop(left);
    }

    /// The one way a device is freed: releases `key`'s claim and its hold,
    /// unless a process other than crustd has the device open, which is
    /// FAILED_PRECONDITION naming the processes, the claim kept. `why` says
    /// why crustd thinks the device is free ("its VM is gone"), for that
    /// message. No claim: nothing to do. Looks again for up to a second and
    /// a half (an opener that only probes lets go), never past `until`.
    pub fn release(&self, key: &Key, why: &str, until: Option<Instant>) -> Result<()> {
        let Some(rdev) = self.table.locked().get(key).map(|c| c.rdev.clone()) else {
            return Ok(());
        };
        let settle = Instant::now() + SETTLE;
        let stop = until.map_or(settle, |u| u.min(settle));
        let openers = loop {
            let o = hostdev::openers(&rdev);
            if o.is_empty() || Instant::now() >= stop {
                break o;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if !openers.is_empty() {
            return Err(Error::StillOpen {
                why: why.to_string(),
                openers,
                host_volume: key.host_volume.clone(),
                rdev,
            });
        }
        // The hold is closed after the lock is let go (the last close of a
        // block device flushes it).
        let gone = self.table.locked().remove(key);
        drop(gone);
        Ok(())
    }

    /// The volumes claimed in `sandbox`.
    pub fn of_sandbox(&self, sandbox: &str) -> Vec<Key> {
        self.table
            .locked()
            .keys()
            .filter(|k| k.sandbox == sandbox)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostdev::Backing;
    use crust_protocols::code::Code;
    use crust_testkit::{disks, needs};

    fn ext(disk: u32, start: u64, end: Option<u64>) -> Option<Extent> {
        Some(Extent {
            backing: Backing::Disk {
                major: 7,
                minor: disk,
            },
            start,
            end,
        })
    }

    fn key(s: &str, v: &str) -> Key {
        Key::new(s, v)
    }

    fn reserve(d: &Devices, k: &Key, e: Option<Extent>) -> std::result::Result<bool, Conflict> {
        d.reserve(k, Path::new(&k.host_volume), "0:0", e)
            .map_err(|r| match r {
                Refusal::Conflict(c) => c,
                Refusal::Other(e) => panic!("{e}"),
            })
    }

    #[test]
    fn overlapping_bytes_conflict_in_both_orders_and_across_sandboxes() {
        let whole = || ext(0, 0, None);
        let p1 = || ext(0, 1 << 20, Some(33 << 20));
        let p2 = || ext(0, 33 << 20, Some(64 << 20));
        let overlapping = || ext(0, 32 << 20, Some(40 << 20));
        for (first, second) in [(whole(), p1()), (p1(), whole()), (p1(), overlapping())] {
            for other_sandbox in [false, true] {
                let d = Devices::default();
                reserve(&d, &key("a", "/x"), first.clone()).unwrap();
                let sb = if other_sandbox { "b" } else { "a" };
                let e = reserve(&d, &key(sb, "/y"), second.clone()).unwrap_err();
                assert_eq!(e.holder, key("a", "/x"));
                assert!(!e.same);
                assert!(
                    d.held(&key(sb, "/y")).is_none(),
                    "nothing left by a refusal"
                );
            }
        }
        // Partitions side by side, and another disk: no conflict.
        let d = Devices::default();
        assert!(reserve(&d, &key("a", "/p1"), p1()).unwrap());
        reserve(&d, &key("b", "/p2"), p2()).unwrap();
        reserve(&d, &key("b", "/other"), ext(1, 0, None)).unwrap();
        // The same device under two names.
        let e = reserve(&d, &key("b", "/link"), p1()).unwrap_err();
        assert!(e.same);
        assert!(e
            .refuse(&key("b", "/link"), Path::new("/dev/loop0p1"))
            .to_string()
            .contains("unpublish it there first"));
        // The same key again keeps its claim; a device not found conflicts with nothing.
        assert!(!reserve(&d, &key("a", "/p1"), p1()).unwrap());
        reserve(&d, &key("c", "/gone"), None).unwrap();
        assert_eq!(d.of_sandbox("b").len(), 2);
        // Released (nothing opens device 0:0): the bytes are free again.
        for k in d.of_sandbox("b") {
            d.release(&k, "test", None).unwrap();
        }
        reserve(&d, &key("d", "/p2"), p2()).unwrap();
        d.release(&key("a", "/p1"), "test", None).unwrap();
        reserve(&d, &key("d", "/whole"), whole()).unwrap_err();
        d.release(&key("d", "/p2"), "test", None).unwrap();
        reserve(&d, &key("d", "/whole"), whole()).unwrap();
    }

    /// A claim whose device a process still has open
    /// (a VM that lost its sandbox.json) is never released, by any path.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_device_a_process_has_open_is_never_released() {
        needs::loop_devices();
        let disk = disks::LoopDisk::new(16, None);
        let d = Devices::default();
        let k = key("pod-a", &disk.path());
        let dev = hostdev::resolve(&disk.path()).unwrap();
        d.claim(&k, &dev).unwrap();
        assert_eq!(d.held(&k), Some(true));
        // Another process opens it read-write, as QEMU does.
        let mut vm = std::process::Command::new("sh")
            .args(["-c", "exec 3<>\"$0\"; exec sleep 30", &disk.path()])
            .spawn()
            .unwrap();
        let t = Instant::now();
        while hostdev::openers(&dev.rdev).is_empty() {
            assert!(t.elapsed() < Duration::from_secs(5), "sh did not open it");
            std::thread::sleep(Duration::from_millis(20));
        }
        let e = d.release(&k, "its VM looks gone", None).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.to_string().contains(&format!("process {}", vm.id())),
            "{e}"
        );
        assert_eq!(d.held(&k), Some(true), "the claim and its hold stay");
        // Held: the host cannot take it for itself.
        assert!(dev.hold().is_err());
        vm.kill().unwrap();
        vm.wait().unwrap();
        d.release(&k, "its VM looks gone", None).unwrap();
        assert_eq!(d.held(&k), None);
        drop(dev.hold().unwrap());
    }
}

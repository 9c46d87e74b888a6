//! What the agent reports about itself and the kernel it runs on: the
//! capabilities of the contract this kernel allows (from the probes of
//! `sys::features`), the filesystems the kernel knows, the boot timeline,
//! memory use; and the gate requests wait at while modules still load.

use std::path::Path;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::sync::{CondvarExt, LockExt};

use crate::cancel::Cancel;
use crate::model::FsType;
use crate::sys::error::SysError;
use crate::sys::features::{features, has_sys_resource};

/// Milliseconds since the kernel started (CLOCK_BOOTTIME).
pub fn boottime_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

/// The capabilities of the wire contract, by their numbers in crust.proto.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capability {
    /// fsGroup with policy Always.
    FsGroupAlways,
    /// fsGroup with policy OnRootMismatch.
    FsGroupOnRootMismatch,
    Subpath,
    /// GetVolumeStats usage.
    VolumeStats,
    /// ExpandVolume.
    VolumeResize,
    /// GetVolumeStats condition.
    VolumeCondition,
    /// Recursive read-only binds.
    RecursiveReadOnly,
    /// Block volumes (volume_mode BLOCK).
    BlockVolume,
    /// FreezeVolumes and ThawVolumes.
    Freeze,
    Trim,
    VolumeHealth,
    /// Encrypted (LUKS2) volumes.
    EncryptionLuks2,
    /// Binds with uid and gid mappings (KEP-127).
    IdmappedBinds,
    /// A publish's trim_interval_s: the agent trims on a schedule.
    ScheduledTrim,
}

/// Whether this kernel has dm-crypt: loaded (or built in), or shipped as a
/// module that the agent's module loader loads at boot, maybe still loading.
pub fn has_dm_crypt() -> bool {
    if Path::new("/sys/module/dm_crypt").exists() {
        return true;
    }
    let dir = Path::new("/lib/modules")
        .join(kernel_release())
        .join("kernel/drivers/md");
    [
        "dm-crypt.ko",
        "dm-crypt.ko.xz",
        "dm-crypt.ko.zst",
        "dm-crypt.ko.gz",
    ]
    .iter()
    .any(|f| dir.join(f).exists())
}

/// What the agent can do here: subpaths need openat2, RRO needs
/// mount_setattr, and resize is offered only when every supported
/// filesystem can grow (ext4 needs CAP_SYS_RESOURCE; xfs grows without it).
pub fn capabilities() -> Vec<Capability> {
    let f = features();
    // Room for every capability there is (13): the pushes never reallocate.
    let mut caps = Vec::with_capacity(13);
    caps.extend([Capability::FsGroupAlways, Capability::FsGroupOnRootMismatch]);
    if f.openat2 {
        caps.push(Capability::Subpath);
    }
    caps.push(Capability::VolumeStats);
    if has_sys_resource() {
        caps.push(Capability::VolumeResize);
    }
    caps.push(Capability::VolumeCondition);
    if f.mount_setattr && f.open_tree {
        caps.push(Capability::RecursiveReadOnly);
    }
    caps.push(Capability::BlockVolume);
    // FIFREEZE/FITHAW (2.6.29) and FITRIM (2.6.37) are in every kernel the
    // agent runs on, for ext4 and xfs alike; whether a disk takes discards
    // is answered per volume (TrimVolume says FAILED_PRECONDITION).
    caps.extend([
        Capability::Freeze,
        Capability::Trim,
        Capability::ScheduledTrim,
        Capability::VolumeHealth,
    ]);
    if has_dm_crypt() {
        caps.push(Capability::EncryptionLuks2);
    }
    if f.idmapped_binds() {
        caps.push(Capability::IdmappedBinds);
    }
    caps
}

/// The filesystems the agent supports that this kernel knows, in /proc/filesystems order.
pub fn supported_filesystems() -> Result<Vec<String>, SysError> {
    let text = std::fs::read_to_string("/proc/filesystems")
        .map_err(|e| SysError::new("read", "/proc/filesystems", e))?;
    Ok(parse_filesystems(&text))
}

fn parse_filesystems(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            match (f.next(), f.next()) {
                (Some(name), None) => Some(name),
                _ => None, // "nodev <name>": not block-backed
            }
        })
        .filter(|n| FsType::parse(n).is_some())
        .map(str::to_string)
        .collect()
}

/// The kernel's release string (uname -r).
pub fn kernel_release() -> String {
    rustix::system::uname()
        .release()
        .to_string_lossy()
        .into_owned()
}

/// Resident memory of this process, from /proc/self/statm.
pub fn rss_bytes() -> Result<u64, SysError> {
    let text = std::fs::read_to_string("/proc/self/statm")
        .map_err(|e| SysError::new("read", "/proc/self/statm", e))?;
    let pages: u64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            SysError::new(
                "parse",
                "/proc/self/statm",
                std::io::Error::from(std::io::ErrorKind::InvalidData),
            )
        })?;
    Ok(pages * rustix::param::page_size() as u64)
}

/// A one-way latch: closed while kernel modules that volume operations need
/// (virtio_blk, xfs) are still loading after the agent began listening.
#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    /// A gate, open or closed.
    pub fn new(open: bool) -> Gate {
        Gate {
            open: Mutex::new(open),
            cv: Condvar::new(),
        }
    }

    /// Opens the gate for good and wakes every waiter.
    pub fn open(&self) {
        *self.open.locked() = true;
        self.cv.notify_all();
    }

    /// Waits until the gate is open, at most `timeout`; true if it is.
    /// Stops early, with the gate still closed, when `cancel` fires.
    pub fn wait(&self, timeout: Duration, cancel: &Cancel) -> bool {
        let end = Instant::now().checked_add(timeout);
        let mut g = self.open.locked();
        while !*g && cancel.why().is_none() {
            let left = end.map_or(timeout, |e| e.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                break;
            }
            g = self.cv.waited_for(g, cancel.slice(left));
        }
        *g
    }
}

/// The boot timeline, in CLOCK_BOOTTIME milliseconds (0: the step did not happen).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// When the agent's main() began.
    pub agent_start_ms: u64,
    /// When the early mounts were done (PID 1 only).
    pub mounts_done_ms: u64,
    /// When the kernel modules were loaded (PID 1 only).
    pub modules_loaded_ms: u64,
    /// When the first listener was bound.
    pub listening_ms: u64,
}

/// What GetAgentInfo reports.
#[derive(Clone, Debug)]
pub struct AgentInfo {
    /// The agent's version.
    pub version: &'static str,
    /// uname -r.
    pub kernel_release: String,
    /// Whether the agent runs as PID 1.
    pub init_mode: bool,
    /// Milliseconds since the agent started.
    pub uptime_ms: u64,
    /// Resident memory.
    pub rss_bytes: u64,
    pub boot: Timeline,
}

/// Gathers GetAgentInfo's answer.
pub fn agent_info(started: Instant, boot: Timeline) -> Result<AgentInfo, SysError> {
    Ok(AgentInfo {
        version: env!("CARGO_PKG_VERSION"),
        kernel_release: kernel_release(),
        init_mode: rustix::process::getpid().is_init(),
        uptime_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        rss_bytes: rss_bytes()?,
        boot,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cancel::Cancel;

    #[test]
    fn filesystems_are_filtered() {
        let text = "nodev\tsysfs\nnodev\ttmpfs\n\text3\n\text4\n\txfs\n\tvfat\nnodev\tfuse\n";
        assert_eq!(parse_filesystems(text), vec!["ext4", "xfs"]);
        assert!(parse_filesystems("nodev\text4\n").is_empty());
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn probes_match_this_kernel() {
        // open_tree and move_mount answer EPERM to a caller without
        // CAP_SYS_ADMIN, which the probe reads as absent.
        crust_testkit::needs::root();
        // These hosts run 5.12+ kernels: every feature is present.
        let f = features();
        assert!(f.mount_setattr && f.openat2 && f.open_tree, "{f:?}");
        let caps = capabilities();
        assert!(caps.contains(&Capability::RecursiveReadOnly));
        assert_eq!(caps.contains(&Capability::VolumeResize), has_sys_resource());
        // And user namespaces: idmapped binds.
        assert!(f.user_namespaces && caps.contains(&Capability::IdmappedBinds));
    }

    #[test]
    fn gate_opens_once_for_all_waiters() {
        let g = std::sync::Arc::new(Gate::new(false));
        assert!(!g.wait(Duration::from_millis(10), &Cancel::never()));
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let g = g.clone();
                std::thread::spawn(move || g.wait(Duration::from_secs(10), &Cancel::never()))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        g.open();
        assert!(waiters.into_iter().all(|w| w.join().unwrap()));
        assert!(g.wait(Duration::ZERO, &Cancel::never()));
        assert!(Gate::new(true).wait(Duration::ZERO, &Cancel::never()));
    }

    #[test]
    fn boottime_advances() {
        let a = boottime_ms();
        std::thread::sleep(Duration::from_millis(20));
        let b = boottime_ms();
        assert!(a > 0 && b >= a + 20, "{a} {b}");
    }

    #[test]
    fn info_reads_the_process() {
        let i = agent_info(Instant::now(), Timeline::default()).unwrap();
        assert!(i.rss_bytes > 0);
        assert!(!i.kernel_release.is_empty());
        assert!(!i.init_mode);
        assert!(boottime_ms() > 0);
    }
}

//! crustd's own record of each sandbox, `DIR/<sandbox>/crustd.json`:
//! host_volume_id → what was plugged for it and how far the call got. It is
//! rewritten whole and atomically (temporary file, fsync, rename, fsync of
//! the directory), before and after every QMP step, so a crustd killed at any
//! point finds the truth on restart: a record in `plugging` or `unplugging`
//! may or may not be in QEMU, and the next call asks QEMU before acting.
//!
//! The sandbox's directory is writable by whoever starts VMs, so the file is
//! reached only through the directory's fd, read only as a regular file of
//! bounded size, and written through an exclusively created temporary
//! (`files`).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::files::{self, ReadError};

crust_protocols::coded_errors! {
/// Why a sandbox's state was not read or not written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(Internal)]
    #[error("cannot read {}: {source}", .path.display())]
    Read { path: PathBuf, source: Arc<io::Error> },
    /// Not a regular file crustd may read.
    #[code(FailedPrecondition)]
    #[error("crustd's state {} is unreadable: {why}; crustd writes a regular file there: compare it with QEMU (query-block) and fix or remove it", .path.display())]
    Unreadable { path: PathBuf, why: ReadError },
    #[code(FailedPrecondition)]
    #[error("crustd's state {} is corrupt ({source}): compare it with QEMU (query-block) and fix or remove it", .path.display())]
    Corrupt { path: PathBuf, source: Arc<serde_json::Error> },
    #[code(Internal)]
    #[error("cannot encode crustd state: {0}")]
    Encode(Arc<serde_json::Error>),
    /// What [`load`] would refuse to read back.
    #[code(ResourceExhausted)]
    #[error("crustd's state {} would grow to {bytes} bytes, more than the {MAX_STATE_FILE} it reads back: the change was not made", .path.display())]
    TooLarge { path: PathBuf, bytes: usize },
    #[code(Internal)]
    #[error("cannot write {}: {source}", .path.display())]
    Write { path: PathBuf, source: Arc<io::Error> },
}
}

type Result<T> = std::result::Result<T, Error>;

/// The state file's name inside a sandbox's directory.
pub const STATE_FILE: &str = "crustd.json";
/// The largest state file read: some thousands of volumes' records.
pub const MAX_STATE_FILE: u64 = 4 << 20;
/// The most volumes one sandbox may have recorded (far beyond the PCI slots
/// a VM has for disks). With every field bounded where it comes in (a path
/// at most PATH_MAX, names of fixed length), the file stays well under
/// [`MAX_STATE_FILE`].
pub const MAX_VOLUMES: usize = 256;

/// How far a volume got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Written before blockdev-add: QEMU may hold the node and the device, or not.
    Plugging,
    /// The disk is in QEMU; the agent has not (yet) published it.
    Plugged,
    /// The agent mounted it, but its fsGroup walk outlived the caller's
    /// deadline and goes on in the guest: kubelet was told DEADLINE_EXCEEDED
    /// and retries. The disk stays plugged; a retry joins the walk (and
    /// records `published` when it answers OK); Unpublish takes it out.
    Publishing,
    /// The agent published it: kubelet was told the guest path.
    Published,
    /// Written before the agent's unpublish and device_del: on its way out.
    Unplugging,
}

/// One host volume in one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    /// The agent's volume id.
    pub volume_id: String,
    /// The virtio-blk serial the guest finds the disk by.
    pub serial: String,
    /// QEMU's block node name.
    pub node: String,
    /// QEMU's device id.
    pub device: String,
    /// The host block device as `MAJOR:MINOR` (one device, one sandbox).
    pub rdev: String,
    /// Where kubelet would have mounted it on the host (recorded only).
    pub host_target_path: String,
    /// Where the agent mounted it in the guest ("" until published).
    pub guest_path: String,
    /// "ext4" or "xfs" ("" for a block volume).
    pub file_system: String,
    /// Attached and mounted read-only.
    pub read_only: bool,
    /// volumeMode: Block.
    pub block: bool,
    /// How far the last call got.
    pub phase: Phase,
    /// The volume path of the direct-volume record it was published from
    /// (its sandbox-id file is removed at unpublish); none for a plain publish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct: Option<String>,
    /// The bytes the host device could give back when it was published
    /// (`HostDevice::capacity`): it must never hold fewer. None in records
    /// of older crustds (then the first size crustd sees is the mark).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_bytes: Option<u64>,
}

/// Everything crustd knows about one sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// By host_volume_id as kubelet sent it.
    pub volumes: BTreeMap<String, Volume>,
}

/// `DIR/<sandbox>/crustd.json`.
pub fn path(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join(STATE_FILE)
}

/// Reads a sandbox's state from its directory `dir` (shown as
/// `sandbox_dir`); none yet is empty. A file that does not parse, or is not
/// a regular file of at most [`MAX_STATE_FILE`] bytes, is refused rather
/// than ignored (ignoring it could forget a plugged disk).
pub fn load(dir: BorrowedFd<'_>, sandbox_dir: &Path) -> Result<State> {
    let path = path(sandbox_dir);
    let text = match files::read_bounded(dir, STATE_FILE, MAX_STATE_FILE) {
        Ok(t) => t,
        Err(ReadError::Missing) => return Ok(State::default()),
        Err(ReadError::Io(source)) => return Err(Error::Read { path, source }),
        Err(why) => return Err(Error::Unreadable { path, why }),
    };
    serde_json::from_slice(&text).map_err(|e| Error::Corrupt {
        path,
        source: Arc::new(e),
    })
}

/// Writes a sandbox's state atomically and durably into its directory `dir`.
/// A state [`load`] would refuse to read back (larger than
/// [`MAX_STATE_FILE`]) is never written: RESOURCE_EXHAUSTED, and the file
/// stays as it was.
pub fn save(dir: BorrowedFd<'_>, sandbox_dir: &Path, state: &State) -> Result<()> {
    let path = path(sandbox_dir);
    let text = serde_json::to_vec_pretty(state).map_err(|e| Error::Encode(Arc::new(e)))?;
    if u64::try_from(text.len()).map_or(true, |n| n > MAX_STATE_FILE) {
        return Err(Error::TooLarge {
            path,
            bytes: text.len(),
        });
    }
    files::write_atomic(dir, STATE_FILE, &text).map_err(|e| Error::Write {
        path,
        source: Arc::new(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::code::Code;

    fn vol(phase: Phase) -> Volume {
        Volume {
            volume_id: "crustd-00".into(),
            serial: "cr-00".into(),
            node: "crustd-00".into(),
            device: "crustd-dev-00".into(),
            rdev: "7:3".into(),
            host_target_path: "/var/lib/kubelet/x".into(),
            guest_path: String::new(),
            file_system: "ext4".into(),
            read_only: false,
            block: false,
            phase,
            direct: None,
            host_bytes: None,
        }
    }

    use std::fs;
    use std::os::fd::AsFd;

    fn load(p: &Path) -> Result<State> {
        super::load(files::open_dir(p).unwrap().as_fd(), p)
    }

    fn save(p: &Path, s: &State) -> Result<()> {
        super::save(files::open_dir(p).unwrap().as_fd(), p, s)
    }

    #[test]
    fn round_trip_and_no_leftovers() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(load(t.path()).unwrap(), State::default());
        let mut s = State::default();
        s.volumes.insert("/dev/loop3".into(), vol(Phase::Plugging));
        save(t.path(), &s).unwrap();
        assert_eq!(load(t.path()).unwrap(), s);
        s.volumes.get_mut("/dev/loop3").unwrap().phase = Phase::Published;
        save(t.path(), &s).unwrap();
        assert_eq!(load(t.path()).unwrap(), s);
        let names: Vec<_> = fs::read_dir(t.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![STATE_FILE.to_string()]);
        let text = fs::read_to_string(path(t.path())).unwrap();
        assert!(text.contains("\"phase\": \"published\""), "{text}");
    }

    #[test]
    fn corrupt_state_is_refused() {
        let t = tempfile::tempdir().unwrap();
        fs::write(path(t.path()), "{\"volumes\": {\"x\": 1}}").unwrap();
        let e = load(t.path()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("corrupt"), "{e}");
    }

    #[test]
    fn a_fifo_or_a_huge_state_is_refused_at_once() {
        let t = tempfile::tempdir().unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path(t.path()),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = load(t.path()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("a FIFO"), "{e}");
        fs::remove_file(path(t.path())).unwrap();
        fs::File::create(path(t.path()))
            .unwrap()
            .set_len(MAX_STATE_FILE + 1)
            .unwrap();
        let e = load(t.path()).unwrap_err();
        assert!(e.to_string().contains("more than crustd reads"), "{e}");
    }

    #[test]
    fn a_symlink_planted_as_the_old_temporary_is_left_alone() {
        // A temporary named `.crustd.json.tmp.<pid>` made with
        // File::create would follow a symlink planted there and overwrite
        // its target.
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let planted = t
            .path()
            .join(format!(".{STATE_FILE}.tmp.{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        save(t.path(), &State::default()).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert!(fs::symlink_metadata(&planted).unwrap().is_symlink());
        assert_eq!(load(t.path()).unwrap(), State::default());
    }

    #[test]
    fn a_state_too_large_to_read_back_is_never_written() {
        let t = tempfile::tempdir().unwrap();
        let mut s = State::default();
        s.volumes.insert("/dev/loop3".into(), vol(Phase::Published));
        save(t.path(), &s).unwrap();
        let mut huge = vol(Phase::Published);
        huge.guest_path = "\u{1}".repeat(usize::try_from(MAX_STATE_FILE).unwrap());
        s.volumes.insert("/dev/loop4".into(), huge);
        let e = save(t.path(), &s).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        assert_eq!(
            load(t.path()).unwrap().volumes.len(),
            1,
            "the old file stays"
        );
    }

    #[test]
    fn failed_write_leaves_the_old_file() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("f");
        let dir = files::open_dir(t.path()).unwrap();
        files::write_atomic(dir.as_fd(), "f", b"old").unwrap();
        // A directory where the file should go: rename fails, the temp file is removed.
        let d = t.path().join("d");
        fs::create_dir_all(d.join("sub")).unwrap();
        assert!(files::write_atomic(dir.as_fd(), "d", b"new").is_err());
        assert_eq!(fs::read(&p).unwrap(), b"old");
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 2);
    }
}

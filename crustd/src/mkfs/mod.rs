//! createFilesystem: a fresh disk (a CSI ephemeral inline volume, a scratch
//! disk made per pod) arrives blank, and crustd formats it on the host,
//! before the hot-plug, with mkfs.ext4 or mkfs.xfs. The guest still never
//! formats, and the host writes a fresh filesystem rather than parsing an
//! untrusted one.
//!
//! The rule that keeps it from ever destroying data: crustd formats only a
//! device that is provably blank, at every offset where something could
//! start. [`inspect`] refuses, naming what it found and where, on any of:
//!
//! - a signature `blkid -p` knows (low-level probing of superblocks and
//!   partition tables: filesystems, RAID, LVM, LUKS, swap, bcache…) at the
//!   device's start and at each offset in [`PROBE_AT`], where partitions
//!   and filesystems start: 63 sectors (the DOS era's first partition) and
//!   every power of two from 1 MiB to 1 GiB (the alignments of fdisk,
//!   parted, sgdisk and the clouds' images);
//! - a label crustd finds itself ([`labels`], shared with the agent's own
//!   blank rule), wherever one could begin on a 512-byte boundary in the
//!   first [`SCAN`] bytes and in the last MiB:
//!   ext2/3/4 and XFS superblocks, GPT headers (primary and backup), LVM2,
//!   MD RAID (0.90, 1.0, 1.1, 1.2), LUKS 1 and 2 (and LUKS2's secondary
//!   header), bcache, swap, btrfs, DOS partition tables and boot sectors;
//! - any non-zero byte in the first or the last MiB.
//!
//! A device that holds exactly the requested filesystem at its start, and
//! nothing else blkid sees there, is used as it is (a republish never
//! reformats). An xfs under mkfs.xfs's minimum is refused before anything
//! is written or plugged.
//!
//! crustd keeps its exclusive hold on the device from the check to the end
//! of the format: mkfs runs on a loop device bound to the device crustd
//! checked (`loopdev`), so mkfs's own O_EXCL open is of the loop device,
//! and nothing can mount or claim the real one in between. After mkfs the
//! loop device is detached (one that someone else opened meanwhile is an
//! error, and the device is not plugged), the device flushed, and the result
//! read back through crustd's own fd: blkid and crustd's scan must both find
//! the requested filesystem at its start.
//!
//! What is not seen: a filesystem that starts beyond the first 64 MiB at an
//! offset not in [`PROBE_AT`], behind zeros everywhere crustd read, whose
//! label crustd's scan does not know (a format blkid knows but crustd
//! does not, at an odd offset past 64 MiB).

use std::fmt;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crust_protocols::labels::{self, PROBE_AT};

use crate::hostdev::{self, HostDevice, Named};

mod loopdev;

crust_protocols::coded_errors! {
/// Why createFilesystem left a device as it was, or could not say what it holds.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("crustd cannot run {cmd} ({source}): createFilesystem needs util-linux's blkid, e2fsprogs' mkfs.ext4 and xfsprogs' mkfs.xfs on the host")]
    NoTool { cmd: &'static str, source: Arc<io::Error> },
    #[code(Unavailable)]
    #[error("{cmd} did not finish within {timeout:?} and was killed")]
    Killed { cmd: &'static str, timeout: Duration },
    #[code(Internal)]
    #[error("waiting for {cmd}: {source}")]
    Wait { cmd: &'static str, source: Arc<io::Error> },
    /// blkid failed at `offset`: the first line it said.
    #[code(FailedPrecondition)]
    #[error("host device {name} is not provably blank: blkid -p could not tell what it holds at byte {offset} ({said}); crustd formats only a device with no signature at all")]
    Unknowable { name: Named, offset: u64, said: String },
    /// Something where createFilesystem wants nothing.
    #[code(FailedPrecondition)]
    #[error("host device {name} holds {what}{}, not {fs}: createFilesystem formats only a device that is blank at every offset where something could start, and this one was left as it is; publish it with its own file system, or wipe it on the host if it is truly unused", At(*.at))]
    Holds { name: Named, what: Holding, at: u64, fs: String },
    #[code(FailedPrecondition)]
    #[error("host device {name} is not blank: byte {byte} is not zero, though neither blkid nor crustd recognises a signature there; createFilesystem formats only a device whose first and last MiB are zeros, and this one was left as it is")]
    NotZero { name: Named, byte: u64 },
    #[code(FailedPrecondition)]
    #[error("host device {name} has {size} bytes, less than the {XFS_MIN_BYTES} bytes (300 MiB) mkfs.xfs needs for an xfs file system: give a larger device, or ext4; nothing was written")]
    TooSmallForXfs { name: Named, size: u64 },
    #[code(Internal)]
    #[error("reading host device {name}: {source}")]
    Read { name: Named, source: Arc<io::Error> },
    #[code(inner)]
    #[error(transparent)]
    Device(#[from] hostdev::Error),
    #[code(InvalidArgument)]
    #[error("crustd cannot create a {0} file system: use ext4 or xfs")]
    FileSystem(String),
    #[code(Internal)]
    #[error("cannot bind a loop device to host device {name} for mkfs ({source}): createFilesystem needs the loop driver on the host")]
    NoLoop { name: Named, source: Arc<io::Error> },
    /// mkfs failed: the first line it said.
    #[code(FailedPrecondition)]
    #[error("{cmd} refused to format host device {name}: {said}")]
    Refused { cmd: &'static str, name: Named, said: String },
    #[code(FailedPrecondition)]
    #[error("host device {name} was formatted through {}, but {source}; crustd does not plug it", .through.display())]
    StillBound { name: Named, through: PathBuf, source: Arc<io::Error> },
    /// What blkid found at the start after mkfs, and whether crustd's own look found `fs`.
    #[code(Internal)]
    #[error("{cmd} succeeded on host device {name}, but reading it back finds {found:?} at its start (crustd's own look: {}), not {fs} alone", if *.ours { .fs.as_str() } else { "no such superblock" })]
    NotFormatted { cmd: &'static str, name: Named, found: Vec<(String, String)>, ours: bool, fs: String },
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// What a device holds where createFilesystem wants nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holding {
    /// What blkid names: (`TYPE` or `PTTYPE`, the value).
    Signatures(Vec<(String, String)>),
    /// A label crustd's own scan found.
    Label(&'static str),
}

impl fmt::Display for Holding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holding::Signatures(found) => {
                for (i, (k, v)) in found.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" and ")?;
                    }
                    match k.as_str() {
                        "PTTYPE" => write!(f, "a {v} partition table")?,
                        _ => f.write_str(v)?,
                    }
                }
                Ok(())
            }
            Holding::Label(what) => f.write_str(what),
        }
    }
}

/// " at byte N", or nothing at byte 0.
struct At(u64);

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => Ok(()),
            at => write!(f, " at byte {at}"),
        }
    }
}

/// blkid's name for a LUKS volume: what an encrypted volume's disk holds
/// once the guest has formatted it. [`inspect`] with it, for an encrypted
/// volume the guest may format, reads only: crustd never formats one.
pub const LUKS: &str = "crypto_LUKS";

/// How much of each end of the device must read as zeros.
const EDGE: u64 = 1 << 20;
/// How far from the start crustd looks for labels itself.
pub const SCAN: u64 = 64 << 20;
/// mkfs.xfs's smallest filesystem: 300 MiB (xfsprogs 5.19 and later refuse
/// less, "Filesystem must be larger than 300MB."; measured with xfsprogs
/// 6.1: 314,572,800 bytes formats, one byte less does not).
pub const XFS_MIN_BYTES: u64 = 300 << 20;
/// The most output kept from a tool (mkfs -q says little; blkid a few lines).
const MAX_OUTPUT: u64 = 64 << 10;
/// How much is read at a time.
const CHUNK: usize = 1 << 20;

/// What is on a device, for createFilesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// Nothing anywhere crustd looked: may be formatted.
    Blank,
    /// The requested filesystem: used as it is.
    Same,
}

/// A tool's exit code and output.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// What the tool said: the first line of its stderr (of its stdout
    /// when its stderr is empty), or its exit code when it said nothing.
    fn said(&self) -> String {
        let text = if self.stderr.is_empty() {
            &self.stdout
        } else {
            &self.stderr
        };
        text.lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map_or_else(|| format!("exit {:?}", self.code), str::to_string)
    }
}

/// Runs `cmd` with no input, killing it after `timeout`.
fn run(cmd: &'static str, args: &[&std::ffi::OsStr], timeout: Duration) -> Result<Ran> {
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::NoTool {
            cmd,
            source: Arc::new(e),
        })?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(r) = r {
                let _ = r.take(MAX_OUTPUT).read_to_end(&mut s);
            }
            String::from_utf8_lossy(&s).trim().to_string()
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Killed { cmd, timeout });
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                return Err(Error::Wait {
                    cmd,
                    source: Arc::new(e),
                })
            }
        }
    };
    Ok(Ran {
        code: status.code(),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// The device as a path every child process opens to the same device
/// crustd checked (its open fd, through /proc), not the node's name again.
fn fd_path(dev: &HostDevice) -> PathBuf {
    PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), dev.raw_fd()))
}

/// Signatures `blkid -p` finds at byte `offset`: `TYPE=…` and `PTTYPE=…`
/// values.
fn signatures(dev: &HostDevice, offset: u64, timeout: Duration) -> Result<Vec<(String, String)>> {
    let p = fd_path(dev);
    let off = offset.to_string();
    let mut args: Vec<&std::ffi::OsStr> = vec!["-p".as_ref(), "-o".as_ref(), "export".as_ref()];
    if offset > 0 {
        args.push("-O".as_ref());
        args.push(off.as_ref());
    }
    args.push(p.as_os_str());
    let r = run("blkid", &args, timeout)?;
    match r.code {
        // Nothing found.
        Some(2) => Ok(Vec::new()),
        Some(0) => Ok(r
            .stdout
            .lines()
            .filter_map(|l| l.split_once('='))
            .filter(|(k, _)| matches!(*k, "TYPE" | "PTTYPE"))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()),
        _ => Err(Error::Unknowable {
            name: dev.name(),
            offset,
            said: r.said(),
        }),
    }
}

/// FAILED_PRECONDITION: `dev` holds `what` at byte `at`, so it is not
/// formatted with `fs`.
fn holds(dev: &HostDevice, what: Holding, at: u64, fs: &str) -> Error {
    Error::Holds {
        name: dev.name(),
        what,
        at,
        fs: fs.to_string(),
    }
}

/// Reads `len` bytes of `dev` from `at` in chunks, handing each (and its
/// offset) to `look` until it answers something.
fn read_looking<T>(
    dev: &HostDevice,
    at: u64,
    len: u64,
    mut look: impl FnMut(&[u8], u64) -> Option<T>,
) -> Result<Option<T>> {
    let mut buf = vec![0u8; CHUNK];
    let end = at.saturating_add(len);
    let mut pos = at;
    while pos < end {
        let want = usize::try_from((end - pos).min(CHUNK as u64)).unwrap_or(CHUNK);
        let mut got = 0;
        while got < want {
            let n = dev
                .file()
                .read_at(&mut buf[got..want], pos + got as u64)
                .map_err(|e| Error::Read {
                    name: dev.name(),
                    source: Arc::new(e),
                })?;
            if n == 0 {
                break;
            }
            got += n;
        }
        if got == 0 {
            break;
        }
        if let Some(x) = look(&buf[..got], pos) {
            return Ok(Some(x));
        }
        pos += got as u64;
    }
    Ok(None)
}

/// A region of the device: (first byte, length).
type Region = (u64, u64);

/// The regions read for zeros (the first and last [`EDGE`]) and for labels
/// (the first [`SCAN`] and the last [`EDGE`]), within `size`.
fn regions(size: u64) -> ([Region; 2], [Region; 2]) {
    let head = size.min(EDGE);
    let tail = size.saturating_sub(EDGE).max(head);
    // The tail region starts on a sector boundary, so labels line up.
    let tail = tail - tail % labels::SECTOR as u64;
    let scan_head = size.min(SCAN);
    let scan_tail = tail.max(scan_head);
    (
        [(0, head), (tail, size - tail)],
        [(0, scan_head), (scan_tail, size - scan_tail)],
    )
}

/// Whether `dev` may be formatted with `fs` (Blank), already holds it
/// (Same), or neither: FAILED_PRECONDITION naming what it holds and where.
/// Reads only.
pub fn inspect(dev: &HostDevice, fs: &str, timeout: Duration) -> Result<Content> {
    let found = signatures(dev, 0, timeout)?;
    if found.len() == 1 && found[0] == ("TYPE".to_string(), fs.to_string()) {
        return Ok(Content::Same);
    }
    if !found.is_empty() {
        return Err(holds(dev, Holding::Signatures(found), 0, fs));
    }
    let size = dev.size()?;
    for at in PROBE_AT.into_iter().filter(|at| *at < size) {
        let mut found = signatures(dev, at, timeout)?;
        if !found.is_empty() {
            found.truncate(1);
            return Err(holds(dev, Holding::Signatures(found), at, fs));
        }
    }
    let (zeros, label_regions) = regions(size);
    for (at, len) in label_regions {
        if let Some(f) = read_looking(dev, at, len, labels::first_label)? {
            return Err(holds(dev, Holding::Label(f.what), f.at, fs));
        }
    }
    for (at, len) in zeros {
        if let Some(byte) = read_looking(dev, at, len, labels::first_nonzero)? {
            return Err(Error::NotZero {
                name: dev.name(),
                byte,
            });
        }
    }
    if fs == "xfs" && size < XFS_MIN_BYTES {
        return Err(Error::TooSmallForXfs {
            name: dev.name(),
            size,
        });
    }
    Ok(Content::Blank)
}

/// Whether crustd's own scan finds `fs` starting at byte 0 of `dev`.
fn starts_with(dev: &HostDevice, fs: &str) -> Result<bool> {
    let head = read_looking(dev, 0, 4096, |b, _| Some(b.to_vec()))?.unwrap_or_default();
    Ok(match fs {
        "ext4" => head.get(1080..1082) == Some(&[0x53, 0xef][..]),
        "xfs" => head.get(0..4) == Some(&b"XFSB"[..]),
        _ => false,
    })
}

/// Formats the blank `dev` with `fs`, the caller holding it exclusively all
/// the while (mkfs writes through a loop device, `loopdev`). The caller
/// has checked it with [`inspect`]. Read back and verified after.
pub fn format(dev: &HostDevice, fs: &str, timeout: Duration) -> Result<()> {
    let (cmd, extra): (&'static str, &[&str]) = match fs {
        // No -F: mke2fs asks before overwriting anything it recognises, and
        // with no terminal that is a no.
        "ext4" => ("mkfs.ext4", &["-q", "-E", "nodiscard"]),
        // No -f: mkfs.xfs refuses a device holding any signature.
        "xfs" => ("mkfs.xfs", &["-q", "-K"]),
        other => return Err(Error::FileSystem(other.to_string())),
    };
    let lo = loopdev::LoopDevice::over(dev.file().as_fd()).map_err(|e| Error::NoLoop {
        name: dev.name(),
        source: Arc::new(e),
    })?;
    let mut args: Vec<&std::ffi::OsStr> = extra.iter().map(|a| a.as_ref()).collect();
    args.push(lo.path.as_os_str());
    let ran = run(cmd, &args, timeout);
    let path = lo.path.clone();
    let detached = lo.detach();
    let r = ran?;
    if r.code != Some(0) {
        return Err(Error::Refused {
            cmd,
            name: dev.name(),
            said: r.said(),
        });
    }
    detached.map_err(|e| Error::StillBound {
        name: dev.name(),
        through: path,
        source: Arc::new(e),
    })?;
    let found = signatures(dev, 0, timeout)?;
    let ours = starts_with(dev, fs)?;
    if found.len() != 1 || found[0] != ("TYPE".to_string(), fs.to_string()) || !ours {
        return Err(Error::NotFormatted {
            cmd,
            name: dev.name(),
            found,
            ours,
            fs: fs.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;

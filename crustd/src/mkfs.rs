//! createFilesystem: a fresh disk (a CSI ephemeral inline volume, a scratch
//! disk made per pod) arrives blank, and crustd formats it on the host,
//! before the hot-plug, with mkfs.ext4 or mkfs.xfs. The guest still never
//! formats, and the host writes a fresh filesystem rather than parsing an
//! untrusted one.
//!
//! The rule that keeps it from ever destroying data: crustd formats only a
//! device that is provably blank. `blkid -p` (low-level probing of every
//! kind: filesystems, partition tables, RAID, LVM, LUKS, swap) finds no
//! signature, and the first and the last MiB read as zeros. A device that
//! already holds the requested filesystem is used as it is (a republish
//! never reformats); anything else is refused, naming what was found, and
//! not one byte of it is written. mkfs.xfs runs without `-f` and mkfs.ext4
//! without `-F` and with no terminal to answer its questions, so each also
//! refuses a signature it finds itself.
//!
//! Both tools open the device O_EXCL, which crustd's own exclusive hold
//! would refuse: the caller lets go of its hold just for the format and
//! takes it again after (the device is blank meanwhile; a host that
//! grabbed it in between makes the new hold fail, and the publish with it).

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::hostdev::HostDevice;

/// How much of each end of the device must read as zeros.
const EDGE: u64 = 1 << 20;
/// The most output kept from a tool (mkfs -q says little; blkid a few lines).
const MAX_OUTPUT: u64 = 64 << 10;

/// What is on a device, for createFilesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// No signature, zeros at both ends: may be formatted.
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

/// Runs `cmd` with no input, killing it after `timeout`.
fn run(cmd: &str, args: &[&std::ffi::OsStr], timeout: Duration) -> Result<Ran> {
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            Error::precondition(format!(
                "crustd cannot run {cmd} ({e}): createFilesystem needs util-linux's blkid, e2fsprogs' mkfs.ext4 and xfsprogs' mkfs.xfs on the host"
            ))
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
                return Err(Error::unavailable(format!(
                    "{cmd} did not finish within {timeout:?} and was killed"
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(Error::internal(format!("waiting for {cmd}: {e}"))),
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

/// Signatures `blkid -p` finds: `TYPE=…` and `PTTYPE=…` values, in words.
fn signatures(dev: &HostDevice, timeout: Duration) -> Result<Vec<(String, String)>> {
    let p = fd_path(dev);
    let r = run(
        "blkid",
        &[
            "-p".as_ref(),
            "-o".as_ref(),
            "export".as_ref(),
            p.as_os_str(),
        ],
        timeout,
    )?;
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
        _ => Err(Error::precondition(format!(
            "host device {} is not provably blank: blkid -p could not tell what it holds ({}); crustd formats only a device with no signature at all",
            dev.name(),
            if r.stderr.is_empty() { format!("exit {:?}", r.code) } else { r.stderr }
        ))),
    }
}

/// The first non-zero byte in the first and last [`EDGE`] bytes, if any.
fn first_nonzero(dev: &HostDevice) -> Result<Option<u64>> {
    let size = dev.size()?;
    let head = size.min(EDGE);
    let tail_start = size.saturating_sub(EDGE).max(head);
    let mut buf = vec![0u8; 64 << 10];
    for (start, end) in [(0, head), (tail_start, size)] {
        let mut at = start;
        while at < end {
            let want = usize::try_from((end - at).min(buf.len() as u64)).unwrap_or(buf.len());
            let n = dev
                .file()
                .read_at(&mut buf[..want], at)
                .map_err(|e| Error::internal(format!("reading host device {}: {e}", dev.name())))?;
            if n == 0 {
                break;
            }
            if let Some(i) = buf[..n].iter().position(|b| *b != 0) {
                return Ok(Some(at + i as u64));
            }
            at += n as u64;
        }
    }
    Ok(None)
}

/// Whether `dev` may be formatted with `fs` (Blank), already holds it
/// (Same), or neither: FAILED_PRECONDITION naming what it holds. Reads
/// only.
pub fn inspect(dev: &HostDevice, fs: &str, timeout: Duration) -> Result<Content> {
    let found = signatures(dev, timeout)?;
    if found.len() == 1 && found[0] == ("TYPE".to_string(), fs.to_string()) {
        return Ok(Content::Same);
    }
    if !found.is_empty() {
        let what: Vec<String> = found
            .iter()
            .map(|(k, v)| match k.as_str() {
                "PTTYPE" => format!("a {v} partition table"),
                _ => v.to_string(),
            })
            .collect();
        return Err(Error::precondition(format!(
            "host device {} holds {}, not {fs}: createFilesystem formats only a blank device, and this one was left as it is; publish it with its own file system, or wipe it on the host if it is truly unused",
            dev.name(),
            what.join(" and ")
        )));
    }
    if let Some(at) = first_nonzero(dev)? {
        return Err(Error::precondition(format!(
            "host device {} is not blank: byte {at} is not zero, though blkid recognises no signature; createFilesystem formats only a device whose first and last MiB are zeros, and this one was left as it is",
            dev.name()
        )));
    }
    Ok(Content::Blank)
}

/// Formats the blank `dev` with `fs`. The caller has checked it with
/// [`inspect`] and let go of its exclusive hold.
pub fn format(dev: &HostDevice, fs: &str, timeout: Duration) -> Result<()> {
    let p = fd_path(dev);
    let (cmd, args): (&str, Vec<&std::ffi::OsStr>) = match fs {
        // No -F: mke2fs asks before overwriting anything it recognises, and
        // with no terminal that is a no.
        "ext4" => (
            "mkfs.ext4",
            vec![
                "-q".as_ref(),
                "-E".as_ref(),
                "nodiscard".as_ref(),
                p.as_os_str(),
            ],
        ),
        // No -f: mkfs.xfs refuses a device holding any signature.
        "xfs" => (
            "mkfs.xfs",
            vec!["-q".as_ref(), "-K".as_ref(), p.as_os_str()],
        ),
        other => {
            return Err(Error::invalid(format!(
                "crustd cannot create a {other} file system: use ext4 or xfs"
            )))
        }
    };
    let r = run(cmd, &args, timeout)?;
    if r.code != Some(0) {
        return Err(Error::precondition(format!(
            "{cmd} refused to format host device {}: {}",
            dev.name(),
            if r.stderr.is_empty() {
                r.stdout
            } else {
                r.stderr
            }
        )));
    }
    match inspect(dev, fs, timeout) {
        Ok(Content::Same) => Ok(()),
        Ok(Content::Blank) => Err(Error::internal(format!(
            "{cmd} succeeded on host device {} but blkid finds no {fs} on it",
            dev.name()
        ))),
        Err(e) => Err(e),
    }
}

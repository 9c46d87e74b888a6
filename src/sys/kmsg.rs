//! The kernel's log as /dev/kmsg gives it to a reader: one record per
//! read, `<level>,<seq>,<usec>,<flags>[,…];<message>` then continuation
//! lines (`Documentation/ABI/testing/dev-kmsg`). Read here from the oldest
//! record the ring still holds to the newest, without waiting, and bounded;
//! what the records mean is the callers'.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;

use crate::sys::error::SysError;

/// Where the log is read.
pub const KMSG: &str = "/dev/kmsg";
/// The most records one read of the log goes through.
const MAX_RECORDS: usize = 1 << 18;
/// The longest record the kernel hands out (`CONSOLE_EXT_LOG_MAX`).
const RECORD_MAX: usize = 8192;

/// One record: its sequence number and its message's first line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub message: String,
}

impl Record {
    /// Reads a record as /dev/kmsg writes it; None for any other form.
    pub fn parse(raw: &[u8]) -> Option<Record> {
        let text = std::str::from_utf8(raw).ok()?;
        let (prefix, rest) = text.split_once(';')?;
        let seq = prefix.split(',').nth(1)?.parse().ok()?;
        let message = rest.split('\n').next().unwrap_or("").to_string();
        Some(Record { seq, message })
    }
}

/// Every record the ring holds, oldest first, for which `keep` says yes
/// (records overwritten while reading are skipped, as the kernel says).
pub fn records(keep: &mut dyn FnMut(&Record) -> bool) -> Result<Vec<Record>, SysError> {
    let mut file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(KMSG)
        .map_err(|e| SysError::new("open", KMSG, e))?;
    let mut buf = vec![0u8; RECORD_MAX];
    let mut out = Vec::new();
    for _ in 0..MAX_RECORDS {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if let Some(r) = buf.get(..n).and_then(Record::parse) {
                    if keep(&r) {
                        out.push(r);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // EPIPE: the ring overwrote records before they were read.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(SysError::new("read", KMSG, e)),
        }
    }
    Ok(out)
}

/// The sequence number the next record will have.
pub fn next_seq() -> Result<u64, SysError> {
    let mut last = None;
    records(&mut |r| {
        last = Some(r.seq);
        false
    })?;
    Ok(last.map_or(0, |s| s.saturating_add(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_as_the_kernel_writes_them() {
        let r = Record::parse(
            b"3,1234,912443100,-,caller=T12;device-mapper: crypt: dm-0: INTEGRITY AEAD ERROR, sector 81920\n SUBSYSTEM=block\n",
        )
        .unwrap();
        assert_eq!(r.seq, 1234);
        assert_eq!(
            r.message,
            "device-mapper: crypt: dm-0: INTEGRITY AEAD ERROR, sector 81920"
        );
        assert_eq!(Record::parse(b"6,7,1,-;x;y\n").unwrap().message, "x;y");
        assert!(Record::parse(b"no prefix").is_none());
        assert!(Record::parse(b"6,x,1,-;m\n").is_none());
        assert!(Record::parse(b"\xff,1;m").is_none());
    }
}

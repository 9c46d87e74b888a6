//! Kata Containers' direct-assigned volume records, the ones CSI drivers
//! write today (Azure Disk, Alibaba Cloud, Kata's csi-kata-directvolume):
//! instead of mounting a block volume on the host, the driver files a
//! record for the runtime, `ROOT/E/mountInfo.json`, where `E` is the volume
//! path (the CSI target path) in base64 with the URL-safe alphabet and `=`
//! padding kept (Go's `base64.URLEncoding`):
//!
//! ```json
//! {"volume-type": "directvol", "device": "/dev/sdx", "fstype": "ext4",
//!  "metadata": {"fsGroup": "2000", "fsGroupChangePolicy": "OnRootMismatch"},
//!  "options": ["noatime"]}
//! ```
//!
//! Once the volume is in sandbox `S`, an empty file `ROOT/E/S` sits beside
//! it (Kata's `RecordSandboxID`); `crustd-ctl direct-volume stats|resize`
//! find the sandbox through it. The driver owns the record; crustd writes
//! and removes only the sandbox-id file.
//!
//! A record is untrusted input: it names a host block device, so a driver
//! made to surface a hostile record could reach any device on the host.
//! `ROOT/E` and `mountInfo.json` must be a real directory and a regular
//! file (no symlink is followed), owned by root, not writable by group or
//! others; the file is read through the directory's fd, bounded
//! ([`MAX_RECORD`]), and parsed by [`parse_record`], a pure function from
//! bytes to a validated [`Record`] or a [`RecordError`] (the entry point a
//! fuzz target calls). The JSON is read as Go's `encoding/json` reads it
//! into Kata's struct, except where that would be ambiguous: a key that Go
//! would match to a field case-insensitively but that is not spelled
//! exactly so, and a key given twice, are refused rather than guessed.
//!
//! `record` is the pure half (bytes to a validated [`Record`]), `store` the
//! files.

mod record;
mod store;

pub use record::{encode, parse_record, MountInfo, Record, RecordError, MAX_FS_GROUP};
pub use store::{
    BadDirectory, Doing, Error, Found, Records, Refusal, SandboxOf, Unsafe, DEFAULT_ROOT,
    MAX_RECORD, MOUNT_INFO,
};

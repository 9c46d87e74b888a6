//! The host device must keep its size across every trim (issue: a discard
//! that reached the end of a raw image truncated it, microsandbox #1472).
//! Around crustd's own RuntimeTrimVolume and at every
//! RuntimeGetVolumeHealth (kubelet polls it, and it is when the agent's own
//! scheduled trims are seen), crustd compares what the device can give back
//! (`HostDevice::capacity`: its size, and a loop device's backing file)
//! with what it could at publish (the record's `host_bytes`). A device
//! found smaller is marked for good: its health says DATA_LOSS
//! `BackingStoreShrank`, the log names it once, and crustd sends it no
//! further trim. What crustd cannot stop: the agent's own schedule, which
//! only an unpublish ends.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crust_protocols::sync::LockExt;
use serde_json::json;

use crate::devices::Key;
use crate::hostdev;
use crate::state::Volume;

/// A host device found smaller than it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shrunk {
    /// The bytes it could give back when published (or first seen).
    pub from: u64,
    /// The bytes it could when found smaller.
    pub to: u64,
}

/// What crustd saw of a volume's host device.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The mark it must keep: the record's, or the first size seen.
    mark: u64,
    shrunk: Option<Shrunk>,
}

/// Every published volume's mark, and which shrank (in memory; a record's
/// `host_bytes` carries the mark across crustd's restarts).
#[derive(Default)]
pub struct Shrinks {
    map: Mutex<HashMap<Key, Seen>>,
}

impl Shrinks {
    /// Looks at `rec`'s host device now: whether it shrank, now or before.
    /// A device crustd cannot open is not judged (the call that needs it
    /// says why).
    pub fn check(&self, key: &Key, rec: &Volume) -> Option<Shrunk> {
        let now = hostdev::open_recorded(&rec.rdev)
            .and_then(|d| d.capacity())
            .ok();
        let mut map = self.map.locked();
        let seen = match (map.get(key), rec.host_bytes) {
            // A new publish of the same volume has a new mark.
            (Some(s), Some(m)) if s.mark != m => None,
            (s, _) => s.copied(),
        };
        let mut seen = match (seen, rec.host_bytes, now) {
            (Some(s), _, _) => s,
            (None, Some(mark), _) | (None, None, Some(mark)) => Seen { mark, shrunk: None },
            (None, None, None) => return None,
        };
        if let (None, Some(to)) = (seen.shrunk, now) {
            if to < seen.mark {
                let s = Shrunk {
                    from: seen.mark,
                    to,
                };
                seen.shrunk = Some(s);
                say(key, rec, s);
            }
        }
        map.insert(key.clone(), seen);
        seen.shrunk
    }

    /// Forgets volume `key` (unpublished).
    pub fn forget(&self, key: &Key) {
        self.map.locked().remove(key);
    }
}

/// The log's line for a device found smaller: once, when found.
fn say(key: &Key, rec: &Volume, s: Shrunk) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let line = json!({
        "ts": (now * 1000.0).round() / 1000.0,
        "event": "BackingStoreShrank",
        "sandbox": key.sandbox,
        "host_volume": key.host_volume,
        "rdev": rec.rdev,
        "from_bytes": s.from,
        "to_bytes": s.to,
        "error": message(key, s),
    });
    let mut text = line.to_string();
    text.push('\n');
    let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
}

/// The sentence health and the log say.
pub fn message(key: &Key, s: Shrunk) -> String {
    format!(
        "host device {} of sandbox {} shrank from {} to {} bytes (a discard may have truncated its backing image): blocks past {} read back as zeros or fail; crustd sends it no further trim; unpublish it and restore the volume",
        key.host_volume, key.sandbox, s.from, s.to, s.to
    )
}

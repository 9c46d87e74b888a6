//! LUKS2 in the guest, with no cryptsetup: a disk's header read and checked
//! as cryptsetup reads it, a keyslot unlocked with a passphrase into the
//! volume key and the data segment that a dm-crypt mapping needs, and a new
//! volume made as cryptsetup makes one, for a disk proved blank first. The
//! module reads disks and never writes one: a new volume is bytes for the
//! caller to write. It never logs or prints a key or a passphrase. A
//! hostile disk is refused before any work proportional to what its header
//! claims: sizes from cryptsetup's set, JSON bounded in size, depth and
//! count, areas inside the device, Argon2 memory within the caller's limit.
//!
//! One idea a file: the refusals (`error`), the binary headers and the
//! choice of copy (`header`), the JSON area as types (`metadata`) over a
//! bounded JSON reader (`json`), the hashes and KDFs (`kdf`, over Argon2
//! of the workspace's own crust-argon2, which runs the lanes on threads),
//! the unlock (`unlock`), a new volume (`format`), and the rule that a disk
//! is blank before it is formatted (`blank`); a volume made in the guest
//! (`made`), with what integrity adds (`made_integrity`, `wipe`). `fuzz` is the fuzz target's way in;
//! `tests` holds the tests against cryptsetup, `fixture` the headers the
//! other tests build by hand.
//!
//! The JSON reader is the agent's own, not serde_json: the area wants only
//! objects, arrays, strings and integers, read with bounds serde_json does
//! not have (depth is bounded there too, the count of values and duplicate
//! keys are not), and the agent is one static binary held to a size bound.
//! Measured on the release agent with the unlock reachable from main: this
//! reader costs 8.6 KB, and a `serde_json::Value` parse of the same area
//! added 25.6 KB on top before any typed decoding; the whole of LUKS2 adds
//! 163 KiB (docs/encryption.md has the figures and the other choices).

pub mod blank;
pub mod disk;
pub mod error;
#[cfg(test)]
mod fixture;
pub mod format;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod header;
pub mod integrity;
pub mod json;
pub mod kdf;
pub mod made;
pub mod made_integrity;
pub mod mapping;
pub mod metadata;
#[cfg(test)]
mod tests;
pub mod unlock;
pub mod wipe;

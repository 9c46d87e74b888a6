//! The key of an encrypted volume, in the guest: where the request says it
//! comes from (`source`: the passphrase itself, `file:///path`, or
//! `kbs:///repository/type/tag`), checked before anything is touched, and
//! then its bytes (`resolve`): read from a file as cryptsetup reads a key
//! file (`file`), or fetched from the KBS by the Confidential Data Hub over
//! its ttrpc socket (`cdh`, which reads its answer in place with `field`).
//! What the key unlocks is luks2's business, not this module's.
//!
//! A key lives only in `Zeroizing` buffers, and never reaches a log line,
//! an error or a Debug output: errors (`error`) carry a file's path or a
//! resource's name, which are not secret, and sizes.

pub mod cdh;
pub mod error;
mod field;
pub mod file;
pub mod resolve;
pub mod source;
#[cfg(test)]
mod tests;

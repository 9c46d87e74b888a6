//! crust-agent: the in-guest storage agent of a microVM sandbox.
//!
//! A request flows server.rs (wire ↔ domain) → validate.rs (is it well formed)
//! → volumes.rs (the volume table, one lock per volume) → the capability
//! modules, each of which owns its syscalls.

// The shared test fixtures name this crate as the integration tests do.
extern crate self as crust_agent;

pub mod beneath;
pub mod blockdev;
pub mod cancel;
pub mod device;
pub mod errors;
#[doc(hidden)]
pub mod fuzz;
pub mod grow;
pub mod init;
pub mod instance;
pub mod logging;
pub mod mount;
pub mod mountinfo;
pub mod notify;
pub mod ownership;
pub mod probe;
pub mod rpc;
pub mod server;
pub mod stats;
pub mod system;
/// Loop devices and mkfs'd filesystems for the unit tests, shared with the
/// host and VM tests. Test-only: the agent itself never runs a program.
#[cfg(test)]
#[path = "../tests/fixtures/disks.rs"]
pub(crate) mod testutil;
pub mod validate;
pub mod volumes;

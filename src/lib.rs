//! crust-agent: the in-guest storage agent of a microVM sandbox.
//!
//! # The layers
//!
//! Each layer uses only the layers below it; within the capabilities none
//! uses another; no file imports in a circle (`tests/layers.rs` checks all
//! three, and that no file outgrows 800 lines of code). A request flows
//! down: the wire translates it, the table runs it as steps over the
//! capabilities, which make the syscalls through the leaves.
//!
//! ```text
//! 4 process       main.rs · init · instance · notify · fuzz (the fuzz targets' way in,
//!                 built only with the `fuzz` feature, for fuzz/)
//! 3 wire          server/ (the one list of methods and what it makes: the ttrpc
//!                 service, the lanes, the direct answers; proto ↔ domain,
//!                 error → status)
//!                 rpc/ (the bounded ttrpc transport: knows no agent type)
//! 2 table         volumes/ (the façade over rooms that own their state, the
//!                 operations that borrow them, publish as steps with one undo
//!                 list, the walk a volume owns, binds, block volumes, state,
//!                 recovery; the Kernel trait under it all)
//!                 error.rs (joins the capabilities' errors)
//! 1 capabilities  device · probe/ · mount/ · ownership/ · stats · grow · luks2/
//!                 each owns its syscalls and its error, and says its code
//! 0 leaves        code (Code) · model (the shared domain types, MountId)
//!                 sys/ (SysError, beneath, mountinfo, sysfs, uevents, blockdev,
//!                 features) · superblock (on-disk layouts) · cancel · validate
//!                 · logging · system (what the agent reports about itself)
//! ```
//!
//! A `mod.rs` (and this file) only declares and documents its modules: it
//! holds no items and imports nothing, so no child can close a circle
//! through its parent.

// The shared test fixtures name this crate as the integration tests do.
extern crate self as crust_agent;

pub mod cancel;
pub mod code;
pub mod device;
pub mod embed;
pub mod error;
#[cfg(feature = "fuzz")]
#[doc(hidden)]
pub mod fuzz;
pub mod grow;
pub mod init;
pub mod instance;
pub mod logging;
pub mod luks2;
pub mod model;
pub mod mount;
pub mod notify;
pub mod ownership;
pub mod probe;
pub mod quiesce;
pub mod rpc;
pub mod server;
pub mod stats;
pub mod superblock;
pub mod sys;
pub mod system;
/// Loop devices and mkfs'd filesystems for the unit tests, shared with the
/// host and VM tests. Test-only: the agent itself never runs a program.
#[cfg(test)]
#[path = "../tests/fixtures/disks.rs"]
pub(crate) mod testutil;
pub mod validate;
pub mod volumes;

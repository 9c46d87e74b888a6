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
//!                 · keys/ (a volume's key: from the request, a file, or the CDH)
//!                 · mkfs (the filesystem inside a new encrypted volume: the one
//!                 program the agent runs)
//!                 each owns its syscalls and its error, and says its code
//! 0 leaves        code (Code) · model (the shared domain types, MountId)
//!                 sys/ (SysError, beneath, mountinfo, sysfs, uevents, blockdev,
//!                 features, dm, keyring, children) · superblock (on-disk layouts) · cancel · validate
//!                 · logging · system (what the agent reports about itself)
//! ```
//!
//! # The API
//!
//! The one public API is [`embed`]: a guest agent written in Rust takes the
//! volume table from it. Every other module is `#[doc(hidden)]`: the way in
//! for the agent's own binary (`src/main.rs`, a crate of its own), its
//! tests, the fuzz targets and the bench, with no promise to anyone else
//! (`tests/layers.rs` checks that no other module is documented as API).
//!
//! A `mod.rs` (and this file) only declares and documents its modules: it
//! holds no items and imports nothing, so no child can close a circle
//! through its parent.

#[doc(hidden)]
pub mod cancel;
#[doc(hidden)]
pub mod code;
#[doc(hidden)]
pub mod device;
pub mod embed;
#[doc(hidden)]
pub mod error;
#[cfg(feature = "fuzz")]
#[doc(hidden)]
pub mod fuzz;
#[doc(hidden)]
pub mod grow;
#[doc(hidden)]
pub mod init;
#[doc(hidden)]
pub mod instance;
#[doc(hidden)]
pub mod keys;
#[doc(hidden)]
pub mod logging;
#[doc(hidden)]
pub mod luks2;
#[doc(hidden)]
pub mod mkfs;
#[doc(hidden)]
pub mod model;
#[doc(hidden)]
pub mod mount;
#[doc(hidden)]
pub mod notify;
#[doc(hidden)]
pub mod ownership;
#[doc(hidden)]
pub mod probe;
#[doc(hidden)]
pub mod quiesce;
#[doc(hidden)]
pub mod rpc;
#[doc(hidden)]
pub mod server;
#[doc(hidden)]
pub mod stats;
#[doc(hidden)]
pub mod superblock;
#[doc(hidden)]
pub mod sys;
#[doc(hidden)]
pub mod system;
#[doc(hidden)]
pub mod validate;
#[doc(hidden)]
pub mod volumes;

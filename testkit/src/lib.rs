//! What the workspace's tests share, so that no test file carries a copy:
//!
//! - [`needs`]: what a test needs beyond a plain developer machine (root,
//!   loop devices, mkfs, Go, grpcio). Such a test is `#[ignore = "needs …:
//!   make test runs it"]`, so a plain `cargo test` reports it ignored, never
//!   passed; run anyway without what it needs, it fails with a sentence
//!   saying what is missing.
//! - [`disks`]: loop devices over sparse images, filesystems made by mkfs and
//!   mounted on temporary directories, torn down on drop.
//! - [`child`]: a test run again in a child process (its own mount
//!   namespace, or limits that must not touch the tests beside it).
//! - [`agent`]: the crust.v1 request builders and answer readers.
//! - [`build`]: the workspace's programs a test runs, built for it.
//! - [`vm`]: the guest under QEMU (crust-vm), its images and console.
//! - [`crustd`]: the crustd process under test and its answers.
//! - [`luks`]: LUKS2 images made and decrypted on the host with cryptsetup.
//! - [`cdh`]: a stand-in for the Confidential Data Hub (the `cdh-standin`
//!   program serves one in a guest).
//! - [`ids`]: acting as another user on a thread, and a file's owner.
//! - [`guest`]: the systemd guest (`make guest-image`) with the agent as a
//!   service, and what a test adds to it.
//!
//! Test code only: it runs host tools (mkfs, losetup, mount), which the agent
//! itself never does. It depends on neither the agent nor crustd, so both use
//! it in their unit tests too.

pub mod agent;
pub mod build;
pub mod cdh;
pub mod child;
pub mod crustd;
pub mod disks;
pub mod guest;
pub mod ids;
pub mod luks;
pub mod needs;
pub mod vm;

pub use disks::{
    allocated, fails, mode, mount_paths_of, mount_points_of, mounts_of, run, LoopDisk, Mounted,
};

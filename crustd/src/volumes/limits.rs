//! What a request may name, written once for the checks (`request`) and
//! their refusals (`error`).

/// The filesystems crustd publishes: what the guest this project builds mounts.
pub const FILE_SYSTEMS: [&str; 2] = ["ext4", "xfs"];

/// The longest `host_target_path` recorded (PATH_MAX): kubelet's own path,
/// kept in crustd's state, which must stay small enough to read back.
pub const MAX_TARGET_PATH: usize = 4096;

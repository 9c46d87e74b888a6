//! The calls' requests and answers in plain types, and the checks a
//! request gets before anything on the host or in the sandbox is looked at.

use std::path::PathBuf;

use crate::error::{Code, Error, Result};
use crate::hostdev;
use crate::registry;

/// Block volumes (volumeMode: Block): the agent publishes the raw device
/// (VolumeMode BLOCK). This one switch gates both the publish and the
/// BLOCK_VOLUME capability.
pub const BLOCK_VOLUMES: bool = true;

/// The filesystems crustd publishes: what the guest this project builds mounts.
pub const FILE_SYSTEMS: [&str; 2] = ["ext4", "xfs"];

/// The longest `host_target_path` recorded (PATH_MAX): kubelet's own path,
/// kept in crustd's state, which must stay small enough to read back.
pub const MAX_TARGET_PATH: usize = 4096;

/// Who named the host device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub enum Origin {
    /// kubelet, as `host_volume_id`.
    #[default]
    Kubelet,
    /// A Kata direct-volume record: its volume path and its file.
    Direct { volume_path: String, file: PathBuf },
}

impl Origin {
    /// The error for a device this origin named that is not a usable block
    /// device: `what` says what it is instead.
    pub fn refuse(&self, device: &str, what: &hostdev::NotBlock) -> Error {
        match self {
            Origin::Kubelet => Error::invalid(format!("host_volume_id {device} {what}")),
            Origin::Direct { file, .. } => Error::invalid(format!(
                "direct-volume record {} names {device}, which {what}",
                file.display()
            )),
        }
    }

    /// The volume path of a direct-volume record.
    pub fn direct(&self) -> Option<&str> {
        match self {
            Origin::Kubelet => None,
            Origin::Direct { volume_path, .. } => Some(volume_path),
        }
    }
}

/// RuntimePublishVolume, in plain types.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct PublishRequest {
    pub sandbox_id: String,
    pub host_volume_id: String,
    pub host_target_path: String,
    pub file_system: String,
    pub mount_options: Vec<String>,
    pub fsgroup_gid: Option<i64>,
    pub fsgroup_policy: String,
    pub read_only: bool,
    pub block: bool,
    /// Format the device first if it is provably blank (never anything else).
    pub create_file_system: bool,
    /// Who named the device.
    pub origin: Origin,
}

/// RuntimePublishDirectVolume, in plain types.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DirectRequest {
    pub sandbox_id: String,
    pub volume_path: String,
    pub read_only: bool,
}

/// Checks a publish request without looking at the host or the sandbox.
pub fn validate(r: &PublishRequest) -> Result<()> {
    registry::check_id(&r.sandbox_id)?;
    hostdev::check_path(&r.host_volume_id)?;
    if r.host_target_path.len() > MAX_TARGET_PATH || r.host_target_path.contains('\0') {
        return Err(Error::invalid(format!(
            "host_target_path has {} bytes{}: give kubelet's target path, at most {MAX_TARGET_PATH} bytes without NUL",
            r.host_target_path.len(),
            if r.host_target_path.contains('\0') { " and a NUL byte" } else { "" }
        )));
    }
    if r.block {
        if !BLOCK_VOLUMES {
            return Err(Error::new(
                Code::Unimplemented,
                "block volumes (volumeMode: Block) are not supported by this crustd yet: the guest agent cannot publish raw block devices; use a filesystem volume",
            ));
        }
        if !r.file_system.is_empty() {
            return Err(Error::invalid(format!(
                "file_system {:?} with block = true: a block volume has no filesystem, leave it empty",
                r.file_system
            )));
        }
        if !r.mount_options.is_empty() {
            return Err(Error::invalid(format!(
                "mount_options {:?} with block = true: a block volume is not mounted, leave them empty",
                r.mount_options
            )));
        }
        if r.create_file_system {
            return Err(Error::invalid(
                "create_file_system with block = true: a block volume has no filesystem to create",
            ));
        }
    } else if !FILE_SYSTEMS.contains(&r.file_system.as_str()) {
        return Err(Error::invalid(format!(
            "file_system {:?} is not supported: use one of {}",
            r.file_system,
            FILE_SYSTEMS.join(", ")
        )));
    }
    fs_group(r)?;
    Ok(())
}

/// fsGroup as the agent takes it: (gid, OnRootMismatch).
pub fn fs_group(r: &PublishRequest) -> Result<Option<(u32, bool)>> {
    let on_root_mismatch = match r.fsgroup_policy.as_str() {
        "" | "Always" => false,
        "OnRootMismatch" => true,
        other => {
            return Err(Error::invalid(format!(
                "fsgroup_policy {other:?} is not a policy: use \"Always\" or \"OnRootMismatch\" (Kubernetes' spelling)"
            )))
        }
    };
    match r.fsgroup_gid {
        None => Ok(None),
        Some(g) => match u32::try_from(g) {
            Ok(gid) if gid != u32::MAX => Ok(Some((gid, on_root_mismatch))),
            _ => Err(Error::invalid(format!(
                "fsgroup_gid {g} is not a group id (0 to 4294967294)"
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_path_beyond_path_max_is_refused() {
        let mut r = PublishRequest {
            sandbox_id: "pod".into(),
            host_volume_id: "/dev/x".into(),
            file_system: "ext4".into(),
            host_target_path: "/var/lib/kubelet/x".into(),
            ..Default::default()
        };
        validate(&r).unwrap();
        r.host_target_path = format!("/{}", "a".repeat(MAX_TARGET_PATH));
        let e = validate(&r).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.to_string().contains("4097 bytes"), "{e}");
        r.host_target_path = "/x\0y".into();
        assert!(validate(&r).unwrap_err().to_string().contains("NUL"));
    }
}

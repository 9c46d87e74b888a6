//! The calls' requests and answers in plain types, and the checks a
//! request gets before anything on the host or in the sandbox is looked at.

use std::path::PathBuf;

use super::error::Error as Refused;
use crate::agent;
use crate::error::{Error, Result};
use crate::hostdev;
use crate::registry;

/// Block volumes (volumeMode: Block): the agent publishes the raw device
/// (VolumeMode BLOCK). This one switch gates both the publish and the
/// BLOCK_VOLUME capability.
pub const BLOCK_VOLUMES: bool = true;

pub use super::limits::{FILE_SYSTEMS, MAX_TARGET_PATH};

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
    pub fn refuse(&self, device: &str, what: hostdev::NotBlock) -> Error {
        match self {
            Origin::Kubelet => hostdev::Error::NotBlock {
                id: device.to_string(),
                what,
            }
            .into(),
            Origin::Direct { file, .. } => Refused::RecordNamesNotBlock {
                file: file.clone(),
                device: device.into(),
                what,
            }
            .into(),
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
    pub fsgroup_policy: FsGroupPolicy,
    pub read_only: bool,
    pub block: bool,
    /// Format the device on the host first if it is provably blank (never
    /// anything else). Never with `encryption`.
    pub create_file_system: bool,
    /// An encrypted volume: the key's reference, and whether the guest may
    /// format a blank disk (it does, inside LUKS2; the host never does).
    pub encryption: Option<agent::Encryption>,
    /// Who named the device.
    pub origin: Origin,
}

/// fsGroupChangePolicy: how the agent applies a publish's fsGroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum FsGroupPolicy {
    /// Every file's group is set ("Always", or no policy named).
    #[default]
    Always,
    /// The files are left alone when the volume's root is already right.
    OnRootMismatch,
}

impl FsGroupPolicy {
    /// A request's `fsgroup_policy`, in Kubernetes' spelling.
    pub fn parse(s: &str) -> Result<FsGroupPolicy> {
        match s {
            "" | "Always" => Ok(FsGroupPolicy::Always),
            "OnRootMismatch" => Ok(FsGroupPolicy::OnRootMismatch),
            other => Err(Refused::Policy(other.to_string()).into()),
        }
    }
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
    let nul = r.host_target_path.contains('\0');
    if r.host_target_path.len() > MAX_TARGET_PATH || nul {
        return Err(Refused::TargetPath {
            len: r.host_target_path.len(),
            nul,
        }
        .into());
    }
    if r.block {
        if !BLOCK_VOLUMES {
            return Err(Refused::NoBlockVolumes.into());
        }
        if !r.file_system.is_empty() {
            return Err(Refused::BlockWithFileSystem(r.file_system.clone()).into());
        }
        if !r.mount_options.is_empty() {
            return Err(Refused::BlockWithOptions(r.mount_options.clone()).into());
        }
        if r.create_file_system {
            return Err(Refused::BlockWithCreate.into());
        }
    } else if !FILE_SYSTEMS.contains(&r.file_system.as_str()) {
        return Err(Refused::FileSystem(r.file_system.clone()).into());
    }
    if r.encryption.is_some() && r.create_file_system {
        return Err(Refused::EncryptedWithCreate.into());
    }
    fs_group(r)?;
    Ok(())
}

/// fsGroup as the agent takes it: (gid, OnRootMismatch).
pub fn fs_group(r: &PublishRequest) -> Result<Option<(u32, bool)>> {
    let on_root_mismatch = r.fsgroup_policy == FsGroupPolicy::OnRootMismatch;
    match r.fsgroup_gid {
        None => Ok(None),
        Some(g) => match u32::try_from(g) {
            Ok(gid) if gid != u32::MAX => Ok(Some((gid, on_root_mismatch))),
            _ => Err(Refused::Gid(g).into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

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

    #[test]
    fn an_encrypted_volume_is_never_formatted_on_the_host() {
        let mut r = PublishRequest {
            sandbox_id: "pod".into(),
            host_volume_id: "/dev/x".into(),
            file_system: "ext4".into(),
            encryption: Some(agent::Encryption {
                key_uri: "kbs:///a/b/c".into(),
                format_if_blank: true,
            }),
            ..Default::default()
        };
        validate(&r).unwrap();
        r.create_file_system = true;
        let e = validate(&r).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(
            e.to_string()
                .contains("never formats an encrypted volume on the host"),
            "{e}"
        );
    }
}

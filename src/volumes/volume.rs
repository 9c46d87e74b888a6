//! A published volume as the table holds it and its record stores it, and
//! how it is told apart from everything else mounted: by its disk and its
//! recorded mount ids, never by a path's spelling.

use std::path::{Path, PathBuf};

use rustix::fs::OFlags;

use super::error::Error;
use super::phase::Phase;
use super::request::{BindInfo, EncryptionInfo, Source, Spec, VolumeInfo, VolumeState};
use crate::luks2::mapping::Mapping;
use crate::model::{Device, IdMap, MountId, RecursiveReadOnly, VolumeMode};
use crate::mount::unmount::Expect;
use crate::sys::beneath::MountPoint;

/// One bind of a volume, as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bind {
    /// Absolute and canonical (beneath the canonical root).
    pub(crate) target: PathBuf,
    /// The same, relative to the root: what the agent resolves.
    pub(crate) rel: PathBuf,
    /// Relative to the volume's root; empty for the root.
    pub(crate) subpath: PathBuf,
    pub(crate) read_only: bool,
    /// The recursive read-only mode asked for.
    pub(crate) rro: RecursiveReadOnly,
    /// Whether it was applied (submounts read-only too).
    pub(crate) rro_applied: bool,
    /// The bind's mount id; None when a record from an older agent had none.
    pub(crate) mount_id: Option<MountId>,
    /// Its uid and gid mappings, when idmapped.
    pub(crate) idmap: Option<IdMap>,
}

impl Bind {
    /// Which mount the bind is, for unmounting it by identity.
    pub(crate) fn mount_identity(&self, dev: &Device) -> Expect {
        match self.mount_id {
            Some(id) => Expect::Mount(id, dev.major, dev.minor),
            None => Expect::Device(dev.major, dev.minor),
        }
    }
}

/// A published volume: what its record holds. What the publish asked for
/// (`spec`), then what the agent found and did.
#[derive(Clone, Debug)]
pub(crate) struct Volume {
    /// What the publish asked for.
    pub(crate) spec: Spec,
    /// The disk.
    pub(crate) device: Device,
    /// `<canonical root>/volumes/<id>`.
    pub(crate) guest_path: PathBuf,
    /// How far its publish got: its mount, its walk, complete or not.
    pub(crate) phase: Phase,
    /// A block volume whose device the agent set read-only (BLKROSET), or
    /// is about to: decided before the first record, so that recovery
    /// clears a flag a publish killed mid-way set, and fixed from then on;
    /// Unpublish clears the flag.
    ro_set: bool,
    /// Its binds, in the order they were made.
    pub(crate) binds: Vec<Bind>,
    /// An encrypted volume's disk and mapping; `device` is then the
    /// mapping, what is mounted or bound.
    pub(crate) encrypted: Option<Encrypted>,
}

/// An encrypted volume's disk (what the host plugged, and what is claimed)
/// and the mapping over it, as recorded. No key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Encrypted {
    pub(crate) disk: Device,
    pub(crate) mapping: Mapping,
}

impl Volume {
    /// A volume about to be published: `spec` on `device` at `guest_path`,
    /// nothing mounted yet (`ro_set`: the agent sets a block device's
    /// read-only flag). The one place a new volume is made.
    pub(crate) fn new(
        spec: Spec,
        device: Device,
        guest_path: PathBuf,
        ro_set: bool,
        encrypted: Option<Encrypted>,
    ) -> Volume {
        let mut v = Volume::recorded(
            spec,
            device,
            guest_path,
            ro_set,
            Phase::Recorded,
            Vec::new(),
        );
        v.encrypted = encrypted;
        v
    }

    /// A volume as its record has it (state.rs).
    pub(crate) fn recorded(
        spec: Spec,
        device: Device,
        guest_path: PathBuf,
        ro_set: bool,
        phase: Phase,
        binds: Vec<Bind>,
    ) -> Volume {
        Volume {
            spec,
            device,
            guest_path,
            phase,
            ro_set,
            binds,
            encrypted: None,
        }
    }

    /// The disk the host plugged: what is claimed, and what a serial names.
    pub(crate) fn disk(&self) -> &Device {
        self.encrypted.as_ref().map_or(&self.device, |e| &e.disk)
    }

    /// Whether the agent set (or is to set) the device read-only, and so
    /// clears the flag when it lets go of the volume.
    pub(crate) fn ro_set(&self) -> bool {
        self.ro_set
    }

    /// The host's volume id.
    pub(crate) fn id(&self) -> &str {
        &self.spec.volume_id
    }

    /// Filesystem (which) or block.
    pub(crate) fn mode(&self) -> VolumeMode {
        self.spec.mode
    }

    /// Whether its publish has an fsGroup walk to do: an fsGroup, on a
    /// volume mounted writable (kubelet leaves a read-only volume alone).
    pub(crate) fn needs_walk(&self) -> bool {
        self.spec.fs_group.is_some() && !self.mounted_read_only()
    }

    /// What ListVolumes reports of it (the device's size left at 0).
    pub(crate) fn info(&self) -> VolumeInfo {
        VolumeInfo {
            volume_id: self.id().to_string(),
            device: self.device.path.display().to_string(),
            serial: match &self.spec.source {
                Source::Serial(s) => s.clone(),
                Source::Path(_) => self.disk().serial.clone().unwrap_or_default(),
            },
            fs_type: match self.spec.mode {
                VolumeMode::Filesystem(fs) => fs.name().to_string(),
                VolumeMode::Block => String::new(),
            },
            guest_path: self.guest_path.display().to_string(),
            read_only: self.mounted_read_only(),
            bind_targets: self
                .binds
                .iter()
                .map(|b| b.target.display().to_string())
                .collect(),
            binds: self
                .binds
                .iter()
                .map(|b| BindInfo {
                    target: b.target.display().to_string(),
                    subpath: b.subpath.display().to_string(),
                    read_only: b.read_only,
                    recursive_read_only: b.rro,
                    recursive_read_only_applied: b.rro_applied,
                    idmap: b.idmap.clone(),
                })
                .collect(),
            block: self.spec.mode == VolumeMode::Block,
            device_bytes: 0,
            state: VolumeState::Ready,
            ownership_done: 0,
            frozen: None,
            trim: None,
            encryption: self.encrypted.as_ref().map(|e| EncryptionInfo {
                kind: "luks2",
                cipher: e.mapping.cipher.clone(),
                key_bits: e.mapping.key_bits,
                integrity: e.mapping.integrity.clone().unwrap_or_default(),
                allow_discards: e.mapping.allow_discards,
                mapping: e.mapping.name.clone(),
                luks_uuid: e.mapping.luks_uuid.clone(),
            }),
        }
    }

    /// Refuses what needs the publish finished (stats, expand, a bind)
    /// while the volume's fsGroup walk runs.
    pub(crate) fn not_publishing(&self) -> Result<(), Error> {
        match self.phase.running() {
            Some(job) => Err(Error::StillPublishing {
                id: self.id().to_string(),
                visited: job.visited(),
            }),
            None => Ok(()),
        }
    }

    /// Whether `mp` is a mount of this volume's disk: of its filesystem,
    /// or, for a block volume, a bind of its node.
    pub(crate) fn of_disk(&self, mp: &MountPoint) -> bool {
        let dev = (self.device.major, self.device.minor);
        match self.spec.mode {
            VolumeMode::Filesystem(_) => mp.dev == dev,
            VolumeMode::Block => mp.is_block_node(dev),
        }
    }

    /// Whether `mp` is the mount the agent made at the guest path: a mount
    /// root of the disk, with the recorded mount id where one was kept.
    pub(crate) fn is_own_mount(&self, mp: &MountPoint) -> bool {
        let recorded = self.phase.mount_id();
        mp.is_root && self.of_disk(mp) && recorded.is_none_or(|id| id == mp.mount_id)
    }

    /// Whether `mp` is bind `b` of this volume, as the agent made it.
    pub(crate) fn is_own_bind(&self, b: &Bind, mp: &MountPoint) -> bool {
        mp.is_root && self.of_disk(mp) && b.mount_id.is_none_or(|id| id == mp.mount_id)
    }

    /// Read-only as mounted: `read_only`, or an `ro` among the options.
    pub(crate) fn mounted_read_only(&self) -> bool {
        self.spec.options.read_only()
    }

    /// What its guest path is opened as: a directory, or (block) the
    /// device node bound onto a file.
    pub(crate) fn guest_path_kind(&self) -> OFlags {
        match self.spec.mode {
            VolumeMode::Filesystem(_) => OFlags::DIRECTORY,
            VolumeMode::Block => OFlags::empty(),
        }
    }

    /// `volumes/<id>`, relative to the root.
    pub(crate) fn rel(&self) -> PathBuf {
        guest_rel(self.id())
    }

    /// Which mount its guest path holds, for unmounting it by identity.
    pub(crate) fn mount_identity(&self) -> Expect {
        match self.phase.mount_id() {
            Some(id) => Expect::Mount(id, self.device.major, self.device.minor),
            None => Expect::Device(self.device.major, self.device.minor),
        }
    }

    /// Names the first parameter in which `asked` differs from this volume.
    pub(crate) fn differs_from(&self, asked: &Spec) -> Option<String> {
        let (mine, o) = (&self.spec, &asked.options);
        if mine.source != asked.source {
            return Some(format!("source {:?} vs {:?}", mine.source, asked.source));
        }
        if mine.mode != asked.mode {
            return Some(match (mine.mode, asked.mode) {
                (VolumeMode::Filesystem(a), VolumeMode::Filesystem(b)) => {
                    format!("fs_type {a} vs {b}")
                }
                (a, b) => format!("volume_mode {} vs {}", a.name(), b.name()),
            });
        }
        if mine.options.given() != o.given() {
            return Some(format!(
                "mount_options {:?} vs {:?}",
                mine.options.given(),
                o.given()
            ));
        }
        if mine.options.read_only_flag() != o.read_only_flag() {
            return Some(format!(
                "read_only {} vs {}",
                mine.options.read_only_flag(),
                o.read_only_flag()
            ));
        }
        if mine.encryption != asked.encryption {
            return Some(format!(
                "encryption {:?} vs {:?}",
                mine.encryption, asked.encryption
            ));
        }
        if mine.fs_group != asked.fs_group {
            return Some(format!(
                "fs_group {:?} vs {:?}",
                mine.fs_group, asked.fs_group
            ));
        }
        if mine.trim_interval_s != asked.trim_interval_s {
            return Some(format!(
                "trim_interval_s {} vs {}",
                mine.trim_interval_s, asked.trim_interval_s
            ));
        }
        None
    }
}

/// `volumes/<id>`: where volume `id` is published, relative to the root.
pub(crate) fn guest_rel(id: &str) -> PathBuf {
    Path::new("volumes").join(id)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;
    use crate::model::{FsType, Policy};
    use crate::volumes::request::{FsGroup, Options, PublishRequest};

    /// A filesystem volume with one bind, as recorded.
    pub(crate) fn sample() -> Volume {
        let options = vec!["noatime".into(), "weird%opt\twith\nbreaks".into()];
        Volume {
            spec: Spec {
                volume_id: "vol-1".into(),
                source: Source::Serial("vol-0123".into()),
                mode: VolumeMode::Filesystem(FsType::Xfs),
                options: Options::parse(options, false).unwrap(),
                fs_group: Some(FsGroup {
                    gid: 2000,
                    policy: Policy::OnRootMismatch,
                }),
                encryption: None,
                trim_interval_s: 0,
            },
            device: Device {
                name: "vdb".into(),
                path: "/dev/vdb".into(),
                major: 254,
                minor: 16,
                serial: Some("vol-0123".into()),
            },
            guest_path: "/r/volumes/vol-1".into(),
            phase: Phase::Published(Some(MountId(77))),
            ro_set: false,
            binds: vec![Bind {
                target: "/r/pods/a b".into(),
                rel: "pods/a b".into(),
                subpath: "data/x".into(),
                read_only: true,
                rro: RecursiveReadOnly::IfPossible,
                rro_applied: true,
                mount_id: Some(MountId(78)),
                idmap: None,
            }],
            encrypted: None,
        }
    }

    /// A read-only block volume with one bind, as recorded.
    pub(crate) fn block_sample() -> Volume {
        let mut v = sample();
        v.spec.volume_id = "blk-1".into();
        v.guest_path = "/r/volumes/blk-1".into();
        v.spec.mode = VolumeMode::Block;
        v.spec.options = Options::parse(Vec::new(), true).unwrap();
        v.spec.fs_group = None;
        v.ro_set = true;
        v.binds[0].subpath = PathBuf::new();
        v.binds[0].rro = RecursiveReadOnly::Disabled;
        v.binds[0].rro_applied = false;
        v
    }

    #[test]
    fn an_ro_option_counts_as_read_only() {
        let mut v = sample();
        assert!(!v.mounted_read_only());
        v.spec.options = Options::parse(vec!["noatime,ro".into()], false).unwrap();
        assert!(v.mounted_read_only() && v.info().read_only);
        v.spec.options = Options::parse(vec!["ro".into(), "rw".into()], false).unwrap();
        assert!(!v.mounted_read_only(), "a later rw overrides ro");
    }

    #[test]
    fn differences_are_named() {
        let v = sample();
        let mut req = PublishRequest {
            spec: v.spec.clone(),
            timeout: Duration::from_secs(1),
            key: None,
        };
        assert_eq!(v.differs_from(&req.spec), None);
        req.timeout = Duration::from_secs(9);
        assert_eq!(
            v.differs_from(&req.spec),
            None,
            "the wait is not a parameter of the volume"
        );
        req.spec.options = Options::parse(v.spec.options.given().to_vec(), true).unwrap();
        assert!(v.differs_from(&req.spec).unwrap().contains("read_only"));
        req.spec.options = v.spec.options.clone();
        req.spec.mode = VolumeMode::Filesystem(FsType::Ext4);
        assert!(v.differs_from(&req.spec).unwrap().contains("fs_type"));
        req.spec.mode = VolumeMode::Block;
        assert!(v
            .differs_from(&req.spec)
            .unwrap()
            .contains("volume_mode xfs vs block"));
    }
}

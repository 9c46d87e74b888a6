//! Proto ↔ domain, and nothing else: a request's fields validated into the
//! table's plain request types (every malformed field INVALID_ARGUMENT,
//! before anything touches the system), the table's answers and errors
//! back into the wire's messages and status codes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crossbeam_channel::TryRecvError;
use crust_protocols::crust::{self as pb, publish_volume_request::Source as PbSource};
use crust_protocols::protobuf::{EnumOrUnknown, MessageField};
use crust_protocols::ttrpc::{self, TtrpcContext};

use crate::cancel::{Cancel, Token, Why};
use crate::code::Code;
use crate::error::{Error, Result};
use crate::keys::source::{KeySource, RequestKey};
use crate::luks2::format::Mac;
use crate::model::{IdMap, IdRange, Policy, RecursiveReadOnly, VolumeMode};
use crate::mount::selinux::without_contexts;
use crate::stats::problem::Health;
use crate::stats::{Condition, Measured};
use crate::sys::mountinfo::shown;
use crate::system::{AgentInfo, Capability, Timeline};
use crate::validate::{self, Invalid};
use crate::volumes::freeze::{Frozen, Thaw};
use crate::volumes::health::Said;
use crate::volumes::lease;
use crate::volumes::request::{
    BindInfo, BindOutcome, BindRequest, Encryption, EncryptionInfo, Expanded, FsGroup, Options,
    PublishRequest, Published, Source, Spec, TrimInfo, VolumeInfo, VolumeState,
};
use crate::volumes::trim::Trimmed;
use zeroize::Zeroizing;

/// Who asked, for the request's cancellation: made only by the handlers
/// that wait for something, so a method answered from memory pays nothing.
pub enum Caller<'a> {
    /// A ttrpc client: its deadline, if it sent one, and its connection.
    Ttrpc(&'a TtrpcContext),
    /// An embedding program with its own deadline (None: none), or the
    /// event loop answering from memory (no deadline).
    Deadline(Option<Instant>),
}

impl Caller<'_> {
    /// The request's cancellation.
    pub fn cancel(&self) -> Cancel {
        match self {
            Caller::Ttrpc(ctx) => cancel_of(ctx),
            Caller::Deadline(None) => Cancel::never(),
            Caller::Deadline(Some(at)) => Cancel::never().with_deadline(*at),
        }
    }
}

/// The request's cancellation: the caller's ttrpc deadline, if it sent one,
/// and its connection — ttrpc disconnects `cancel_rx` when the caller goes.
fn cancel_of(ctx: &TtrpcContext) -> Cancel {
    let rx = ctx.cancel_rx.clone();
    let gone = Token::watching(Why::CallerGone, move || {
        matches!(rx.try_recv(), Err(TryRecvError::Disconnected))
    });
    let cancel = Cancel::never().with_token(&gone);
    match u64::try_from(ctx.timeout_nano) {
        Ok(n) if n > 0 => cancel.with_timeout(Duration::from_nanos(n)),
        _ => cancel,
    }
}

/// The ttrpc status code of an error class (the same numbers).
pub fn status_code(c: Code) -> ttrpc::Code {
    use crust_protocols::protobuf::Enum;
    ttrpc::Code::from_i32(c.number()).unwrap_or(ttrpc::Code::INTERNAL)
}

/// The contract's number of a capability.
pub fn capability(c: Capability) -> pb::Capability {
    match c {
        Capability::FsGroupAlways => pb::Capability::CAPABILITY_FS_GROUP_CHANGE_POLICY_ALWAYS,
        Capability::FsGroupOnRootMismatch => {
            pb::Capability::CAPABILITY_FS_GROUP_CHANGE_POLICY_ROOT_MISMATCH
        }
        Capability::Subpath => pb::Capability::CAPABILITY_SUBPATH,
        Capability::VolumeStats => pb::Capability::CAPABILITY_VOLUME_STATS,
        Capability::VolumeResize => pb::Capability::CAPABILITY_VOLUME_RESIZE,
        Capability::VolumeCondition => pb::Capability::CAPABILITY_VOLUME_CONDITION,
        Capability::RecursiveReadOnly => pb::Capability::CAPABILITY_RECURSIVE_READ_ONLY,
        Capability::BlockVolume => pb::Capability::CAPABILITY_BLOCK_VOLUME,
        Capability::Freeze => pb::Capability::CAPABILITY_FREEZE,
        Capability::Trim => pb::Capability::CAPABILITY_TRIM,
        Capability::VolumeHealth => pb::Capability::CAPABILITY_VOLUME_HEALTH,
        Capability::EncryptionLuks2 => pb::Capability::CAPABILITY_ENCRYPTION_LUKS2,
        Capability::IdmappedBinds => pb::Capability::CAPABILITY_IDMAPPED_BINDS,
        Capability::ScheduledTrim => pb::Capability::CAPABILITY_SCHEDULED_TRIM,
    }
}

/// An enum field's value, or INVALID_ARGUMENT naming the field for an unknown number.
fn known<E: crust_protocols::protobuf::Enum>(
    field: &str,
    v: EnumOrUnknown<E>,
) -> Result<E, Invalid> {
    v.enum_value()
        .map_err(|n| Invalid(format!("{field} has the unknown value {n}")))
}

/// PublishVolumeRequest → a validated domain request.
pub fn publish_request(req: &pb::PublishVolumeRequest) -> Result<PublishRequest, Error> {
    publish_request_with(req, req.mount_options.clone())
}

/// [`publish_request`] with `options` in place of the request's.
fn publish_request_with(
    req: &pb::PublishVolumeRequest,
    options: Vec<String>,
) -> Result<PublishRequest, Error> {
    validate::volume_id(&req.volume_id)?;
    let source = match &req.source {
        Some(PbSource::Serial(s)) => {
            validate::serial(s)?;
            Source::Serial(s.clone())
        }
        Some(PbSource::DevicePath(p)) => Source::Path(validate::device_path(p)?),
        _ => {
            return Err(Invalid(format!(
                "volume {}: no source; set serial (the virtio-blk serial) or device_path",
                req.volume_id
            ))
            .into())
        }
    };
    let mode = match known("volume_mode", req.volume_mode)? {
        pb::VolumeMode::FILESYSTEM => VolumeMode::Filesystem(validate::fs_type(&req.fs_type)?),
        pb::VolumeMode::BLOCK => {
            validate::block_publish(
                &req.volume_id,
                &req.fs_type,
                &options,
                req.fs_group.is_some(),
            )?;
            VolumeMode::Block
        }
    };
    let options = Options::parse(options, req.read_only)?;
    let fs_group = match req.fs_group.as_ref() {
        None => None,
        Some(g) => Some(FsGroup {
            gid: validate::gid(g.gid)?,
            policy: match known("fs_group.change_policy", g.change_policy)? {
                pb::FsGroupChangePolicy::ALWAYS => Policy::Always,
                pb::FsGroupChangePolicy::ON_ROOT_MISMATCH => Policy::OnRootMismatch,
            },
        }),
    };
    let (encryption, key) = encryption(req)?;
    Ok(PublishRequest {
        spec: Spec {
            volume_id: req.volume_id.clone(),
            source,
            mode,
            options,
            fs_group,
            encryption,
            trim_interval_s: validate::trim_interval(req.trim_interval_s)?,
        },
        timeout: validate::timeout(req.timeout_ms),
        key,
    })
}

/// A publish's encryption part → how the volume is opened, and its key.
fn encryption(
    req: &pb::PublishVolumeRequest,
) -> Result<(Option<Encryption>, Option<KeySource>), Error> {
    use pb::encryption::{Key, Kind};
    let Some(e) = req.encryption.as_ref() else {
        return Ok((None, None));
    };
    let id = &req.volume_id;
    match known("encryption.kind", e.kind)? {
        Kind::NONE
            if e.key.is_none()
                && !e.format_if_blank
                && !e.allow_discards
                && e.integrity.is_empty() =>
        {
            Ok((None, None))
        }
        Kind::NONE => Err(Invalid(format!(
            "volume {id}: encryption.kind is NONE, yet the encryption part sets a key or an option; set kind LUKS2, or leave the part unset"
        ))
        .into()),
        Kind::LUKS2 => {
            // A copy the agent zeroes; the request's own bytes go with the
            // request (docs/encryption.md says where they may linger).
            let key = e.key.as_ref().and_then(|k| match k {
                Key::Passphrase(p) => Some(RequestKey::Passphrase(Zeroizing::new(p.clone()))),
                Key::KeyUri(u) => Some(RequestKey::Uri(u.clone())),
                _ => None,
            });
            let key = KeySource::from_request(key)
                .map_err(|Invalid(why)| Invalid(format!("volume {id}: {why}")))?;
            let asked = Encryption {
                allow_discards: e.allow_discards,
                format_if_blank: e.format_if_blank,
                integrity: format_integrity(id, e)?,
            };
            Ok((Some(asked), Some(key)))
        }
    }
}

/// The integrity a LUKS2 publish asks its new volume to be made with:
/// only with format_if_blank (without it the header decides), only one the
/// agent makes, and never with allow_discards (dm-integrity under LUKS2
/// takes no discards).
fn format_integrity(id: &str, e: &pb::Encryption) -> Result<Option<Mac>, Error> {
    if e.integrity.is_empty() {
        return Ok(None);
    }
    // The value as sent, cut: a request may carry a long one.
    let cut: String = e.integrity.chars().take(64).collect();
    let more = if cut.len() < e.integrity.len() {
        "…"
    } else {
        ""
    };
    let shown = format!("{cut:?}{more}");
    let Some(mac) = Mac::from_flag(&e.integrity) else {
        let known: Vec<&str> = Mac::ALL.iter().map(|m| m.flag()).collect();
        return Err(Invalid(format!(
            "volume {id}: encryption.integrity {shown} is not one the agent makes ({}, or empty for none)",
            known.join(", ")
        ))
        .into());
    };
    if !e.format_if_blank {
        return Err(Invalid(format!(
            "volume {id}: encryption.integrity {shown} is only for a volume the agent makes (format_if_blank); an existing volume's header says its integrity"
        ))
        .into());
    }
    if e.allow_discards {
        return Err(Invalid(format!(
            "volume {id}: encryption.integrity {shown} with allow_discards: dm-integrity under LUKS2 takes no discards"
        ))
        .into());
    }
    Ok(Some(mac))
}

/// What ListVolumes says of an encrypted volume.
fn encryption_info(e: EncryptionInfo) -> pb::EncryptionInfo {
    pb::EncryptionInfo {
        kind: e.kind.into(),
        cipher: e.cipher,
        key_bits: e.key_bits,
        integrity: e.integrity,
        allow_discards: e.allow_discards,
        mapping: e.mapping,
        luks_uuid: e.luks_uuid,
        ..Default::default()
    }
}

/// [`publish_request`] in a guest with or without SELinux: without it,
/// SELinux context options mean nothing, so they are left out of the mount
/// and returned, to be said (in the answer and the log).
pub fn publish_request_in(
    req: &pb::PublishVolumeRequest,
    selinux: bool,
) -> Result<(PublishRequest, Vec<String>), Error> {
    let (kept, not_applied) = without_contexts(&req.mount_options, selinux);
    Ok((publish_request_with(req, kept)?, not_applied))
}

/// The table's answer to a publish → the wire's, with the SELinux options
/// left out of the mount (`publish_request_in`).
pub fn published(out: Published, not_applied: Vec<String>) -> pb::PublishVolumeResponse {
    pb::PublishVolumeResponse {
        guest_path: out.guest_path.display().to_string(),
        device: out.device.display().to_string(),
        already_published: out.already_published,
        ownership: match out.ownership {
            None => MessageField::none(),
            Some(r) => MessageField::some(pb::OwnershipReport {
                skipped: r.skipped,
                visited: r.visited,
                changed: r.changed,
                errors: r.errors,
                duration_us: u64::try_from(r.duration.as_micros()).unwrap_or(u64::MAX),
                mounts_skipped: r.mounts_skipped,
                skipped_mount_points: r.skipped_mount_points.iter().map(|p| shown(p)).collect(),
                ..Default::default()
            }),
        },
        options_not_applied: not_applied,
        ..Default::default()
    }
}

/// The capabilities this guest has → GetCapabilities' answer.
pub fn capabilities(caps: Vec<Capability>) -> pb::GetCapabilitiesResponse {
    pb::GetCapabilitiesResponse {
        capabilities: caps.into_iter().map(|c| capability(c).into()).collect(),
        ..Default::default()
    }
}

/// The filesystems the kernel mounts → GetSupportedFileSystems' answer.
pub fn file_systems(file_systems: Vec<String>) -> pb::GetSupportedFileSystemsResponse {
    pb::GetSupportedFileSystemsResponse {
        file_systems,
        ..Default::default()
    }
}

/// Unpublish's answer.
pub fn unpublished(was_published: bool) -> pb::UnpublishVolumeResponse {
    pb::UnpublishVolumeResponse {
        was_published,
        ..Default::default()
    }
}

/// A volume's size and condition → GetVolumeStats' answer. A device has no
/// used or available bytes, as CSI plugins report block volumes.
pub fn stats(measured: Option<Measured>, c: Condition) -> pb::GetVolumeStatsResponse {
    use pb::volume_usage::Unit;
    let usage = match measured {
        None => Vec::new(),
        Some(Measured::Block { device_bytes }) => vec![usage(0, device_bytes, 0, Unit::BYTES)],
        Some(Measured::Filesystem(u)) => vec![
            usage(u.bytes_available, u.bytes_total, u.bytes_used, Unit::BYTES),
            usage(
                u.inodes_available,
                u.inodes_total,
                u.inodes_used,
                Unit::INODES,
            ),
        ],
    };
    pb::GetVolumeStatsResponse {
        usage,
        condition: MessageField::some(pb::VolumeCondition {
            abnormal: c.abnormal,
            message: c.message,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Expand's answer, each size clamped to the wire's i64.
pub fn expanded(out: Expanded) -> pb::ExpandVolumeResponse {
    pb::ExpandVolumeResponse {
        capacity_bytes: i64::try_from(out.capacity_bytes).unwrap_or(i64::MAX),
        device_bytes: i64::try_from(out.device_bytes).unwrap_or(i64::MAX),
        ..Default::default()
    }
}

/// BindMount's answer.
pub fn bound(out: BindOutcome) -> pb::BindMountResponse {
    pb::BindMountResponse {
        recursive_read_only_applied: out.recursive_read_only_applied,
        already_mounted: out.already_mounted,
        ..Default::default()
    }
}

/// Unmount's answer.
pub fn unmounted(was_mounted: bool) -> pb::UnmountResponse {
    pb::UnmountResponse {
        was_mounted,
        ..Default::default()
    }
}

/// The table's list → ListVolumes' answer.
pub fn volumes(list: Vec<VolumeInfo>) -> pb::ListVolumesResponse {
    pb::ListVolumesResponse {
        volumes: list.into_iter().map(volume_info).collect(),
        ..Default::default()
    }
}

/// What the agent says of itself, its boot and its state directory →
/// GetAgentInfo's answer.
pub fn agent_info(
    i: AgentInfo,
    t: Timeline,
    state_problem: Option<String>,
) -> pb::GetAgentInfoResponse {
    pb::GetAgentInfoResponse {
        version: i.version.to_string(),
        kernel_release: i.kernel_release,
        init_mode: i.init_mode,
        uptime_ms: i.uptime_ms,
        rss_bytes: i.rss_bytes,
        state_problem: state_problem.unwrap_or_default(),
        boot: MessageField::some(pb::BootTimeline {
            agent_start_ms: t.agent_start_ms,
            mounts_done_ms: t.mounts_done_ms,
            modules_loaded_ms: t.modules_loaded_ms,
            listening_ms: t.listening_ms,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Shutdown's answer.
pub fn shut_down(volumes_unmounted: u32) -> pb::ShutdownResponse {
    pb::ShutdownResponse {
        volumes_unmounted,
        ..Default::default()
    }
}

/// BindMountRequest → a validated domain request; `target` is the table's
/// rule for a target beneath its root, which answers the canonical path.
pub fn bind_request(
    req: &pb::BindMountRequest,
    target: impl FnOnce(&str) -> Result<PathBuf, Invalid>,
) -> Result<BindRequest, Error> {
    validate::volume_id(&req.volume_id)?;
    let subpath = validate::subpath(&req.subpath)?;
    let rro = match known("recursive_read_only", req.recursive_read_only)? {
        pb::RecursiveReadOnly::DISABLED => RecursiveReadOnly::Disabled,
        pb::RecursiveReadOnly::IF_POSSIBLE => RecursiveReadOnly::IfPossible,
        pb::RecursiveReadOnly::ENABLED => RecursiveReadOnly::Enabled,
    };
    validate::recursive_read_only(req.read_only, rro)?;
    let ranges = |m: &[pb::IDMapping]| -> Vec<IdRange> {
        m.iter()
            .map(|r| IdRange {
                container_id: r.container_id,
                host_id: r.host_id,
                length: r.length,
            })
            .collect()
    };
    let idmap = validate::id_map(ranges(&req.uid_mappings), ranges(&req.gid_mappings))?;
    Ok(BindRequest {
        volume_id: req.volume_id.clone(),
        subpath,
        target: target(&req.target)?,
        read_only: req.read_only,
        recursive_read_only: rro,
        idmap,
    })
}

/// A bind's mappings on the wire: uids, gids (both empty for a plain bind).
fn id_mappings(m: Option<IdMap>) -> (Vec<pb::IDMapping>, Vec<pb::IDMapping>) {
    let wire = |v: Vec<IdRange>| -> Vec<pb::IDMapping> {
        v.into_iter()
            .map(|r| pb::IDMapping {
                host_id: r.host_id,
                container_id: r.container_id,
                length: r.length,
                ..Default::default()
            })
            .collect()
    };
    m.map_or_else(Default::default, |m| (wire(m.uids), wire(m.gids)))
}

/// ListVolumes' entry for a bind.
fn bind_info(b: BindInfo) -> pb::BindInfo {
    let (uid_mappings, gid_mappings) = id_mappings(b.idmap);
    pb::BindInfo {
        target: b.target,
        subpath: b.subpath,
        read_only: b.read_only,
        recursive_read_only: match b.recursive_read_only {
            RecursiveReadOnly::Disabled => pb::RecursiveReadOnly::DISABLED,
            RecursiveReadOnly::IfPossible => pb::RecursiveReadOnly::IF_POSSIBLE,
            RecursiveReadOnly::Enabled => pb::RecursiveReadOnly::ENABLED,
        }
        .into(),
        recursive_read_only_applied: b.recursive_read_only_applied,
        uid_mappings,
        gid_mappings,
        ..Default::default()
    }
}

/// One VolumeUsage entry, each count clamped to the wire's i64.
pub fn usage(
    available: u64,
    total: u64,
    used: u64,
    unit: pb::volume_usage::Unit,
) -> pb::VolumeUsage {
    let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    pb::VolumeUsage {
        available: clamp(available),
        total: clamp(total),
        used: clamp(used),
        unit: unit.into(),
        ..Default::default()
    }
}

/// ListVolumes' entry for a volume.
pub fn volume_info(v: VolumeInfo) -> pb::VolumeInfo {
    pb::VolumeInfo {
        volume_id: v.volume_id,
        device: v.device,
        serial: v.serial,
        fs_type: v.fs_type,
        guest_path: v.guest_path,
        read_only: v.read_only,
        bind_targets: v.bind_targets,
        binds: v.binds.into_iter().map(bind_info).collect(),
        volume_mode: if v.block {
            pb::VolumeMode::BLOCK
        } else {
            pb::VolumeMode::FILESYSTEM
        }
        .into(),
        device_bytes: v.device_bytes,
        state: match v.state {
            VolumeState::Ready => pb::VolumeState::VOLUME_STATE_READY,
            VolumeState::Publishing => pb::VolumeState::VOLUME_STATE_PUBLISHING,
        }
        .into(),
        ownership_done: v.ownership_done,
        freeze_id: v.frozen.as_ref().map(|f| f.0.clone()).unwrap_or_default(),
        frozen_ms_left: v
            .frozen
            .map_or(0, |f| u64::try_from(f.1.as_millis()).unwrap_or(u64::MAX)),
        encryption: MessageField::from_option(v.encryption.map(encryption_info)),
        trim: MessageField::from_option(v.trim.map(trim_info)),
        ..Default::default()
    }
}

/// What ListVolumes says of a volume's trim schedule.
fn trim_info(t: TrimInfo) -> pb::TrimSchedule {
    pb::TrimSchedule {
        interval_s: t.interval_s,
        last_unix_ms: t.last_unix_ms,
        last_bytes: t.last_bytes,
        last_duration_us: u64::try_from(t.last_duration.as_micros()).unwrap_or(u64::MAX),
        next_unix_ms: t.next_unix_ms,
        last_error: t.last_error.unwrap_or_default(),
        ..Default::default()
    }
}

/// The most volumes one freeze or thaw names: a pod's volumes, with room.
pub const MAX_GROUP: usize = crust_protocols::freeze::MAX_VOLUMES;

/// A freeze's or a thaw's volume ids, validated: 1 to MAX_GROUP, each
/// well formed, none twice.
pub fn volume_ids(ids: &[String]) -> Result<Vec<String>, Invalid> {
    if ids.is_empty() || ids.len() > MAX_GROUP {
        return Err(Invalid(format!(
            "volume_ids names {} volumes; name 1 to {MAX_GROUP}",
            ids.len()
        )));
    }
    for (i, id) in ids.iter().enumerate() {
        validate::volume_id(id)?;
        if ids[..i].contains(id) {
            return Err(Invalid(format!("volume_ids names {id} twice")));
        }
    }
    Ok(ids.to_vec())
}

/// A freeze's timeout: 0 is the default; more than the maximum is refused.
pub fn freeze_timeout(ms: u32) -> Result<Duration, Invalid> {
    let asked = Duration::from_millis(u64::from(ms));
    match asked {
        d if d.is_zero() => Ok(lease::DEFAULT_TIMEOUT),
        d if d > lease::MAX_TIMEOUT => Err(Invalid(format!(
            "timeout_ms {ms} is longer than the longest freeze, {} ms: a pod's writes wait for all of it",
            lease::MAX_TIMEOUT.as_millis()
        ))),
        d => Ok(d),
    }
}

/// A freeze's own id, if the caller named one.
pub fn freeze_id(id: &str) -> Result<Option<&str>, Invalid> {
    if id.is_empty() {
        return Ok(None);
    }
    crust_protocols::freeze::check_id(id).map_err(Invalid)?;
    Ok(Some(id))
}

/// What a ThawVolumes request ends: the freeze it names, or (with force)
/// whatever holds the volumes it names; anything else is refused, since
/// volume ids alone would end whatever holds them, another caller's freeze
/// among them.
pub fn thaw_request(req: &pb::ThawVolumesRequest) -> Result<Thaw, Invalid> {
    let named = !req.freeze_id.is_empty();
    match (req.force, named, req.volume_ids.is_empty()) {
        (false, true, true) => {
            crust_protocols::freeze::check_id(&req.freeze_id).map_err(Invalid)?;
            Ok(Thaw::Freeze(req.freeze_id.clone()))
        }
        (true, false, false) => Ok(Thaw::Force(volume_ids(&req.volume_ids)?)),
        (true, true, _) => Err(Invalid(
            "force ends whatever holds the volumes named in volume_ids; it takes no freeze_id".into(),
        )),
        (false, true, false) => Err(Invalid(
            "a thaw by freeze_id ends all of that freeze; it takes no volume_ids".into(),
        )),
        (false, false, false) => Err(Invalid(
            "a thaw names the freeze it ends (freeze_id): volume ids alone would end whatever holds them, another caller's freeze among them; to do that on purpose, set force".into(),
        )),
        (_, false, true) => Err(Invalid(
            "a thaw names the freeze it ends (freeze_id), or sets force and names volume_ids".into(),
        )),
    }
}

/// FreezeVolumes' answer.
pub fn frozen(f: Frozen) -> pb::FreezeVolumesResponse {
    pb::FreezeVolumesResponse {
        freeze_id: f.freeze_id,
        thaw_at_unix_ms: f.thaw_at_unix_ms,
        timeout_ms: u32::try_from(f.timeout.as_millis()).unwrap_or(u32::MAX),
        ..Default::default()
    }
}

/// ThawVolumes' answer.
pub fn thawed(thawed: Vec<String>) -> pb::ThawVolumesResponse {
    pb::ThawVolumesResponse {
        thawed,
        ..Default::default()
    }
}

/// TrimVolume's answer.
pub fn trimmed(t: Trimmed) -> pb::TrimVolumeResponse {
    pb::TrimVolumeResponse {
        trimmed_bytes: t.trimmed_bytes,
        covered_bytes: t.covered_bytes,
        duration_us: u64::try_from(t.duration.as_micros()).unwrap_or(u64::MAX),
        ..Default::default()
    }
}

/// GetVolumeHealth's answer: CSI's list, empty when healthy.
pub fn health(said: Vec<Said>) -> pb::GetVolumeHealthResponse {
    use pb::volume_health::Status;
    pb::GetVolumeHealthResponse {
        health: said
            .into_iter()
            .map(|s| pb::VolumeHealth {
                status: match s.status {
                    Health::Inaccessible => Status::INACCESSIBLE,
                    Health::DataLoss => Status::DATA_LOSS,
                    Health::Degraded => Status::DEGRADED,
                }
                .into(),
                reason: s.reason.to_string(),
                message: s.message,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::protobuf::MessageField;

    type Mutation<T> = Box<dyn Fn(&mut T)>;

    fn publish() -> pb::PublishVolumeRequest {
        let mut r = pb::PublishVolumeRequest::new();
        r.volume_id = "vol-1".into();
        r.set_serial("vol-0123".into());
        r.fs_type = "ext4".into();
        r
    }

    #[test]
    fn stats_answers_carry_bytes_inodes_and_the_condition() {
        let sick = Condition {
            abnormal: true,
            message: "disk vdb is gone".into(),
            problems: Vec::new(),
        };
        let r = stats(Some(Measured::Block { device_bytes: 5 }), sick.clone());
        assert_eq!(r.usage.len(), 1);
        assert_eq!((r.usage[0].total, r.usage[0].used), (5, 0));
        assert_eq!(r.condition.message, "disk vdb is gone");
        assert!(r.condition.abnormal);
        let u = crate::stats::Usage {
            bytes_total: u64::MAX,
            bytes_available: 1,
            bytes_used: 2,
            inodes_total: 10,
            inodes_available: 7,
            inodes_used: 3,
        };
        let r = stats(Some(Measured::Filesystem(u)), sick);
        assert_eq!(r.usage.len(), 2);
        assert_eq!(r.usage[0].total, i64::MAX, "clamped to the wire's i64");
        assert_eq!(
            r.usage[1].unit.enum_value(),
            Ok(pb::volume_usage::Unit::INODES)
        );
        assert_eq!((r.usage[1].available, r.usage[1].used), (7, 3));
        assert!(stats(
            None,
            Condition {
                abnormal: false,
                message: "ok".into(),
                problems: Vec::new(),
            }
        )
        .usage
        .is_empty());
    }

    #[test]
    fn publish_requests_are_translated() {
        let mut r = publish();
        r.mount_options = vec!["noatime".into(), "discard".into()];
        let mut g = pb::FsGroup::new();
        g.gid = 2000;
        g.change_policy = pb::FsGroupChangePolicy::ON_ROOT_MISMATCH.into();
        r.fs_group = MessageField::some(g);
        let d = publish_request(&r).unwrap().spec;
        assert_eq!(d.source, Source::Serial("vol-0123".into()));
        assert_eq!(
            d.fs_group,
            Some(FsGroup {
                gid: 2000,
                policy: Policy::OnRootMismatch
            })
        );
        assert_eq!(
            publish_request(&r).unwrap().timeout,
            validate::DEFAULT_TIMEOUT
        );
        assert_eq!(d.options.mount().data, "discard");
        assert_ne!(d.options.mount().flags & libc::MS_NOATIME, 0);
    }

    #[test]
    fn bad_publish_requests_are_invalid_argument() {
        let cases: Vec<(&str, Mutation<pb::PublishVolumeRequest>)> = vec![
            ("empty id", Box::new(|r| r.volume_id.clear())),
            ("bad id", Box::new(|r| r.volume_id = "../x".into())),
            ("no source", Box::new(|r| r.source = None)),
            ("long serial", Box::new(|r| r.set_serial("x".repeat(21)))),
            ("bad serial", Box::new(|r| r.set_serial("a b".into()))),
            (
                "path outside /dev",
                Box::new(|r| r.set_device_path("/tmp/disk".into())),
            ),
            (
                "relative path",
                Box::new(|r| r.set_device_path("vdb".into())),
            ),
            ("fs type", Box::new(|r| r.fs_type = "btrfs".into())),
            ("no fs type", Box::new(|r| r.fs_type.clear())),
            (
                "bind option",
                Box::new(|r| r.mount_options = vec!["bind".into()]),
            ),
            (
                "remount option",
                Box::new(|r| r.mount_options = vec!["noatime,remount".into()]),
            ),
            (
                "propagation",
                Box::new(|r| r.mount_options = vec!["rshared".into()]),
            ),
            (
                "gid -1",
                Box::new(|r| {
                    let mut g = pb::FsGroup::new();
                    g.gid = u32::MAX;
                    r.fs_group = MessageField::some(g);
                }),
            ),
            (
                "unknown policy",
                Box::new(|r| {
                    let mut g = pb::FsGroup::new();
                    g.change_policy = EnumOrUnknown::from_i32(7);
                    r.fs_group = MessageField::some(g);
                }),
            ),
        ];
        let block = |r: &mut pb::PublishVolumeRequest| {
            r.volume_mode = pb::VolumeMode::BLOCK.into();
            r.fs_type.clear();
        };
        let more: Vec<(&str, Mutation<pb::PublishVolumeRequest>)> = vec![
            (
                "BLOCK with fs_type",
                Box::new(|r| r.volume_mode = pb::VolumeMode::BLOCK.into()),
            ),
            (
                "BLOCK with mount options",
                Box::new(move |r| {
                    block(r);
                    r.mount_options = vec!["noatime".into()];
                }),
            ),
            (
                "BLOCK with fs_group",
                Box::new(move |r| {
                    block(r);
                    r.fs_group = MessageField::some(pb::FsGroup::new());
                }),
            ),
            (
                "unknown mode",
                Box::new(|r| r.volume_mode = EnumOrUnknown::from_i32(5)),
            ),
        ];
        for (what, mutate) in cases.into_iter().chain(more) {
            let mut r = publish();
            mutate(&mut r);
            let e = publish_request(&r).expect_err(what);
            assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e}");
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn block_publish_requests_name_no_filesystem() {
        let mut r = publish();
        r.volume_mode = pb::VolumeMode::BLOCK.into();
        r.fs_type.clear();
        r.read_only = true;
        let d = publish_request(&r).unwrap().spec;
        assert_eq!(d.mode, VolumeMode::Block);
        assert!(d.options.read_only_flag() && d.options.given().is_empty() && d.fs_group.is_none());
        assert!(d.options.read_only());
    }

    #[test]
    fn bind_requests_are_checked() {
        let mut r = pb::BindMountRequest::new();
        r.volume_id = "v".into();
        r.subpath = "data".into();
        r.read_only = true;
        r.recursive_read_only = pb::RecursiveReadOnly::ENABLED.into();
        let root = |t: &str| validate::target(std::path::Path::new("/run/crust"), t);
        r.target = "/run/crust//pods/a/".into();
        let d = bind_request(&r, root).unwrap();
        assert_eq!(d.recursive_read_only, RecursiveReadOnly::Enabled);
        // The target as the table's rule answers it: canonical.
        assert_eq!(d.target, std::path::Path::new("/run/crust/pods/a"));
        let bad: Vec<Mutation<pb::BindMountRequest>> = vec![
            Box::new(|r| r.read_only = false),
            Box::new(|r| r.recursive_read_only = EnumOrUnknown::from_i32(9)),
            Box::new(|r| r.subpath = "../x".into()),
            Box::new(|r| r.subpath = "/etc".into()),
            Box::new(|r| r.volume_id.clear()),
            Box::new(|r| r.target = "/tmp/a".into()),
            Box::new(|r| r.target = "/run/crust/volumes/v".into()),
        ];
        for (i, mutate) in bad.iter().enumerate() {
            let mut r2 = r.clone();
            mutate(&mut r2);
            let e = bind_request(&r2, root).expect_err(&format!("case {i}"));
            assert_eq!(e.code(), Code::InvalidArgument, "case {i}: {e}");
        }
    }

    /// Mappings come through as CRI names them (container, host, length),
    /// checked by validate::id_map, and go back out in ListVolumes alike.
    #[test]
    fn bind_mappings_are_checked_and_listed() {
        let m = |container_id, host_id, length| pb::IDMapping {
            container_id,
            host_id,
            length,
            ..Default::default()
        };
        let mut r = pb::BindMountRequest::new();
        r.volume_id = "v".into();
        r.target = "/run/crust/pods/a".into();
        r.uid_mappings = vec![m(0, 100000, 65536)];
        r.gid_mappings = vec![m(0, 200000, 65536)];
        let root = |t: &str| validate::target(std::path::Path::new("/run/crust"), t);
        let map = bind_request(&r, root).unwrap().idmap.unwrap();
        assert_eq!(
            (
                map.uids[0].container_id,
                map.uids[0].host_id,
                map.uids[0].length
            ),
            (0, 100000, 65536)
        );
        assert_eq!(map.gids[0].host_id, 200000);
        let (u, g) = id_mappings(Some(map));
        assert_eq!((u, g), (r.uid_mappings.clone(), r.gid_mappings.clone()));
        assert_eq!(id_mappings(None), (vec![], vec![]));
        for bad in [vec![], vec![m(0, 1, 0)], vec![m(0, 1, 5), m(4, 9, 1)]] {
            let mut r2 = r.clone();
            r2.gid_mappings = bad;
            let e = bind_request(&r2, root).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        }
    }

    #[test]
    fn a_caller_that_disconnects_cancels_its_request() {
        let (gone_tx, gone_rx) = crossbeam_channel::unbounded::<()>();
        let (res_tx, _res_rx) = std::sync::mpsc::channel();
        let ctx = TtrpcContext {
            fd: -1,
            cancel_rx: gone_rx,
            mh: Default::default(),
            res_tx,
            metadata: Default::default(),
            timeout_nano: 60_000_000_000,
            conn_ctx: Default::default(),
        };
        let cancel = Caller::Ttrpc(&ctx).cancel();
        assert_eq!(cancel.why(), None);
        assert!(
            cancel.deadline().is_some(),
            "the ttrpc timeout is the deadline"
        );
        drop(gone_tx);
        let e = cancel.check(|| "waiting".into()).unwrap_err();
        assert_eq!(e.why, Why::CallerGone);
        assert_eq!(status_code(e.code()), ttrpc::Code::CANCELLED);
    }

    #[test]
    fn every_code_has_a_status() {
        for c in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::DeadlineExceeded,
            Code::OutOfRange,
            Code::Internal,
            Code::Unimplemented,
            Code::Cancelled,
            Code::ResourceExhausted,
        ] {
            assert_eq!(format!("{:?}", status_code(c)), c.name());
        }
    }

    #[test]
    fn the_walk_report_names_the_mount_points_it_did_not_enter() {
        use crate::ownership::walk::Report;
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let out = Published {
            guest_path: "/run/crust/volumes/v".into(),
            device: "/dev/vdb".into(),
            already_published: false,
            ownership: Some(Report {
                visited: 10,
                changed: 9,
                duration: Duration::from_micros(1500),
                mounts_skipped: 20,
                skipped_mount_points: vec![
                    "data/cache".into(),
                    PathBuf::from(OsString::from_vec(b"bad\xffname".to_vec())),
                ],
                ..Report::default()
            }),
        };
        let r = published(out, Vec::new());
        let o = r.ownership.as_ref().expect("a report");
        assert_eq!((o.visited, o.changed, o.duration_us), (10, 9, 1500));
        assert_eq!(o.mounts_skipped, 20, "all are counted");
        assert_eq!(
            o.skipped_mount_points,
            ["data/cache", "bad\\xffname"],
            "bytes that are not UTF-8 are shown as \\xNN"
        );
        // No fsGroup: no report.
        let none = Published {
            guest_path: "/g".into(),
            device: "/d".into(),
            already_published: false,
            ownership: None,
        };
        assert!(published(none, Vec::new()).ownership.is_none());
    }

    /// `encryption.integrity`: a MAC the agent makes, only when a blank
    /// disk may be made (LUKS2, format_if_blank) and without discards;
    /// every other use is INVALID_ARGUMENT, naming the field.
    #[test]
    fn integrity_is_asked_only_of_a_volume_the_agent_makes() {
        use crate::luks2::format::Mac;
        let with = |kind: pb::encryption::Kind, integrity: &str, format: bool, discards: bool| {
            let mut r = publish();
            let mut e = pb::Encryption::new();
            e.kind = kind.into();
            e.set_passphrase(b"pw".to_vec());
            e.format_if_blank = format;
            e.allow_discards = discards;
            e.integrity = integrity.into();
            r.encryption = MessageField::some(e);
            publish_request(&r)
        };
        let luks2 = pb::encryption::Kind::LUKS2;
        let asked = with(luks2, "hmac-sha256", true, false).unwrap();
        assert_eq!(
            asked.spec.encryption.unwrap().integrity,
            Some(Mac::HmacSha256)
        );
        let none = with(luks2, "", true, false).unwrap();
        assert_eq!(none.spec.encryption.unwrap().integrity, None);
        let long = "x".repeat(5000);
        for (kind, integrity, format, discards, says) in [
            (
                luks2,
                "hmac-sha512",
                true,
                false,
                "\"hmac-sha512\" is not one the agent makes (hmac-sha256",
            ),
            (
                luks2,
                "hmac(sha256)",
                true,
                false,
                "not one the agent makes",
            ),
            (luks2, long.as_str(), true, false, "…"),
            (
                luks2,
                "hmac-sha256",
                false,
                false,
                "only for a volume the agent makes (format_if_blank)",
            ),
            (
                luks2,
                "hmac-sha256",
                true,
                true,
                "dm-integrity under LUKS2 takes no discards",
            ),
            (
                pb::encryption::Kind::NONE,
                "hmac-sha256",
                false,
                false,
                "encryption.kind is NONE",
            ),
        ] {
            let e = with(kind, integrity, format, discards).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e}");
            let said = e.to_string();
            assert!(
                said.contains(says) && said.starts_with("volume vol-1: "),
                "{says}: {said}"
            );
            assert!(said.len() < 400, "{said}");
        }
    }
}

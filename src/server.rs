//! The ttrpc service `crust.v1.Agent`: translates protobuf requests into
//! validated domain requests, calls the volume table, and translates results
//! and errors back (error → status code). Nothing else happens here. Every
//! handler runs under `catch_unwind`, so a bug answers INTERNAL instead of
//! taking PID 1 down, and logs one line with method, volume, code and time.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::TryRecvError;
use crust_protocols::crust::{self as pb, publish_volume_request::Source as PbSource};
use crust_protocols::crust_ttrpc;
use crust_protocols::protobuf::{EnumOrUnknown, MessageField};
use crust_protocols::ttrpc::{self, TtrpcContext};
use slog::{debug, info, warn, Logger};

use crate::cancel::{Cancel, Token, Why};
use crate::errors::{Code, Error, Result};
use crate::mount::RecursiveReadOnly;
use crate::ownership::Policy;
use crate::stats::Measured;
use crate::system::{self, Capability, Gate, Timeline};
use crate::validate::{self, Invalid};
use crate::volumes::{self, BindRequest, FsGroup, PublishRequest, Source, VolumeMode, Volumes};

/// The service state shared by all connections.
pub struct Service {
    volumes: Arc<Volumes>,
    log: Logger,
    started: Instant,
    timeline: Arc<Mutex<Timeline>>,
    /// Told once a Shutdown request has unmounted everything.
    shutdown: Mutex<Option<Sender<()>>>,
    /// Open once the kernel modules for disks and filesystems are loaded.
    modules: Arc<Gate>,
}

/// How long a request waits for the boot's module loading before going on anyway.
const MODULES_WAIT: Duration = Duration::from_secs(60);

impl Service {
    /// A service over `volumes`; `shutdown` is signalled after a Shutdown
    /// request; disk operations wait for `modules` to open.
    pub fn new(
        volumes: Arc<Volumes>,
        log: Logger,
        started: Instant,
        timeline: Arc<Mutex<Timeline>>,
        shutdown: Sender<()>,
        modules: Arc<Gate>,
    ) -> Service {
        Service {
            volumes,
            log,
            started,
            timeline,
            shutdown: Mutex::new(Some(shutdown)),
            modules,
        }
    }

    /// Runs one request: catches panics, logs the outcome, maps the error.
    fn handle<T>(
        &self,
        method: &'static str,
        volume: &str,
        f: impl FnOnce() -> Result<T>,
    ) -> ttrpc::Result<T> {
        let start = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(Error::Panic(method, what))
        });
        let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        match &result {
            Ok(_) => {
                info!(self.log, "request"; "method" => method, "volume" => volume, "code" => "OK", "duration_us" => us)
            }
            Err(e) => {
                warn!(self.log, "request"; "method" => method, "volume" => volume, "code" => e.code().name(),
                            "duration_us" => us, "error" => %e)
            }
        }
        result.map_err(|e| {
            ttrpc::Error::RpcStatus(ttrpc::get_status(status_code(e.code()), e.to_string()))
        })
    }
}

/// The request's cancellation: the caller's ttrpc deadline, if it sent one,
/// and its connection — ttrpc disconnects `cancel_rx` when the caller goes.
pub(crate) fn cancel_of(ctx: &TtrpcContext) -> Cancel {
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

/// The ttrpc status code of an error class.
pub fn status_code(c: Code) -> ttrpc::Code {
    match c {
        Code::InvalidArgument => ttrpc::Code::INVALID_ARGUMENT,
        Code::NotFound => ttrpc::Code::NOT_FOUND,
        Code::AlreadyExists => ttrpc::Code::ALREADY_EXISTS,
        Code::FailedPrecondition => ttrpc::Code::FAILED_PRECONDITION,
        Code::DeadlineExceeded => ttrpc::Code::DEADLINE_EXCEEDED,
        Code::OutOfRange => ttrpc::Code::OUT_OF_RANGE,
        Code::Internal => ttrpc::Code::INTERNAL,
        Code::Unimplemented => ttrpc::Code::UNIMPLEMENTED,
        Code::Cancelled => ttrpc::Code::CANCELLED,
        Code::ResourceExhausted => ttrpc::Code::RESOURCE_EXHAUSTED,
    }
}

fn capability(c: Capability) -> pb::Capability {
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
                &req.mount_options,
                req.fs_group.is_some(),
            )?;
            VolumeMode::Block
        }
    };
    let mount = crate::mount::parse_options(&req.mount_options, req.read_only)?;
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
    Ok(PublishRequest {
        volume_id: req.volume_id.clone(),
        source,
        mode,
        options: req.mount_options.clone(),
        mount,
        read_only: req.read_only,
        fs_group,
        timeout: validate::timeout(req.timeout_ms),
    })
}

/// [`publish_request`] in a guest with or without SELinux: without it,
/// SELinux context options mean nothing, so they are left out of the mount
/// and returned, to be said (in the answer and the log).
pub fn publish_request_in(
    req: &pb::PublishVolumeRequest,
    selinux: bool,
) -> Result<(PublishRequest, Vec<String>), Error> {
    let (kept, not_applied) = crate::mount::selinux::without_contexts(&req.mount_options, selinux);
    if not_applied.is_empty() {
        return Ok((publish_request(req)?, not_applied));
    }
    let req = pb::PublishVolumeRequest {
        mount_options: kept,
        ..req.clone()
    };
    Ok((publish_request(&req)?, not_applied))
}

/// BindMountRequest → a validated domain request; `target` validates the
/// target and gives its canonical spelling (`Volumes::target`).
pub fn bind_request(
    target: &dyn Fn(&str) -> Result<PathBuf, Invalid>,
    req: &pb::BindMountRequest,
) -> Result<BindRequest, Error> {
    validate::volume_id(&req.volume_id)?;
    let subpath = validate::subpath(&req.subpath)?;
    let target = target(&req.target)?;
    let rro = match known("recursive_read_only", req.recursive_read_only)? {
        pb::RecursiveReadOnly::DISABLED => RecursiveReadOnly::Disabled,
        pb::RecursiveReadOnly::IF_POSSIBLE => RecursiveReadOnly::IfPossible,
        pb::RecursiveReadOnly::ENABLED => RecursiveReadOnly::Enabled,
    };
    validate::recursive_read_only(req.read_only, rro)?;
    Ok(BindRequest {
        volume_id: req.volume_id.clone(),
        subpath,
        target,
        read_only: req.read_only,
        recursive_read_only: rro,
    })
}

fn usage(available: u64, total: u64, used: u64, unit: pb::volume_usage::Unit) -> pb::VolumeUsage {
    let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    pb::VolumeUsage {
        available: clamp(available),
        total: clamp(total),
        used: clamp(used),
        unit: unit.into(),
        ..Default::default()
    }
}

fn volume_info(v: volumes::VolumeInfo) -> pb::VolumeInfo {
    pb::VolumeInfo {
        volume_id: v.volume_id,
        device: v.device,
        serial: v.serial,
        fs_type: v.fs_type,
        guest_path: v.guest_path,
        read_only: v.read_only,
        bind_targets: v.bind_targets,
        volume_mode: if v.block {
            pb::VolumeMode::BLOCK
        } else {
            pb::VolumeMode::FILESYSTEM
        }
        .into(),
        device_bytes: v.device_bytes,
        ..Default::default()
    }
}

impl crust_ttrpc::Agent for Service {
    fn get_capabilities(
        &self,
        _: &TtrpcContext,
        _: pb::GetCapabilitiesRequest,
    ) -> ttrpc::Result<pb::GetCapabilitiesResponse> {
        self.handle("GetCapabilities", "", || {
            Ok(pb::GetCapabilitiesResponse {
                capabilities: system::capabilities()
                    .into_iter()
                    .map(|c| capability(c).into())
                    .collect(),
                ..Default::default()
            })
        })
    }

    fn get_supported_file_systems(
        &self,
        ctx: &TtrpcContext,
        _: pb::GetSupportedFileSystemsRequest,
    ) -> ttrpc::Result<pb::GetSupportedFileSystemsResponse> {
        self.handle("GetSupportedFileSystems", "", || {
            self.modules.wait(MODULES_WAIT, &cancel_of(ctx));
            Ok(pb::GetSupportedFileSystemsResponse {
                file_systems: system::supported_filesystems()?,
                ..Default::default()
            })
        })
    }

    fn publish_volume(
        &self,
        ctx: &TtrpcContext,
        req: pb::PublishVolumeRequest,
    ) -> ttrpc::Result<pb::PublishVolumeResponse> {
        self.handle("PublishVolume", &req.volume_id, || {
            let (domain, not_applied) = publish_request_in(&req, crate::mount::selinux::enabled())?;
            if !not_applied.is_empty() {
                info!(self.log, "SELinux options left out: the guest has no SELinux";
                      "method" => "PublishVolume", "volume" => &req.volume_id,
                      "options_not_applied" => not_applied.join(" "));
            }
            let cancel = cancel_of(ctx);
            // Device lookup needs virtio_blk, an xfs mount needs xfs: both may still be loading.
            self.modules.wait(MODULES_WAIT, &cancel);
            let out = self.volumes.publish(&domain, &cancel)?;
            Ok(pb::PublishVolumeResponse {
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
                        ..Default::default()
                    }),
                },
                options_not_applied: not_applied,
                ..Default::default()
            })
        })
    }

    fn unpublish_volume(
        &self,
        ctx: &TtrpcContext,
        req: pb::UnpublishVolumeRequest,
    ) -> ttrpc::Result<pb::UnpublishVolumeResponse> {
        self.handle("UnpublishVolume", &req.volume_id, || {
            validate::volume_id(&req.volume_id)?;
            let was_published = self.volumes.unpublish(&req.volume_id, &cancel_of(ctx))?;
            Ok(pb::UnpublishVolumeResponse {
                was_published,
                ..Default::default()
            })
        })
    }

    fn get_volume_stats(
        &self,
        ctx: &TtrpcContext,
        req: pb::GetVolumeStatsRequest,
    ) -> ttrpc::Result<pb::GetVolumeStatsResponse> {
        self.handle("GetVolumeStats", &req.volume_id, || {
            validate::volume_id(&req.volume_id)?;
            let (u, c) = self.volumes.stats(&req.volume_id, &cancel_of(ctx))?;
            let usage = match u {
                None => Vec::new(),
                // A device has no used or available bytes, as CSI plugins report block volumes.
                Some(Measured::Block { device_bytes }) => {
                    vec![usage(0, device_bytes, 0, pb::volume_usage::Unit::BYTES)]
                }
                Some(Measured::Filesystem(u)) => vec![
                    usage(
                        u.bytes_available,
                        u.bytes_total,
                        u.bytes_used,
                        pb::volume_usage::Unit::BYTES,
                    ),
                    usage(
                        u.inodes_available,
                        u.inodes_total,
                        u.inodes_used,
                        pb::volume_usage::Unit::INODES,
                    ),
                ],
            };
            Ok(pb::GetVolumeStatsResponse {
                usage,
                condition: MessageField::some(pb::VolumeCondition {
                    abnormal: c.abnormal,
                    message: c.message,
                    ..Default::default()
                }),
                ..Default::default()
            })
        })
    }

    fn expand_volume(
        &self,
        ctx: &TtrpcContext,
        req: pb::ExpandVolumeRequest,
    ) -> ttrpc::Result<pb::ExpandVolumeResponse> {
        self.handle("ExpandVolume", &req.volume_id, || {
            validate::volume_id(&req.volume_id)?;
            let required = validate::required_bytes(req.required_bytes)?;
            let out = self.volumes.expand(
                &req.volume_id,
                required,
                validate::timeout(req.timeout_ms),
                &cancel_of(ctx),
            )?;
            Ok(pb::ExpandVolumeResponse {
                capacity_bytes: i64::try_from(out.capacity_bytes).unwrap_or(i64::MAX),
                device_bytes: i64::try_from(out.device_bytes).unwrap_or(i64::MAX),
                ..Default::default()
            })
        })
    }

    fn bind_mount(
        &self,
        ctx: &TtrpcContext,
        req: pb::BindMountRequest,
    ) -> ttrpc::Result<pb::BindMountResponse> {
        self.handle("BindMount", &req.volume_id, || {
            let out = self.volumes.bind(
                &bind_request(&|t| self.volumes.target(t), &req)?,
                &cancel_of(ctx),
            )?;
            Ok(pb::BindMountResponse {
                recursive_read_only_applied: out.recursive_read_only_applied,
                already_mounted: out.already_mounted,
                ..Default::default()
            })
        })
    }

    fn unmount(
        &self,
        ctx: &TtrpcContext,
        req: pb::UnmountRequest,
    ) -> ttrpc::Result<pb::UnmountResponse> {
        self.handle("Unmount", "", || {
            let target = self.volumes.target(&req.target)?;
            let was_mounted = self.volumes.unmount(&target, &cancel_of(ctx))?;
            Ok(pb::UnmountResponse {
                was_mounted,
                ..Default::default()
            })
        })
    }

    fn list_volumes(
        &self,
        _: &TtrpcContext,
        _: pb::ListVolumesRequest,
    ) -> ttrpc::Result<pb::ListVolumesResponse> {
        self.handle("ListVolumes", "", || {
            Ok(pb::ListVolumesResponse {
                volumes: self.volumes.list().into_iter().map(volume_info).collect(),
                ..Default::default()
            })
        })
    }

    fn get_agent_info(
        &self,
        _: &TtrpcContext,
        _: pb::GetAgentInfoRequest,
    ) -> ttrpc::Result<pb::GetAgentInfoResponse> {
        self.handle("GetAgentInfo", "", || {
            let t = *self.timeline.lock().unwrap_or_else(|p| p.into_inner());
            let i = system::agent_info(self.started, t)?;
            Ok(pb::GetAgentInfoResponse {
                version: i.version.to_string(),
                kernel_release: i.kernel_release,
                init_mode: i.init_mode,
                uptime_ms: i.uptime_ms,
                rss_bytes: i.rss_bytes,
                state_problem: self.volumes.state_problem().unwrap_or_default(),
                boot: MessageField::some(pb::BootTimeline {
                    agent_start_ms: t.agent_start_ms,
                    mounts_done_ms: t.mounts_done_ms,
                    modules_loaded_ms: t.modules_loaded_ms,
                    listening_ms: t.listening_ms,
                    ..Default::default()
                }),
                ..Default::default()
            })
        })
    }

    fn shutdown(
        &self,
        _: &TtrpcContext,
        _: pb::ShutdownRequest,
    ) -> ttrpc::Result<pb::ShutdownResponse> {
        self.handle("Shutdown", "", || {
            let volumes_unmounted = self.volumes.shutdown();
            if let Some(tx) = self
                .shutdown
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
            {
                debug!(self.log, "shutdown requested");
                let _ = tx.send(());
            }
            Ok(pb::ShutdownResponse {
                volumes_unmounted,
                ..Default::default()
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Mutation<T> = Box<dyn Fn(&mut T)>;

    fn publish() -> pb::PublishVolumeRequest {
        let mut r = pb::PublishVolumeRequest::new();
        r.volume_id = "vol-1".into();
        r.set_serial("vol-0123".into());
        r.fs_type = "ext4".into();
        r
    }

    #[test]
    fn publish_requests_are_translated() {
        let mut r = publish();
        r.mount_options = vec!["noatime".into(), "discard".into()];
        let mut g = pb::FsGroup::new();
        g.gid = 2000;
        g.change_policy = pb::FsGroupChangePolicy::ON_ROOT_MISMATCH.into();
        r.fs_group = MessageField::some(g);
        let d = publish_request(&r).unwrap();
        assert_eq!(d.source, Source::Serial("vol-0123".into()));
        assert_eq!(
            d.fs_group,
            Some(FsGroup {
                gid: 2000,
                policy: Policy::OnRootMismatch
            })
        );
        assert_eq!(d.timeout, validate::DEFAULT_TIMEOUT);
        assert_eq!(d.mount.data, "discard");
        assert_ne!(d.mount.flags & libc::MS_NOATIME, 0);
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
        let d = publish_request(&r).unwrap();
        assert_eq!(d.mode, VolumeMode::Block);
        assert!(d.read_only && d.options.is_empty() && d.fs_group.is_none());
        assert_ne!(d.mount.flags & libc::MS_RDONLY, 0);
    }

    #[test]
    fn bind_requests_are_checked() {
        let root = std::path::Path::new("/run/crust");
        let mut r = pb::BindMountRequest::new();
        r.volume_id = "v".into();
        r.target = "/run/crust/pods/a".into();
        r.subpath = "data".into();
        r.read_only = true;
        r.recursive_read_only = pb::RecursiveReadOnly::ENABLED.into();
        let d = bind_request(&|t| validate::target(root, t), &r).unwrap();
        assert_eq!(d.recursive_read_only, RecursiveReadOnly::Enabled);
        let bad: Vec<Mutation<pb::BindMountRequest>> = vec![
            Box::new(|r| r.read_only = false),
            Box::new(|r| r.recursive_read_only = EnumOrUnknown::from_i32(9)),
            Box::new(|r| r.subpath = "../x".into()),
            Box::new(|r| r.subpath = "/etc".into()),
            Box::new(|r| r.target = "relative".into()),
            Box::new(|r| r.target = "/etc/x".into()),
            Box::new(|r| r.volume_id.clear()),
        ];
        for (i, mutate) in bad.iter().enumerate() {
            let mut r2 = r.clone();
            mutate(&mut r2);
            let e =
                bind_request(&|t| validate::target(root, t), &r2).expect_err(&format!("case {i}"));
            assert_eq!(e.code(), Code::InvalidArgument, "case {i}: {e}");
        }
    }

    #[test]
    fn a_panicking_handler_answers_internal_and_the_service_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let volumes = Volumes::open(
            dir.path(),
            crate::device::Sysfs::system(),
            crate::logging::discard(),
        )
        .unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        let svc = Service::new(
            Arc::new(volumes),
            crate::logging::discard(),
            Instant::now(),
            Arc::new(Mutex::new(Timeline::default())),
            tx,
            Arc::new(Gate::new(true)),
        );
        let r: ttrpc::Result<()> = svc.handle("Test", "v", || panic!("boom at {}", 42));
        match r {
            Err(ttrpc::Error::RpcStatus(s)) => {
                assert_eq!(s.code(), ttrpc::Code::INTERNAL);
                assert!(s.message().contains("boom at 42"), "{}", s.message());
            }
            other => panic!("expected INTERNAL, got {other:?}"),
        }
        assert_eq!(svc.handle("Test", "v", || Ok(7)).unwrap(), 7);
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
        let cancel = cancel_of(&ctx);
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
}

//! The ttrpc service `crust.v1.Agent`: each method translates its request
//! (`translate`), calls the volume table, and translates the answer or the
//! error back. Every handler runs under `catch_unwind`, so a bug answers
//! INTERNAL instead of taking PID 1 down, and logs one line with method,
//! volume, code and time. [`lane`] is the service's rule for the transport:
//! which methods answer at once, from memory.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc;
use crust_protocols::ttrpc::{self, TtrpcContext};
use slog::{debug, info, warn, Logger};

use super::translate::{
    agent_info, bind_request, bound, cancel_of, capabilities, expanded, file_systems, freeze_id,
    freeze_timeout, frozen, health, publish_request_in, published, shut_down, stats, status_code,
    thaw_request, thawed, trimmed, unmounted, unpublished, volume_ids, volumes,
};
use crate::cancel::Cancel;
use crate::error::{Error, Result};
use crate::rpc::lograte::LogRate;
use crate::rpc::table::{direct, Lane, Table};
use crate::sys::sysfs::Sysfs;
use crate::system::{self, Gate, Timeline};
use crate::validate;
use crate::volumes::table::Volumes;

/// Which lane of the transport a method of this service takes (the
/// transport knows no method names: this is its rule). GetCapabilities and
/// GetAgentInfo answer from memory and /proc, take no lock a long operation
/// holds and touch no disk: the event loop answers them itself, so a health
/// check costs no thread hop. ListVolumes asks each volume's device its size
/// (an ioctl), so it takes the quick workers: answered even while every
/// regular worker waits for a disk, never holding up the loop. Every other
/// method may wait for disks and walks.
pub fn lane(path: &str) -> Lane {
    path.strip_prefix("/crust.v1.Agent/")
        .map_or(Lane::Regular, method_lane)
}

/// The service as the transport serves it: the generated table, each
/// method in its [`lane`], and the methods the loop answers itself given
/// their direct answers: the same call, with the successful Response
/// written straight to bytes instead of through ttrpc's handler machinery,
/// which costs more than answering from memory does.
pub fn table(service: Arc<Service>) -> Table {
    let (caps, info) = (service.clone(), service.clone());
    Table::new(crust_ttrpc::create_agent(service), lane)
        .with_direct(
            "/crust.v1.Agent/GetCapabilities",
            direct(move |_: pb::GetCapabilitiesRequest| caps.capabilities_answer()),
        )
        .with_direct(
            "/crust.v1.Agent/GetAgentInfo",
            direct(move |_: pb::GetAgentInfoRequest| info.agent_info_answer()),
        )
}

/// [`lane`] of a method of this service, by its name.
fn method_lane(method: &str) -> Lane {
    match method {
        "GetCapabilities" | "GetAgentInfo" => Lane::Inline,
        "ListVolumes" => Lane::Quick,
        _ => Lane::Regular,
    }
}

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
    /// Where the guest's SELinux is seen (a guest without it leaves SELinux
    /// context options out of a mount).
    sysfs: Sysfs,
    /// The rate of the log lines of the methods the event loop answers
    /// itself: a flood of them must not pace the loop at the console's speed.
    inline_lines: LogRate,
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
            sysfs: Sysfs::system(),
            inline_lines: LogRate::new(),
        }
    }

    /// Runs one request: catches panics, logs the outcome, maps the error.
    fn handle<T>(
        &self,
        method: &'static str,
        volume: &str,
        f: impl FnOnce() -> Result<T>,
    ) -> ttrpc::Result<T> {
        map_status(self.run(method, volume, f))
    }
}

impl Service {
    /// The request's log line. Not generic, so written once in the binary
    /// rather than once per method. The loop's own methods log at the
    /// transport's rate, saying how many lines were held back; every other
    /// method logs each call.
    #[inline(never)]
    fn log_outcome(&self, method: &'static str, volume: &str, start: Instant, err: Option<&Error>) {
        let held = if method_lane(method) == Lane::Inline {
            match self.inline_lines.allow() {
                Some(held) => held,
                None => return,
            }
        } else {
            0
        };
        let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        match err {
            None => {
                info!(self.log, "request"; "method" => method, "volume" => volume, "code" => "OK", "duration_us" => us,
                      "lines_held_back" => held)
            }
            Some(e) => {
                warn!(self.log, "request"; "method" => method, "volume" => volume, "code" => e.code().name(),
                            "duration_us" => us, "error" => %e, "lines_held_back" => held)
            }
        }
    }
}

/// A request handler's panic, as the error it is answered with.
fn panicked(method: &'static str, p: &(dyn std::any::Any + Send)) -> Error {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string());
    Error::Panic(method, what)
}

/// An answer as ttrpc's: the error's class and sentence.
fn map_status<T>(result: Result<T>) -> ttrpc::Result<T> {
    result.map_err(|e| {
        ttrpc::Error::RpcStatus(ttrpc::get_status(status_code(e.code()), e.to_string()))
    })
}

/// Each method's work, from its request to its answer, with the caller's
/// cancellation: what the ttrpc methods below run under [`Service::handle`],
/// and what an embedding program calls (`crate::embed`).
impl Service {
    /// Runs one request for an embedding program: catches panics and logs
    /// the outcome as the ttrpc methods do; the error keeps its code.
    pub fn run<T>(
        &self,
        method: &'static str,
        volume: &str,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let start = Instant::now();
        let result =
            catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(panicked(method, &*p)));
        self.log_outcome(method, volume, start, result.as_ref().err());
        result
    }

    /// GetSupportedFileSystems.
    pub fn file_systems_in(&self, cancel: &Cancel) -> Result<pb::GetSupportedFileSystemsResponse> {
        self.modules.wait(MODULES_WAIT, cancel);
        Ok(file_systems(system::supported_filesystems()?))
    }

    /// PublishVolume.
    pub fn publish_in(
        &self,
        req: &pb::PublishVolumeRequest,
        cancel: &Cancel,
    ) -> Result<pb::PublishVolumeResponse> {
        let selinux = self.sysfs.selinux_enabled();
        let (domain, not_applied) = publish_request_in(req, selinux)?;
        if !not_applied.is_empty() {
            info!(self.log, "SELinux options left out: the guest has no SELinux";
                  "method" => "PublishVolume", "volume" => &req.volume_id,
                  "options_not_applied" => not_applied.join(" "));
        }
        // Device lookup needs virtio_blk, an xfs mount needs xfs: both may still be loading.
        self.modules.wait(MODULES_WAIT, cancel);
        let out = self.volumes.publish(&domain, cancel)?;
        Ok(published(out, not_applied))
    }

    /// UnpublishVolume.
    pub fn unpublish_in(
        &self,
        req: &pb::UnpublishVolumeRequest,
        cancel: &Cancel,
    ) -> Result<pb::UnpublishVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        Ok(unpublished(self.volumes.unpublish(&req.volume_id, cancel)?))
    }

    /// GetVolumeStats.
    pub fn stats_in(
        &self,
        req: &pb::GetVolumeStatsRequest,
        cancel: &Cancel,
    ) -> Result<pb::GetVolumeStatsResponse> {
        validate::volume_id(&req.volume_id)?;
        let (u, c) = self.volumes.stats(&req.volume_id, cancel)?;
        Ok(stats(u, c))
    }

    /// ExpandVolume.
    pub fn expand_in(
        &self,
        req: &pb::ExpandVolumeRequest,
        cancel: &Cancel,
    ) -> Result<pb::ExpandVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let required = validate::required_bytes(req.required_bytes)?;
        let out = self.volumes.expand(
            &req.volume_id,
            required,
            validate::timeout(req.timeout_ms),
            cancel,
        )?;
        Ok(expanded(out))
    }

    /// BindMount.
    pub fn bind_in(
        &self,
        req: &pb::BindMountRequest,
        cancel: &Cancel,
    ) -> Result<pb::BindMountResponse> {
        Ok(bound(self.volumes.bind(&bind_request(req)?, cancel)?))
    }

    /// Unmount.
    pub fn unmount_in(
        &self,
        req: &pb::UnmountRequest,
        cancel: &Cancel,
    ) -> Result<pb::UnmountResponse> {
        let target = std::path::Path::new(&req.target);
        Ok(unmounted(self.volumes.unmount(target, cancel)?))
    }

    /// ListVolumes.
    pub fn list_in(&self) -> pb::ListVolumesResponse {
        volumes(self.volumes.list())
    }

    /// FreezeVolumes.
    pub fn freeze_in(
        &self,
        req: &pb::FreezeVolumesRequest,
        cancel: &Cancel,
    ) -> Result<pb::FreezeVolumesResponse> {
        let ids = volume_ids(&req.volume_ids)?;
        let timeout = freeze_timeout(req.timeout_ms)?;
        let asked = freeze_id(&req.freeze_id)?;
        Ok(frozen(self.volumes.freeze(&ids, timeout, asked, cancel)?))
    }

    /// ThawVolumes.
    pub fn thaw_in(&self, req: &pb::ThawVolumesRequest) -> Result<pb::ThawVolumesResponse> {
        Ok(thawed(self.volumes.thaw(&thaw_request(req)?)?))
    }

    /// TrimVolume.
    pub fn trim_in(
        &self,
        req: &pb::TrimVolumeRequest,
        cancel: &Cancel,
    ) -> Result<pb::TrimVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let out = self
            .volumes
            .trim(&req.volume_id, req.min_extent_bytes, cancel)?;
        Ok(trimmed(out))
    }

    /// GetVolumeHealth.
    pub fn health_in(
        &self,
        req: &pb::GetVolumeHealthRequest,
        cancel: &Cancel,
    ) -> Result<pb::GetVolumeHealthResponse> {
        validate::volume_id(&req.volume_id)?;
        Ok(health(self.volumes.health(&req.volume_id, cancel)?))
    }

    /// Shutdown: every volume unpublished; the shutdown sender told.
    pub fn shutdown_in(&self) -> pb::ShutdownResponse {
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
        shut_down(volumes_unmounted)
    }
}

/// The methods the event loop answers, as both their generated handlers
/// and their direct answers ([`table`]) call them: neither needs the
/// handler's context.
impl Service {
    /// GetCapabilities.
    fn capabilities_answer(&self) -> ttrpc::Result<pb::GetCapabilitiesResponse> {
        self.handle("GetCapabilities", "", || {
            Ok(capabilities(system::capabilities()))
        })
    }

    /// GetAgentInfo.
    fn agent_info_answer(&self) -> ttrpc::Result<pb::GetAgentInfoResponse> {
        self.handle("GetAgentInfo", "", || {
            let t = *self.timeline.lock().unwrap_or_else(|p| p.into_inner());
            let i = system::agent_info(self.started, t)?;
            Ok(agent_info(i, t, self.volumes.state_problem()))
        })
    }
}

impl crust_ttrpc::Agent for Service {
    fn get_capabilities(
        &self,
        _: &TtrpcContext,
        _: pb::GetCapabilitiesRequest,
    ) -> ttrpc::Result<pb::GetCapabilitiesResponse> {
        self.capabilities_answer()
    }

    fn get_supported_file_systems(
        &self,
        ctx: &TtrpcContext,
        _: pb::GetSupportedFileSystemsRequest,
    ) -> ttrpc::Result<pb::GetSupportedFileSystemsResponse> {
        self.handle("GetSupportedFileSystems", "", || {
            self.file_systems_in(&cancel_of(ctx))
        })
    }

    fn publish_volume(
        &self,
        ctx: &TtrpcContext,
        req: pb::PublishVolumeRequest,
    ) -> ttrpc::Result<pb::PublishVolumeResponse> {
        self.handle("PublishVolume", &req.volume_id, || {
            self.publish_in(&req, &cancel_of(ctx))
        })
    }

    fn unpublish_volume(
        &self,
        ctx: &TtrpcContext,
        req: pb::UnpublishVolumeRequest,
    ) -> ttrpc::Result<pb::UnpublishVolumeResponse> {
        self.handle("UnpublishVolume", &req.volume_id, || {
            self.unpublish_in(&req, &cancel_of(ctx))
        })
    }

    fn get_volume_stats(
        &self,
        ctx: &TtrpcContext,
        req: pb::GetVolumeStatsRequest,
    ) -> ttrpc::Result<pb::GetVolumeStatsResponse> {
        self.handle("GetVolumeStats", &req.volume_id, || {
            self.stats_in(&req, &cancel_of(ctx))
        })
    }

    fn expand_volume(
        &self,
        ctx: &TtrpcContext,
        req: pb::ExpandVolumeRequest,
    ) -> ttrpc::Result<pb::ExpandVolumeResponse> {
        self.handle("ExpandVolume", &req.volume_id, || {
            self.expand_in(&req, &cancel_of(ctx))
        })
    }

    fn bind_mount(
        &self,
        ctx: &TtrpcContext,
        req: pb::BindMountRequest,
    ) -> ttrpc::Result<pb::BindMountResponse> {
        self.handle("BindMount", &req.volume_id, || {
            self.bind_in(&req, &cancel_of(ctx))
        })
    }

    fn unmount(
        &self,
        ctx: &TtrpcContext,
        req: pb::UnmountRequest,
    ) -> ttrpc::Result<pb::UnmountResponse> {
        self.handle("Unmount", "", || self.unmount_in(&req, &cancel_of(ctx)))
    }

    fn list_volumes(
        &self,
        _: &TtrpcContext,
        _: pb::ListVolumesRequest,
    ) -> ttrpc::Result<pb::ListVolumesResponse> {
        self.handle("ListVolumes", "", || Ok(self.list_in()))
    }

    fn get_agent_info(
        &self,
        _: &TtrpcContext,
        _: pb::GetAgentInfoRequest,
    ) -> ttrpc::Result<pb::GetAgentInfoResponse> {
        self.agent_info_answer()
    }

    fn shutdown(
        &self,
        _: &TtrpcContext,
        _: pb::ShutdownRequest,
    ) -> ttrpc::Result<pb::ShutdownResponse> {
        self.handle("Shutdown", "", || Ok(self.shutdown_in()))
    }

    fn freeze_volumes(
        &self,
        ctx: &TtrpcContext,
        req: pb::FreezeVolumesRequest,
    ) -> ttrpc::Result<pb::FreezeVolumesResponse> {
        self.handle("FreezeVolumes", &req.volume_ids.join(","), || {
            self.freeze_in(&req, &cancel_of(ctx))
        })
    }

    fn thaw_volumes(
        &self,
        _: &TtrpcContext,
        req: pb::ThawVolumesRequest,
    ) -> ttrpc::Result<pb::ThawVolumesResponse> {
        let subject = if req.freeze_id.is_empty() {
            req.volume_ids.join(",")
        } else {
            req.freeze_id.clone()
        };
        self.handle("ThawVolumes", &subject, || self.thaw_in(&req))
    }

    fn trim_volume(
        &self,
        ctx: &TtrpcContext,
        req: pb::TrimVolumeRequest,
    ) -> ttrpc::Result<pb::TrimVolumeResponse> {
        self.handle("TrimVolume", &req.volume_id, || {
            self.trim_in(&req, &cancel_of(ctx))
        })
    }

    fn get_volume_health(
        &self,
        ctx: &TtrpcContext,
        req: pb::GetVolumeHealthRequest,
    ) -> ttrpc::Result<pb::GetVolumeHealthResponse> {
        self.handle("GetVolumeHealth", &req.volume_id, || {
            self.health_in(&req, &cancel_of(ctx))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::sysfs::Sysfs;

    #[test]
    fn a_panicking_handler_answers_internal_and_the_service_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let volumes =
            Volumes::open(dir.path(), Sysfs::system(), crate::logging::discard()).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        let svc = Service::new(
            volumes,
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

    /// Counts the records logged through it.
    struct Counting(Arc<std::sync::atomic::AtomicUsize>);

    impl slog::Drain for Counting {
        type Ok = ();
        type Err = slog::Never;
        fn log(
            &self,
            _: &slog::Record,
            _: &slog::OwnedKVList,
        ) -> std::result::Result<(), slog::Never> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
    }

    /// A flood of the loop's own methods logs at the transport's rate; every
    /// other method logs each call.
    #[test]
    fn the_loops_own_methods_log_at_a_rate() {
        let dir = tempfile::tempdir().unwrap();
        let volumes =
            Volumes::open(dir.path(), Sysfs::system(), crate::logging::discard()).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        let lines = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let svc = Service::new(
            volumes,
            slog::Logger::root(Counting(lines.clone()), slog::o!()),
            Instant::now(),
            Arc::new(Mutex::new(Timeline::default())),
            tx,
            Arc::new(Gate::new(true)),
        );
        let n = || lines.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..1000 {
            svc.handle("GetCapabilities", "", || Ok(())).unwrap();
        }
        let rate = usize::try_from(crate::rpc::lograte::PER_SECOND).unwrap();
        assert!(n() <= 2 * rate, "{} lines for 1000 calls", n());
        let before = n();
        for _ in 0..100 {
            svc.handle("Unmount", "", || Ok(())).unwrap();
        }
        assert_eq!(n() - before, 100);
    }

    #[test]
    fn only_methods_that_answer_from_memory_are_inline() {
        for m in crust_ttrpc::create_agent(Arc::new(NoAgent)).keys() {
            let want = match m.rsplit('/').next() {
                Some("GetCapabilities" | "GetAgentInfo") => Lane::Inline,
                Some("ListVolumes") => Lane::Quick,
                _ => Lane::Regular,
            };
            assert_eq!(lane(m), want, "{m}");
        }
        assert_eq!(lane("/other.Service/GetCapabilities"), Lane::Regular);
    }

    /// The methods the loop answers itself answer directly, and as their
    /// generated handlers would.
    #[test]
    fn inline_methods_answer_directly_as_their_handlers_would() {
        use crate::rpc::dispatch::{run, Job, Outbox};
        use crust_protocols::protobuf::Message;
        let dir = tempfile::tempdir().unwrap();
        let volumes =
            Volumes::open(dir.path(), Sysfs::system(), crate::logging::discard()).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        let svc = Arc::new(Service::new(
            volumes,
            crate::logging::discard(),
            Instant::now(),
            Arc::new(Mutex::new(Timeline::default())),
            tx,
            Arc::new(Gate::new(true)),
        ));
        let t = table(svc.clone());
        let generated = Table::new(crust_ttrpc::create_agent(svc), lane);
        let job = |t: &Table, m: &str| {
            let mut req = ttrpc::Request::new();
            (req.service, req.method) = ("crust.v1.Agent".into(), m.into());
            Job {
                conn: 1,
                fd: -1,
                stream: 1,
                method: t.find("crust.v1.Agent", m).unwrap(),
                req,
                gone: crossbeam_channel::unbounded().1,
                wire: crate::rpc::wire::test_wire(),
            }
        };
        let out = Outbox::new();
        for m in crust_ttrpc::create_agent(Arc::new(NoAgent)).keys() {
            let name = m.rsplit('/').next().unwrap();
            let i = t.find("crust.v1.Agent", name).unwrap();
            assert_eq!(t.direct(i).is_some(), lane(m) == Lane::Inline, "{m}");
        }
        let caps = run(&t, job(&t, "GetCapabilities"), &out);
        assert_eq!(
            caps,
            run(&generated, job(&generated, "GetCapabilities"), &out)
        );
        assert!(caps.1.is_none());
        let info = run(&t, job(&t, "GetAgentInfo"), &out);
        let res = ttrpc::Response::parse_from_bytes(&info.0).unwrap();
        assert_eq!(res.status.code.value(), 0, "{}", res.status.message);
        let got = pb::GetAgentInfoResponse::parse_from_bytes(&res.payload).unwrap();
        assert!(got.rss_bytes > 0 && !got.version.is_empty());
    }

    /// The generated table's method names, without a service behind them.
    struct NoAgent;
    impl crust_ttrpc::Agent for NoAgent {}
}

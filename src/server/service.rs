//! The work of the ttrpc service `crust.v1.Agent`: each method's handler
//! translates its request (`translate`), calls the volume table, and
//! translates the answer or the error back. `Service::run` runs a handler
//! under `catch_unwind`, so a bug answers INTERNAL instead of taking PID 1
//! down, and logs one line with method, volume, code and time. Which
//! handler serves which method, in which lane of the transport, is the
//! method table's (`methods`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::crust as pb;
use crust_protocols::sync::LockExt;
use slog::{debug, info, warn, Logger};

use super::translate::{
    agent_info, bind_request, bound, capabilities, expanded, file_systems, freeze_id,
    freeze_timeout, frozen, health, publish_request_in, published, shut_down, stats, thaw_request,
    thawed, trimmed, unmounted, unpublished, volume_ids, volumes,
};
use super::volumes::VolumeTable;
use crate::cancel::Cancel;
use crate::error::{Error, Result};
use crate::rpc::lograte::LogRate;
use crate::rpc::table::Lane;
use crate::sys::sysfs::Sysfs;
use crate::system::{self, Gate, Timeline};
use crate::validate;
use crate::volumes::table::Volumes;

/// The service state shared by all connections, over the volume table `T`
/// (the agent's own, or a stand-in).
pub struct Service<T: VolumeTable = Volumes> {
    volumes: Arc<T>,
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

impl<T: VolumeTable> Service<T> {
    /// A service over `volumes`; `shutdown` is signalled after a Shutdown
    /// request; disk operations wait for `modules` to open.
    pub fn new(
        volumes: Arc<T>,
        log: Logger,
        started: Instant,
        timeline: Arc<Mutex<Timeline>>,
        shutdown: Sender<()>,
        modules: Arc<Gate>,
    ) -> Service<T> {
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

    /// Runs one request of `method`, which takes `lane`: catches panics,
    /// logs the outcome. The error keeps its code.
    pub(crate) fn run<R>(
        &self,
        method: &'static str,
        lane: Lane,
        volume: &str,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let start = Instant::now();
        let result =
            catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(panicked(method, &*p)));
        self.log_outcome(method, lane, volume, start, result.as_ref().err());
        result
    }

    /// The request's log line. Not generic over the request, so written
    /// once in the binary rather than once per method. The loop's own
    /// methods log at the transport's rate, saying how many lines were held
    /// back; every other method logs each call.
    #[inline(never)]
    fn log_outcome(
        &self,
        method: &'static str,
        lane: Lane,
        volume: &str,
        start: Instant,
        err: Option<&Error>,
    ) {
        let held = if lane == Lane::Inline {
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

/// Each method's handler, from its request to its answer (the method table
/// names them). A handler that may wait takes the request's cancellation;
/// one that answers at once does not, so none is made for it.
impl<T: VolumeTable> Service<T> {
    /// From the probes made at start: answered from memory.
    pub(crate) fn capabilities_in(
        &self,
        _: &pb::GetCapabilitiesRequest,
    ) -> Result<pb::GetCapabilitiesResponse> {
        Ok(capabilities(system::capabilities()))
    }

    /// From memory and /proc.
    pub(crate) fn agent_info_in(
        &self,
        _: &pb::GetAgentInfoRequest,
    ) -> Result<pb::GetAgentInfoResponse> {
        let t = *self.timeline.locked();
        let i = system::agent_info(self.started, t)?;
        Ok(agent_info(i, t, self.volumes.state_problem()))
    }

    /// Once the boot's modules are in: xfs may still be loading.
    pub(crate) fn file_systems_in(
        &self,
        _: &pb::GetSupportedFileSystemsRequest,
        cancel: &Cancel,
    ) -> Result<pb::GetSupportedFileSystemsResponse> {
        self.modules.wait(MODULES_WAIT, cancel);
        Ok(file_systems(system::supported_filesystems()?))
    }

    /// SELinux context options are left out in a guest without SELinux,
    /// and said so in the log and the answer.
    pub(crate) fn publish_in(
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

    pub(crate) fn unpublish_in(
        &self,
        req: &pb::UnpublishVolumeRequest,
        cancel: &Cancel,
    ) -> Result<pb::UnpublishVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        Ok(unpublished(self.volumes.unpublish(&req.volume_id, cancel)?))
    }

    pub(crate) fn stats_in(
        &self,
        req: &pb::GetVolumeStatsRequest,
        cancel: &Cancel,
    ) -> Result<pb::GetVolumeStatsResponse> {
        validate::volume_id(&req.volume_id)?;
        let (u, c) = self.volumes.stats(&req.volume_id, cancel)?;
        Ok(stats(u, c))
    }

    pub(crate) fn expand_in(
        &self,
        req: &pb::ExpandVolumeRequest,
        cancel: &Cancel,
    ) -> Result<pb::ExpandVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let required = validate::required_bytes(req.required_bytes)?;
        let timeout = validate::timeout(req.timeout_ms);
        let out = self
            .volumes
            .expand(&req.volume_id, required, timeout, cancel)?;
        Ok(expanded(out))
    }

    /// The target is validated beneath the table's root with the rest of
    /// the request.
    pub(crate) fn bind_in(
        &self,
        req: &pb::BindMountRequest,
        cancel: &Cancel,
    ) -> Result<pb::BindMountResponse> {
        let domain = bind_request(req, |t| self.volumes.target(t))?;
        Ok(bound(self.volumes.bind(&domain, cancel)?))
    }

    pub(crate) fn unmount_in(
        &self,
        req: &pb::UnmountRequest,
        cancel: &Cancel,
    ) -> Result<pb::UnmountResponse> {
        let target = self.volumes.target(&req.target)?;
        Ok(unmounted(self.volumes.unmount(&target, cancel)?))
    }

    /// Never waits for an operation in flight.
    pub(crate) fn list_in(&self, _: &pb::ListVolumesRequest) -> Result<pb::ListVolumesResponse> {
        Ok(volumes(self.volumes.list()))
    }

    pub(crate) fn freeze_in(
        &self,
        req: &pb::FreezeVolumesRequest,
        cancel: &Cancel,
    ) -> Result<pb::FreezeVolumesResponse> {
        let ids = volume_ids(&req.volume_ids)?;
        let timeout = freeze_timeout(req.timeout_ms)?;
        let asked = freeze_id(&req.freeze_id)?;
        Ok(frozen(self.volumes.freeze(&ids, timeout, asked, cancel)?))
    }

    /// Never waits: a thaw must get through whatever holds the volumes.
    pub(crate) fn thaw_in(&self, req: &pb::ThawVolumesRequest) -> Result<pb::ThawVolumesResponse> {
        Ok(thawed(self.volumes.thaw(&thaw_request(req)?)?))
    }

    pub(crate) fn trim_in(
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

    pub(crate) fn health_in(
        &self,
        req: &pb::GetVolumeHealthRequest,
        cancel: &Cancel,
    ) -> Result<pb::GetVolumeHealthResponse> {
        validate::volume_id(&req.volume_id)?;
        Ok(health(self.volumes.health(&req.volume_id, cancel)?))
    }

    /// Every volume unpublished, then the shutdown sender told.
    pub(crate) fn shutdown_in(&self, _: &pb::ShutdownRequest) -> Result<pb::ShutdownResponse> {
        let volumes_unmounted = self.volumes.shutdown();
        if let Some(tx) = self.shutdown.locked().take() {
            debug!(self.log, "shutdown requested");
            let _ = tx.send(());
        }
        Ok(shut_down(volumes_unmounted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;

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
        let r: Result<()> = svc.run("Test", Lane::Regular, "v", || panic!("boom at {}", 42));
        let e = r.unwrap_err();
        assert_eq!(e.code(), Code::Internal);
        assert!(e.to_string().contains("boom at 42"), "{e}");
        assert_eq!(svc.run("Test", Lane::Regular, "v", || Ok(7)).unwrap(), 7);
    }
}

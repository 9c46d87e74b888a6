//! A typed client for the crust.v1 `Agent` service: any RPC by its
//! request's type (`call`: the method and its answer come from crust.proto),
//! a named call for each, a per-call deadline, and ttrpc's errors sorted
//! into "the agent said no" (a status code and message) and "the
//! conversation broke".

use std::time::Duration;

pub use crust_protocols::code::Code;
use crust_protocols::{crust::*, crust_ttrpc::AgentClient, rpc::Rpc, ttrpc};
use thiserror::Error;

use crate::{
    address::Address,
    connect::{connect, ConnectError},
};

/// What the agent waits for a device when `timeout_ms` is 0 (api.md §1).
const DEFAULT_AGENT_WAIT: Duration = Duration::from_millis(10_000);
/// Time allowed beyond the agent's own wait, for the work after it.
const WAIT_MARGIN: Duration = Duration::from_secs(10);

/// Why a call did not return a response.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CallError {
    /// The agent answered with an error status.
    #[error("{code}: {message}")]
    Status {
        /// The code (a number gRPC does not define is UNKNOWN, the number
        /// then leading the message).
        code: Code,
        /// The agent's explanation.
        message: String,
    },
    /// No answer within the call's deadline.
    #[error("{method} got no answer within {:.1}s: the agent may be stuck or gone; retry with a longer --timeout", .timeout.as_secs_f64())]
    TimedOut {
        method: &'static str,
        timeout: Duration,
    },
    /// The connection broke (closed, reset) or carried garbage.
    #[error("{method} failed: the connection to the agent broke ({detail})")]
    Connection {
        method: &'static str,
        detail: String,
    },
}

impl CallError {
    /// Sorts a ttrpc error of `method`, which was given `timeout` and ended
    /// after `elapsed`.
    pub fn from_ttrpc(
        method: &'static str,
        timeout: Duration,
        elapsed: Duration,
        err: ttrpc::Error,
    ) -> Self {
        match err {
            ttrpc::Error::RpcStatus(status) => {
                CallError::status(status.code.value(), status.message)
            }
            // ttrpc's sync client reports its own deadline as an untyped
            // error, like a closed channel: the clock tells them apart.
            ttrpc::Error::Others(_) if elapsed >= timeout => {
                CallError::TimedOut { method, timeout }
            }
            other => CallError::Connection {
                method,
                detail: other.to_string(),
            },
        }
    }
}

impl CallError {
    /// The agent's status numbered `code`, with its message.
    pub fn status(code: i32, message: String) -> CallError {
        match Code::from_number(code) {
            Some(code) => CallError::Status { code, message },
            None => CallError::Status {
                code: Code::Unknown,
                message: format!("{}: {message}", code_name(code)),
            },
        }
    }
}

/// The canonical upper-case name of a gRPC status code number (crust-protocols'
/// table); `CODE_n` for a number gRPC does not define.
pub fn code_name(code: i32) -> String {
    Code::from_number(code).map_or_else(|| format!("CODE_{code}"), |c| c.name().to_string())
}

/// The deadline for a call in which the agent itself waits `agent_wait_ms`
/// (0 = its default): never shorter than that wait plus a margin, so the
/// client does not give up while the agent is still within its rights.
pub fn deadline_for_wait(timeout: Duration, agent_wait_ms: u32) -> Duration {
    let wait = match agent_wait_ms {
        0 => DEFAULT_AGENT_WAIT,
        ms => Duration::from_millis(u64::from(ms)),
    };
    timeout.max(wait + WAIT_MARGIN)
}

/// A connection to one agent. Cloning shares the connection.
#[derive(Clone)]
pub struct CrustClient {
    inner: AgentClient,
    timeout: Duration,
}

impl CrustClient {
    /// Wraps an established ttrpc connection; each call waits at most `timeout`.
    pub fn new(client: ttrpc::Client, timeout: Duration) -> Self {
        CrustClient {
            inner: AgentClient::new(client),
            timeout,
        }
    }

    /// Connects to `addr` (within `timeout`) and uses `timeout` per call too.
    pub fn connect(addr: &Address, timeout: Duration) -> Result<Self, ConnectError> {
        Ok(Self::new(connect(addr, timeout)?, timeout))
    }

    /// The per-call deadline.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the per-call deadline.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Calls the method `req` is the request of (crust.proto's `Agent`
    /// service, [`Rpc`]), within the per-call deadline. Every method of the
    /// contract is callable here, the named calls below included: they are
    /// this with their request made, or their deadline stretched.
    pub fn call<R: Rpc>(&self, req: &R) -> Result<R::Response, CallError> {
        self.call_within(req, self.timeout)
    }

    /// [`call`](Self::call) within `timeout` instead of the per-call
    /// deadline: for a request that has the agent wait itself
    /// ([`deadline_for_wait`]).
    pub fn call_within<R: Rpc>(
        &self,
        req: &R,
        timeout: Duration,
    ) -> Result<R::Response, CallError> {
        let ctx = ttrpc::context::with_duration(timeout);
        let t0 = std::time::Instant::now();
        R::call(&self.inner, ctx, req)
            .map_err(|e| CallError::from_ttrpc(R::METHOD, timeout, t0.elapsed(), e))
    }

    /// The optional features the agent has (`CAPABILITY_*`).
    pub fn get_capabilities(&self) -> Result<GetCapabilitiesResponse, CallError> {
        self.call(&GetCapabilitiesRequest::new())
    }

    /// The filesystems the agent can publish, e.g. `["ext4", "xfs"]`.
    pub fn get_supported_file_systems(&self) -> Result<GetSupportedFileSystemsResponse, CallError> {
        self.call(&GetSupportedFileSystemsRequest::new())
    }

    /// Publishes a volume; the call deadline covers the agent's `timeout_ms` wait.
    pub fn publish_volume(
        &self,
        req: &PublishVolumeRequest,
    ) -> Result<PublishVolumeResponse, CallError> {
        self.call_within(req, deadline_for_wait(self.timeout, req.timeout_ms))
    }

    /// Unmounts a volume and its binds; succeeds when it was not published.
    pub fn unpublish_volume(
        &self,
        req: &UnpublishVolumeRequest,
    ) -> Result<UnpublishVolumeResponse, CallError> {
        self.call(req)
    }

    /// Bytes and inodes of a published volume, and its condition.
    pub fn get_volume_stats(
        &self,
        req: &GetVolumeStatsRequest,
    ) -> Result<GetVolumeStatsResponse, CallError> {
        self.call(req)
    }

    /// Grows a volume; the call deadline covers the agent's `timeout_ms` wait.
    pub fn expand_volume(
        &self,
        req: &ExpandVolumeRequest,
    ) -> Result<ExpandVolumeResponse, CallError> {
        self.call_within(req, deadline_for_wait(self.timeout, req.timeout_ms))
    }

    /// Binds a volume (or a subpath) at a target, optionally (recursively) read-only.
    pub fn bind_mount(&self, req: &BindMountRequest) -> Result<BindMountResponse, CallError> {
        self.call(req)
    }

    /// Unmounts a bind target; succeeds when nothing was mounted there.
    pub fn unmount(&self, req: &UnmountRequest) -> Result<UnmountResponse, CallError> {
        self.call(req)
    }

    /// The published volumes and their bind targets.
    pub fn list_volumes(&self) -> Result<ListVolumesResponse, CallError> {
        self.call(&ListVolumesRequest::new())
    }

    /// Version, kernel, memory and boot timeline of the agent.
    pub fn get_agent_info(&self) -> Result<GetAgentInfoResponse, CallError> {
        self.call(&GetAgentInfoRequest::new())
    }

    /// Freezes volumes' filesystems, all or none, until thawed or the
    /// request's `timeout_ms` passes (then the agent thaws them itself).
    pub fn freeze_volumes(
        &self,
        req: &FreezeVolumesRequest,
    ) -> Result<FreezeVolumesResponse, CallError> {
        self.call(req)
    }

    /// Thaws volumes; ABORTED when a freeze had already ended by itself.
    pub fn thaw_volumes(&self, req: &ThawVolumesRequest) -> Result<ThawVolumesResponse, CallError> {
        self.call(req)
    }

    /// Gives a volume's free space back to its disk (FITRIM).
    pub fn trim_volume(&self, req: &TrimVolumeRequest) -> Result<TrimVolumeResponse, CallError> {
        self.call(req)
    }

    /// A volume's health in CSI 1.13's shape: empty when healthy.
    pub fn get_volume_health(
        &self,
        req: &GetVolumeHealthRequest,
    ) -> Result<GetVolumeHealthResponse, CallError> {
        self.call(req)
    }

    /// Asks the agent to unmount everything and power off (when it is PID 1).
    pub fn shutdown(&self) -> Result<ShutdownResponse, CallError> {
        self.call(&ShutdownRequest::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_calls_outlast_the_agents_wait() {
        let s = Duration::from_secs;
        let table = [
            (s(5), 0, s(20)),      // the agent's default 10 s wait + margin
            (s(60), 0, s(60)),     // a longer --timeout wins
            (s(5), 30_000, s(40)), // --wait 30
            (s(100), 30_000, s(100)),
            (s(5), 1, Duration::from_millis(10_001)),
        ];
        for (timeout, wait_ms, want) in table {
            assert_eq!(
                deadline_for_wait(timeout, wait_ms),
                want,
                "{timeout:?} {wait_ms}"
            );
        }
    }

    /// The generic call sends the method its request names, and names it
    /// in its errors.
    #[test]
    fn a_call_names_the_method_of_its_request() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("silent.sock");
        // Accepted by the kernel's backlog, never answered.
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let addr: Address = format!("unix://{}", sock.display()).parse().unwrap();
        let t = Duration::from_millis(50);
        let client = CrustClient::connect(&addr, t).unwrap();
        assert_eq!(
            client.call(&UnmountRequest::new()).unwrap_err(),
            CallError::TimedOut {
                method: "Unmount",
                timeout: t
            }
        );
        assert!(matches!(
            client.get_volume_health(&GetVolumeHealthRequest::new()),
            Err(CallError::TimedOut {
                method: "GetVolumeHealth",
                ..
            })
        ));
    }

    #[test]
    fn code_names_are_canonical() {
        let table = [
            (0, "OK"),
            (3, "INVALID_ARGUMENT"),
            (4, "DEADLINE_EXCEEDED"),
            (5, "NOT_FOUND"),
            (6, "ALREADY_EXISTS"),
            (9, "FAILED_PRECONDITION"),
            (11, "OUT_OF_RANGE"),
            (13, "INTERNAL"),
            (16, "UNAUTHENTICATED"),
            (99, "CODE_99"),
            (-1, "CODE_-1"),
        ];
        for (n, name) in table {
            assert_eq!(code_name(n), name, "{n}");
        }
    }

    #[test]
    fn ttrpc_errors_sort_into_status_timeout_connection() {
        let t = Duration::from_secs(2);
        let status = ttrpc::Error::RpcStatus(ttrpc::get_status(
            ttrpc::Code::NOT_FOUND,
            "volume vol-1 is not published",
        ));
        assert_eq!(
            CallError::from_ttrpc("GetVolumeStats", t, Duration::ZERO, status),
            CallError::Status {
                code: Code::NotFound,
                message: "volume vol-1 is not published".into()
            }
        );
        let timeout = ttrpc::Error::Others(
            "Receive packet from Receiver timeout: timed out waiting on channel".into(),
        );
        assert_eq!(
            CallError::from_ttrpc("GetVolumeStats", t, t, timeout),
            CallError::TimedOut {
                method: "GetVolumeStats",
                timeout: t
            }
        );
        for broken in [
            ttrpc::Error::Socket("socket disconnected".into()),
            ttrpc::Error::Others(
                "Receive packet from Receiver error: receiving on a closed channel".into(),
            ),
            ttrpc::Error::Eof,
            // The same words before the deadline: not ttrpc's deadline.
            ttrpc::Error::Others(
                "Receive packet from Receiver timeout: timed out waiting on channel".into(),
            ),
        ] {
            let e = CallError::from_ttrpc("Unmount", t, t / 2, broken);
            assert!(
                matches!(
                    e,
                    CallError::Connection {
                        method: "Unmount",
                        ..
                    }
                ),
                "{e:?}"
            );
        }
    }
}

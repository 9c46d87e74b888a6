//! kubelet's side of CRUST: the crust.runtime.v1alpha1 client stubs,
//! generated here from protocols/crust_runtime.proto independently of
//! crustd (which generates only its server half), and a blocking
//! [`Kubelet`] that dials crustd's unix socket the way kubelet does (gRPC
//! over HTTP/2). The `crustd-ctl` command that uses it is built with crustd
//! (`crustd::ctl`, beside the direct-volume record code it shares), so this
//! crate depends on nothing of crustd's and crustd's tests, the demo and the
//! bench can use it.
//!
//! Every call carries its deadline (`grpc-timeout`), as kubelet's do: crustd
//! passes it down, and knows when its caller gave up. A freeze's group is
//! a lease: its id, answered by the freeze, is what thaws it.

use std::path::Path;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Status;

/// The generated messages and client.
#[allow(clippy::all, clippy::pedantic, clippy::restriction, missing_docs)]
pub mod pb {
    tonic::include_proto!("crust.runtime.v1alpha1");
}

use pb::runtime_assisted_storage_management_client::RuntimeAssistedStorageManagementClient as Client;

/// A blocking CRUST client on one connection to crustd.
pub struct Kubelet {
    /// Drives the connection; calls block on it.
    rt: tokio::runtime::Runtime,
    /// The generated client (cheap to clone: shares the channel).
    client: Client<Channel>,
    /// The deadline each call sends; none for [`Kubelet::no_deadline`].
    deadline: Option<Duration>,
}

impl Kubelet {
    /// Connects to crustd at `socket`; each call may take up to `timeout`,
    /// and tells crustd so.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Kubelet, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a tokio runtime: {e}"))?;
        let path = socket.to_path_buf();
        let channel = rt
            .block_on(async {
                // The URI is required by the API and unused: the connector dials the socket.
                Endpoint::try_from("http://crustd.invalid")
                    .map_err(|e| e.to_string())?
                    .connect_timeout(Duration::from_secs(5))
                    .timeout(timeout)
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let p = path.clone();
                        async move { UnixStream::connect(p).await.map(TokioIo::new) }
                    }))
                    .await
                    .map_err(|e| format!("{e:?}"))
            })
            .map_err(|e| format!("cannot connect to crustd at {}: {e}", socket.display()))?;
        Ok(Kubelet {
            rt,
            client: Client::new(channel),
            deadline: Some(timeout),
        })
    }

    /// The same client, sending no deadline with its calls: a caller unlike
    /// kubelet, for tests of what crustd does then (it still gives up at
    /// its own timeout, without telling crustd).
    pub fn no_deadline(mut self) -> Kubelet {
        self.deadline = None;
        self
    }

    /// `m` as a request carrying this client's deadline.
    fn request<M>(&self, m: M) -> tonic::Request<M> {
        let mut r = tonic::Request::new(m);
        if let Some(d) = self.deadline {
            r.set_timeout(d);
        }
        r
    }

    fn call<T, F>(&self, f: impl FnOnce(Client<Channel>) -> F) -> Result<T, Status>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.rt
            .block_on(f(self.client.clone()))
            .map(|r| r.into_inner())
    }

    pub fn capabilities(&self) -> Result<pb::RuntimeGetCapabilitiesResponse, Status> {
        let r = self.request(pb::RuntimeGetCapabilitiesRequest {});
        self.call(|mut c| async move { c.runtime_get_capabilities(r).await })
    }

    pub fn file_systems(&self) -> Result<pb::RuntimeGetSupportedFileSystemsResponse, Status> {
        let r = self.request(pb::RuntimeGetSupportedFileSystemsRequest {});
        self.call(|mut c| async move { c.runtime_get_supported_file_systems(r).await })
    }

    pub fn publish(
        &self,
        r: pb::RuntimePublishVolumeRequest,
    ) -> Result<pb::RuntimePublishVolumeResponse, Status> {
        let r = self.request(r);
        self.call(|mut c| async move { c.runtime_publish_volume(r).await })
    }

    /// RuntimePublishVolume with a gRPC deadline (`grpc-timeout`), as
    /// kubelet sends one: crustd passes it down to the agent.
    pub fn publish_within(
        &self,
        r: pb::RuntimePublishVolumeRequest,
        deadline: Duration,
    ) -> Result<pb::RuntimePublishVolumeResponse, Status> {
        let mut req = tonic::Request::new(r);
        req.set_timeout(deadline);
        self.call(|mut c| async move { c.runtime_publish_volume(req).await })
    }

    pub fn publish_direct(
        &self,
        sandbox: &str,
        volume_path: &str,
        read_only: bool,
    ) -> Result<pb::RuntimePublishDirectVolumeResponse, Status> {
        let r = pb::RuntimePublishDirectVolumeRequest {
            sandbox_id: sandbox.into(),
            volume_path: volume_path.into(),
            read_only,
        };
        let r = self.request(r);
        self.call(|mut c| async move { c.runtime_publish_direct_volume(r).await })
    }

    pub fn unpublish(&self, sandbox: &str, volume: &str) -> Result<(), Status> {
        let r = self.request(pb::RuntimeUnpublishVolumeRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: volume.into(),
        });
        self.call(|mut c| async move { c.runtime_unpublish_volume(r).await })
            .map(|_| ())
    }

    /// RuntimeUnpublishVolume with a gRPC deadline, as kubelet sends one.
    pub fn unpublish_within(
        &self,
        sandbox: &str,
        volume: &str,
        deadline: Duration,
    ) -> Result<(), Status> {
        let mut r = tonic::Request::new(pb::RuntimeUnpublishVolumeRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: volume.into(),
        });
        r.set_timeout(deadline);
        self.call(|mut c| async move { c.runtime_unpublish_volume(r).await })
            .map(|_| ())
    }

    /// RuntimeGetVolumeStats with a gRPC deadline, as kubelet sends one.
    pub fn stats_within(
        &self,
        sandbox: &str,
        volume: &str,
        deadline: Duration,
    ) -> Result<pb::RuntimeGetVolumeStatsResponse, Status> {
        let mut r = tonic::Request::new(pb::RuntimeGetVolumeStatsRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: volume.into(),
        });
        r.set_timeout(deadline);
        self.call(|mut c| async move { c.runtime_get_volume_stats(r).await })
    }

    pub fn stats(
        &self,
        sandbox: &str,
        volume: &str,
    ) -> Result<pb::RuntimeGetVolumeStatsResponse, Status> {
        let r = self.request(pb::RuntimeGetVolumeStatsRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: volume.into(),
        });
        self.call(|mut c| async move { c.runtime_get_volume_stats(r).await })
    }

    pub fn expand(&self, sandbox: &str, volume: &str, required_bytes: i64) -> Result<i64, Status> {
        let r = self.request(pb::RuntimeExpandVolumeRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: volume.into(),
            required_bytes,
        });
        self.call(|mut c| async move { c.runtime_expand_volume(r).await })
            .map(|r| r.capacity_bytes)
    }

    /// RuntimeFreezeVolumes of (sandbox, host volume) pairs, all or none,
    /// under the caller's `freeze_id` or one crustd makes: the answer's id
    /// is what thaws the group.
    pub fn freeze(
        &self,
        volumes: &[(String, String)],
        timeout_ms: u32,
        freeze_id: Option<&str>,
    ) -> Result<pb::RuntimeFreezeVolumesResponse, Status> {
        let r = self.request(freeze_request(volumes, timeout_ms, freeze_id));
        self.call(|mut c| async move { c.runtime_freeze_volumes(r).await })
    }

    /// [`Kubelet::freeze`] with a deadline of its own.
    pub fn freeze_within(
        &self,
        volumes: &[(String, String)],
        timeout_ms: u32,
        freeze_id: Option<&str>,
        deadline: Duration,
    ) -> Result<pb::RuntimeFreezeVolumesResponse, Status> {
        let mut r = tonic::Request::new(freeze_request(volumes, timeout_ms, freeze_id));
        r.set_timeout(deadline);
        self.call(|mut c| async move { c.runtime_freeze_volumes(r).await })
    }

    /// RuntimeThawVolumes of the group `freeze_id`: OK while it held every
    /// volume up to now; ABORTED when a part ended first (a snapshot taken
    /// after may be torn); NOT_FOUND for an id crustd never issued.
    pub fn thaw(&self, freeze_id: &str) -> Result<(), Status> {
        self.thaw_with(pb::RuntimeThawVolumesRequest {
            freeze_id: freeze_id.into(),
            ..Default::default()
        })
    }

    /// RuntimeThawVolumes with force: ends whatever freeze holds the volumes.
    pub fn thaw_force(&self, volumes: &[(String, String)]) -> Result<(), Status> {
        self.thaw_with(pb::RuntimeThawVolumesRequest {
            volumes: refs(volumes),
            force: true,
            ..Default::default()
        })
    }

    /// RuntimeThawVolumes as given.
    pub fn thaw_with(&self, r: pb::RuntimeThawVolumesRequest) -> Result<(), Status> {
        let r = self.request(r);
        self.call(|mut c| async move { c.runtime_thaw_volumes(r).await })
            .map(|_| ())
    }

    /// RuntimeTrimVolume; answers the bytes given back.
    pub fn trim(&self, sandbox: &str, volume: &str, min_extent_bytes: u64) -> Result<u64, Status> {
        let r = self.request(pb::RuntimeTrimVolumeRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: volume.into(),
            min_extent_bytes,
        });
        self.call(|mut c| async move { c.runtime_trim_volume(r).await })
            .map(|r| r.trimmed_bytes)
    }

    /// RuntimeGetVolumeHealth: CSI 1.13's list, empty when healthy.
    pub fn health(&self, sandbox: &str, volume: &str) -> Result<Vec<pb::VolumeHealth>, Status> {
        let r = self.request(pb::RuntimeGetVolumeHealthRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: volume.into(),
        });
        self.call(|mut c| async move { c.runtime_get_volume_health(r).await })
            .map(|r| r.health)
    }
}

fn freeze_request(
    volumes: &[(String, String)],
    timeout_ms: u32,
    freeze_id: Option<&str>,
) -> pb::RuntimeFreezeVolumesRequest {
    pb::RuntimeFreezeVolumesRequest {
        volumes: refs(volumes),
        timeout_ms,
        freeze_id: freeze_id.unwrap_or_default().to_string(),
    }
}

/// (sandbox, host volume) pairs as the protocol's references.
fn refs(volumes: &[(String, String)]) -> Vec<pb::VolumeRef> {
    volumes
        .iter()
        .map(|(s, v)| pb::VolumeRef {
            sandbox_id: s.clone(),
            host_volume_id: v.clone(),
        })
        .collect()
}

/// The bytes usage of a stats answer: (available, total, used).
pub fn bytes(s: &pb::RuntimeGetVolumeStatsResponse) -> Option<(i64, i64, i64)> {
    s.usage
        .iter()
        .find(|u| u.unit() == pb::volume_usage::Unit::Bytes)
        .map(|u| (u.available, u.total, u.used))
}

/// The canonical upper-case name of a gRPC code, e.g. `NOT_FOUND` (the
/// table crust-protocols keeps for every crate).
pub fn code_name(code: tonic::Code) -> String {
    let n = i32::from(code);
    crust_protocols::code::Code::from_number(n)
        .map_or_else(|| format!("CODE_{n}"), |c| c.name().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_names() {
        assert_eq!(code_name(tonic::Code::NotFound), "NOT_FOUND");
        assert_eq!(code_name(tonic::Code::Ok), "OK");
        assert_eq!(
            code_name(tonic::Code::FailedPrecondition),
            "FAILED_PRECONDITION"
        );
    }
}

//! The gRPC layer: protobuf ↔ plain types, crustd's error → gRPC status, and
//! one structured log line per call. Each call's work (blocking QMP and agent
//! I/O) runs through `calls` (a thread of its own, bounded per sandbox,
//! joined by the same call made again), so calls for different volumes and
//! sandboxes proceed at once; `volumes` serializes what must be.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tonic::{Request, Response, Status};

use crate::calls::{Calls, Reply, What};
use crate::devices::Key;
use crate::error::{Error, Result};
use crate::pb;
use crate::pb::runtime_assisted_storage_management_server::RuntimeAssistedStorageManagement;
use crate::pb::runtime_capability::rpc::Type as Cap;
use crate::volumes::{self, Crustd, DirectRequest, FsGroupPolicy, Origin, PublishRequest};

/// What crustd advertises: what works end to end through it with the guest
/// this project builds, and nothing a call would refuse (no SUBPATH or
/// SELINUX_RELABEL: CRUST has no call for them here; BLOCK_VOLUME only with
/// `volumes::BLOCK_VOLUMES`). SELINUX_RELABEL_ON_MOUNT: the guest loads no
/// SELinux policy, so the agent leaves kubelet's context= options out of the
/// mount and says so, the no-op configuration KEP-2857 lets a runtime
/// declare as supported (a guest with SELinux gets them as given).
pub fn capabilities() -> Vec<Cap> {
    let mut caps = vec![
        Cap::FsGroupChangePolicyAlways,
        Cap::FsGroupChangePolicyRootMismatch,
        Cap::SelinuxRelabelOnMount,
        Cap::VolumeStats,
        Cap::VolumeResize,
        Cap::VolumeCondition,
        Cap::Freeze,
        Cap::Trim,
        Cap::VolumeHealth,
    ];
    if volumes::BLOCK_VOLUMES {
        caps.push(Cap::BlockVolume);
    }
    caps
}

/// The tonic service around a [`Crustd`].
#[derive(Clone)]
pub struct Service {
    calls: Arc<Calls>,
}

impl Service {
    pub fn new(inner: Arc<Crustd>) -> Service {
        Service {
            calls: Arc::new(Calls::new(inner)),
        }
    }

    /// Makes the call `what` for a caller whose deadline is `at`, and logs it.
    async fn run(
        &self,
        what: What,
        at: Option<Instant>,
        sandbox: &str,
        host_volume: &str,
    ) -> std::result::Result<Reply, Status> {
        let t0 = Instant::now();
        let method = what.method();
        let asked = what.freeze_id().to_string();
        let out = self.calls.call(what, at).await;
        let group = match &out {
            Ok(Reply::Frozen(f)) => f.id.as_str(),
            _ => asked.as_str(),
        };
        log(method, sandbox, host_volume, group, &out, t0);
        out.map_err(to_status)
    }
}

/// A publish refused before it is a call (its words do not parse), logged
/// as a call is.
fn refused(method: &str, r: &pb::RuntimePublishVolumeRequest, e: Error) -> Status {
    let out: Result<()> = Err(e);
    log(
        method,
        &r.sandbox_id,
        &r.host_volume_id,
        "",
        &out,
        Instant::now(),
    );
    out.map_err(to_status).unwrap_err()
}

/// An answer of another shape than the call's: a defect of crustd's.
fn mismatch(r: Reply) -> Status {
    to_status(Error::Mismatch(format!("{r:?}")))
}

/// One line: the call, what it named (`group`: a freeze's id, "" for
/// none), its code, how long it took, and its error.
fn log<T>(
    method: &str,
    sandbox: &str,
    host_volume: &str,
    group: &str,
    out: &Result<T>,
    t0: Instant,
) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut line = json!({
        "ts": (now * 1000.0).round() / 1000.0,
        "method": method,
        "sandbox": sandbox,
        "host_volume": host_volume,
        "code": out.as_ref().map_or_else(|e| e.code().name(), |_| "OK"),
        "ms": (t0.elapsed().as_secs_f64() * 1e5).round() / 100.0,
    });
    if !group.is_empty() {
        line["freeze_id"] = group.into();
    }
    if let Err(e) = out {
        line["error"] = e.to_string().clone().into();
    }
    // One write per line, so lines from calls at once never interleave.
    let mut text = line.to_string();
    text.push('\n');
    let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
}

/// When the caller gives up: now plus its `grpc-timeout` header, if it sent
/// one that parses (gRPC over HTTP/2: at most 8 digits and a unit, `H`, `M`,
/// `S`, `m`, `u` or `n`). kubelet sets one on every call.
pub fn caller_deadline<T>(req: &Request<T>) -> Option<Instant> {
    let value = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    Instant::now().checked_add(grpc_timeout(value)?)
}

/// A `grpc-timeout` value as a duration.
pub fn grpc_timeout(value: &str) -> Option<Duration> {
    let unit = value.chars().last()?;
    let digits = &value[..value.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// crustd's error as a gRPC status (the codes share gRPC's numbers).
pub fn to_status(e: Error) -> Status {
    Status::new(tonic::Code::from_i32(e.code().number()), e.to_string())
}

#[tonic::async_trait]
impl RuntimeAssistedStorageManagement for Service {
    async fn runtime_get_capabilities(
        &self,
        _: Request<pb::RuntimeGetCapabilitiesRequest>,
    ) -> std::result::Result<Response<pb::RuntimeGetCapabilitiesResponse>, Status> {
        let capabilities = capabilities()
            .into_iter()
            .map(|t| pb::RuntimeCapability {
                r#type: Some(pb::runtime_capability::Type::Rpc(
                    pb::runtime_capability::Rpc { r#type: t.into() },
                )),
            })
            .collect();
        log::<()>(
            "RuntimeGetCapabilities",
            "",
            "",
            "",
            &Ok(()),
            Instant::now(),
        );
        Ok(Response::new(pb::RuntimeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn runtime_get_supported_file_systems(
        &self,
        _: Request<pb::RuntimeGetSupportedFileSystemsRequest>,
    ) -> std::result::Result<Response<pb::RuntimeGetSupportedFileSystemsResponse>, Status> {
        log::<()>(
            "RuntimeGetSupportedFileSystems",
            "",
            "",
            "",
            &Ok(()),
            Instant::now(),
        );
        Ok(Response::new(pb::RuntimeGetSupportedFileSystemsResponse {
            file_systems: volumes::FILE_SYSTEMS
                .iter()
                .map(|s| s.to_string())
                .collect(),
        }))
    }

    async fn runtime_publish_volume(
        &self,
        req: Request<pb::RuntimePublishVolumeRequest>,
    ) -> std::result::Result<Response<pb::RuntimePublishVolumeResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let fsgroup_policy = match FsGroupPolicy::parse(&r.fsgroup_policy) {
            Ok(p) => p,
            Err(e) => return Err(refused("RuntimePublishVolume", &r, e)),
        };
        let p = PublishRequest {
            sandbox_id: r.sandbox_id,
            host_volume_id: r.host_volume_id,
            host_target_path: r.host_target_path,
            file_system: r.file_system,
            mount_options: r.mount_options,
            fsgroup_gid: r.fsgroup_gid,
            fsgroup_policy,
            read_only: r.read_only,
            block: r.block,
            create_file_system: r.create_file_system,
            origin: Origin::Kubelet,
        };
        let (s, v) = (p.sandbox_id.clone(), p.host_volume_id.clone());
        match self.run(What::Publish(p), at, &s, &v).await? {
            Reply::Path(guest_path) => Ok(Response::new(pb::RuntimePublishVolumeResponse {
                guest_path,
            })),
            other => Err(mismatch(other)),
        }
    }

    async fn runtime_publish_direct_volume(
        &self,
        req: Request<pb::RuntimePublishDirectVolumeRequest>,
    ) -> std::result::Result<Response<pb::RuntimePublishDirectVolumeResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let d = DirectRequest {
            sandbox_id: r.sandbox_id,
            volume_path: r.volume_path,
            read_only: r.read_only,
        };
        // The log names the volume path: the device is known only once the record is read.
        let (s, v) = (d.sandbox_id.clone(), d.volume_path.clone());
        match self.run(What::Direct(d), at, &s, &v).await? {
            Reply::Direct(guest_path, host_volume_id) => {
                Ok(Response::new(pb::RuntimePublishDirectVolumeResponse {
                    guest_path,
                    host_volume_id,
                }))
            }
            other => Err(mismatch(other)),
        }
    }

    async fn runtime_unpublish_volume(
        &self,
        req: Request<pb::RuntimeUnpublishVolumeRequest>,
    ) -> std::result::Result<Response<pb::RuntimeUnpublishVolumeResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let (s, v) = (r.sandbox_id, r.host_volume_id);
        let what = What::Unpublish {
            sandbox: s.clone(),
            volume: v.clone(),
        };
        match self.run(what, at, &s, &v).await? {
            Reply::Done => Ok(Response::new(pb::RuntimeUnpublishVolumeResponse {})),
            other => Err(mismatch(other)),
        }
    }

    async fn runtime_get_volume_stats(
        &self,
        req: Request<pb::RuntimeGetVolumeStatsRequest>,
    ) -> std::result::Result<Response<pb::RuntimeGetVolumeStatsResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let (s, v) = (r.sandbox_id, r.host_volume_id);
        let what = What::Stats {
            sandbox: s.clone(),
            volume: v.clone(),
        };
        let st = match self.run(what, at, &s, &v).await? {
            Reply::Stats(st) => st,
            other => return Err(mismatch(other)),
        };
        use pb::volume_usage::Unit;
        Ok(Response::new(pb::RuntimeGetVolumeStatsResponse {
            usage: st
                .usage
                .iter()
                .map(|u| pb::VolumeUsage {
                    available: u.available,
                    total: u.total,
                    used: u.used,
                    unit: if u.inodes { Unit::Inodes } else { Unit::Bytes }.into(),
                })
                .collect(),
            volume_condition: Some(pb::VolumeCondition {
                abnormal: st.abnormal,
                message: st.message,
            }),
        }))
    }

    async fn runtime_expand_volume(
        &self,
        req: Request<pb::RuntimeExpandVolumeRequest>,
    ) -> std::result::Result<Response<pb::RuntimeExpandVolumeResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let (s, v) = (r.sandbox_id, r.host_volume_id);
        let what = What::Expand {
            sandbox: s.clone(),
            volume: v.clone(),
            bytes: r.required_bytes,
        };
        match self.run(what, at, &s, &v).await? {
            Reply::Capacity(capacity_bytes) => Ok(Response::new(pb::RuntimeExpandVolumeResponse {
                capacity_bytes,
            })),
            other => Err(mismatch(other)),
        }
    }

    async fn runtime_freeze_volumes(
        &self,
        req: Request<pb::RuntimeFreezeVolumesRequest>,
    ) -> std::result::Result<Response<pb::RuntimeFreezeVolumesResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let volumes = refs(&r.volumes);
        let first = first_ref(&volumes);
        let what = What::Freeze {
            volumes,
            timeout_ms: r.timeout_ms,
            freeze_id: r.freeze_id,
        };
        match self
            .run(what, at, &first.sandbox, &first.host_volume)
            .await?
        {
            Reply::Frozen(f) => Ok(Response::new(pb::RuntimeFreezeVolumesResponse {
                freeze_id: f.id,
                thaw_at_unix_ms: f.thaw_at_unix_ms,
            })),
            other => Err(mismatch(other)),
        }
    }

    async fn runtime_thaw_volumes(
        &self,
        req: Request<pb::RuntimeThawVolumesRequest>,
    ) -> std::result::Result<Response<pb::RuntimeThawVolumesResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let volumes = refs(&r.volumes);
        let first = first_ref(&volumes);
        let what = What::Thaw {
            volumes,
            freeze_id: r.freeze_id,
            force: r.force,
        };
        match self
            .run(what, at, &first.sandbox, &first.host_volume)
            .await?
        {
            Reply::Done => Ok(Response::new(pb::RuntimeThawVolumesResponse {})),
            other => Err(mismatch(other)),
        }
    }

    async fn runtime_trim_volume(
        &self,
        req: Request<pb::RuntimeTrimVolumeRequest>,
    ) -> std::result::Result<Response<pb::RuntimeTrimVolumeResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let (s, v) = (r.sandbox_id, r.host_volume_id);
        let what = What::Trim {
            sandbox: s.clone(),
            volume: v.clone(),
            min_extent: r.min_extent_bytes,
        };
        match self.run(what, at, &s, &v).await? {
            Reply::Trimmed(trimmed_bytes) => Ok(Response::new(pb::RuntimeTrimVolumeResponse {
                trimmed_bytes,
            })),
            other => Err(mismatch(other)),
        }
    }

    async fn runtime_get_volume_health(
        &self,
        req: Request<pb::RuntimeGetVolumeHealthRequest>,
    ) -> std::result::Result<Response<pb::RuntimeGetVolumeHealthResponse>, Status> {
        let at = caller_deadline(&req);
        let r = req.into_inner();
        let (s, v) = (r.sandbox_id, r.host_volume_id);
        let what = What::Health {
            sandbox: s.clone(),
            volume: v.clone(),
        };
        match self.run(what, at, &s, &v).await? {
            Reply::Health(list) => Ok(Response::new(pb::RuntimeGetVolumeHealthResponse {
                health: list
                    .into_iter()
                    .map(|h| pb::VolumeHealth {
                        status: h.status,
                        reason: h.reason,
                        message: h.message,
                    })
                    .collect(),
            })),
            other => Err(mismatch(other)),
        }
    }
}

/// A request's volume references.
fn refs(v: &[pb::VolumeRef]) -> Vec<Key> {
    v.iter()
        .map(|r| Key::new(&r.sandbox_id, &r.host_volume_id))
        .collect()
}

/// The first of them, for the log line (empty names when there is none).
fn first_ref(v: &[Key]) -> Key {
    v.first().cloned().unwrap_or_else(|| Key::new("", ""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        let table = [
            ("2S", Some(Duration::from_secs(2))),
            ("120S", Some(Duration::from_secs(120))),
            ("1999m", Some(Duration::from_millis(1999))),
            ("5M", Some(Duration::from_secs(300))),
            ("1H", Some(Duration::from_secs(3600))),
            ("99999999u", Some(Duration::from_micros(99_999_999))),
            ("7n", Some(Duration::from_nanos(7))),
            ("0m", Some(Duration::ZERO)),
            // Nine digits, no digits, no unit, an unknown unit, a sign, spaces.
            ("123456789S", None),
            ("S", None),
            ("10", None),
            ("10s", None),
            ("-1S", None),
            (" 1S", None),
            ("", None),
            ("1é", None),
        ];
        for (v, want) in table {
            assert_eq!(grpc_timeout(v), want, "{v:?}");
        }
    }

    #[test]
    fn the_caller_deadline_comes_from_the_header() {
        let mut req = Request::new(());
        assert_eq!(caller_deadline(&req), None);
        req.set_timeout(Duration::from_secs(120));
        let d = caller_deadline(&req).unwrap();
        let left = d.saturating_duration_since(Instant::now());
        assert!(
            left > Duration::from_secs(119) && left <= Duration::from_secs(120),
            "{left:?}"
        );
    }
}

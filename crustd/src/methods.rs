//! crustd's one list of CRUST methods. Each entry names a method of
//! crust_runtime.proto's service, the tonic method that serves it with its
//! request and answer messages, and how it is answered: `local`, from what
//! crustd knows, or `served`, as a [`Call`] that `calls` runs. Made from the
//! list: the tonic service (`RuntimeAssistedStorageManagement` for
//! `Service`) and [`METHODS`].
//!
//! A served method's request makes its call ([`Served`]), and the call's
//! type says what it answers: the response is made from that answer and no
//! other, so an answer of another method's shape cannot reach it.
//!
//! The list is held to the .proto when it compiles: every method of the
//! contract, in its order ([`CONTRACT`], which build.rs makes from the
//! .proto), each served entry named as its call's method.

use std::sync::Arc;
use std::time::Instant;

use crust_protocols::rpc::same_method;
use tonic::{Request, Response, Status};

use crate::agent::Health as GuestHealth;
use crate::calls::Call;
use crate::deadline::Deadline;
use crate::devices::Key;
use crate::error::{Error, Result};
use crate::freezes::Frozen;
use crate::pb;
use crate::pb::runtime_assisted_storage_management_server::RuntimeAssistedStorageManagement;
use crate::service::{caller_deadline, capabilities, log, to_status, Service};
use crate::volumes::{self, Crustd, DirectRequest, FsGroupPolicy, Origin, PublishRequest};

include!(concat!(env!("OUT_DIR"), "/runtime_methods.rs"));

/// The entries' shape: `Name: tonic_method(Request) -> Response, how;`,
/// where `how` is `served` (a [`Served`] request) or `local` (a [`Local`] one).
macro_rules! methods {
    ($($name:ident: $rust:ident($req:ident) -> $resp:ident, $how:ident;)*) => {
        #[tonic::async_trait]
        impl RuntimeAssistedStorageManagement for Service {
            $(
                async fn $rust(
                    &self,
                    req: Request<pb::$req>,
                ) -> std::result::Result<Response<pb::$resp>, Status> {
                    $how(self, stringify!($name), req).await
                }
            )*
        }

        /// Every method crustd serves, in crust_runtime.proto's order.
        pub const METHODS: [&str; CONTRACT.len()] = [$(stringify!($name)),*];

        // The list is the contract's, in its order, and each served entry's
        // name is its call's method.
        const _: () = {
            $(named!($how, $name, $req);)*
            let mut i = 0;
            while i < METHODS.len() {
                assert!(same_method(METHODS[i], CONTRACT[i]), "the list is not crust_runtime.proto's");
                i += 1;
            }
        };
    };
}

/// A served entry's check that its name is its call's method.
macro_rules! named {
    (served, $name:ident, $req:ident) => {
        assert!(
            same_method(
                stringify!($name),
                <<pb::$req as Served>::Call as Call>::METHOD
            ),
            concat!(stringify!($name), "'s call is another method's")
        );
    };
    (local, $name:ident, $req:ident) => {};
}

methods! {
    RuntimeGetCapabilities: runtime_get_capabilities(RuntimeGetCapabilitiesRequest) -> RuntimeGetCapabilitiesResponse, local;
    RuntimeGetSupportedFileSystems: runtime_get_supported_file_systems(RuntimeGetSupportedFileSystemsRequest) -> RuntimeGetSupportedFileSystemsResponse, local;
    RuntimePublishVolume: runtime_publish_volume(RuntimePublishVolumeRequest) -> RuntimePublishVolumeResponse, served;
    RuntimeUnpublishVolume: runtime_unpublish_volume(RuntimeUnpublishVolumeRequest) -> RuntimeUnpublishVolumeResponse, served;
    RuntimeGetVolumeStats: runtime_get_volume_stats(RuntimeGetVolumeStatsRequest) -> RuntimeGetVolumeStatsResponse, served;
    RuntimeExpandVolume: runtime_expand_volume(RuntimeExpandVolumeRequest) -> RuntimeExpandVolumeResponse, served;
    RuntimePublishDirectVolume: runtime_publish_direct_volume(RuntimePublishDirectVolumeRequest) -> RuntimePublishDirectVolumeResponse, served;
    RuntimeFreezeVolumes: runtime_freeze_volumes(RuntimeFreezeVolumesRequest) -> RuntimeFreezeVolumesResponse, served;
    RuntimeThawVolumes: runtime_thaw_volumes(RuntimeThawVolumesRequest) -> RuntimeThawVolumesResponse, served;
    RuntimeTrimVolume: runtime_trim_volume(RuntimeTrimVolumeRequest) -> RuntimeTrimVolumeResponse, served;
    RuntimeGetVolumeHealth: runtime_get_volume_health(RuntimeGetVolumeHealthRequest) -> RuntimeGetVolumeHealthResponse, served;
}

/// The request of a method answered by a call through `calls`.
pub trait Served: Sized + Send + 'static {
    /// The call it asks for.
    type Call: Call;
    /// The method's response message.
    type Response;
    /// The call, in plain types; refused when the request's words do not
    /// parse into them.
    fn call(self) -> std::result::Result<Self::Call, Box<Refused>>;
    /// The response, from the call's answer.
    fn response(answer: <Self::Call as Call>::Answer) -> Self::Response;
}

/// A request refused before it is a call: what it named, for the log, and why.
pub struct Refused {
    /// The sandbox it named.
    pub sandbox: String,
    /// The host volume it named.
    pub host_volume: String,
    /// Why.
    pub error: Error,
}

/// The request of a method crustd answers from what it knows.
pub trait Local: Send + 'static {
    /// The method's response message.
    type Response;
    /// The response, made from crustd's own tables.
    fn answer() -> Self::Response;
}

/// A served method: its call, made for the caller's deadline and logged
/// (under the call's method, which the table's name is checked to be).
async fn served<M: Served>(
    service: &Service,
    name: &'static str,
    req: Request<M>,
) -> std::result::Result<Response<M::Response>, Status> {
    let at = caller_deadline(&req);
    let call = match req.into_inner().call() {
        Ok(call) => call,
        Err(r) => {
            let out: Result<()> = Err(r.error);
            log(name, &r.sandbox, &r.host_volume, "", &out, Instant::now());
            return Err(out.map_err(to_status).unwrap_err());
        }
    };
    let answer = service.run(call, at).await?;
    Ok(Response::new(M::response(answer)))
}

/// A local method: its answer, logged.
async fn local<M: Local>(
    _: &Service,
    name: &'static str,
    _: Request<M>,
) -> std::result::Result<Response<M::Response>, Status> {
    let answer = M::answer();
    log::<()>(name, "", "", "", &Ok(()), Instant::now());
    Ok(Response::new(answer))
}

impl Local for pb::RuntimeGetCapabilitiesRequest {
    type Response = pb::RuntimeGetCapabilitiesResponse;

    fn answer() -> Self::Response {
        let capabilities = capabilities()
            .into_iter()
            .map(|t| pb::RuntimeCapability {
                r#type: Some(pb::runtime_capability::Type::Rpc(
                    pb::runtime_capability::Rpc { r#type: t.into() },
                )),
            })
            .collect();
        pb::RuntimeGetCapabilitiesResponse { capabilities }
    }
}

impl Local for pb::RuntimeGetSupportedFileSystemsRequest {
    type Response = pb::RuntimeGetSupportedFileSystemsResponse;

    fn answer() -> Self::Response {
        pb::RuntimeGetSupportedFileSystemsResponse {
            file_systems: volumes::FILE_SYSTEMS
                .iter()
                .map(|s| s.to_string())
                .collect(),
        }
    }
}

impl Served for pb::RuntimePublishVolumeRequest {
    type Call = PublishRequest;
    type Response = pb::RuntimePublishVolumeResponse;

    fn call(self) -> std::result::Result<PublishRequest, Box<Refused>> {
        let fsgroup_policy = match FsGroupPolicy::parse(&self.fsgroup_policy) {
            Ok(p) => p,
            Err(error) => {
                return Err(Box::new(Refused {
                    sandbox: self.sandbox_id,
                    host_volume: self.host_volume_id,
                    error,
                }))
            }
        };
        Ok(PublishRequest {
            sandbox_id: self.sandbox_id,
            host_volume_id: self.host_volume_id,
            host_target_path: self.host_target_path,
            file_system: self.file_system,
            mount_options: self.mount_options,
            fsgroup_gid: self.fsgroup_gid,
            fsgroup_policy,
            read_only: self.read_only,
            block: self.block,
            create_file_system: self.create_file_system,
            // crust_runtime.proto's publish has no field that asks for encryption.
            encryption: None,
            origin: Origin::Kubelet,
        })
    }

    fn response(guest_path: String) -> Self::Response {
        pb::RuntimePublishVolumeResponse { guest_path }
    }
}

impl Call for PublishRequest {
    const METHOD: &'static str = "RuntimePublishVolume";
    /// The guest path.
    type Answer = String;

    fn sandbox(&self) -> &str {
        &self.sandbox_id
    }

    fn subject(&self) -> (&str, &str) {
        (&self.sandbox_id, &self.host_volume_id)
    }

    fn run(&self, c: &Arc<Crustd>, deadline: &Deadline) -> Result<String> {
        c.publish(self, deadline)
    }
}

impl Served for pb::RuntimePublishDirectVolumeRequest {
    type Call = DirectRequest;
    type Response = pb::RuntimePublishDirectVolumeResponse;

    fn call(self) -> std::result::Result<DirectRequest, Box<Refused>> {
        Ok(DirectRequest {
            sandbox_id: self.sandbox_id,
            volume_path: self.volume_path,
            read_only: self.read_only,
        })
    }

    fn response((guest_path, host_volume_id): (String, String)) -> Self::Response {
        pb::RuntimePublishDirectVolumeResponse {
            guest_path,
            host_volume_id,
        }
    }
}

impl Call for DirectRequest {
    const METHOD: &'static str = "RuntimePublishDirectVolume";
    /// The guest path and the device the record named.
    type Answer = (String, String);

    fn sandbox(&self) -> &str {
        &self.sandbox_id
    }

    /// The volume path: the device is known only once the record is read.
    fn subject(&self) -> (&str, &str) {
        (&self.sandbox_id, &self.volume_path)
    }

    fn run(&self, c: &Arc<Crustd>, deadline: &Deadline) -> Result<(String, String)> {
        c.publish_direct(self, deadline)
    }
}

/// A call on one volume of one sandbox, its struct and [`Call`] impl: the
/// fields besides the volume's, and the answer with how it is had.
macro_rules! volume_call {
    ($(#[$doc:meta])* $call:ident { $($field:ident: $ty:ty),* } -> $answer:ty,
     $method:literal, |$c:ident, $s:ident, $d:ident| $run:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $call {
            pub sandbox: String,
            pub volume: String,
            $(pub $field: $ty,)*
        }

        impl Call for $call {
            const METHOD: &'static str = $method;
            type Answer = $answer;

            fn sandbox(&self) -> &str {
                &self.sandbox
            }

            fn subject(&self) -> (&str, &str) {
                (&self.sandbox, &self.volume)
            }

            fn run(&self, $c: &Arc<Crustd>, $d: &Deadline) -> Result<$answer> {
                let $s = self;
                $run
            }
        }
    };
}

volume_call!(
    /// RuntimeUnpublishVolume.
    Unpublish {} -> (), "RuntimeUnpublishVolume",
    |c, s, d| c.unpublish(&s.sandbox, &s.volume, d)
);

impl Served for pb::RuntimeUnpublishVolumeRequest {
    type Call = Unpublish;
    type Response = pb::RuntimeUnpublishVolumeResponse;

    fn call(self) -> std::result::Result<Unpublish, Box<Refused>> {
        Ok(Unpublish {
            sandbox: self.sandbox_id,
            volume: self.host_volume_id,
        })
    }

    fn response(_: ()) -> Self::Response {
        pb::RuntimeUnpublishVolumeResponse {}
    }
}

volume_call!(
    /// RuntimeGetVolumeStats.
    Stats {} -> volumes::Stats, "RuntimeGetVolumeStats",
    |c, s, d| c.stats(&s.sandbox, &s.volume, d)
);

impl Served for pb::RuntimeGetVolumeStatsRequest {
    type Call = Stats;
    type Response = pb::RuntimeGetVolumeStatsResponse;

    fn call(self) -> std::result::Result<Stats, Box<Refused>> {
        Ok(Stats {
            sandbox: self.sandbox_id,
            volume: self.host_volume_id,
        })
    }

    fn response(st: volumes::Stats) -> Self::Response {
        use pb::volume_usage::Unit;
        pb::RuntimeGetVolumeStatsResponse {
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
        }
    }
}

volume_call!(
    /// RuntimeExpandVolume; answers the capacity in bytes.
    Expand { bytes: i64 } -> i64, "RuntimeExpandVolume",
    |c, s, d| c.expand(&s.sandbox, &s.volume, s.bytes, d)
);

impl Served for pb::RuntimeExpandVolumeRequest {
    type Call = Expand;
    type Response = pb::RuntimeExpandVolumeResponse;

    fn call(self) -> std::result::Result<Expand, Box<Refused>> {
        Ok(Expand {
            sandbox: self.sandbox_id,
            volume: self.host_volume_id,
            bytes: self.required_bytes,
        })
    }

    fn response(capacity_bytes: i64) -> Self::Response {
        pb::RuntimeExpandVolumeResponse { capacity_bytes }
    }
}

volume_call!(
    /// RuntimeTrimVolume; answers the bytes given back.
    Trim { min_extent: u64 } -> u64, "RuntimeTrimVolume",
    |c, s, d| c.trim(&s.sandbox, &s.volume, s.min_extent, d)
);

impl Served for pb::RuntimeTrimVolumeRequest {
    type Call = Trim;
    type Response = pb::RuntimeTrimVolumeResponse;

    fn call(self) -> std::result::Result<Trim, Box<Refused>> {
        Ok(Trim {
            sandbox: self.sandbox_id,
            volume: self.host_volume_id,
            min_extent: self.min_extent_bytes,
        })
    }

    fn response(trimmed_bytes: u64) -> Self::Response {
        pb::RuntimeTrimVolumeResponse { trimmed_bytes }
    }
}

volume_call!(
    /// RuntimeGetVolumeHealth; answers the guest's list.
    Health {} -> Vec<GuestHealth>, "RuntimeGetVolumeHealth",
    |c, s, d| c.health(&s.sandbox, &s.volume, d)
);

impl Served for pb::RuntimeGetVolumeHealthRequest {
    type Call = Health;
    type Response = pb::RuntimeGetVolumeHealthResponse;

    fn call(self) -> std::result::Result<Health, Box<Refused>> {
        Ok(Health {
            sandbox: self.sandbox_id,
            volume: self.host_volume_id,
        })
    }

    fn response(list: Vec<GuestHealth>) -> Self::Response {
        pb::RuntimeGetVolumeHealthResponse {
            health: list
                .into_iter()
                .map(|h| pb::VolumeHealth {
                    status: h.status,
                    reason: h.reason,
                    message: h.message,
                })
                .collect(),
        }
    }
}

/// RuntimeFreezeVolumes. Its slot is its first sandbox's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Freeze {
    pub volumes: Vec<Key>,
    pub timeout_ms: u32,
    /// The caller's id for the group ("": crustd makes one).
    pub freeze_id: String,
}

impl Call for Freeze {
    const METHOD: &'static str = "RuntimeFreezeVolumes";
    type Answer = Frozen;

    fn sandbox(&self) -> &str {
        self.volumes.first().map_or("", |k| k.sandbox.as_str())
    }

    fn subject(&self) -> (&str, &str) {
        first(&self.volumes)
    }

    /// The group made, once answered; the one asked for until then.
    fn group<'a>(&'a self, answer: Option<&'a Frozen>) -> &'a str {
        answer.map_or(self.freeze_id.as_str(), |f| f.id.as_str())
    }

    fn run(&self, c: &Arc<Crustd>, deadline: &Deadline) -> Result<Frozen> {
        c.freeze(&self.volumes, self.timeout_ms, &self.freeze_id, deadline)
    }

    /// Nobody holds the group's id: it is ended at once.
    fn unclaimed(crustd: &Arc<Crustd>, f: &Frozen) {
        if !f.made_now {
            // Answered again from the record: whoever made it was told.
            return;
        }
        let (c, id) = (crustd.clone(), f.id.clone());
        let spawned = std::thread::Builder::new()
            .name("freeze-unclaimed".into())
            .spawn(move || c.end_unclaimed(&id));
        if let Err(e) = spawned {
            eprintln!("crustd: could not start a thread to end a group nobody holds ({e}); crustd's timer ends it");
        }
    }
}

impl Served for pb::RuntimeFreezeVolumesRequest {
    type Call = Freeze;
    type Response = pb::RuntimeFreezeVolumesResponse;

    fn call(self) -> std::result::Result<Freeze, Box<Refused>> {
        Ok(Freeze {
            volumes: refs(&self.volumes),
            timeout_ms: self.timeout_ms,
            freeze_id: self.freeze_id,
        })
    }

    fn response(f: Frozen) -> Self::Response {
        pb::RuntimeFreezeVolumesResponse {
            freeze_id: f.id,
            thaw_at_unix_ms: f.thaw_at_unix_ms,
        }
    }
}

/// RuntimeThawVolumes: a group by its id, or with force the volumes. Its
/// slot is its first sandbox's, or the group's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Thaw {
    pub volumes: Vec<Key>,
    pub freeze_id: String,
    pub force: bool,
}

impl Call for Thaw {
    const METHOD: &'static str = "RuntimeThawVolumes";
    type Answer = ();

    fn sandbox(&self) -> &str {
        self.volumes
            .first()
            .map_or(self.freeze_id.as_str(), |k| k.sandbox.as_str())
    }

    fn subject(&self) -> (&str, &str) {
        first(&self.volumes)
    }

    fn group<'a>(&'a self, _: Option<&'a ()>) -> &'a str {
        &self.freeze_id
    }

    fn run(&self, c: &Arc<Crustd>, deadline: &Deadline) -> Result<()> {
        c.thaw(&self.volumes, &self.freeze_id, self.force, deadline)
    }
}

impl Served for pb::RuntimeThawVolumesRequest {
    type Call = Thaw;
    type Response = pb::RuntimeThawVolumesResponse;

    fn call(self) -> std::result::Result<Thaw, Box<Refused>> {
        Ok(Thaw {
            volumes: refs(&self.volumes),
            freeze_id: self.freeze_id,
            force: self.force,
        })
    }

    fn response(_: ()) -> Self::Response {
        pb::RuntimeThawVolumesResponse {}
    }
}

/// A request's volume references.
fn refs(v: &[pb::VolumeRef]) -> Vec<Key> {
    v.iter()
        .map(|r| Key::new(&r.sandbox_id, &r.host_volume_id))
        .collect()
}

/// The first of them, for the log line (empty names when there is none).
fn first(v: &[Key]) -> (&str, &str) {
    v.first()
        .map_or(("", ""), |k| (k.sandbox.as_str(), k.host_volume.as_str()))
}

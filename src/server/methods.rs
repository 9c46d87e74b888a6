//! The service's one list of methods. Each entry says, for a method of
//! crust.proto's `Agent` service: its name, the `crust_ttrpc::Agent` method
//! ttrpc calls with its request and answer messages, the lane of the
//! transport it takes, the handler on `Service` that serves it, and what
//! its log line names. Made from the list: the ttrpc service (`Agent` for
//! `Service`), the lane rule ([`lane`]), the direct answers of the methods
//! the event loop answers itself ([`table`]), and [`call`], the one way a
//! method runs, whoever asks (a ttrpc client, the loop, `embed::Table`).
//!
//! The list is held to crust.proto when it compiles: every method of the
//! contract, in its order, each with its own request and answer messages
//! (`crust_protocols::rpc`), and a handler can only answer its own method's
//! message.
//!
//! Lanes: GetCapabilities and GetAgentInfo answer from memory and /proc,
//! take no lock a long operation holds and touch no disk: the event loop
//! answers them itself, so a health check costs no thread hop. ListVolumes
//! asks each volume's device its size (an ioctl), so it takes the quick
//! workers: answered even while every regular worker waits for a disk,
//! never holding up the loop. Every other method may wait for disks and
//! walks.

use std::borrow::Cow;
use std::sync::Arc;

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc;
use crust_protocols::rpc::{same_method, Rpc, METHODS as CONTRACT};
use crust_protocols::ttrpc::{self, TtrpcContext};

use super::service::Service;
use super::translate::{status_code, Caller};
use super::volumes::VolumeTable;
use crate::error::{Error, Result};
use crate::rpc::table::{direct, Lane, Table};

/// The path of a method of the service is this and its name (a macro, so
/// that a path can be made whole when this compiles).
macro_rules! service {
    () => {
        "/crust.v1.Agent/"
    };
}

/// A method of the service, known by its request message (the entries of
/// the list below).
pub trait Method: Rpc {
    /// The lane of the transport its requests take.
    const LANE: Lane;
    /// What its log line names as the volume: the volume, volumes or
    /// freeze the request acts on; empty for none.
    fn subject(&self) -> Cow<'_, str>;
    /// Runs its handler.
    fn serve<T: VolumeTable>(
        service: &Service<T>,
        req: &Self,
        caller: &Caller,
    ) -> Result<Self::Response>;
}

/// The entries' shape: `Name: ttrpc_method(Request) -> Response, Lane,
/// handler(), |request| what the log names;`, with `handler(cancel)` for a
/// handler that takes the request's cancellation (one that may wait).
macro_rules! methods {
    ($(
        $name:ident: $ttrpc:ident($req:ident) -> $resp:ident,
        $lane:ident, $handler:ident($($cancel:ident)?), |$r:pat_param| $subject:expr;
    )*) => {
        $(
            impl Method for pb::$req {
                const LANE: Lane = Lane::$lane;

                fn subject(&self) -> Cow<'_, str> {
                    let $r = self;
                    Cow::from($subject)
                }

                fn serve<T: VolumeTable>(
                    service: &Service<T>,
                    req: &Self,
                    caller: &Caller,
                ) -> Result<pb::$resp> {
                    // Asked only by a handler that takes a cancellation.
                    let _ = caller;
                    service.$handler(req $(, &caller.$cancel())?)
                }
            }
        )*

        impl<T: VolumeTable> crust_ttrpc::Agent for Service<T> {
            $(
                fn $ttrpc(&self, ctx: &TtrpcContext, req: pb::$req) -> ttrpc::Result<pb::$resp> {
                    answer(self, &req, &Caller::Ttrpc(ctx))
                }
            )*
        }

        /// Every method's name and lane, in crust.proto's order (a request
        /// of the fuzz targets picks its method here by index).
        pub const METHODS: [(&str, Lane); CONTRACT.len()] = [$((stringify!($name), Lane::$lane)),*];

        // Each name is its request's method, and the list is crust.proto's, in its order.
        const _: () = {
            $(assert!(same_method(stringify!($name), <pb::$req as Rpc>::METHOD));)*
            let mut i = 0;
            while i < METHODS.len() {
                assert!(same_method(METHODS[i].0, CONTRACT[i]), "the list is not crust.proto's");
                i += 1;
            }
        };

        /// The lane of a method of the service, by its name: the regular
        /// lane unless its entry says otherwise.
        fn lane_of(method: &str) -> Lane {
            $(lane_of!($lane, method, $name);)*
            Lane::Regular
        }

        /// `table` with the direct answer of each method the loop answers.
        fn with_direct_answers<T: VolumeTable>(table: Table, service: &Arc<Service<T>>) -> Table {
            $(let table = direct_answer!($lane, table, service, $name, $req);)*
            table
        }
    };
}

/// [`lane_of`]'s check of one method: none for a regular one, so the rule
/// compares only the few names that take another lane.
macro_rules! lane_of {
    (Regular, $method:ident, $name:ident) => {};
    ($lane:ident, $method:ident, $name:ident) => {
        if $method == stringify!($name) {
            return Lane::$lane;
        }
    };
}

/// An inline method's direct answer: [`call`] with no handler context,
/// its answer written straight to bytes; any other lane has none.
macro_rules! direct_answer {
    (Inline, $table:ident, $service:ident, $name:ident, $req:ident) => {{
        let s = Arc::clone($service);
        $table.with_direct(
            concat!(service!(), stringify!($name)),
            direct(move |req: pb::$req| answer(&s, &req, &Caller::Deadline(None))),
        )
    }};
    ($lane:ident, $table:ident, $service:ident, $name:ident, $req:ident) => {
        $table
    };
}

methods! {
    GetCapabilities: get_capabilities(GetCapabilitiesRequest) -> GetCapabilitiesResponse,
        Inline, capabilities_in(), |_| "";
    GetSupportedFileSystems: get_supported_file_systems(GetSupportedFileSystemsRequest)
        -> GetSupportedFileSystemsResponse,
        Regular, file_systems_in(cancel), |_| "";
    PublishVolume: publish_volume(PublishVolumeRequest) -> PublishVolumeResponse,
        Regular, publish_in(cancel), |r| &r.volume_id;
    UnpublishVolume: unpublish_volume(UnpublishVolumeRequest) -> UnpublishVolumeResponse,
        Regular, unpublish_in(cancel), |r| &r.volume_id;
    GetVolumeStats: get_volume_stats(GetVolumeStatsRequest) -> GetVolumeStatsResponse,
        Regular, stats_in(cancel), |r| &r.volume_id;
    ExpandVolume: expand_volume(ExpandVolumeRequest) -> ExpandVolumeResponse,
        Regular, expand_in(cancel), |r| &r.volume_id;
    BindMount: bind_mount(BindMountRequest) -> BindMountResponse,
        Regular, bind_in(cancel), |r| &r.volume_id;
    Unmount: unmount(UnmountRequest) -> UnmountResponse,
        Regular, unmount_in(cancel), |_| "";
    ListVolumes: list_volumes(ListVolumesRequest) -> ListVolumesResponse,
        Quick, list_in(), |_| "";
    GetAgentInfo: get_agent_info(GetAgentInfoRequest) -> GetAgentInfoResponse,
        Inline, agent_info_in(), |_| "";
    Shutdown: shutdown(ShutdownRequest) -> ShutdownResponse,
        Regular, shutdown_in(), |_| "";
    FreezeVolumes: freeze_volumes(FreezeVolumesRequest) -> FreezeVolumesResponse,
        Regular, freeze_in(cancel), |r| r.volume_ids.join(",");
    ThawVolumes: thaw_volumes(ThawVolumesRequest) -> ThawVolumesResponse,
        Regular, thaw_in(), |r| thawing(r);
    TrimVolume: trim_volume(TrimVolumeRequest) -> TrimVolumeResponse,
        Regular, trim_in(cancel), |r| &r.volume_id;
    GetVolumeHealth: get_volume_health(GetVolumeHealthRequest) -> GetVolumeHealthResponse,
        Regular, health_in(cancel), |r| &r.volume_id;
}

/// What a thaw's log line names: the freeze it ends, or the volumes a
/// forced thaw names.
fn thawing(r: &pb::ThawVolumesRequest) -> Cow<'_, str> {
    if r.freeze_id.is_empty() {
        Cow::from(r.volume_ids.join(","))
    } else {
        Cow::from(&r.freeze_id)
    }
}

/// Runs method `M` for `req` as every caller runs it: its handler under
/// `Service::run` (a panic answered INTERNAL, one log line, at its lane's
/// rate for the loop's own methods).
pub fn call<T: VolumeTable, M: Method>(
    service: &Service<T>,
    req: &M,
    caller: &Caller,
) -> Result<M::Response> {
    service.run(M::METHOD, M::LANE, &req.subject(), || {
        M::serve(service, req, caller)
    })
}

/// [`call`] for ttrpc: an error as its status ([`status`]).
fn answer<T: VolumeTable, M: Method>(
    service: &Service<T>,
    req: &M,
    caller: &Caller,
) -> ttrpc::Result<M::Response> {
    call(service, req, caller).map_err(status)
}

/// An error as ttrpc's status: its class and sentence. Kept out of line:
/// the same code for every method, written once in the binary.
#[inline(never)]
fn status(e: Error) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(status_code(e.code()), e.to_string()))
}

/// The lane of a method path ("/crust.v1.Agent/Method"), the transport's
/// rule; a path that is no method of the list takes the regular lane.
pub fn lane(path: &str) -> Lane {
    path.strip_prefix(service!()).map_or(Lane::Regular, lane_of)
}

/// The service as the transport serves it: the generated table, each
/// method in its [`lane`], and the inline methods given their direct
/// answers: the same call, with the successful Response written straight to
/// bytes instead of through ttrpc's handler machinery, which costs more
/// than answering from memory does.
pub fn table<T: VolumeTable>(service: Arc<Service<T>>) -> Table {
    let generated = Table::new(crust_ttrpc::create_agent(service.clone()), lane);
    with_direct_answers(generated, &service)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::dispatch::{run, Job, Outbox};
    use crate::sys::sysfs::Sysfs;
    use crate::system::{Gate, Timeline};
    use crate::volumes::table::Volumes;
    use crust_protocols::protobuf::Message;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::Instant;

    /// A service over a table on a fresh root, logging to `log`.
    fn service(log: slog::Logger) -> (tempfile::TempDir, Arc<Service>) {
        let dir = tempfile::tempdir().unwrap();
        let volumes =
            Volumes::open(dir.path(), Sysfs::system(), crate::logging::discard()).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        let svc = Service::new(
            volumes,
            log,
            Instant::now(),
            Arc::new(Mutex::new(Timeline::default())),
            tx,
            Arc::new(Gate::new(true)),
        );
        (dir, Arc::new(svc))
    }

    /// Counts the records logged through it.
    struct Counting(Arc<AtomicUsize>);

    impl slog::Drain for Counting {
        type Ok = ();
        type Err = slog::Never;
        fn log(
            &self,
            _: &slog::Record,
            _: &slog::OwnedKVList,
        ) -> std::result::Result<(), slog::Never> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    /// A flood of the loop's own methods logs at the transport's rate; every
    /// other method logs each call.
    #[test]
    fn the_loops_own_methods_log_at_a_rate() {
        let lines = Arc::new(AtomicUsize::new(0));
        let (_dir, svc) = service(slog::Logger::root(Counting(lines.clone()), slog::o!()));
        let n = || lines.load(Ordering::SeqCst);
        let caller = Caller::Deadline(None);
        for _ in 0..1000 {
            call(&svc, &pb::GetCapabilitiesRequest::new(), &caller).unwrap();
        }
        let rate = usize::try_from(crate::rpc::lograte::PER_SECOND).unwrap();
        assert!(n() <= 2 * rate, "{} lines for 1000 calls", n());
        let before = n();
        for _ in 0..100 {
            // Refused (no target), and logged all the same.
            call(&svc, &pb::UnmountRequest::new(), &caller).unwrap_err();
        }
        assert_eq!(n() - before, 100);
    }

    /// The methods the loop answers itself, and only they, answer directly,
    /// and as their generated handlers would: the same bytes for a payload
    /// that is not the method's message and for a deterministic answer, an
    /// answer that decodes for the rest.
    #[test]
    fn inline_methods_answer_directly_as_their_handlers_would() {
        let (_dir, svc) = service(crate::logging::discard());
        let t = table(svc.clone());
        let generated = Table::new(crust_ttrpc::create_agent(svc), lane);
        let job = |t: &Table, m: &str, payload: &[u8]| {
            let mut req = ttrpc::Request::new();
            (req.service, req.method) = ("crust.v1.Agent".into(), m.into());
            req.payload = payload.to_vec();
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
        for (name, want) in METHODS {
            let i = t.find("crust.v1.Agent", name).unwrap();
            assert_eq!(t.lane(i), want, "{name}");
            assert_eq!(t.direct(i).is_some(), want == Lane::Inline, "{name}");
            if want != Lane::Inline {
                continue;
            }
            let garbage = [0xff];
            let direct = run(&t, job(&t, name, &garbage), &out);
            assert_eq!(
                direct,
                run(&generated, job(&generated, name, &garbage), &out)
            );
            let (answer, failure) = run(&t, job(&t, name, &[]), &out);
            assert!(failure.is_none(), "{name}: {failure:?}");
            let res = ttrpc::Response::parse_from_bytes(&answer).unwrap();
            assert_eq!(res.status.code.value(), 0, "{name}: {}", res.status.message);
        }
        let caps = run(&t, job(&t, "GetCapabilities", &[]), &out);
        assert_eq!(
            caps,
            run(&generated, job(&generated, "GetCapabilities", &[]), &out)
        );
        let info = run(&t, job(&t, "GetAgentInfo", &[]), &out);
        let res = ttrpc::Response::parse_from_bytes(&info.0).unwrap();
        let got = pb::GetAgentInfoResponse::parse_from_bytes(&res.payload).unwrap();
        assert!(got.rss_bytes > 0 && !got.version.is_empty());
        assert_eq!(lane("/other.Service/GetCapabilities"), Lane::Regular);
    }
}

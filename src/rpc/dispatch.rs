//! One request through ttrpc's generated service table: the request's
//! context is built as ttrpc's own server builds it (deadline, metadata,
//! and a cancel channel that disconnects when the caller goes away), the
//! generated handler decodes, calls the service and encodes, and whatever
//! happens the caller gets an answer — INVALID_ARGUMENT for a payload that
//! is not the method's message, INTERNAL for the rest. A method with a
//! direct answer (`table`) gives the same answer without the context.

use std::os::fd::RawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use crust_protocols::protobuf::Message;
use crust_protocols::ttrpc::{self, Code, MessageHeader, MethodHandler, TtrpcContext};

use super::frame;
use super::table::{Table, UNPACK_ERROR};
use super::wire::Wire;

/// A request ready to run.
pub(crate) struct Job {
    /// The connection it came on.
    pub(crate) conn: u64,
    /// Its descriptor, for the handler's context (informational).
    pub(crate) fd: RawFd,
    /// Its stream id, to answer on.
    pub(crate) stream: u32,
    /// Its method, by its index in the [`Table`].
    pub(crate) method: usize,
    /// The decoded ttrpc envelope (its service and method names, which
    /// `method` carries, may be left out).
    pub(crate) req: ttrpc::Request,
    /// Disconnects when the caller is gone (ttrpc's `cancel_rx`).
    pub(crate) gone: crossbeam_channel::Receiver<()>,
    /// Where the answer goes.
    pub(crate) wire: Arc<Wire>,
}

/// A finished request whose connection needs the event loop: answers left
/// pending, or reading to resume after the in-flight limit.
pub(crate) struct Done {
    /// The connection.
    pub(crate) conn: u64,
}

/// Where a generated handler sends its encoded response; one per worker.
pub(crate) struct Outbox {
    tx: Sender<(MessageHeader, Vec<u8>)>,
    rx: Receiver<(MessageHeader, Vec<u8>)>,
    conn_ctx: Arc<ttrpc::ConnectionContext>,
}

impl Outbox {
    pub(crate) fn new() -> Outbox {
        let (tx, rx) = std::sync::mpsc::channel();
        Outbox {
            tx,
            rx,
            conn_ctx: Arc::new(ttrpc::ConnectionContext::default()),
        }
    }
}

/// How a request ended, for the transport's log line (the service logs its
/// own): `None` when a response came from the service.
pub(crate) type Failure = Option<(Code, String)>;

/// What a request's handler came to: its answer (`None`: it gave none), or
/// its own error, or its panic.
type Outcome = std::thread::Result<ttrpc::Result<Option<Vec<u8>>>>;

/// Runs `job` and returns its answer: the ttrpc Response message that the
/// response frame on the job's stream carries (the wire frames it as it
/// writes, so the answer is copied once). A method with a direct answer is
/// answered by it ([`run_direct`]).
pub(crate) fn run(table: &Table, job: Job, out: &Outbox) -> (Vec<u8>, Failure) {
    if let Some(answered) = run_direct(table, job.method, &job.req.payload) {
        return answered;
    }
    let Some(handler) = table.handler(job.method) else {
        let msg = table.unknown("a method outside the table");
        return (
            status(Code::UNIMPLEMENTED, &msg),
            Some((Code::UNIMPLEMENTED, msg)),
        );
    };
    let path = table.path(job.method);
    settle(path, generated(handler, job, out))
}

/// Answers a request for `method` carrying `payload` with the method's
/// direct answer ([`Table::direct`]), if it has one: no handler context,
/// so no job to build.
pub(crate) fn run_direct(
    table: &Table,
    method: usize,
    payload: &[u8],
) -> Option<(Vec<u8>, Failure)> {
    let direct = table.direct(method)?;
    let outcome = catch_unwind(AssertUnwindSafe(|| direct(payload).map(Some)));
    Some(settle(table.path(method), outcome))
}

/// The answer to send for what the handler of `path` came to.
fn settle(path: &str, outcome: Outcome) -> (Vec<u8>, Failure) {
    let (code, msg) = match outcome {
        Ok(Ok(Some(answer))) => return (answer, None),
        Ok(Err(ttrpc::Error::Others(e))) if e.starts_with(UNPACK_ERROR) => (
            Code::INVALID_ARGUMENT,
            format!(
                "{}: the payload is not a valid request message for this method ({})",
                path,
                e.trim_start_matches(UNPACK_ERROR).trim()
            ),
        ),
        Ok(Err(e)) => (Code::INTERNAL, format!("{path}: {e}")),
        Ok(Ok(None)) => (
            Code::INTERNAL,
            format!("{path}: the handler gave no response"),
        ),
        Err(_) => (
            Code::INTERNAL,
            format!("{path}: the handler panicked (see the log)"),
        ),
    };
    (status(code, &msg), Some((code, msg)))
}

/// Runs `job` through its generated `handler`, with the context ttrpc's own
/// server gives it; the answer is what it sent to the outbox.
fn generated(handler: &(dyn MethodHandler + Send + Sync), job: Job, out: &Outbox) -> Outcome {
    while out.rx.try_recv().is_ok() {}
    let ctx = TtrpcContext {
        fd: job.fd,
        cancel_rx: job.gone,
        mh: MessageHeader::new_request(job.stream, 0),
        res_tx: out.tx.clone(),
        metadata: ttrpc::context::from_pb(&job.req.metadata),
        timeout_nano: job.req.timeout_nano,
        conn_ctx: out.conn_ctx.clone(),
    };
    let result = catch_unwind(AssertUnwindSafe(|| handler.handler(ctx, job.req)));
    match out.rx.try_recv() {
        // A frame's length is a u32: a larger answer cannot be sent.
        Ok((_, answer)) if u32::try_from(answer.len()).is_ok() => Ok(Ok(Some(answer))),
        _ => result.map(|r| r.map(|()| None)),
    }
}

/// A ttrpc Response carrying only a status.
pub(crate) fn status(code: Code, msg: &str) -> Vec<u8> {
    let mut res = ttrpc::Response::new();
    res.status = crust_protocols::protobuf::MessageField::some(ttrpc::get_status(code, msg));
    // A Response of a status alone always encodes.
    res.write_to_bytes().unwrap_or_default()
}

/// A response frame on `stream` carrying only a status.
pub(crate) fn status_frame(stream: u32, code: Code, msg: &str) -> Vec<u8> {
    // A status alone always fits a frame.
    frame::response(stream, &status(code, msg)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::crust as pb;
    use crust_protocols::crust_ttrpc;

    struct Caps;
    impl crust_ttrpc::Agent for Caps {
        fn get_capabilities(
            &self,
            ctx: &TtrpcContext,
            _: pb::GetCapabilitiesRequest,
        ) -> ttrpc::Result<pb::GetCapabilitiesResponse> {
            assert_eq!(ctx.timeout_nano, 5);
            assert_eq!(ctx.metadata.get("k"), Some(&vec!["v".to_string()]));
            let mut r = pb::GetCapabilitiesResponse::new();
            r.capabilities = vec![pb::Capability::CAPABILITY_SUBPATH.into()];
            Ok(r)
        }
        fn get_agent_info(
            &self,
            _: &TtrpcContext,
            _: pb::GetAgentInfoRequest,
        ) -> ttrpc::Result<pb::GetAgentInfoResponse> {
            panic!("boom");
        }
    }

    fn table() -> Table {
        Table::new(crust_ttrpc::create_agent(Arc::new(Caps)), |_| {
            crate::rpc::table::Lane::Regular
        })
    }

    fn job(t: &Table, method: &str, payload: Vec<u8>) -> Job {
        let mut req = ttrpc::Request::new();
        req.service = "crust.v1.Agent".into();
        req.method = method.into();
        req.payload = payload;
        req.timeout_nano = 5;
        let mut kv = ttrpc::proto::KeyValue::new();
        kv.key = "k".into();
        kv.value = "v".into();
        req.metadata = vec![kv];
        let (_tx, gone) = crossbeam_channel::unbounded();
        Job {
            conn: 1,
            fd: -1,
            stream: 7,
            method: t.find("crust.v1.Agent", method).unwrap_or(usize::MAX),
            req,
            gone,
            wire: crate::rpc::wire::test_wire(),
        }
    }

    fn answer(f: &[u8]) -> ttrpc::Response {
        ttrpc::Response::parse_from_bytes(f).unwrap()
    }

    #[test]
    fn a_request_runs_through_the_generated_table() {
        let t = table();
        let out = Outbox::new();
        let (f, failure) = run(&t, job(&t, "GetCapabilities", Vec::new()), &out);
        assert!(failure.is_none());
        let r = answer(&f);
        assert_eq!(r.status.code.value(), 0);
        let caps = pb::GetCapabilitiesResponse::parse_from_bytes(&r.payload).unwrap();
        assert_eq!(caps.capabilities.len(), 1);
    }

    #[test]
    fn a_payload_that_is_not_the_message_is_invalid_argument() {
        let t = table();
        let out = Outbox::new();
        // Field 1 as a varint whose bytes never end.
        let (f, failure) = run(&t, job(&t, "GetCapabilities", vec![0x08, 0xff, 0xff]), &out);
        let r = answer(&f);
        assert_eq!(
            r.status.code.value(),
            Code::INVALID_ARGUMENT as i32,
            "{}",
            r.status.message
        );
        assert!(
            r.status.message.contains("not a valid request"),
            "{}",
            r.status.message
        );
        assert_eq!(failure.unwrap().0, Code::INVALID_ARGUMENT);
    }

    #[test]
    fn unknown_methods_and_panics_are_answered() {
        let t = table();
        let out = Outbox::new();
        let (f, _) = run(&t, job(&t, "Frobnicate", Vec::new()), &out);
        assert_eq!(answer(&f).status.code.value(), Code::UNIMPLEMENTED as i32);
        let (f, failure) = run(&t, job(&t, "GetAgentInfo", Vec::new()), &out);
        assert_eq!(answer(&f).status.code.value(), Code::INTERNAL as i32);
        assert_eq!(failure.unwrap().0, Code::INTERNAL);
        // The worker's outbox is clean for the next request.
        let (f, failure) = run(&t, job(&t, "GetCapabilities", Vec::new()), &out);
        assert!(failure.is_none());
        assert_eq!(answer(&f).status.code.value(), 0);
    }

    /// Answers from memory, as the loop's methods do: each ignores the
    /// context, so it can answer both through its generated handler and
    /// directly.
    struct Memory;

    impl Memory {
        fn caps() -> ttrpc::Result<pb::GetCapabilitiesResponse> {
            let mut r = pb::GetCapabilitiesResponse::new();
            r.capabilities = (1..=11)
                .map(crust_protocols::protobuf::EnumOrUnknown::from_i32)
                .collect();
            Ok(r)
        }
        fn refused() -> ttrpc::Result<pb::GetAgentInfoResponse> {
            Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
                Code::NOT_FOUND,
                "no such thing: \u{2028}",
            )))
        }
        fn broken() -> ttrpc::Result<pb::ListVolumesResponse> {
            Err(ttrpc::Error::Others("it broke".into()))
        }
        fn empty() -> ttrpc::Result<pb::ShutdownResponse> {
            Ok(pb::ShutdownResponse::new())
        }
        fn panics() -> ttrpc::Result<pb::GetSupportedFileSystemsResponse> {
            panic!("boom")
        }
    }

    impl crust_ttrpc::Agent for Memory {
        fn get_capabilities(
            &self,
            _: &TtrpcContext,
            _: pb::GetCapabilitiesRequest,
        ) -> ttrpc::Result<pb::GetCapabilitiesResponse> {
            Memory::caps()
        }
        fn get_agent_info(
            &self,
            _: &TtrpcContext,
            _: pb::GetAgentInfoRequest,
        ) -> ttrpc::Result<pb::GetAgentInfoResponse> {
            Memory::refused()
        }
        fn list_volumes(
            &self,
            _: &TtrpcContext,
            _: pb::ListVolumesRequest,
        ) -> ttrpc::Result<pb::ListVolumesResponse> {
            Memory::broken()
        }
        fn shutdown(
            &self,
            _: &TtrpcContext,
            _: pb::ShutdownRequest,
        ) -> ttrpc::Result<pb::ShutdownResponse> {
            Memory::empty()
        }
        fn get_supported_file_systems(
            &self,
            _: &TtrpcContext,
            _: pb::GetSupportedFileSystemsRequest,
        ) -> ttrpc::Result<pb::GetSupportedFileSystemsResponse> {
            Memory::panics()
        }
    }

    /// A direct answer is its generated handler's answer, byte for byte:
    /// an answer, an empty answer, a status, another error, a payload that
    /// is not the method's message, a panic.
    #[test]
    fn direct_answers_are_the_generated_handlers_answers() {
        use crate::rpc::table::direct;
        let generated = Table::new(crust_ttrpc::create_agent(Arc::new(Memory)), |_| {
            crate::rpc::table::Lane::Inline
        });
        let directly = Table::new(crust_ttrpc::create_agent(Arc::new(Memory)), |_| {
            crate::rpc::table::Lane::Inline
        })
        .with_direct(
            "/crust.v1.Agent/GetCapabilities",
            direct(|_: pb::GetCapabilitiesRequest| Memory::caps()),
        )
        .with_direct(
            "/crust.v1.Agent/GetAgentInfo",
            direct(|_: pb::GetAgentInfoRequest| Memory::refused()),
        )
        .with_direct(
            "/crust.v1.Agent/ListVolumes",
            direct(|_: pb::ListVolumesRequest| Memory::broken()),
        )
        .with_direct(
            "/crust.v1.Agent/Shutdown",
            direct(|_: pb::ShutdownRequest| Memory::empty()),
        )
        .with_direct(
            "/crust.v1.Agent/GetSupportedFileSystems",
            direct(|_: pb::GetSupportedFileSystemsRequest| Memory::panics()),
        );
        let out = Outbox::new();
        let cases: [(&str, Vec<u8>); 7] = [
            ("GetCapabilities", Vec::new()),
            ("GetCapabilities", vec![0x08, 0xff, 0xff]),
            ("GetAgentInfo", Vec::new()),
            ("ListVolumes", Vec::new()),
            ("Shutdown", Vec::new()),
            ("Shutdown", vec![0x1a, 0x02, b'h', b'i']),
            ("GetSupportedFileSystems", Vec::new()),
        ];
        for (method, payload) in cases {
            let i = directly.find("crust.v1.Agent", method).unwrap();
            assert!(directly.direct(i).is_some(), "{method}");
            let want = run(&generated, job(&generated, method, payload.clone()), &out);
            let got = run(&directly, job(&directly, method, payload.clone()), &out);
            assert_eq!(got, want, "{method} {payload:?}");
        }
        // The cases reach every way an answer is made.
        let code = |m: &str, p: Vec<u8>| {
            answer(&run(&directly, job(&directly, m, p), &out).0)
                .status
                .code
                .value()
        };
        assert_eq!(code("GetCapabilities", Vec::new()), 0);
        assert_eq!(
            code("GetCapabilities", vec![0x08, 0xff, 0xff]),
            Code::INVALID_ARGUMENT as i32
        );
        assert_eq!(code("GetAgentInfo", Vec::new()), Code::NOT_FOUND as i32);
        assert_eq!(code("ListVolumes", Vec::new()), Code::UNKNOWN as i32);
        assert_eq!(
            code("GetSupportedFileSystems", Vec::new()),
            Code::INTERNAL as i32
        );
    }
}

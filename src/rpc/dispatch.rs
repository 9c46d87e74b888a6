//! One request through ttrpc's generated service table: the request's
//! context is built as ttrpc's own server builds it (deadline, metadata,
//! and a cancel channel that disconnects when the caller goes away), the
//! generated handler decodes, calls the service and encodes, and whatever
//! happens the caller gets a response frame — INVALID_ARGUMENT for a
//! payload that is not the method's message, INTERNAL for the rest.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use crust_protocols::protobuf::Message;
use crust_protocols::ttrpc::{self, Code, MessageHeader, MethodHandler, TtrpcContext};

use super::frame;
use super::wire::Wire;

/// The generated service table: "/package.Service/Method" → handler.
pub type Methods = HashMap<String, Box<dyn MethodHandler + Send + Sync>>;

/// ttrpc's wording when a generated handler cannot decode its payload
/// (`request_handler!`); a test below pins it to the ttrpc in use.
const UNPACK_ERROR: &str = "Unpack request error";

/// A request ready to run.
pub(crate) struct Job {
    /// The connection it came on.
    pub(crate) conn: u64,
    /// Its descriptor, for the handler's context (informational).
    pub(crate) fd: RawFd,
    /// Its stream id, to answer on.
    pub(crate) stream: u32,
    /// "/crust.v1.Agent/PublishVolume".
    pub(crate) path: String,
    /// The decoded ttrpc envelope.
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

/// Runs `job` and returns its response frame.
pub(crate) fn run(methods: &Methods, job: Job, out: &Outbox) -> (Vec<u8>, Failure) {
    let stream = job.stream;
    let Some(handler) = methods.get(&job.path) else {
        let msg = unknown_method(&job.path, methods);
        return (
            status_frame(stream, Code::UNIMPLEMENTED, &msg),
            Some((Code::UNIMPLEMENTED, msg)),
        );
    };
    while out.rx.try_recv().is_ok() {}
    let ctx = TtrpcContext {
        fd: job.fd,
        cancel_rx: job.gone,
        mh: MessageHeader::new_request(stream, 0),
        res_tx: out.tx.clone(),
        metadata: ttrpc::context::from_pb(&job.req.metadata),
        timeout_nano: job.req.timeout_nano,
        conn_ctx: out.conn_ctx.clone(),
    };
    let result = catch_unwind(AssertUnwindSafe(|| handler.handler(ctx, job.req)));
    if let Ok((_, payload)) = out.rx.try_recv() {
        if let Some(f) = frame::response(stream, &payload) {
            return (f, None);
        }
    }
    let (code, msg) = match result {
        Ok(Err(ttrpc::Error::Others(e))) if e.starts_with(UNPACK_ERROR) => (
            Code::INVALID_ARGUMENT,
            format!(
                "{}: the payload is not a valid request message for this method ({})",
                job.path,
                e.trim_start_matches(UNPACK_ERROR).trim()
            ),
        ),
        Ok(Err(e)) => (Code::INTERNAL, format!("{}: {e}", job.path)),
        Ok(Ok(())) => (
            Code::INTERNAL,
            format!("{}: the handler gave no response", job.path),
        ),
        Err(_) => (
            Code::INTERNAL,
            format!("{}: the handler panicked (see the log)", job.path),
        ),
    };
    (status_frame(stream, code, &msg), Some((code, msg)))
}

/// The message for a method that is not in the table: it names the
/// services the table serves ("/crust.v1.Agent/X" serves "crust.v1.Agent").
pub(crate) fn unknown_method(path: &str, methods: &Methods) -> String {
    let mut services: Vec<&str> = methods
        .keys()
        .filter_map(|k| k.strip_prefix('/')?.rsplit_once('/').map(|(s, _)| s))
        .collect();
    services.sort_unstable();
    services.dedup();
    format!(
        "{path} is not a method of this agent (it serves {})",
        services.join(", ")
    )
}

/// A response frame on `stream` carrying only a status.
pub(crate) fn status_frame(stream: u32, code: Code, msg: &str) -> Vec<u8> {
    let mut res = ttrpc::Response::new();
    res.status = crust_protocols::protobuf::MessageField::some(ttrpc::get_status(code, msg));
    // A Response of a status alone always encodes, and always fits a frame.
    let payload = res.write_to_bytes().unwrap_or_default();
    frame::response(stream, &payload).unwrap_or_default()
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

    fn job(method: &str, payload: Vec<u8>) -> Job {
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
            path: format!("/crust.v1.Agent/{method}"),
            req,
            gone,
            wire: crate::rpc::wire::test_wire(),
        }
    }

    fn answer(f: &[u8]) -> ttrpc::Response {
        let h = frame::Header::parse(f[..frame::HEADER_LEN].try_into().unwrap());
        assert_eq!((h.stream, h.kind), (7, frame::TYPE_RESPONSE));
        assert_eq!(h.len as usize, f.len() - frame::HEADER_LEN);
        ttrpc::Response::parse_from_bytes(&f[frame::HEADER_LEN..]).unwrap()
    }

    #[test]
    fn a_request_runs_through_the_generated_table() {
        let methods = crust_ttrpc::create_agent(Arc::new(Caps));
        let out = Outbox::new();
        let (f, failure) = run(&methods, job("GetCapabilities", Vec::new()), &out);
        assert!(failure.is_none());
        let r = answer(&f);
        assert_eq!(r.status.code.value(), 0);
        let caps = pb::GetCapabilitiesResponse::parse_from_bytes(&r.payload).unwrap();
        assert_eq!(caps.capabilities.len(), 1);
    }

    #[test]
    fn a_payload_that_is_not_the_message_is_invalid_argument() {
        let methods = crust_ttrpc::create_agent(Arc::new(Caps));
        let out = Outbox::new();
        // Field 1 as a varint whose bytes never end.
        let (f, failure) = run(
            &methods,
            job("GetCapabilities", vec![0x08, 0xff, 0xff]),
            &out,
        );
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
        let methods = crust_ttrpc::create_agent(Arc::new(Caps));
        let out = Outbox::new();
        let (f, _) = run(&methods, job("Frobnicate", Vec::new()), &out);
        assert_eq!(answer(&f).status.code.value(), Code::UNIMPLEMENTED as i32);
        let (f, failure) = run(&methods, job("GetAgentInfo", Vec::new()), &out);
        assert_eq!(answer(&f).status.code.value(), Code::INTERNAL as i32);
        assert_eq!(failure.unwrap().0, Code::INTERNAL);
        // The worker's outbox is clean for the next request.
        let (f, failure) = run(&methods, job("GetCapabilities", Vec::new()), &out);
        assert!(failure.is_none());
        assert_eq!(answer(&f).status.code.value(), 0);
    }
}

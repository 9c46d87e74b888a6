//! The service table as the transport serves it: each method of the
//! generated table with the lane the service's rule gives it, made once at
//! start. A request's method is found from its envelope's service and
//! method names without building its path, and travels as an index, so no
//! request pays for a string or a keyed hash to be routed.
//!
//! A method the event loop answers may also have a [`Direct`] answer: the
//! same work as its generated handler, with the successful Response written
//! straight to bytes. The generated handler builds, boxes, encodes and
//! sends the envelope through a channel, which costs more than answering
//! from memory does.

use std::collections::HashMap;

use crust_protocols::protobuf::{self, CodedOutputStream, Message, MessageField};
use crust_protocols::ttrpc::proto::{Codec, MESSAGE_LENGTH_MAX};
use crust_protocols::ttrpc::{self, Code, MethodHandler};

/// The generated service table: "/package.Service/Method" → handler.
pub type Methods = HashMap<String, Box<dyn MethodHandler + Send + Sync>>;

/// Where a request runs: the service says (its [`LaneRule`]); the
/// transport names no method of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Any worker.
    Regular,
    /// Methods that answer from memory without waiting for a disk: their
    /// own short queue and workers, so they are answered while every
    /// regular worker waits.
    Quick,
    /// Methods that answer at once from memory, with no lock a long
    /// operation holds and no I/O beyond /proc: the event loop runs them
    /// itself as it reads them, with no thread hop (they never queue).
    Inline,
}

/// The service's rule: the lane of a method path ("/package.Service/Method").
pub type LaneRule = fn(&str) -> Lane;

/// ttrpc's wording when a generated handler cannot decode its payload
/// (`request_handler!`); a test in `dispatch` pins it to the ttrpc in use.
pub(crate) const UNPACK_ERROR: &str = "Unpack request error";

/// A method answered without ttrpc's handler context: the request's
/// payload in, the encoded ttrpc Response out. An `Err` is the handler's
/// own failure (a payload that is not the method's message), as a
/// generated handler returns it. [`direct`] makes one.
pub type Direct = Box<dyn Fn(&[u8]) -> ttrpc::Result<Vec<u8>> + Send + Sync>;

/// The [`Direct`] answer of a method `call` serves: what ttrpc's generated
/// handler does (`request_handler!`, then `send_response`), byte for byte.
/// The request is decoded as it decodes it; the answer, or the error's
/// status, becomes the Response it would send. Only `call`'s own work is
/// left; the handler context (deadline, metadata, caller-gone channel) is
/// not given, so a method that needs it must not answer directly.
pub fn direct<Req, Resp>(
    call: impl Fn(Req) -> ttrpc::Result<Resp> + Send + Sync + 'static,
) -> Direct
where
    Req: Message,
    Resp: Message,
{
    Box::new(move |payload: &[u8]| {
        let req = <Req as Codec>::decode(payload).map_err(|e| others(UNPACK_ERROR, &e))?;
        match call(req) {
            Ok(rep) => sendable(ok_response(&rep).map_err(|e| others("Encoding response", &e))?),
            Err(e) => sendable(failed(e)?),
        }
    })
}

/// The encoded Response for a call that failed with `e`: its status, or
/// UNKNOWN for an error that carries none.
fn failed(e: ttrpc::Error) -> ttrpc::Result<Vec<u8>> {
    match e {
        ttrpc::Error::RpcStatus(s) => status_response(s),
        x => status_response(ttrpc::get_status(Code::UNKNOWN, format!("{x:?}"))),
    }
}

/// `res`, or in its place the INVALID_ARGUMENT Response ttrpc sends for an
/// answer larger than a message may be.
fn sendable(res: Vec<u8>) -> ttrpc::Result<Vec<u8>> {
    if res.len() <= MESSAGE_LENGTH_MAX {
        return Ok(res);
    }
    let msg = format!(
        "response payload {} bytes exceeds safe limit {} bytes (after transform overhead)",
        res.len(),
        MESSAGE_LENGTH_MAX
    );
    status_response(ttrpc::get_status(Code::INVALID_ARGUMENT, msg))
}

/// ttrpc's wording of a handler's own failure (`err_to_others!`: what
/// failed, then the error).
fn others(what: &str, e: &protobuf::Error) -> ttrpc::Error {
    ttrpc::Error::Others(format!("{what} {e}"))
}

/// The encoded ttrpc Response of a successful call answering `rep`:
/// status OK with no message (field 1, empty), then `rep` as the payload
/// (field 2, left out when empty, as proto3 leaves out an empty bytes
/// field). `rep` is written in place, as `Codec::encode` would write it,
/// rather than encoded apart and copied.
fn ok_response(rep: &impl Message) -> protobuf::Result<Vec<u8>> {
    rep.check_initialized()?;
    let len = usize::try_from(rep.compute_size()).unwrap_or(usize::MAX);
    let mut out = Vec::with_capacity(len.saturating_add(14));
    out.extend_from_slice(&[0x0a, 0x00]);
    if len > 0 {
        out.push(0x12);
        let mut n = len;
        while n >= 0x80 {
            out.push(0x80 | low7(n));
            n >>= 7;
        }
        out.push(low7(n));
        let mut os = CodedOutputStream::vec(&mut out);
        rep.write_to_with_cached_sizes(&mut os)?;
        os.flush()?;
    }
    Ok(out)
}

/// The low seven bits of `n`: one byte of a varint.
fn low7(n: usize) -> u8 {
    u8::try_from(n & 0x7f).unwrap_or(0)
}

/// The encoded ttrpc Response carrying only `status`.
fn status_response(status: ttrpc::Status) -> ttrpc::Result<Vec<u8>> {
    let mut res = ttrpc::Response::new();
    res.status = MessageField::some(status);
    Codec::encode(&res).map_err(|e| ttrpc::Error::Others(e.to_string()))
}

/// One method of the table.
struct Entry {
    /// "/package.Service/Method".
    path: String,
    /// Where its requests run.
    lane: Lane,
    handler: Box<dyn MethodHandler + Send + Sync>,
    /// Its direct answer, if the service gave one.
    direct: Option<Direct>,
}

/// The methods served, each with its lane; a method is named by its index.
pub struct Table {
    entries: Vec<Entry>,
}

impl Table {
    /// The table of `methods`, each in the lane `lane` gives it.
    pub fn new(methods: Methods, lane: LaneRule) -> Table {
        let entries = methods
            .into_iter()
            .map(|(path, handler)| Entry {
                lane: lane(&path),
                path,
                handler,
                direct: None,
            })
            .collect();
        Table { entries }
    }

    /// Has method `path` answered by `direct` instead of its generated
    /// handler; a path not in the table is left alone.
    pub fn with_direct(mut self, path: &str, direct: Direct) -> Table {
        if let Some(e) = self.entries.iter_mut().find(|e| e.path == path) {
            e.direct = Some(direct);
        }
        self
    }

    /// The method a request names, by its envelope's service and method:
    /// the entry whose path is "/{service}/{method}".
    pub(crate) fn find(&self, service: &str, method: &str) -> Option<usize> {
        let (s, m) = (service.as_bytes(), method.as_bytes());
        self.entries.iter().position(|e| {
            let p = e.path.as_bytes();
            p.len() == s.len() + m.len() + 2
                && p[0] == b'/'
                && &p[1..=s.len()] == s
                && p[s.len() + 1] == b'/'
                && &p[s.len() + 2..] == m
        })
    }

    /// Method `i`'s path ("/package.Service/Method"), for logs and messages.
    pub(crate) fn path(&self, i: usize) -> &str {
        self.entries.get(i).map_or("", |e| e.path.as_str())
    }

    /// Method `i`'s lane.
    pub(crate) fn lane(&self, i: usize) -> Lane {
        self.entries.get(i).map_or(Lane::Regular, |e| e.lane)
    }

    /// Method `i`'s handler.
    pub(crate) fn handler(&self, i: usize) -> Option<&(dyn MethodHandler + Send + Sync)> {
        self.entries.get(i).map(|e| &*e.handler)
    }

    /// Method `i`'s direct answer, if it has one.
    pub(crate) fn direct(&self, i: usize) -> Option<&Direct> {
        self.entries.get(i).and_then(|e| e.direct.as_ref())
    }

    /// The message for a method that is not in the table: it names the
    /// services the table serves ("/crust.v1.Agent/X" serves "crust.v1.Agent").
    pub(crate) fn unknown(&self, path: &str) -> String {
        let mut services: Vec<&str> = self
            .entries
            .iter()
            .filter_map(|e| e.path.strip_prefix('/')?.rsplit_once('/').map(|(s, _)| s))
            .collect();
        services.sort_unstable();
        services.dedup();
        format!(
            "{path} is not a method of this agent (it serves {})",
            services.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::crust_ttrpc;
    use std::sync::Arc;

    fn table() -> Table {
        struct Nothing;
        impl crust_ttrpc::Agent for Nothing {}
        let lane = |p: &str| match p {
            "/crust.v1.Agent/GetCapabilities" => Lane::Inline,
            "/crust.v1.Agent/ListVolumes" => Lane::Quick,
            _ => Lane::Regular,
        };
        Table::new(crust_ttrpc::create_agent(Arc::new(Nothing)), lane)
    }

    #[test]
    fn a_method_is_found_by_exactly_its_service_and_name() {
        let t = table();
        let i = t.find("crust.v1.Agent", "GetCapabilities").unwrap();
        assert_eq!(t.path(i), "/crust.v1.Agent/GetCapabilities");
        assert_eq!(t.lane(i), Lane::Inline);
        assert!(t.handler(i).is_some());
        let l = t.find("crust.v1.Agent", "ListVolumes").unwrap();
        assert_eq!(t.lane(l), Lane::Quick);
        let p = t.find("crust.v1.Agent", "PublishVolume").unwrap();
        assert_eq!(t.lane(p), Lane::Regular);
        // The same bytes split elsewhere, a prefix, a longer name, case: none is the method.
        for (s, m) in [
            ("crust.v1", "Agent/GetCapabilities"),
            ("crust.v1.Agent/GetCapabilities", ""),
            ("", "crust.v1.Agent/GetCapabilities"),
            ("crust.v1.Agent", "GetCapabilitie"),
            ("crust.v1.Agent", "GetCapabilitiesX"),
            ("crust.v1.agent", "GetCapabilities"),
            ("", ""),
        ] {
            assert_eq!(t.find(s, m), None, "{s:?} {m:?}");
        }
        // An index beyond the table names nothing.
        assert_eq!((t.path(999), t.lane(999)), ("", Lane::Regular));
        assert!(t.handler(999).is_none());
    }

    #[test]
    fn an_unknown_method_is_answered_with_the_services_served() {
        let msg = table().unknown("/x.Y/Z");
        assert_eq!(
            msg,
            "/x.Y/Z is not a method of this agent (it serves crust.v1.Agent)"
        );
    }

    /// The hand-written envelope of a successful answer is the one
    /// protobuf writes, for answers whose length takes one to three varint
    /// bytes, and for an empty one.
    #[test]
    fn a_successful_answer_is_encoded_as_protobuf_encodes_it() {
        use crust_protocols::crust as pb;
        for n in [0, 1, 12, 125, 126, 300, 16_381, 16_382, 70_000] {
            let mut rep = pb::GetSupportedFileSystemsResponse::new();
            if n > 0 {
                rep.file_systems = vec!["x".repeat(n)];
            }
            let mut res = ttrpc::Response::new();
            res.status = MessageField::some(ttrpc::get_status(Code::OK, ""));
            res.payload = rep.write_to_bytes().unwrap();
            let want = res.write_to_bytes().unwrap();
            assert_eq!(
                ok_response(&rep).unwrap(),
                want,
                "{} payload bytes",
                res.payload.len()
            );
        }
    }
}

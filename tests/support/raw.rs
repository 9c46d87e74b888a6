//! A ttrpc client at the frame level, for what the real clients never send:
//! garbage, wrong stream ids, oversized frames, pipelines of thousands, and
//! connections that never read.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crust_protocols::protobuf::Message;
use crust_protocols::ttrpc;

pub const HEADER: usize = 10;

/// A frame's header and payload, as bytes.
pub fn frame(stream: u32, kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + payload.len());
    f.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(&[kind, 0]);
    f.extend_from_slice(payload);
    f
}

/// A ttrpc Request envelope for crust.v1.Agent/`method`.
pub fn envelope(method: &str, payload: &[u8], timeout: Duration) -> Vec<u8> {
    let mut r = ttrpc::Request::new();
    r.service = "crust.v1.Agent".into();
    r.method = method.into();
    r.payload = payload.to_vec();
    r.timeout_nano = i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX);
    r.write_to_bytes().unwrap()
}

/// A request frame for `method` with an encoded message.
pub fn request(stream: u32, method: &str, msg: &impl Message) -> Vec<u8> {
    request_within(stream, method, msg, Duration::from_secs(30))
}

/// The same, with the deadline `timeout` (the envelope's `timeout_nano`).
pub fn request_within(stream: u32, method: &str, msg: &impl Message, timeout: Duration) -> Vec<u8> {
    frame(
        stream,
        1,
        &envelope(method, &msg.write_to_bytes().unwrap(), timeout),
    )
}

/// One connection, read and written by hand.
pub struct Raw {
    pub s: UnixStream,
}

impl Raw {
    pub fn connect(sock: &Path) -> Raw {
        let s = UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw { s }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    /// The next frame: (stream id, type, decoded Response).
    pub fn answer(&mut self) -> (u32, u8, ttrpc::Response) {
        let mut h = [0u8; HEADER];
        self.s.read_exact(&mut h).expect("an answer frame");
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let stream = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
        let mut body = vec![0u8; len];
        self.s.read_exact(&mut body).unwrap();
        (
            stream,
            h[8],
            ttrpc::Response::parse_from_bytes(&body).unwrap(),
        )
    }

    /// The status code (as ttrpc's enum name) and message of the next answer, checking its stream.
    pub fn status(&mut self, stream: u32) -> (String, String) {
        let (id, kind, r) = self.answer();
        assert_eq!((id, kind), (stream, 2), "answer on the request's stream");
        let code = r
            .status
            .code
            .enum_value()
            .map(|c| format!("{c:?}"))
            .unwrap_or_else(|n| n.to_string());
        (code, r.status.message.clone())
    }
}

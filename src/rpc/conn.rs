//! One client connection: its bytes in (cut into frames), its answers out
//! (the `Wire`, which the workers share to answer without a detour
//! through the event loop), the ttrpc rules a request frame must follow
//! before it runs, and the channel whose disconnection tells its requests
//! that the caller is gone.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crust_protocols::protobuf::Message;
use crust_protocols::ttrpc::{self, Code};
use rustix::io::Errno;
use rustix::net::RecvFlags;

use super::dispatch;
use super::envelope;
use super::frame::{Frame, Reader, TYPE_REQUEST};
use super::table::Table;
use super::wire::Wire;

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 16 << 10;

/// What to do with a frame.
#[derive(Debug)]
pub(crate) enum Admit {
    /// Answer at once with this frame (a refusal); the code and reason are
    /// for the log.
    Refuse(Vec<u8>, Code, String),
    Run {
        stream: u32,
        /// Its method, by its index in the [`Table`].
        method: usize,
        /// The decoded envelope (its service and method names, which
        /// `method` carries, may be left out).
        req: ttrpc::Request,
    },
}

/// A client connection, as the event loop keeps it.
pub(crate) struct Conn {
    /// The socket and its answers, shared with the workers.
    pub(crate) wire: Arc<Wire>,
    /// Frames being received.
    reader: Reader,
    /// The highest stream id seen: ids must be odd and increase (ttrpc).
    last_stream: u32,
    /// Dropped when the connection closes: every request's `cancel_rx`
    /// then reports the caller gone. Made with the first request.
    gone: Option<(
        crossbeam_channel::Sender<()>,
        crossbeam_channel::Receiver<()>,
    )>,
    /// The last time a byte moved either way or a request was admitted.
    pub(crate) last_active: Instant,
    /// Since when a frame has been partly received.
    pub(crate) partial_since: Option<Instant>,
    /// Since when pending output has not moved.
    pub(crate) stalled_since: Option<Instant>,
    /// What epoll watches for on it now.
    pub(crate) registered: rustix::event::epoll::EventFlags,
}

impl Conn {
    /// A connection on `fd`, accepting request payloads up to `max_request` bytes.
    pub(crate) fn new(fd: OwnedFd, max_request: usize) -> Conn {
        Conn {
            wire: Arc::new(Wire::new(fd)),
            reader: Reader::new(max_request),
            last_stream: 0,
            gone: None,
            last_active: Instant::now(),
            partial_since: None,
            stalled_since: None,
            // What the loop registers a new connection with.
            registered: rustix::event::epoll::EventFlags::IN
                | rustix::event::epoll::EventFlags::RDHUP,
        }
    }

    /// The socket.
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.wire.fd
    }

    /// Requests queued or running.
    pub(crate) fn in_flight(&self) -> usize {
        self.wire.in_flight.load(Ordering::SeqCst)
    }

    /// The raw descriptor (for handler contexts and logs).
    pub(crate) fn raw(&self) -> RawFd {
        self.wire.fd.as_raw_fd()
    }

    /// Whether the reader wants more bytes (no whole frame waits in it).
    pub(crate) fn wants_bytes(&self) -> bool {
        self.reader.wants_bytes()
    }

    /// Bytes waiting to be sent.
    pub(crate) fn pending_out(&self) -> usize {
        self.wire.pending()
    }

    /// Bytes held for this connection, in and out.
    pub(crate) fn held(&self) -> usize {
        self.reader.held() + self.pending_out()
    }

    /// Nothing in flight, nothing half-received, nothing to send.
    pub(crate) fn idle(&self) -> bool {
        self.in_flight() == 0 && !self.reader.mid_frame() && self.pending_out() == 0
    }

    /// One read from the socket into the reader, which reads into `spare`
    /// (the loop's buffer) when it holds none of its own. `Ok(0)` is the
    /// end of the stream; `Err(AGAIN)` means nothing to read now.
    pub(crate) fn read(&mut self, spare: &mut Vec<u8>, now: Instant) -> Result<usize, Errno> {
        self.reader.borrow(spare);
        let buf = self.reader.spare();
        buf.reserve(READ_CHUNK);
        let (n, _) = rustix::net::recv(
            &self.wire.fd,
            rustix::buffer::spare_capacity(buf),
            RecvFlags::empty(),
        )?;
        self.reader.pushed();
        if n > 0 {
            self.last_active = now;
        }
        self.note_partial(now);
        Ok(n)
    }

    /// Keeps `partial_since` current: set while the reader waits for the
    /// rest of a frame (the client's turn), cleared otherwise.
    pub(crate) fn note_partial(&mut self, now: Instant) {
        if self.reader.wants_bytes() && self.reader.mid_frame() {
            self.partial_since.get_or_insert(now);
        } else {
            self.partial_since = None;
        }
    }

    /// The next whole frame received, if any.
    pub(crate) fn next_frame(&mut self) -> Option<Frame> {
        self.reader.next_frame()
    }

    /// Hands the reader's buffer back to the loop (`spare`) once it holds
    /// nothing: a connection between requests keeps no buffer.
    pub(crate) fn settle(&mut self, spare: &mut Vec<u8>) {
        self.reader.give_back(spare);
    }

    /// Applies ttrpc's rules to a frame: what to answer, or what to run.
    pub(crate) fn admit(&mut self, frame: Frame, table: &Table, max_request: usize) -> Admit {
        let refuse = |stream: u32, code: Code, msg: String| {
            Admit::Refuse(dispatch::status_frame(stream, code, &msg), code, msg)
        };
        let (h, body) = match frame {
            Frame::TooLarge(h) => {
                return refuse(
                    h.stream,
                    Code::RESOURCE_EXHAUSTED,
                    format!(
                        "message length {} exceeds the agent's maximum request size of {max_request} bytes",
                        h.len
                    ),
                )
            }
            Frame::Whole(h, body) => (h, body),
        };
        if h.stream % 2 != 1 {
            return refuse(
                h.stream,
                Code::INVALID_ARGUMENT,
                format!(
                    "stream id {} is even: client-initiated streams must be odd",
                    h.stream
                ),
            );
        }
        if h.kind != TYPE_REQUEST {
            return refuse(
                h.stream,
                Code::INVALID_ARGUMENT,
                format!(
                    "frame type {} on stream {} is not served: only unary requests (type 1) are",
                    h.kind, h.stream
                ),
            );
        }
        if h.stream <= self.last_stream {
            return refuse(
                h.stream,
                Code::INVALID_ARGUMENT,
                format!(
                    "stream id {} cannot be re-used and must increment (the last was {})",
                    h.stream, self.last_stream
                ),
            );
        }
        self.last_stream = h.stream;
        match route(&body, table) {
            Ok((method, req)) => Admit::Run {
                stream: h.stream,
                method,
                req,
            },
            Err((code, msg)) => refuse(h.stream, code, msg),
        }
    }

    /// The receiver its requests watch (ttrpc's `cancel_rx`).
    pub(crate) fn gone_rx(&mut self) -> crossbeam_channel::Receiver<()> {
        self.gone
            .get_or_insert_with(crossbeam_channel::unbounded)
            .1
            .clone()
    }

    /// Appends a frame to send (the loop's own refusals).
    pub(crate) fn queue(&mut self, frame: &[u8]) {
        self.wire.queue(frame);
    }

    /// Sends what the socket takes now. `Err`: the connection is broken.
    pub(crate) fn flush(&mut self, now: Instant) -> Result<(), Errno> {
        let (wrote, left) = self.wire.flush()?;
        if wrote > 0 {
            self.last_active = now;
        }
        if left == 0 || wrote > 0 {
            self.stalled_since = None;
        }
        if left > 0 {
            self.stalled_since.get_or_insert(now);
        }
        Ok(())
    }
}

/// The method a request frame's payload names, and its envelope; or why
/// it cannot run. A plain envelope (`envelope::plain`) is read in place and
/// its names are not copied: `method` carries them. Any other is decoded by
/// protobuf, which words the refusal of a malformed one.
fn route(body: &[u8], table: &Table) -> Result<(usize, ttrpc::Request), (Code, String)> {
    let unknown = |service: &str, method: &str| {
        let msg = table.unknown(&format!("/{service}/{method}"));
        (Code::UNIMPLEMENTED, msg)
    };
    if let Some(p) = envelope::plain(body) {
        let method = table
            .find(p.service, p.method)
            .ok_or_else(|| unknown(p.service, p.method))?;
        let mut req = ttrpc::Request::new();
        req.payload = p.payload.to_vec();
        req.timeout_nano = p.timeout_nano;
        return Ok((method, req));
    }
    let req = ttrpc::Request::parse_from_bytes(body).map_err(|e| {
        let msg = format!("the frame's payload is not a ttrpc Request: {e}");
        (Code::INVALID_ARGUMENT, msg)
    })?;
    let method = table
        .find(&req.service, &req.method)
        .ok_or_else(|| unknown(&req.service, &req.method))?;
    Ok((method, req))
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Workers still holding the wire drop their answers.
        self.wire.closed.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::frame::{Header, HEADER_LEN, TYPE_RESPONSE};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    fn methods() -> Table {
        struct Nothing;
        impl crust_protocols::crust_ttrpc::Agent for Nothing {}
        let methods = crust_protocols::crust_ttrpc::create_agent(std::sync::Arc::new(Nothing));
        Table::new(methods, |_| crate::rpc::table::Lane::Regular)
    }

    fn pair() -> (Conn, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (Conn::new(OwnedFd::from(a), 64), b)
    }

    fn request(service: &str, method: &str) -> Vec<u8> {
        let mut r = ttrpc::Request::new();
        r.service = service.into();
        r.method = method.into();
        r.write_to_bytes().unwrap()
    }

    fn whole(stream: u32, kind: u8, body: Vec<u8>) -> Frame {
        Frame::Whole(
            Header {
                len: u32::try_from(body.len()).unwrap_or(u32::MAX),
                stream,
                kind,
                flags: 0,
            },
            body,
        )
    }

    fn refused(a: Admit) -> (Code, String) {
        match a {
            Admit::Refuse(f, code, msg) => {
                let h = Header::parse(f[..HEADER_LEN].try_into().unwrap());
                assert_eq!(h.kind, TYPE_RESPONSE);
                let r = ttrpc::Response::parse_from_bytes(&f[HEADER_LEN..]).unwrap();
                assert_eq!(r.status.code.value(), code as i32);
                (code, msg)
            }
            Admit::Run { method, .. } => panic!("ran method {method}"),
        }
    }

    #[test]
    fn ttrpc_rules_for_request_frames() {
        let (mut c, _peer) = pair();
        let m = methods();
        let caps = || request("crust.v1.Agent", "GetCapabilities");
        assert!(matches!(
            c.admit(whole(1, 1, caps()), &m, 64),
            Admit::Run { stream: 1, .. }
        ));
        // Even, reused, decreasing, not a request, too large, garbage, unknown.
        let (code, msg) = refused(c.admit(whole(4, 1, caps()), &m, 64));
        assert_eq!(code, Code::INVALID_ARGUMENT);
        assert!(msg.contains("must be odd"), "{msg}");
        assert_eq!(
            refused(c.admit(whole(1, 1, caps()), &m, 64)).0,
            Code::INVALID_ARGUMENT
        );
        assert_eq!(
            refused(c.admit(whole(5, 3, caps()), &m, 64)).0,
            Code::INVALID_ARGUMENT
        );
        assert_eq!(
            refused(c.admit(whole(7, 2, caps()), &m, 64)).0,
            Code::INVALID_ARGUMENT
        );
        let big = Frame::TooLarge(Header {
            len: 1 << 30,
            stream: 9,
            kind: 1,
            flags: 0,
        });
        assert_eq!(refused(c.admit(big, &m, 64)).0, Code::RESOURCE_EXHAUSTED);
        let (code, msg) = refused(c.admit(whole(11, 1, vec![0xff; 8]), &m, 64));
        assert_eq!(code, Code::INVALID_ARGUMENT);
        assert!(msg.contains("not a ttrpc Request"), "{msg}");
        let (code, msg) = refused(c.admit(whole(13, 1, request("x.Y", "Z")), &m, 64));
        assert_eq!(code, Code::UNIMPLEMENTED);
        assert!(msg.contains("/x.Y/Z"), "{msg}");
        // Refusals do not stop the stream: the next good request runs.
        assert!(matches!(
            c.admit(whole(15, 1, caps()), &m, 64),
            Admit::Run { stream: 15, .. }
        ));
    }

    #[test]
    fn reads_cut_frames_and_output_waits_for_a_slow_reader() {
        let (mut c, mut peer) = pair();
        let now = Instant::now();
        let mut spare = Vec::new();
        assert_eq!(c.read(&mut spare, now), Err(Errno::AGAIN));
        c.settle(&mut spare);
        assert!(spare.capacity() > 0, "the loop's buffer, back");
        let body = request("crust.v1.Agent", "GetCapabilities");
        let mut f = Header {
            len: u32::try_from(body.len()).unwrap_or(u32::MAX),
            stream: 1,
            kind: 1,
            flags: 0,
        }
        .encode()
        .to_vec();
        f.extend(&body);
        peer.write_all(&f[..5]).unwrap();
        assert_eq!(c.read(&mut spare, now), Ok(5));
        assert!(c.next_frame().is_none());
        c.settle(&mut spare);
        assert_eq!(spare.capacity(), 0, "half a frame keeps the buffer");
        assert_eq!(
            c.partial_since,
            Some(now),
            "half a frame: the client's turn"
        );
        peer.write_all(&f[5..]).unwrap();
        c.read(&mut spare, now).unwrap();
        assert!(matches!(c.next_frame(), Some(Frame::Whole(h, _)) if h.stream == 1));
        c.settle(&mut spare);
        // Whether the allocator grew it in place is its own affair; what
        // matters is that the buffer is the loop's again, not the idle
        // connection's.
        assert!(
            spare.capacity() >= READ_CHUNK,
            "the buffer, back to the loop"
        );
        assert_eq!(c.held(), 0);
        c.note_partial(now);
        assert_eq!(c.partial_since, None);
        // Output beyond what the socket takes stays pending, then drains.
        let chunk = vec![7u8; 64 << 10];
        for _ in 0..32 {
            c.queue(&chunk);
        }
        c.flush(now).unwrap();
        assert!(c.pending_out() > 0 && c.stalled_since.is_some());
        let total = 32 * chunk.len();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; total];
            peer.read_exact(&mut got).unwrap();
            got.iter().all(|b| *b == 7)
        });
        while c.pending_out() > 0 {
            c.flush(Instant::now()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(reader.join().unwrap());
        assert!(c.stalled_since.is_none() && c.idle());
        // The peer closed: reads see the end of the stream.
        assert_eq!(c.read(&mut spare, now), Ok(0));
    }

    #[test]
    fn dropping_the_connection_disconnects_its_requests_cancel_channel() {
        let (mut c, _peer) = pair();
        let rx = c.gone_rx();
        assert_eq!(rx.try_recv(), Err(crossbeam_channel::TryRecvError::Empty));
        drop(c);
        assert_eq!(
            rx.try_recv(),
            Err(crossbeam_channel::TryRecvError::Disconnected)
        );
    }
}

//! ttrpc's framing: a 10-byte header (payload length and stream id, both
//! u32 big-endian, then the frame type and flags) followed by the payload.
//! `Reader` cuts frames out of the bytes a connection delivers, holding at
//! most one frame's worth; a frame announcing more than the limit is
//! reported at once and its payload discarded as it arrives, never stored.

/// Bytes of a frame header.
pub(crate) const HEADER_LEN: usize = 10;
/// A request frame (the only kind a client sends on unary calls).
pub(crate) const TYPE_REQUEST: u8 = 1;
pub(crate) const TYPE_RESPONSE: u8 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// Payload bytes after the header.
    pub(crate) len: u32,
    /// The stream (call) the frame belongs to; odd when the client opened it.
    pub(crate) stream: u32,
    /// Frame type: 1 request, 2 response, 3 data.
    pub(crate) kind: u8,
    /// Frame flags (unused by unary calls).
    pub(crate) flags: u8,
}

impl Header {
    /// Parses the first [`HEADER_LEN`] bytes of `b`.
    pub(crate) fn parse(b: &[u8; HEADER_LEN]) -> Header {
        Header {
            len: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            stream: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            kind: b[8],
            flags: b[9],
        }
    }

    /// The header's wire bytes.
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..4].copy_from_slice(&self.len.to_be_bytes());
        b[4..8].copy_from_slice(&self.stream.to_be_bytes());
        b[8] = self.kind;
        b[9] = self.flags;
        b
    }
}

/// The header of a response frame for `stream` carrying `len` bytes.
/// `None` when the payload cannot be described by a u32 length.
pub(crate) fn response_header(stream: u32, len: usize) -> Option<[u8; HEADER_LEN]> {
    let h = Header {
        len: u32::try_from(len).ok()?,
        stream,
        kind: TYPE_RESPONSE,
        flags: 0,
    };
    Some(h.encode())
}

/// A response frame (header and payload) for `stream`, ready to write.
/// `None` when the payload cannot be described by a u32 length.
pub(crate) fn response(stream: u32, payload: &[u8]) -> Option<Vec<u8>> {
    let h = response_header(stream, payload.len())?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    Some(out)
}

/// What the reader cut out of the stream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    Whole(Header, Vec<u8>),
    /// A frame whose payload exceeds the limit: reported when its header
    /// arrives; its payload is skipped without being stored.
    TooLarge(Header),
}

/// Cuts frames out of a byte stream with a payload limit.
#[derive(Debug)]
pub(crate) struct Reader {
    /// Received bytes not yet cut into frames (at most one header and one
    /// payload up to the limit, plus what the last read brought).
    buf: Vec<u8>,
    /// The header of an oversized frame, not yet reported.
    too_large: Option<Header>,
    /// Payload bytes of an oversized frame still to discard.
    skip: u64,
    /// The largest payload accepted.
    max: usize,
}

impl Reader {
    /// A reader accepting payloads of up to `max` bytes.
    pub(crate) fn new(max: usize) -> Reader {
        Reader {
            buf: Vec::new(),
            too_large: None,
            skip: 0,
            max,
        }
    }

    /// Whether more bytes are wanted before the next frame can be cut:
    /// false while a whole frame is already buffered.
    pub(crate) fn wants_bytes(&self) -> bool {
        self.too_large.is_none() && !self.has_frame()
    }

    /// Whether bytes of an unfinished frame are held (or being skipped).
    pub(crate) fn mid_frame(&self) -> bool {
        self.skip > 0 || !self.buf.is_empty()
    }

    pub(crate) fn held(&self) -> usize {
        self.buf.len()
    }

    fn has_frame(&self) -> bool {
        match self.header() {
            Some(h) => self.buf.len() - HEADER_LEN >= h.len as usize,
            None => false,
        }
    }

    fn header(&self) -> Option<Header> {
        let b: &[u8; HEADER_LEN] = self.buf.get(..HEADER_LEN)?.try_into().ok()?;
        Some(Header::parse(b))
    }

    /// Takes in received bytes.
    #[cfg(test)]
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
        self.pushed();
    }

    /// The buffer, for a read to append to directly; [`Reader::pushed`]
    /// must follow.
    pub(crate) fn spare(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// To call after bytes were appended through [`Reader::spare`].
    pub(crate) fn pushed(&mut self) {
        self.discard();
    }

    /// Drops the payload bytes of an oversized frame, and notices one whose
    /// header has just come to the front (unless one is already waiting to
    /// be reported: its successor is then looked at after that).
    fn discard(&mut self) {
        loop {
            if self.skip > 0 {
                let n = self
                    .buf
                    .len()
                    .min(usize::try_from(self.skip).unwrap_or(usize::MAX));
                self.buf.drain(..n);
                self.skip -= n as u64;
                if self.skip > 0 {
                    return;
                }
            }
            if self.too_large.is_some() {
                return;
            }
            match self.header() {
                Some(h) if h.len as usize > self.max => {
                    self.buf.drain(..HEADER_LEN);
                    self.too_large = Some(h);
                    self.skip = u64::from(h.len);
                }
                _ => return,
            }
        }
    }

    /// The next frame, if one is complete.
    pub(crate) fn next_frame(&mut self) -> Option<Frame> {
        if let Some(h) = self.too_large.take() {
            self.discard();
            return Some(Frame::TooLarge(h));
        }
        let h = self.header()?;
        let end = HEADER_LEN + h.len as usize;
        if self.buf.len() < end {
            return None;
        }
        let body = self.buf[HEADER_LEN..end].to_vec();
        self.buf.drain(..end);
        self.discard();
        Some(Frame::Whole(h, body))
    }

    /// Reads into `spare` (the event loop's buffer, taken from it) when
    /// this reader holds no buffer of its own: a read costs no allocation.
    pub(crate) fn borrow(&mut self, spare: &mut Vec<u8>) {
        if self.buf.capacity() == 0 {
            std::mem::swap(&mut self.buf, spare);
        }
    }

    /// Once nothing is held, gives the buffer back to the loop (`spare`,
    /// if it has none) or frees it: a connection between frames holds no
    /// buffer, so idle connections cost no memory here.
    pub(crate) fn give_back(&mut self, spare: &mut Vec<u8>) {
        if !self.buf.is_empty() || self.buf.capacity() == 0 {
            return;
        }
        if spare.capacity() == 0 && self.buf.capacity() <= SPARE_MAX {
            std::mem::swap(&mut self.buf, spare);
        } else {
            self.buf = Vec::new();
        }
    }
}

/// The largest buffer the loop keeps to read into; larger ones (a frame
/// near the request limit grew it) are freed once empty.
const SPARE_MAX: usize = 32 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(stream: u32, kind: u8, body: &[u8]) -> Vec<u8> {
        let mut v = Header {
            len: u32::try_from(body.len()).unwrap_or(u32::MAX),
            stream,
            kind,
            flags: 0,
        }
        .encode()
        .to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn headers_round_trip_big_endian() {
        let h = Header {
            len: 0x0102_0304,
            stream: 0xa0b0_c0d1,
            kind: 1,
            flags: 4,
        };
        let b = h.encode();
        assert_eq!(b, [1, 2, 3, 4, 0xa0, 0xb0, 0xc0, 0xd1, 1, 4]);
        assert_eq!(Header::parse(&b), h);
        let r = response(7, b"xy").unwrap();
        assert_eq!(&r[..HEADER_LEN], &[0, 0, 0, 2, 0, 0, 0, 7, 2, 0]);
        assert_eq!(&r[HEADER_LEN..], b"xy");
    }

    #[test]
    fn frames_arrive_in_any_pieces() {
        let mut all = frame(1, 1, b"hello");
        all.extend(frame(3, 1, b""));
        all.extend(frame(5, 1, &[7u8; 300]));
        // Byte by byte, and all at once, give the same frames.
        for chunk in [1, 3, 10, 11, all.len()] {
            let mut r = Reader::new(1024);
            let mut got = Vec::new();
            for piece in all.chunks(chunk) {
                r.push(piece);
                while let Some(f) = r.next_frame() {
                    got.push(f);
                }
            }
            assert_eq!(got.len(), 3, "chunk {chunk}");
            assert_eq!(
                got[0],
                Frame::Whole(
                    Header::parse(&all[..10].try_into().unwrap()),
                    b"hello".to_vec()
                )
            );
            assert!(matches!(&got[1], Frame::Whole(h, b) if h.stream == 3 && b.is_empty()));
            assert!(matches!(&got[2], Frame::Whole(h, b) if h.stream == 5 && b.len() == 300));
            assert!(!r.mid_frame());
        }
    }

    #[test]
    fn an_oversized_frame_is_reported_at_its_header_and_never_stored() {
        let mut r = Reader::new(16);
        let big = frame(9, 1, &[0xaa; 100_000]);
        r.push(&big[..HEADER_LEN]);
        assert_eq!(
            r.next_frame(),
            Some(Frame::TooLarge(Header {
                len: 100_000,
                stream: 9,
                kind: 1,
                flags: 0
            }))
        );
        // The payload streams through without being held, then the next frame parses.
        for piece in big[HEADER_LEN..].chunks(4096) {
            r.push(piece);
            assert!(r.held() == 0, "held {}", r.held());
            assert_eq!(r.next_frame(), None);
        }
        assert!(!r.mid_frame());
        r.push(&frame(11, 1, b"ok"));
        assert!(matches!(r.next_frame(), Some(Frame::Whole(h, b)) if h.stream == 11 && b == b"ok"));
    }

    #[test]
    fn an_oversized_frame_in_one_piece_with_its_successor() {
        let mut r = Reader::new(16);
        let mut all = frame(1, 1, &[1u8; 17]);
        all.extend(frame(3, 1, b"next"));
        r.push(&all);
        assert!(matches!(r.next_frame(), Some(Frame::TooLarge(h)) if h.len == 17));
        assert!(
            matches!(r.next_frame(), Some(Frame::Whole(h, b)) if h.stream == 3 && b == b"next")
        );
        assert_eq!(r.next_frame(), None);
        // The limit itself is allowed.
        r.push(&frame(5, 1, &[0u8; 16]));
        assert!(matches!(r.next_frame(), Some(Frame::Whole(h, _)) if h.stream == 5));
    }

    #[test]
    fn reads_into_the_spare_buffer_honour_the_skip() {
        let mut r = Reader::new(4);
        let mut all = frame(1, 1, &[9u8; 8]);
        all.extend(frame(3, 1, b"ab"));
        r.push(&all[..HEADER_LEN + 2]);
        assert!(matches!(r.next_frame(), Some(Frame::TooLarge(_))));
        assert!(r.mid_frame(), "6 payload bytes still to skip");
        r.spare().extend_from_slice(&all[HEADER_LEN + 2..]);
        r.pushed();
        assert!(matches!(r.next_frame(), Some(Frame::Whole(h, b)) if h.stream == 3 && b == b"ab"));
        assert!(!r.mid_frame() && r.wants_bytes());
    }

    #[test]
    fn a_frame_of_max_u32_length_does_not_overflow() {
        let mut r = Reader::new(64 << 10);
        r.push(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1, 1, 0, 1, 2, 3]);
        assert!(matches!(r.next_frame(), Some(Frame::TooLarge(h)) if h.len == u32::MAX));
        assert_eq!(r.held(), 0);
        assert!(r.mid_frame());
    }
}

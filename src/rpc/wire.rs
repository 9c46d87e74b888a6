//! The sending side of a connection: the socket and the answers waiting to
//! leave it, shared by the event loop and the workers, so that a worker
//! answers straight to the socket without a detour through the loop.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crust_protocols::sync::LockExt;
use rustix::io::Errno;
use rustix::net::SendFlags;

use super::frame;

/// The sending side of a connection, shared by the event loop and the
/// workers answering its requests: a worker writes its answer straight to
/// the socket when nothing is queued before it, and queues it otherwise
/// (the loop then writes it as the socket drains).
pub(crate) struct Wire {
    /// The socket (non-blocking). Closed when the last holder lets go.
    pub(crate) fd: OwnedFd,
    /// Bytes to send: `buf[sent..]` is pending.
    out: Mutex<Out>,
    /// How many bytes `out` holds pending, kept beside it so that the loop
    /// weighs a connection's output limits without taking the lock.
    pending: AtomicUsize,
    /// Requests queued or running whose answers are not yet sent or queued.
    pub(crate) in_flight: AtomicUsize,
    /// Set once the loop has closed the connection: answers are dropped.
    pub(crate) closed: AtomicBool,
}

#[derive(Default)]
struct Out {
    buf: Vec<u8>,
    sent: usize,
}

impl Wire {
    /// Bytes waiting to be sent.
    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// Queues a frame behind what is pending, without writing.
    pub(crate) fn queue(&self, frame: &[u8]) {
        let mut o = self.out.locked();
        o.push(&[frame]);
        self.note(&o);
    }

    /// Queues the response frame on `stream` carrying `answer` (a ttrpc
    /// Response) behind what is pending, without writing.
    pub(crate) fn queue_response(&self, stream: u32, answer: &[u8]) {
        // Answers fit a frame: dispatch gives no other.
        let Some(h) = frame::response_header(stream, answer.len()) else {
            return;
        };
        let mut o = self.out.locked();
        o.push(&[&h, answer]);
        self.note(&o);
    }

    /// Sends the response frame on `stream` carrying `answer` now if
    /// nothing waits before it, as far as the socket takes it; queues the
    /// rest. Returns the bytes left pending.
    pub(crate) fn answer(&self, stream: u32, answer: &[u8]) -> Result<usize, Errno> {
        if self.closed.load(Ordering::SeqCst) {
            return Ok(0);
        }
        let Some(h) = frame::response_header(stream, answer.len()) else {
            return Ok(0);
        };
        let mut o = self.out.locked();
        let idle = o.sent == o.buf.len();
        o.push(&[&h, answer]);
        let r = if idle {
            o.send(&self.fd).map(|_| ())
        } else {
            Ok(())
        };
        self.note(&o);
        r.map(|()| o.buf.len() - o.sent)
    }

    /// Writes what is pending as far as the socket takes it. Returns
    /// (bytes written, bytes still pending).
    pub(crate) fn flush(&self) -> Result<(usize, usize), Errno> {
        let mut o = self.out.locked();
        let r = o.send(&self.fd);
        self.note(&o);
        r
    }

    /// Publishes what `o` holds pending.
    fn note(&self, o: &Out) {
        self.pending.store(o.buf.len() - o.sent, Ordering::Release);
    }
}

impl Out {
    /// Appends `parts` behind what is pending (reusing the buffer once
    /// everything before was sent).
    fn push(&mut self, parts: &[&[u8]]) {
        if self.sent == self.buf.len() {
            self.buf.clear();
            self.sent = 0;
        }
        for p in parts {
            self.buf.extend_from_slice(p);
        }
    }

    /// Sends what is pending as far as `fd` takes it: (bytes written,
    /// bytes still pending). A drained buffer over 64 KiB is freed.
    fn send(&mut self, fd: &OwnedFd) -> Result<(usize, usize), Errno> {
        let mut wrote = 0;
        while self.sent < self.buf.len() {
            match rustix::net::send(fd, &self.buf[self.sent..], SendFlags::NOSIGNAL) {
                Ok(n) => {
                    self.sent += n;
                    wrote += n;
                }
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return Ok((wrote, self.buf.len() - self.sent)),
                Err(e) => return Err(e),
            }
        }
        self.buf.clear();
        self.sent = 0;
        if self.buf.capacity() > 64 << 10 {
            self.buf = Vec::new();
        }
        Ok((wrote, 0))
    }
}

impl Wire {
    /// A wire over `fd` with nothing in flight or pending.
    pub(crate) fn new(fd: OwnedFd) -> Wire {
        Wire {
            fd,
            out: Mutex::new(Out::default()),
            pending: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        }
    }
}

/// A wire over one end of a socket pair, for tests that need a job.
#[cfg(test)]
pub(crate) fn test_wire() -> std::sync::Arc<Wire> {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    std::sync::Arc::new(Wire::new(OwnedFd::from(a)))
}

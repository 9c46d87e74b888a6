//! The sending side of a connection: the socket and the answers waiting to
//! leave it, shared by the event loop and the workers, so that a worker
//! answers straight to the socket without a detour through the loop.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use rustix::io::Errno;
use rustix::net::SendFlags;

/// The sending side of a connection, shared by the event loop and the
/// workers answering its requests: a worker writes its answer straight to
/// the socket when nothing is queued before it, and queues it otherwise
/// (the loop then writes it as the socket drains).
pub(crate) struct Wire {
    /// The socket (non-blocking). Closed when the last holder lets go.
    pub(crate) fd: OwnedFd,
    /// Bytes to send: `buf[sent..]` is pending.
    out: Mutex<Out>,
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
    fn out(&self) -> MutexGuard<'_, Out> {
        self.out.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes waiting to be sent.
    pub(crate) fn pending(&self) -> usize {
        let o = self.out();
        o.buf.len() - o.sent
    }

    /// Queues a frame behind what is pending, without writing.
    pub(crate) fn queue(&self, frame: &[u8]) {
        let mut o = self.out();
        if o.sent == o.buf.len() {
            o.buf.clear();
            o.sent = 0;
        }
        o.buf.extend_from_slice(frame);
    }

    /// Sends a frame now if nothing waits before it, as far as the socket
    /// takes it; queues the rest. Returns the bytes left pending.
    pub(crate) fn answer(&self, frame: &[u8]) -> Result<usize, Errno> {
        if self.closed.load(Ordering::SeqCst) {
            return Ok(0);
        }
        let mut o = self.out();
        if o.sent == o.buf.len() {
            o.buf.clear();
            o.sent = 0;
            let mut done = 0;
            while done < frame.len() {
                match rustix::net::send(&self.fd, &frame[done..], SendFlags::NOSIGNAL) {
                    Ok(n) => done += n,
                    Err(Errno::INTR) => continue,
                    Err(Errno::AGAIN) => break,
                    Err(e) => return Err(e),
                }
            }
            o.buf.extend_from_slice(&frame[done..]);
        } else {
            o.buf.extend_from_slice(frame);
        }
        Ok(o.buf.len() - o.sent)
    }

    /// Writes what is pending as far as the socket takes it. Returns
    /// (bytes written, bytes still pending).
    pub(crate) fn flush(&self) -> Result<(usize, usize), Errno> {
        let mut o = self.out();
        let mut wrote = 0;
        while o.sent < o.buf.len() {
            match rustix::net::send(&self.fd, &o.buf[o.sent..], SendFlags::NOSIGNAL) {
                Ok(n) => {
                    o.sent += n;
                    wrote += n;
                }
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return Ok((wrote, o.buf.len() - o.sent)),
                Err(e) => return Err(e),
            }
        }
        o.buf.clear();
        o.sent = 0;
        if o.buf.capacity() > 64 << 10 {
            o.buf = Vec::new();
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

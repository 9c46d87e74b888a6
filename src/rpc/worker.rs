//! A worker thread: takes a request from the queue for its lane, runs it
//! through the service table, and answers straight to its connection's
//! socket; the event loop is woken only for what the socket did not take,
//! or to resume reading a connection held at its in-flight limit.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;

use slog::{warn, Logger};

use super::dispatch::{self, Done, Outbox};
use super::lograte::LogRate;
use super::pool::Queue;
use super::table::{Lane, Table};

/// What one worker shares with the transport.
pub(super) struct Worker {
    pub(super) lane: Lane,
    pub(super) queue: Arc<Queue>,
    pub(super) methods: Arc<Table>,
    /// Tells the loop a connection needs it.
    pub(super) done: Sender<Done>,
    /// Wakes the loop.
    pub(super) wake: Arc<OwnedFd>,
    pub(super) log: Logger,
    pub(super) rate: Arc<LogRate>,
    /// A connection's in-flight limit (`Limits::in_flight_per_connection`).
    pub(super) cap: usize,
}

impl Worker {
    /// Serves jobs until the queue is closed.
    pub(super) fn run(self) {
        let out = Outbox::new();
        while let Some(job) = self.queue.pop(self.lane) {
            let (conn, method, start) = (job.conn, job.method, Instant::now());
            let (stream, wire) = (job.stream, job.wire.clone());
            let (answer, failure) = dispatch::run(&self.methods, job, &out);
            if let Some((code, why)) = failure {
                if let Some(held) = self.rate.allow() {
                    warn!(self.log, "request"; "method" => self.methods.path(method), "code" => format!("{code:?}"),
                          "duration_us" => u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
                          "error" => why, "lines_held_back" => held);
                }
            }
            let pending = wire.answer(stream, &answer).unwrap_or(1);
            let before = wire.in_flight.fetch_sub(1, Ordering::SeqCst);
            drop(wire);
            if pending > 0 || before >= self.cap {
                if self.done.send(Done { conn }).is_err() {
                    return;
                }
                let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
            }
        }
    }
}

//! The transport started and stopped: the worker threads (each takes a
//! request from the queue, runs it through the service table and answers
//! straight to its connection's socket) and the event loop's thread.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::epoll;
use rustix::event::{eventfd, EventfdFlags};
use slog::{warn, Logger};

use super::dispatch::{self, Done, Methods, Outbox};
use super::limits::{Limits, FD_RESERVE};
use super::listen::{raise_fd_limit, Peers};
use super::lograte::LogRate;
use super::pool::{Lane, LaneRule, Queue};
use super::reactor::{Reactor, FIRST_CONN};

/// A running transport.
pub struct Server {
    stop: Arc<AtomicBool>,
    wake: Arc<OwnedFd>,
    event_loop: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves `methods` on the listening sockets (address, socket), within
    /// `limits`, to the vsock `peers` allowed; `lane` is the service's rule
    /// for which methods the loop answers itself and which take the quick
    /// workers (the transport knows no method). The descriptor limit is
    /// raised for the connections; if it cannot be, the connection limit
    /// shrinks to fit and says so.
    pub fn start(
        listeners: Vec<(String, OwnedFd)>,
        methods: Methods,
        lane: LaneRule,
        mut limits: Limits,
        peers: Peers,
        log: Logger,
        grace: Duration,
    ) -> io::Result<Server> {
        let want = limits.max_connections as u64 + FD_RESERVE;
        let have = raise_fd_limit(want);
        if have < want {
            let fit =
                usize::try_from(have.saturating_sub(FD_RESERVE).max(16)).unwrap_or(usize::MAX);
            warn!(log, "the descriptor limit is low: fewer connections allowed";
                  "nofile" => have, "max_connections" => fit, "wanted" => limits.max_connections);
            limits.max_connections = fit;
        }
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
        let methods = Arc::new(methods);
        let queue = Arc::new(Queue::new(limits.queue, limits.quick_queue));
        let rate = Arc::new(LogRate::new());
        let stop = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = std::sync::mpsc::channel();

        let lanes = (0..limits.workers.max(1))
            .map(|_| Lane::Regular)
            .chain((0..limits.quick_workers).map(|_| Lane::Quick));
        let cap = limits.in_flight_per_connection;
        for (i, lane) in lanes.enumerate() {
            let (queue, methods, done_tx, wake, log, rate) = (
                queue.clone(),
                methods.clone(),
                done_tx.clone(),
                wake.clone(),
                log.clone(),
                rate.clone(),
            );
            let name = match lane {
                Lane::Regular => format!("rpc-worker-{i}"),
                Lane::Quick | Lane::Inline => format!("rpc-quick-{i}"),
            };
            std::thread::Builder::new().name(name).spawn(move || {
                let out = Outbox::new();
                while let Some(job) = queue.pop(lane) {
                    let (conn, path, start) = (job.conn, job.path.clone(), Instant::now());
                    let wire = job.wire.clone();
                    let (frame, failure) = dispatch::run(&methods, job, &out);
                    if let Some((code, why)) = failure {
                        if let Some(held) = rate.allow() {
                            warn!(log, "request"; "method" => path, "code" => format!("{code:?}"),
                                  "duration_us" => u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
                                  "error" => why, "lines_held_back" => held);
                        }
                    }
                    // Answer straight away; the loop is needed only for what
                    // the socket did not take, or to resume reading a
                    // connection held at its in-flight limit.
                    let pending = wire.answer(&frame).unwrap_or(1);
                    let before = wire.in_flight.fetch_sub(1, Ordering::SeqCst);
                    drop(wire);
                    if pending > 0 || before >= cap {
                        if done_tx.send(Done { conn }).is_err() {
                            return;
                        }
                        let _ = rustix::io::write(&*wake, &1u64.to_ne_bytes());
                    }
                }
            })?;
        }

        let reactor = Reactor {
            epoll,
            wake: wake.clone(),
            listeners: listeners.into_iter().map(Some).collect(),
            conns: HashMap::new(),
            next_id: FIRST_CONN,
            methods,
            lane,
            outbox: Outbox::new(),
            queue,
            done: done_rx,
            limits,
            log,
            rate,
            stop: stop.clone(),
            accept_paused_until: None,
            peers,
        };
        reactor.register()?;
        let event_loop = std::thread::Builder::new()
            .name("rpc-loop".into())
            .spawn(move || reactor.run(grace))?;
        Ok(Server {
            stop,
            wake,
            event_loop: Some(event_loop),
        })
    }

    /// Stops accepting and reading, lets answers in flight leave (within
    /// the grace given at start), then closes every connection.
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        if let Some(h) = self.event_loop.take() {
            let _ = h.join();
        }
    }
}

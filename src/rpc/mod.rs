//! The agent's ttrpc transport: the wire protocol of ttrpc (Go's
//! containerd/ttrpc and the Rust crate speak it alike) served by a bounded
//! loop instead of the ttrpc crate's thread-per-connection server, so that
//! no client, however it behaves, can make the agent spawn threads, hold
//! memory or keep descriptors without bound.
//!
//! One event-loop thread ([`reactor`]) owns every connection; a fixed pool
//! of workers ([`pool`]) runs requests through the generated service table
//! ([`dispatch`]), exactly as ttrpc's server would. Every frame gets an
//! answer. The RPC layer above (`server.rs`) is unchanged by it.

pub(crate) mod conn;
pub(crate) mod dispatch;
pub(crate) mod frame;
mod listen;
mod lograte;
mod pool;
mod reactor;
#[cfg(test)]
mod tests;

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

pub use dispatch::Methods;
pub use listen::{listen, raise_fd_limit, Address, Peers, VsockAddr, SOCKET_MODE, VMADDR_CID_HOST};

use dispatch::Outbox;
use lograte::LogRate;
use pool::{Lane, Queue};
use reactor::Reactor;

/// Every bound the transport keeps, whatever clients do.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections open at once. At the limit a new connection closes the
    /// longest-idle one; if every connection is busy it is refused.
    pub max_connections: usize,
    /// Worker threads running requests.
    pub workers: usize,
    /// Extra workers that run only the quick methods.
    pub quick_workers: usize,
    /// Requests waiting for a worker; past it, RESOURCE_EXHAUSTED — except
    /// for a connection's only request, which always waits its turn (so the
    /// excess is bounded by the connections). Served round-robin by connection.
    pub queue: usize,
    /// The same for the quick methods' own queue.
    pub quick_queue: usize,
    /// Requests of one connection queued or running: past it the agent
    /// stops reading that connection until answers go out (back-pressure,
    /// not refusal: a pipelining client is slowed, not failed).
    pub in_flight_per_connection: usize,
    /// The largest request payload; a larger frame is answered
    /// RESOURCE_EXHAUSTED and its bytes discarded unread.
    pub max_request: usize,
    /// Pending answers of one connection above which its requests are no
    /// longer read.
    pub out_pause: usize,
    /// Pending answers of one connection above which it is closed.
    pub out_max: usize,
    /// How long a frame may stay half-received.
    pub frame_timeout: Duration,
    /// How long pending answers may go unread before the connection closes.
    pub stall_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 1024,
            workers: 16,
            quick_workers: 2,
            queue: 256,
            quick_queue: 64,
            in_flight_per_connection: 32,
            max_request: 64 << 10,
            out_pause: 64 << 10,
            out_max: 1 << 20,
            frame_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Descriptors kept free for the agent's own work (disks, mounts, the
/// ownership walk's directories) beyond one per connection.
const FD_RESERVE: u64 = 512;

/// A running transport.
pub struct Server {
    stop: Arc<AtomicBool>,
    wake: Arc<OwnedFd>,
    event_loop: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves `methods` on the listening sockets (address, socket), within
    /// `limits`, to the vsock `peers` allowed. The descriptor limit is raised
    /// for the connections; if it cannot be, the connection limit shrinks to
    /// fit and says so.
    pub fn start(
        listeners: Vec<(String, OwnedFd)>,
        methods: Methods,
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
                Lane::Quick => format!("rpc-quick-{i}"),
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
                        if done_tx.send(dispatch::Done { conn }).is_err() {
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
            next_id: reactor::FIRST_CONN,
            methods,
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

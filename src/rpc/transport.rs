//! The transport started and stopped: the worker threads (`worker.rs`) and
//! the event loop's thread. A transport that fails to start leaves no
//! thread behind.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::event::epoll;
use rustix::event::{eventfd, EventfdFlags};
use slog::{warn, Logger};

use super::dispatch::Outbox;
use super::limits::{Limits, FD_RESERVE};
use super::listen::{raise_fd_limit, Peers};
use super::lograte::LogRate;
use super::pool::Queue;
use super::reactor::{Conns, Reactor, FIRST_CONN};
use super::table::{Lane, Table};
use super::worker::Worker;

/// Starts a thread for each worker with `spawn`. If one cannot start, the
/// workers already started would wait for jobs for ever: their queue is
/// closed and each joined before the error is answered.
fn start_workers(
    queue: &Queue,
    workers: impl Iterator<Item = Worker>,
    mut spawn: impl FnMut(String, Worker) -> io::Result<JoinHandle<()>>,
) -> io::Result<Vec<JoinHandle<()>>> {
    let mut started = Vec::new();
    for (i, w) in workers.enumerate() {
        let name = match w.lane {
            Lane::Regular => format!("rpc-worker-{i}"),
            Lane::Quick | Lane::Inline => format!("rpc-quick-{i}"),
        };
        match spawn(name, w) {
            Ok(h) => started.push(h),
            Err(e) => {
                stop_workers(queue, started);
                return Err(e);
            }
        }
    }
    Ok(started)
}

/// Ends the workers of a transport that did not start: their queue closed,
/// each joined.
fn stop_workers(queue: &Queue, workers: Vec<JoinHandle<()>>) {
    queue.close();
    for w in workers {
        let _ = w.join();
    }
}

/// A running transport.
pub struct Server {
    stop: Arc<AtomicBool>,
    wake: Arc<OwnedFd>,
    event_loop: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves the methods of `table` on the listening sockets (address,
    /// socket), within `limits`, to the vsock `peers` allowed; the table
    /// says which methods the loop answers itself and which take the quick
    /// workers (the transport knows no method). The descriptor limit is
    /// raised for the connections; if it cannot be, the connection limit
    /// shrinks to fit and says so.
    pub fn start(
        listeners: Vec<(String, OwnedFd)>,
        table: Table,
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
        let methods = Arc::new(table);
        let queue = Arc::new(Queue::new(limits.queue, limits.quick_queue));
        let rate = Arc::new(LogRate::new());
        let stop = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = std::sync::mpsc::channel();

        let lanes = (0..limits.workers.max(1))
            .map(|_| Lane::Regular)
            .chain((0..limits.quick_workers).map(|_| Lane::Quick));
        let cap = limits.in_flight_per_connection;
        let workers = lanes.map(|lane| Worker {
            lane,
            queue: queue.clone(),
            methods: methods.clone(),
            done: done_tx.clone(),
            wake: wake.clone(),
            log: log.clone(),
            rate: rate.clone(),
            cap,
        });
        let workers = start_workers(&queue, workers, |name, w| {
            std::thread::Builder::new()
                .name(name)
                .spawn(move || w.run())
        })?;

        let reactor = Reactor {
            epoll,
            wake: wake.clone(),
            listeners: listeners.into_iter().map(Some).collect(),
            conns: Conns::default(),
            next_id: FIRST_CONN,
            methods,
            outbox: Outbox::new(),
            spare: Vec::new(),
            queue: queue.clone(),
            done: done_rx,
            limits,
            log,
            rate,
            stop: stop.clone(),
            accept_paused_until: None,
            peers,
        };
        if let Err(e) = reactor.register() {
            stop_workers(&queue, workers);
            return Err(e.into());
        }
        let event_loop = match std::thread::Builder::new()
            .name("rpc-loop".into())
            .spawn(move || reactor.run(grace))
        {
            Ok(h) => h,
            Err(e) => {
                stop_workers(&queue, workers);
                return Err(e);
            }
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that cannot be started leaves none of the others waiting.
    #[test]
    fn a_worker_that_cannot_start_stops_the_ones_started() {
        let queue = Arc::new(Queue::new(4, 4));
        let (done, _rx) = std::sync::mpsc::channel();
        let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC).unwrap());
        let worker = |lane| Worker {
            lane,
            queue: queue.clone(),
            methods: Arc::new(Table::new(Default::default(), |_| Lane::Regular)),
            done: done.clone(),
            wake: wake.clone(),
            log: crate::logging::discard(),
            rate: Arc::new(LogRate::new()),
            cap: 1,
        };
        let ended = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut n = 0;
        let e = start_workers(
            &queue,
            [Lane::Regular, Lane::Regular, Lane::Quick, Lane::Quick]
                .into_iter()
                .map(worker),
            |name, w| {
                n += 1;
                if n == 3 {
                    return Err(io::Error::other("no more threads"));
                }
                let ended = ended.clone();
                std::thread::Builder::new().name(name).spawn(move || {
                    w.run();
                    ended.fetch_add(1, Ordering::SeqCst);
                })
            },
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "no more threads");
        // Joined before the error came back: both started workers ended.
        assert_eq!(ended.load(Ordering::SeqCst), 2);
    }
}

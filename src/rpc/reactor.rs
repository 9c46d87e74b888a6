//! The event loop: one thread owns the listening sockets and every client
//! connection (non-blocking, in one epoll set), cuts frames, admits
//! requests into the worker queue, and writes the answers the workers hand
//! back. It never blocks on a client, so no client can stall another;
//! every bound of [`Limits`] is enforced here.
//!
//! Inline methods it runs itself, as it reads them: no thread hop for a
//! health check. The service's rule ([`LaneRule`]) says which, and may name
//! only methods that wait for nothing: no disk, no lock a long operation
//! holds, no sleep (the agent's are GetCapabilities and GetAgentInfo, which
//! answer from memory, uname and /proc; `server::methods` says why).
//! An inline method is bounded like any other: its answer counts against
//! the connection's output limit before the next frame is admitted, and a
//! connection's inline answers and its workers' leave in the order they are
//! ready. Its one line of log is the same single write to the console the
//! loop's own warnings make.
//!
//! The loop's own cost per request is kept below the method's: a read
//! allocates nothing (the loop lends its one read buffer to a connection
//! only while that holds part of a frame), a request is routed by an index
//! (`table`) with its envelope read in place (`envelope`), an inline method
//! with a direct answer skips ttrpc's handler machinery, and an answer is
//! framed as it is queued. Every microsecond the loop spends shows in a
//! health check's round trip, twice over when client and agent share a CPU.
//!
//! [`LaneRule`]: super::table::LaneRule

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::epoll::{self, EventData, EventFlags};
use rustix::io::Errno;
use rustix::net::SocketFlags;
use slog::{debug, info, warn, Logger};

use super::conn::{Admit, Conn};
use super::dispatch::{self, Done, Failure, Job, Outbox};
use super::limits::Limits;
use super::listen::{peer_of, Peer, Peers, VMADDR_CID_HOST};
use super::lograte::LogRate;
use super::pool::Queue;
use super::table::{Lane, Table};

/// Epoll data of the wake-up eventfd.
const WAKE: u64 = 0;
/// Epoll data of listener `i` is `FIRST_LISTENER + i`.
const FIRST_LISTENER: u64 = 1;
/// Connections are numbered from here, never reused.
pub(crate) const FIRST_CONN: u64 = 1 << 16;
/// How often timeouts are looked at.
const TICK: Duration = Duration::from_millis(500);
/// How long accepting pauses when the process is out of descriptors.
const ACCEPT_PAUSE: Duration = Duration::from_millis(200);

/// Hashes the loop's connection ids: its own sequence numbers, never a
/// client's choice, so a multiply spreads them as well as a keyed hash
/// would, for a fraction of its cost on every event.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The connections by id.
pub(crate) type Conns = HashMap<u64, Conn, BuildHasherDefault<IdHasher>>;

/// What the loop owns.
pub(crate) struct Reactor {
    pub(crate) epoll: OwnedFd,
    pub(crate) wake: Arc<OwnedFd>,
    /// The listening sockets with their addresses; `None` once closed.
    pub(crate) listeners: Vec<Option<(String, OwnedFd)>>,
    pub(crate) conns: Conns,
    pub(crate) next_id: u64,
    /// The methods served, each with its lane.
    pub(crate) methods: Arc<Table>,
    /// Where the inline methods' handlers leave their answers.
    pub(crate) outbox: Outbox,
    /// The buffer reads go into, lent to a connection while it holds bytes
    /// of a frame (`Conn::read`), so a request costs no allocation to read.
    pub(crate) spare: Vec<u8>,
    pub(crate) queue: Arc<Queue>,
    pub(crate) done: Receiver<Done>,
    pub(crate) limits: Limits,
    pub(crate) log: Logger,
    pub(crate) rate: Arc<LogRate>,
    pub(crate) stop: Arc<AtomicBool>,
    /// Accepting resumes at this time (after running out of descriptors).
    pub(crate) accept_paused_until: Option<Instant>,
    /// Which vsock peers may connect.
    pub(crate) peers: Peers,
}

/// Why a connection is closed, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Close {
    /// The client closed or reset it (normal).
    HungUp,
    /// A read or write failed.
    Broken(Errno),
    /// Its pending answers passed the output limit: it does not read them.
    OutputFull,
    /// Its answers have not moved for the stall timeout.
    Stalled,
    /// It sent part of a frame and stopped for the frame timeout.
    SlowFrame,
    /// Closed to admit a new connection at the connection limit.
    Evicted,
    /// The agent is stopping.
    Stopping,
}

impl Reactor {
    /// Registers the wake-up and listening sockets.
    pub(crate) fn register(&self) -> rustix::io::Result<()> {
        epoll::add(
            &self.epoll,
            &*self.wake,
            EventData::new_u64(WAKE),
            EventFlags::IN,
        )?;
        for (i, l) in self.listeners.iter().enumerate() {
            if let Some((_, fd)) = l {
                epoll::add(
                    &self.epoll,
                    fd,
                    EventData::new_u64(FIRST_LISTENER + i as u64),
                    EventFlags::IN,
                )?;
            }
        }
        Ok(())
    }

    /// Runs until stopped, then gives in-flight answers `grace` to leave.
    pub(crate) fn run(mut self, grace: Duration) {
        let mut events: Vec<epoll::Event> = Vec::with_capacity(256);
        let mut last_tick = Instant::now();
        let mut stopping: Option<Instant> = None;
        loop {
            if stopping.is_none() && self.stop.load(Ordering::SeqCst) {
                self.close_listeners();
                for c in self.conns.values_mut() {
                    // No new requests: only answers still to come.
                    c.last_active = Instant::now();
                }
                let ids: Vec<u64> = self.conns.keys().copied().collect();
                for id in ids {
                    self.interest(id);
                }
                stopping = Some(Instant::now() + grace);
            }
            if let Some(end) = stopping {
                let busy = self
                    .conns
                    .values()
                    .any(|c| c.in_flight() > 0 || c.pending_out() > 0);
                if !busy || Instant::now() >= end {
                    break;
                }
            }
            events.clear();
            let timeout = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: if stopping.is_some() {
                    20_000_000
                } else {
                    i64::try_from(TICK.as_nanos()).unwrap_or(i64::MAX)
                },
            };
            match epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&timeout),
            ) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => {
                    warn!(self.log, "the connection loop cannot wait for events; stopping"; "error" => %e);
                    break;
                }
            }
            let now = Instant::now();
            let mut woken = false;
            for ev in &events {
                let (data, flags) = (ev.data.u64(), ev.flags);
                match data {
                    WAKE => {
                        let mut b = [0u8; 8];
                        let _ = rustix::io::read(&*self.wake, &mut b);
                        woken = true;
                    }
                    d if d < FIRST_CONN => self.accept(
                        usize::try_from(d - FIRST_LISTENER).unwrap_or(usize::MAX),
                        now,
                    ),
                    id => self.on_conn(id, flags, now),
                }
            }
            // A worker that needs the loop says so before it writes the wake-up.
            if woken {
                self.deliver(now);
            }
            if now.duration_since(last_tick) >= TICK {
                last_tick = now;
                self.sweep(now);
            }
        }
        // Dropping the connections disconnects their requests' cancel channels.
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id, Close::Stopping);
        }
        self.queue.close();
    }

    fn close_listeners(&mut self) {
        for l in &mut self.listeners {
            if let Some((_, fd)) = l.take() {
                let _ = epoll::delete(&self.epoll, &fd);
            }
        }
    }

    /// Accepts what waits on listener `i`.
    fn accept(&mut self, i: usize, now: Instant) {
        for _ in 0..64 {
            let Some(Some((addr, fd))) = self.listeners.get(i) else {
                return;
            };
            match rustix::net::accept_with(fd, SocketFlags::NONBLOCK | SocketFlags::CLOEXEC) {
                Ok(c) => {
                    if let Some(peer) = self.peer_allowed(&c, addr) {
                        self.admit_conn(c, peer, now)
                    }
                }
                Err(Errno::AGAIN) => return,
                Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
                Err(e) => {
                    // Out of descriptors or memory: stop accepting for a moment instead
                    // of spinning on a listener that stays readable.
                    if let Some(held) = self.rate.allow() {
                        warn!(self.log, "cannot accept a connection; pausing accepts";
                              "listen" => addr.as_str(), "error" => %e, "connections" => self.conns.len(),
                              "pause_ms" => u64::try_from(ACCEPT_PAUSE.as_millis()).unwrap_or(u64::MAX), "lines_held_back" => held);
                    }
                    self.pause_accepting(now);
                    return;
                }
            }
        }
    }

    /// Whether the peer of a new connection may talk to the agent (vsock:
    /// its context id is in [`Peers`]); a refused one is logged (rate
    /// limited) and closed before anything is read from it.
    fn peer_allowed(&self, c: &OwnedFd, addr: &str) -> Option<Peer> {
        let refused = match peer_of(c.as_fd()) {
            Ok(Peer::Local) => return Some(Peer::Local),
            Ok(p @ Peer::Vsock { cid, port }) if self.peers.allows(cid) => {
                // Allowed by --vsock-peers: worth a line, the default allows none.
                if cid != VMADDR_CID_HOST {
                    if let Some(held) = self.rate.allow() {
                        info!(self.log, "connection from a vsock peer other than the host";
                              "listen" => addr, "peer" => format!("cid {cid} port {port}"),
                              "lines_held_back" => held);
                    }
                }
                return Some(p);
            }
            Ok(Peer::Vsock { cid, port }) => format!("cid {cid} port {port}"),
            Err(e) => format!("unknown ({e})"),
        };
        if let Some(held) = self.rate.allow() {
            warn!(self.log, "connection refused: this vsock peer may not talk to the agent (see --vsock-peers)";
                  "listen" => addr, "peer" => refused, "allowed" => %self.peers,
                  "lines_held_back" => held);
        }
        None
    }

    fn pause_accepting(&mut self, now: Instant) {
        for l in self.listeners.iter().flatten() {
            let _ = epoll::delete(&self.epoll, &l.1);
        }
        self.accept_paused_until = Some(now + ACCEPT_PAUSE);
    }

    fn resume_accepting(&mut self) {
        self.accept_paused_until = None;
        for (i, l) in self.listeners.iter().enumerate() {
            if let Some((_, fd)) = l {
                let _ = epoll::add(
                    &self.epoll,
                    fd,
                    EventData::new_u64(FIRST_LISTENER + i as u64),
                    EventFlags::IN,
                );
            }
        }
    }

    /// Takes a new connection in, making room at the limit by closing the
    /// longest-idle one; with every connection busy, refuses it.
    fn admit_conn(&mut self, fd: OwnedFd, peer: Peer, now: Instant) {
        if self.conns.len() >= self.limits.max_connections {
            let idlest = self
                .conns
                .iter()
                .filter(|(_, c)| c.idle())
                .min_by_key(|(_, c)| c.last_active)
                .map(|(id, c)| (*id, now.duration_since(c.last_active)));
            match idlest {
                Some((id, idle_for)) => {
                    if let Some(held) = self.rate.allow() {
                        warn!(self.log, "connection limit reached: closing the longest-idle connection for a new one";
                              "limit" => self.limits.max_connections, "idle_s" => idle_for.as_secs(),
                              "lines_held_back" => held);
                    }
                    self.close(id, Close::Evicted);
                }
                None => {
                    if let Some(held) = self.rate.allow() {
                        warn!(self.log, "connection refused: the connection limit is reached and every connection is busy";
                              "limit" => self.limits.max_connections, "lines_held_back" => held);
                    }
                    return; // dropping `fd` closes it: the client sees the connection end
                }
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        if let Err(e) = epoll::add(
            &self.epoll,
            &fd,
            EventData::new_u64(id),
            EventFlags::IN | EventFlags::RDHUP,
        ) {
            if let Some(held) = self.rate.allow() {
                warn!(self.log, "cannot watch a new connection; closing it"; "error" => %e, "lines_held_back" => held);
            }
            return;
        }
        self.conns
            .insert(id, Conn::new(fd, self.limits.max_request));
        debug!(self.log, "connection opened"; "conn" => id, "connections" => self.conns.len(),
        "peer" => match peer {
            Peer::Local => "local".to_string(),
            Peer::Vsock { cid, port } => format!("cid {cid} port {port}"),
        });
    }

    fn on_conn(&mut self, id: u64, flags: EventFlags, now: Instant) {
        if flags.intersects(EventFlags::ERR | EventFlags::HUP | EventFlags::RDHUP) {
            // ttrpc's rule (and Go's): the client going away cancels its calls.
            self.close(id, Close::HungUp);
            return;
        }
        if flags.contains(EventFlags::OUT) {
            // Writing may let frames held back by the output limit go.
            self.pump(id, now);
        }
        if flags.contains(EventFlags::IN) {
            self.read(id, now);
        }
    }

    fn read(&mut self, id: u64, now: Instant) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if !c.wants_bytes() {
            self.interest(id);
            return;
        }
        match c.read(&mut self.spare, now) {
            Ok(0) => return self.close(id, Close::HungUp),
            Ok(_) | Err(Errno::AGAIN) | Err(Errno::INTR) => {}
            Err(Errno::CONNRESET) | Err(Errno::PIPE) => return self.close(id, Close::HungUp),
            Err(e) => return self.close(id, Close::Broken(e)),
        }
        self.pump(id, now);
    }

    /// Admits the frames a connection holds, as far as its in-flight and
    /// output limits allow, writes what waits, and sets what to wait for.
    fn pump(&mut self, id: u64, now: Instant) {
        loop {
            let admitted = self.admit_frames(id, now);
            let before = self.conns.get(&id).map_or(0, |c| c.pending_out());
            self.flush(id, now);
            let Some(c) = self.conns.get(&id) else {
                return;
            };
            // Writing may have brought the output under its limit while
            // frames still wait: admit them now, nothing else will wake us.
            let drained = c.pending_out() < before;
            if !(admitted || drained)
                || c.wants_bytes()
                || c.in_flight() >= self.limits.in_flight_per_connection
                || c.pending_out() >= self.limits.out_pause
            {
                return;
            }
        }
    }

    /// Admits held frames while the limits allow; whether any was taken.
    fn admit_frames(&mut self, id: u64, now: Instant) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        let serve = Serve {
            methods: &self.methods,
            outbox: &self.outbox,
            queue: &self.queue,
            log: &self.log,
            rate: &self.rate,
        };
        let mut any = false;
        while c.in_flight() < self.limits.in_flight_per_connection
            && c.pending_out() < self.limits.out_pause
        {
            let Some(frame) = c.next_frame() else { break };
            any = true;
            c.last_active = now;
            match c.admit(frame, serve.methods, self.limits.max_request) {
                Admit::Refuse(f, code, why) => {
                    c.queue(&f);
                    if let Some(held) = serve.rate.allow() {
                        warn!(serve.log, "request refused"; "conn" => id, "code" => format!("{code:?}"),
                              "error" => why, "lines_held_back" => held);
                    }
                }
                Admit::Run {
                    stream,
                    method,
                    req,
                } => {
                    let lane = serve.methods.lane(method);
                    let direct = match lane {
                        Lane::Inline => serve.direct(method, &req.payload),
                        _ => None,
                    };
                    let answer = direct.or_else(|| {
                        let first = c.in_flight() == 0;
                        let job = Job {
                            conn: id,
                            fd: c.raw(),
                            stream,
                            method,
                            req,
                            gone: c.gone_rx(),
                            wire: c.wire.clone(),
                        };
                        match lane {
                            Lane::Inline => Some(serve.inline(job)),
                            lane => serve.enqueue(job, lane, first),
                        }
                    });
                    if let Some(a) = answer {
                        c.wire.queue_response(stream, &a);
                    }
                }
            }
        }
        c.note_partial(now);
        c.settle(&mut self.spare);
        any
    }

    /// Takes up connections whose workers left answers pending or whose
    /// reading may resume.
    fn deliver(&mut self, now: Instant) {
        let mut touched = Vec::new();
        while let Ok(d) = self.done.try_recv() {
            if self.conns.contains_key(&d.conn) {
                touched.push(d.conn);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for id in touched {
            // Frames held back by the in-flight limit may go now.
            self.pump(id, now);
        }
    }

    /// Writes what a connection's socket takes; enforces the output limit.
    fn flush(&mut self, id: u64, now: Instant) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.pending_out() == 0 {
            return self.interest(id);
        }
        match c.flush(now) {
            Ok(()) => {}
            Err(Errno::PIPE) | Err(Errno::CONNRESET) => return self.close(id, Close::HungUp),
            Err(e) => return self.close(id, Close::Broken(e)),
        }
        if c.pending_out() > self.limits.out_max {
            return self.close(id, Close::OutputFull);
        }
        self.interest(id);
    }

    /// Sets what epoll waits for on a connection: input while it may send
    /// more, output while answers wait, hang-ups always.
    fn interest(&mut self, id: u64) {
        let stopping = self.stop.load(Ordering::Relaxed);
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let mut want = EventFlags::RDHUP;
        if !stopping
            && c.wants_bytes()
            && c.in_flight() < self.limits.in_flight_per_connection
            && c.pending_out() < self.limits.out_pause
        {
            want |= EventFlags::IN;
        }
        if c.pending_out() > 0 {
            want |= EventFlags::OUT;
        }
        if want != c.registered
            && epoll::modify(&self.epoll, c.fd(), EventData::new_u64(id), want).is_ok()
        {
            c.registered = want;
        }
    }

    /// Closes connections that broke a time limit; resumes accepting.
    fn sweep(&mut self, now: Instant) {
        if self.accept_paused_until.is_some_and(|t| now >= t) && !self.stop.load(Ordering::Relaxed)
        {
            self.resume_accepting();
        }
        let mut late = Vec::new();
        for (id, c) in &self.conns {
            if c.partial_since
                .is_some_and(|t| now.duration_since(t) >= self.limits.frame_timeout)
            {
                late.push((*id, Close::SlowFrame));
            } else if c
                .stalled_since
                .is_some_and(|t| now.duration_since(t) >= self.limits.stall_timeout)
            {
                late.push((*id, Close::Stalled));
            }
        }
        for (id, why) in late {
            self.close(id, why);
        }
    }

    fn close(&mut self, id: u64, why: Close) {
        let Some(c) = self.conns.remove(&id) else {
            return;
        };
        let _ = epoll::delete(&self.epoll, c.fd());
        let (in_flight, held) = (c.in_flight(), c.held());
        drop(c);
        match why {
            Close::HungUp | Close::Stopping => {
                debug!(self.log, "connection closed"; "conn" => id, "why" => format!("{why:?}"),
                       "in_flight" => in_flight, "connections" => self.conns.len());
            }
            _ => {
                if let Some(held_back) = self.rate.allow() {
                    let what = match why {
                        Close::OutputFull => "closed a connection that does not read its answers (output limit reached)",
                        Close::Stalled => "closed a connection that stopped reading its answers",
                        Close::SlowFrame => "closed a connection that sent part of a frame and stopped",
                        Close::Evicted => "closed an idle connection at the connection limit",
                        _ => "closed a broken connection",
                    };
                    warn!(self.log, "{}", what; "conn" => id, "why" => format!("{why:?}"),
                          "in_flight" => in_flight, "bytes_held" => held,
                          "lines_held_back" => held_back);
                }
            }
        }
    }
}

/// What running a request needs of the loop besides the connection: held
/// apart from the connection table, so a request runs while its connection
/// is borrowed from the table.
struct Serve<'a> {
    methods: &'a Table,
    outbox: &'a Outbox,
    queue: &'a Queue,
    log: &'a Logger,
    rate: &'a LogRate,
}

impl Serve<'_> {
    /// Runs a job of the inline lane on the loop's own thread: its answer.
    fn inline(&self, job: Job) -> Vec<u8> {
        let (method, start) = (job.method, Instant::now());
        self.logged(method, start, dispatch::run(self.methods, job, self.outbox))
    }

    /// Answers a request of the inline lane with its method's direct
    /// answer, if it has one (no job is needed).
    fn direct(&self, method: usize, payload: &[u8]) -> Option<Vec<u8>> {
        let start = Instant::now();
        let answered = dispatch::run_direct(self.methods, method, payload)?;
        Some(self.logged(method, start, answered))
    }

    /// The answer to a request of `method` begun at `start`; a failure the
    /// service did not answer itself is logged.
    fn logged(
        &self,
        method: usize,
        start: Instant,
        (answer, failure): (Vec<u8>, Failure),
    ) -> Vec<u8> {
        if let Some((code, why)) = failure {
            if let Some(held) = self.rate.allow() {
                warn!(self.log, "request"; "method" => self.methods.path(method), "code" => format!("{code:?}"),
                      "duration_us" => u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
                      "error" => why, "lines_held_back" => held);
            }
        }
        answer
    }

    /// Hands a job to the workers of its lane (`first`: its connection has
    /// nothing else in flight); when the lane's queue is full, the
    /// RESOURCE_EXHAUSTED answer to send instead.
    fn enqueue(&self, job: Job, lane: Lane, first: bool) -> Option<Vec<u8>> {
        let (conn, wire) = (job.conn, job.wire.clone());
        // Counted before the push: a worker may finish it at once.
        wire.in_flight.fetch_add(1, Ordering::SeqCst);
        let (job, waiting) = self.queue.push(job, lane, first).err()?;
        wire.in_flight.fetch_sub(1, Ordering::SeqCst);
        let msg = format!(
            "the agent is busy: {waiting} requests are already waiting for a worker; retry shortly"
        );
        if let Some(held) = self.rate.allow() {
            warn!(self.log, "request refused"; "conn" => conn, "method" => self.methods.path(job.method),
                  "code" => "RESOURCE_EXHAUSTED", "error" => &msg, "lines_held_back" => held);
        }
        Some(dispatch::status(
            crust_protocols::ttrpc::Code::RESOURCE_EXHAUSTED,
            &msg,
        ))
    }
}

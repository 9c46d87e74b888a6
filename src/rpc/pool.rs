//! A fixed set of worker threads fed by a bounded queue. Requests the
//! event loop admits wait here, served round-robin by connection; a full
//! queue is refused at once (the loop answers RESOURCE_EXHAUSTED) instead
//! of growing. Quick methods (the service says which: [`LaneRule`]) have
//! their own short queue and workers, so a health check is answered even
//! while every regular worker waits for a disk; inline ones never come here.
//!
//! [`LaneRule`]: super::table::LaneRule

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::thread::Thread;

use crust_protocols::sync::LockExt;

use super::dispatch::Job;
use super::table::Lane;

/// Jobs of one lane, taken round-robin by connection: a client's request
/// waits behind at most one of each other client's, however many they sent.
#[derive(Default)]
struct Fair {
    /// Connections with jobs waiting, in turn order.
    turn: VecDeque<u64>,
    /// Each such connection's jobs, oldest first.
    jobs: HashMap<u64, VecDeque<Job>>,
    /// Jobs waiting in all.
    len: usize,
}

impl Fair {
    fn push(&mut self, job: Job) {
        let q = self.jobs.entry(job.conn).or_default();
        if q.is_empty() {
            self.turn.push_back(job.conn);
        }
        q.push_back(job);
        self.len += 1;
    }

    fn pop(&mut self) -> Option<Job> {
        let conn = self.turn.pop_front()?;
        let q = self.jobs.get_mut(&conn)?;
        let job = q.pop_front()?;
        if q.is_empty() {
            self.jobs.remove(&conn);
        } else {
            self.turn.push_back(conn);
        }
        self.len -= 1;
        Some(job)
    }

    fn clear(&mut self) {
        self.turn.clear();
        self.jobs.clear();
        self.len = 0;
    }
}

#[derive(Default)]
struct Lanes {
    regular: Fair,
    quick: Fair,
    closed: bool,
    /// Idle regular workers, the most recently idle last.
    idle_regular: Vec<Thread>,
    /// Idle quick workers, the most recently idle last.
    idle_quick: Vec<Thread>,
}

/// The bounded queue between the event loop and the workers. A job wakes
/// the worker that went idle last: the few that are needed stay warm (their
/// stacks, caches and allocator arenas), the rest stay asleep.
pub(crate) struct Queue {
    lanes: Mutex<Lanes>,
    /// The most regular jobs waiting (beyond each connection's first).
    regular_cap: usize,
    /// The most quick jobs waiting (beyond each connection's first).
    quick_cap: usize,
}

impl Queue {
    pub(crate) fn new(regular_cap: usize, quick_cap: usize) -> Queue {
        Queue {
            lanes: Mutex::new(Lanes::default()),
            regular_cap,
            quick_cap,
        }
    }

    /// Queues `job`, or gives it back with the number waiting in its lane
    /// when that lane is full (or the queue closed). A connection's `first`
    /// request (none of its others in flight) is always taken: so many
    /// clients flooding cannot lock out one that sends a request at a time,
    /// and the excess is bounded by the number of connections.
    pub(crate) fn push(&self, job: Job, lane: Lane, first: bool) -> Result<(), (Box<Job>, usize)> {
        let mut l = self.lanes.locked();
        if l.closed {
            return Err((Box::new(job), 0));
        }
        let (fair, cap) = match lane {
            Lane::Regular => (&mut l.regular, self.regular_cap),
            // An inline job queued (no loop to run it) is a quick one.
            Lane::Quick | Lane::Inline => (&mut l.quick, self.quick_cap),
        };
        if fair.len >= cap && !first {
            let n = fair.len;
            return Err((Box::new(job), n));
        }
        fair.push(job);
        // Any worker takes quick jobs; regular ones only regular workers.
        let waker = match lane {
            Lane::Regular => l.idle_regular.pop(),
            Lane::Quick | Lane::Inline => l.idle_quick.pop().or_else(|| l.idle_regular.pop()),
        };
        drop(l);
        if let Some(t) = waker {
            t.unpark();
        }
        Ok(())
    }

    /// The next job for a worker of `lane`; `None` once the queue is closed.
    pub(crate) fn pop(&self, lane: Lane) -> Option<Job> {
        let me = std::thread::current();
        loop {
            let mut l = self.lanes.locked();
            // Woken by a push (which took us off the idle list) or spuriously.
            l.idle_regular.retain(|t| t.id() != me.id());
            l.idle_quick.retain(|t| t.id() != me.id());
            if l.closed {
                return None;
            }
            if let Some(j) = l.quick.pop() {
                return Some(j);
            }
            if lane == Lane::Regular {
                if let Some(j) = l.regular.pop() {
                    return Some(j);
                }
            }
            match lane {
                Lane::Regular => l.idle_regular.push(me.clone()),
                Lane::Quick | Lane::Inline => l.idle_quick.push(me.clone()),
            }
            drop(l);
            std::thread::park();
        }
    }

    /// Drops what waits and wakes every worker to exit.
    pub(crate) fn close(&self) {
        let mut l = self.lanes.locked();
        l.closed = true;
        l.regular.clear();
        l.quick.clear();
        let mut idle = std::mem::take(&mut l.idle_regular);
        idle.append(&mut l.idle_quick);
        drop(l);
        for t in idle {
            t.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn job(conn: u64, stream: u32) -> Job {
        let (_tx, gone) = crossbeam_channel::unbounded();
        Job {
            conn,
            fd: -1,
            stream,
            method: 0,
            req: Default::default(),
            gone,
            wire: crate::rpc::wire::test_wire(),
        }
    }

    #[test]
    fn full_lanes_refuse_but_a_connections_first_request_gets_in() {
        let q = Queue::new(2, 1);
        q.push(job(1, 1), Lane::Regular, true).ok().unwrap();
        q.push(job(1, 3), Lane::Regular, false).ok().unwrap();
        let (back, waiting) = q.push(job(1, 5), Lane::Regular, false).err().unwrap();
        assert_eq!((back.stream, waiting), (5, 2));
        // Another client's only request is taken even so.
        q.push(job(2, 1), Lane::Regular, true).ok().unwrap();
        q.push(job(3, 7), Lane::Quick, true).ok().unwrap();
        assert!(q.push(job(3, 9), Lane::Quick, false).is_err());
        // Quick first; then regular, one per connection in turn.
        assert_eq!(q.pop(Lane::Regular).unwrap().conn, 3);
        let order: Vec<(u64, u32)> = (0..3)
            .map(|_| q.pop(Lane::Regular).map(|j| (j.conn, j.stream)).unwrap())
            .collect();
        assert_eq!(order, vec![(1, 1), (2, 1), (1, 3)]);
    }

    #[test]
    fn a_flooding_connection_takes_its_turn_like_any_other() {
        let q = Queue::new(1000, 10);
        for s in 0..100 {
            q.push(job(1, 2 * s + 1), Lane::Regular, s == 0)
                .ok()
                .unwrap();
        }
        q.push(job(2, 1), Lane::Regular, true).ok().unwrap();
        assert_eq!(q.pop(Lane::Regular).unwrap().conn, 1);
        assert_eq!(q.pop(Lane::Regular).unwrap().conn, 2, "second, not 101st");
    }

    #[test]
    fn waiting_workers_wake_for_their_lane_and_at_close() {
        let q = Arc::new(Queue::new(4, 4));
        let (q1, q2) = (q.clone(), q.clone());
        let quick = std::thread::spawn(move || q1.pop(Lane::Quick).map(|j| j.stream));
        let regular = std::thread::spawn(move || q2.pop(Lane::Regular).map(|j| j.stream));
        std::thread::sleep(Duration::from_millis(50));
        q.push(job(1, 1), Lane::Regular, true).ok().unwrap();
        assert_eq!(regular.join().unwrap(), Some(1));
        q.close();
        assert_eq!(quick.join().unwrap(), None);
        assert!(q.push(job(1, 3), Lane::Quick, true).is_err());
    }
}

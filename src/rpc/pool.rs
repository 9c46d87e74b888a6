//! A fixed set of worker threads fed by a bounded queue. Requests the
//! event loop admits wait here; a full queue is refused at once (the loop
//! answers RESOURCE_EXHAUSTED) instead of growing. Quick, lock-free methods
//! (capabilities, agent info, the volume list) have their own short queue
//! and workers, so a health check is answered even while every regular
//! worker waits for a disk.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};

use super::dispatch::Job;

/// Whether a request goes to the quick lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Any worker.
    Regular,
    /// Methods that answer from memory without waiting.
    Quick,
}

/// The methods that take the quick lane.
const QUICK: [&str; 3] = [
    "/crust.v1.Agent/GetCapabilities",
    "/crust.v1.Agent/GetAgentInfo",
    "/crust.v1.Agent/ListVolumes",
];

impl Lane {
    /// The lane of a method path.
    pub(crate) fn of(path: &str) -> Lane {
        if QUICK.contains(&path) {
            Lane::Quick
        } else {
            Lane::Regular
        }
    }
}

#[derive(Default)]
struct Lanes {
    regular: VecDeque<Job>,
    quick: VecDeque<Job>,
    closed: bool,
}

/// The bounded queue between the event loop and the workers.
pub(crate) struct Queue {
    lanes: Mutex<Lanes>,
    /// Regular workers wait here (they also take quick jobs).
    any: Condvar,
    /// Quick workers wait here.
    quick: Condvar,
    /// The most regular jobs waiting.
    regular_cap: usize,
    /// The most quick jobs waiting.
    quick_cap: usize,
}

impl Queue {
    pub(crate) fn new(regular_cap: usize, quick_cap: usize) -> Queue {
        Queue {
            lanes: Mutex::new(Lanes::default()),
            any: Condvar::new(),
            quick: Condvar::new(),
            regular_cap,
            quick_cap,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lanes> {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job`, or gives it back with the number waiting in its lane
    /// when that lane is full (or the queue closed).
    pub(crate) fn push(&self, job: Job, lane: Lane) -> Result<(), (Box<Job>, usize)> {
        let mut l = self.lock();
        if l.closed {
            return Err((Box::new(job), 0));
        }
        match lane {
            Lane::Regular if l.regular.len() >= self.regular_cap => {
                let n = l.regular.len();
                Err((Box::new(job), n))
            }
            Lane::Quick if l.quick.len() >= self.quick_cap => {
                let n = l.quick.len();
                Err((Box::new(job), n))
            }
            Lane::Regular => {
                l.regular.push_back(job);
                drop(l);
                self.any.notify_one();
                Ok(())
            }
            Lane::Quick => {
                l.quick.push_back(job);
                drop(l);
                // Whichever kind of worker is free first takes it.
                self.quick.notify_one();
                self.any.notify_one();
                Ok(())
            }
        }
    }

    /// The next job for a worker of `lane`; `None` once the queue is closed.
    pub(crate) fn pop(&self, lane: Lane) -> Option<Job> {
        let mut l = self.lock();
        loop {
            if l.closed {
                return None;
            }
            if let Some(j) = l.quick.pop_front() {
                return Some(j);
            }
            if lane == Lane::Regular {
                if let Some(j) = l.regular.pop_front() {
                    return Some(j);
                }
            }
            let cv = match lane {
                Lane::Regular => &self.any,
                Lane::Quick => &self.quick,
            };
            l = cv.wait(l).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Drops what waits and wakes every worker to exit.
    pub(crate) fn close(&self) {
        let mut l = self.lock();
        l.closed = true;
        l.regular.clear();
        l.quick.clear();
        drop(l);
        self.any.notify_all();
        self.quick.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn job(stream: u32) -> Job {
        let (_tx, gone) = crossbeam_channel::unbounded();
        Job {
            conn: 1,
            fd: -1,
            stream,
            path: String::new(),
            req: Default::default(),
            gone,
        }
    }

    #[test]
    fn lanes_of_methods() {
        assert_eq!(Lane::of("/crust.v1.Agent/GetAgentInfo"), Lane::Quick);
        assert_eq!(Lane::of("/crust.v1.Agent/PublishVolume"), Lane::Regular);
        assert_eq!(Lane::of("/other.Svc/GetAgentInfo"), Lane::Regular);
    }

    #[test]
    fn full_lanes_refuse_and_the_other_lane_still_takes() {
        let q = Queue::new(2, 1);
        q.push(job(1), Lane::Regular).ok().unwrap();
        q.push(job(3), Lane::Regular).ok().unwrap();
        let (back, waiting) = q.push(job(5), Lane::Regular).err().unwrap();
        assert_eq!((back.stream, waiting), (5, 2));
        q.push(job(7), Lane::Quick).ok().unwrap();
        assert!(q.push(job(9), Lane::Quick).is_err());
        // Quick first, then regular in order; a quick worker never takes regular work.
        assert_eq!(q.pop(Lane::Regular).unwrap().stream, 7);
        assert_eq!(q.pop(Lane::Regular).unwrap().stream, 1);
        q.push(job(11), Lane::Regular).ok().unwrap();
        assert_eq!(q.pop(Lane::Regular).unwrap().stream, 3);
    }

    #[test]
    fn waiting_workers_wake_for_their_lane_and_at_close() {
        let q = Arc::new(Queue::new(4, 4));
        let (q1, q2) = (q.clone(), q.clone());
        let quick = std::thread::spawn(move || q1.pop(Lane::Quick).map(|j| j.stream));
        let regular = std::thread::spawn(move || q2.pop(Lane::Regular).map(|j| j.stream));
        std::thread::sleep(Duration::from_millis(50));
        q.push(job(1), Lane::Regular).ok().unwrap();
        assert_eq!(regular.join().unwrap(), Some(1));
        q.close();
        assert_eq!(quick.join().unwrap(), None);
        assert!(q.push(job(3), Lane::Quick).is_err());
    }
}

//! The calls in flight. Each call's work runs on a blocking thread of its
//! own, detached from its caller: when kubelet gives up (its deadline, a
//! disconnect), the work goes on to its end, bounded by its own deadlines
//! (it plugs nothing once the caller's deadline has passed), and the same
//! call made again while it runs joins it instead of starting it twice.
//! Two callers waiting at once for the same call each run it in turn (every
//! call is idempotent); a retry after its caller left joins.
//!
//! A call is any [`Call`]: its type says its method and what it answers,
//! so a caller is handed its own call's answer and no other (the calls
//! themselves are `methods`'). Calls of one type join when they are equal.
//!
//! An answer nobody takes is not always harmless: a freeze's is a lease
//! whose id only its caller would hold. So the work and the last caller to
//! leave settle, once, whether the answer was taken; one that was not (the
//! caller gave up or went away before it came) is handed back to crustd,
//! which ends the group at once ([`Call::unclaimed`]).
//!
//! What one sandbox can hold is bounded: at most [`PER_SANDBOX`] calls of a
//! sandbox run at once (a hung guest ties up that many threads and no
//! more); the next ones wait for a free slot until their deadline, then
//! answer RESOURCE_EXHAUSTED. The whole node runs at most [`IN_FLIGHT`].

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::hash::Hash;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::sync::LockExt;
use tokio::sync::{watch, Semaphore};

use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::volumes::Crustd;

/// The most calls of one sandbox that run at once.
pub const PER_SANDBOX: usize = 16;
/// The most calls that run at once on the node.
pub const IN_FLIGHT: usize = 1024;
/// How long before the caller's deadline its wait ends, so that the caller
/// hears crustd's answer (DEADLINE_EXCEEDED, saying the call goes on)
/// rather than tonic's own "Timeout expired", whose clock started a moment
/// earlier, when the request arrived.
const GRACE: Duration = Duration::from_millis(25);

/// One call, by everything that makes it itself: equal calls join.
pub trait Call: Clone + Eq + Hash + Send + Sync + 'static {
    /// The CRUST method, for messages and the log.
    const METHOD: &'static str;
    /// What it answers.
    type Answer: Clone + Send + Sync + 'static;
    /// The sandbox whose slots it takes.
    fn sandbox(&self) -> &str;
    /// What its log line names: the sandbox and the host volume.
    fn subject(&self) -> (&str, &str);
    /// The freeze group its log line names ("" for none), given its answer
    /// when there is one.
    fn group<'a>(&'a self, answer: Option<&'a Self::Answer>) -> &'a str {
        let _ = answer;
        ""
    }
    /// Does the work, on a blocking thread.
    fn run(&self, crustd: &Arc<Crustd>, deadline: &Deadline) -> Result<Self::Answer>;
    /// `answer`, this call's, was taken by no caller (runs on the call's
    /// thread or a caller's): nothing to do unless it hands out what only
    /// its caller would hold.
    fn unclaimed(crustd: &Arc<Crustd>, answer: &Self::Answer) {
        let _ = (crustd, answer);
    }
}

type Outcome<A> = Option<Result<A>>;

/// Whether a call's answer was taken: not yet.
const PENDING: u8 = 0;
/// By a caller.
const TAKEN: u8 = 1;
/// By nobody: its callers had left when it came.
const UNCLAIMED: u8 = 2;

/// One call at work, answering `A`.
struct Running<A> {
    /// Its deadline, extended by a joining retry, and how many callers wait
    /// for it now (none: it outlived them, and the same call joins it).
    deadline: Deadline,
    /// Its answer, once there.
    done: watch::Receiver<Outcome<A>>,
    /// Set once the answer is there.
    answered: AtomicBool,
    /// PENDING, TAKEN or UNCLAIMED: settled once, by whoever comes first.
    claim: AtomicU8,
}

impl<A> Running<A> {
    /// Settles that nobody took the answer; true for the one that settles it.
    fn unclaimed(&self) -> bool {
        self.claim
            .compare_exchange(PENDING, UNCLAIMED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
}

/// A caller's wait; when it ends (answered, or dropped by a caller that
/// gave up or went away), the call has one caller fewer, and the last one
/// to leave an answer it did not take hands it back.
struct Waiting<C: Call> {
    running: Arc<Running<C::Answer>>,
    crustd: Arc<Crustd>,
}

impl<C: Call> Drop for Waiting<C> {
    fn drop(&mut self) {
        let r = &self.running;
        if r.deadline.leave() == 0 && r.answered.load(Ordering::SeqCst) && r.unclaimed() {
            if let Some(Ok(answer)) = r.done.borrow().as_ref() {
                C::unclaimed(&self.crustd, answer);
            }
        }
    }
}

/// The calls of one type at work, by the call.
type Table<C> = HashMap<C, Arc<Running<<C as Call>::Answer>>>;

/// A [`Table`] of any type of call.
trait AnyTable: Any + Send {
    fn len(&self) -> usize;
    fn as_any(&mut self) -> &mut dyn Any;
}

impl<C: Call> AnyTable for Table<C> {
    fn len(&self) -> usize {
        HashMap::len(self)
    }

    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
}

/// The calls at work: a table for each type of call.
#[derive(Default)]
struct Tables(HashMap<TypeId, Box<dyn AnyTable>>);

impl Tables {
    /// The table of the calls of type `C`.
    fn of<C: Call>(&mut self) -> &mut Table<C> {
        let t = self
            .0
            .entry(TypeId::of::<C>())
            .or_insert_with(|| Box::new(Table::<C>::new()));
        match t.as_any().downcast_mut() {
            Some(t) => t,
            None => unreachable!("each table is filed under its own type of call"),
        }
    }

    /// How many calls are at work.
    fn len(&self) -> usize {
        self.0.values().map(|t| t.len()).sum()
    }
}

/// The calls in flight; see the module doc.
pub struct Calls {
    crustd: Arc<Crustd>,
    running: Mutex<Tables>,
    sandboxes: Mutex<HashMap<String, Arc<Semaphore>>>,
    node: Arc<Semaphore>,
    per_sandbox: usize,
}

impl Calls {
    pub fn new(crustd: Arc<Crustd>) -> Calls {
        Calls::with_bounds(crustd, PER_SANDBOX, IN_FLIGHT)
    }

    /// With other bounds (for tests).
    pub fn with_bounds(crustd: Arc<Crustd>, per_sandbox: usize, node: usize) -> Calls {
        Calls {
            crustd,
            running: Mutex::default(),
            sandboxes: Mutex::default(),
            node: Arc::new(Semaphore::new(node)),
            per_sandbox,
        }
    }

    pub fn crustd(&self) -> &Arc<Crustd> {
        &self.crustd
    }

    /// How many calls are at work, and how many sandboxes have one (a bound tests check).
    pub fn in_flight(&self) -> (usize, usize) {
        (self.running.locked().len(), self.sandboxes.locked().len())
    }

    /// Makes call `what` for a caller whose deadline is `at` (none: crustd's
    /// own bounds), joining the same call if one outlived its caller.
    pub async fn call<C: Call>(
        self: &Arc<Self>,
        what: C,
        at: Option<Instant>,
    ) -> Result<C::Answer> {
        let running = match self.join(&what, at) {
            Some(r) => r,
            None => self.start(what.clone(), at).await?,
        };
        let waiting = Waiting::<C> {
            running,
            crustd: self.crustd.clone(),
        };
        let mut done = waiting.running.done.clone();
        let answered = done.wait_for(Option::is_some);
        let out = match at {
            Some(d) => {
                match tokio::time::timeout_at(d.checked_sub(GRACE).unwrap_or(d).into(), answered)
                    .await
                {
                    Ok(r) => r.map(|v| v.clone()),
                    Err(_) => return Err(Error::StillAtWork { method: C::METHOD }),
                }
            }
            None => answered.await.map(|v| v.clone()),
        };
        match out {
            Ok(Some(r)) => {
                // Taken, so the last caller leaving hands nothing back.
                let _ = waiting.running.claim.compare_exchange(
                    PENDING,
                    TAKEN,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                r
            }
            _ => Err(Error::NoAnswer { method: C::METHOD }),
        }
    }

    /// The same call at work with no caller left, now the caller's.
    fn join<C: Call>(&self, what: &C, at: Option<Instant>) -> Option<Arc<Running<C::Answer>>> {
        let mut tables = self.running.locked();
        let r = tables.of::<C>().get(what)?;
        if !r.deadline.rejoin() {
            return None;
        }
        r.deadline.extend(at);
        Some(r.clone())
    }

    /// Starts `what` once its sandbox and the node have a free slot.
    async fn start<C: Call>(
        self: &Arc<Self>,
        what: C,
        at: Option<Instant>,
    ) -> Result<Arc<Running<C::Answer>>> {
        let wait = self.crustd.config().wait_timeout;
        let until = at.unwrap_or_else(|| crate::locks::after(wait));
        let sem = self.semaphore(what.sandbox());
        let permits = tokio::time::timeout_at(until.into(), async {
            let s = sem.clone().acquire_owned().await;
            let n = self.node.clone().acquire_owned().await;
            (s, n)
        })
        .await;
        let Ok((Ok(sandbox), Ok(node))) = permits else {
            self.prune(what.sandbox());
            return Err(Error::NoTurn {
                sandbox: what.sandbox().to_string(),
                per_sandbox: self.per_sandbox,
                node: IN_FLIGHT,
                method: C::METHOD,
            });
        };
        let (tx, rx) = watch::channel(None);
        let running = Arc::new(Running {
            deadline: Deadline::new(at),
            done: rx,
            answered: AtomicBool::new(false),
            claim: AtomicU8::new(PENDING),
        });
        self.running
            .locked()
            .of::<C>()
            .insert(what.clone(), running.clone());
        let me = self.clone();
        let r = running.clone();
        // The work is detached: no one awaits this handle, the answer goes by `tx`.
        drop(tokio::task::spawn_blocking(move || {
            let out =
                std::panic::catch_unwind(AssertUnwindSafe(|| what.run(&me.crustd, &r.deadline)))
                    .unwrap_or_else(|_| Err(Error::Panicked { method: C::METHOD }));
            // Out of the map before anyone hears the answer: a caller that
            // has it and makes the same call again must start it afresh,
            // not join this one and be handed its old answer (a retry after
            // the state changed, e.g. a sandbox.json written back, got the
            // answer from before).
            me.forget_running(&what, &r);
            let _ = tx.send(Some(out.clone()));
            r.answered.store(true, Ordering::SeqCst);
            if !r.deadline.attended() && r.unclaimed() {
                if let Ok(answer) = &out {
                    C::unclaimed(&me.crustd, answer);
                }
            }
            drop((sandbox, node));
            me.prune(what.sandbox());
        }));
        Ok(running)
    }

    /// After a call's work, before its answer is sent: its entry goes, so
    /// no call joins it once it has answered.
    fn forget_running<C: Call>(&self, what: &C, r: &Arc<Running<C::Answer>>) {
        let mut tables = self.running.locked();
        let map = tables.of::<C>();
        if map.get(what).is_some_and(|x| Arc::ptr_eq(x, r)) {
            map.remove(what);
        }
    }

    /// The slots of `sandbox`.
    fn semaphore(&self, sandbox: &str) -> Arc<Semaphore> {
        self.sandboxes
            .locked()
            .entry(sandbox.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_sandbox)))
            .clone()
    }

    /// Forgets the slots of `sandbox` when none is taken or waited for.
    fn prune(&self, sandbox: &str) {
        let mut m = self.sandboxes.locked();
        let idle = m.get(sandbox).is_some_and(|s| {
            Arc::strong_count(s) == 1 && s.available_permits() == self.per_sandbox
        });
        if idle {
            m.remove(sandbox);
        }
    }
}

/// How long a test waits for something that should happen at once.
#[cfg(test)]
const SOON: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;
    use crate::volumes::Config;

    fn calls(per_sandbox: usize) -> (tempfile::TempDir, Arc<Calls>) {
        let t = tempfile::tempdir().unwrap();
        let c = Arc::new(Crustd::new(Config::new(t.path())));
        (t, Arc::new(Calls::with_bounds(c, per_sandbox, 8)))
    }

    /// A call of the tests' own: RuntimeGetVolumeStats of a volume.
    #[derive(Clone, PartialEq, Eq, Hash)]
    struct Stats {
        sandbox: String,
        volume: String,
    }

    impl Call for Stats {
        const METHOD: &'static str = "RuntimeGetVolumeStats";
        type Answer = crate::volumes::Stats;

        fn sandbox(&self) -> &str {
            &self.sandbox
        }

        fn subject(&self) -> (&str, &str) {
            (&self.sandbox, &self.volume)
        }

        fn run(&self, c: &Arc<Crustd>, deadline: &Deadline) -> Result<Self::Answer> {
            c.stats(&self.sandbox, &self.volume, deadline)
        }
    }

    fn stats(sandbox: &str) -> Stats {
        Stats {
            sandbox: sandbox.into(),
            volume: "/dev/x".into(),
        }
    }

    /// Another type of call with the same fields.
    #[derive(Clone, PartialEq, Eq, Hash)]
    struct Other(Stats);

    impl Call for Other {
        const METHOD: &'static str = "RuntimeGetVolumeHealth";
        type Answer = ();

        fn sandbox(&self) -> &str {
            self.0.sandbox()
        }

        fn subject(&self) -> (&str, &str) {
            self.0.subject()
        }

        fn run(&self, _: &Arc<Crustd>, _: &Deadline) -> Result<()> {
            Ok(())
        }
    }

    /// Calls join only calls of their own type: equal fields of another
    /// type are another call, whose answer is of another shape.
    #[test]
    fn a_call_finds_only_calls_of_its_own_type() {
        let mut tables = Tables::default();
        let (tx, rx) = watch::channel(None);
        let running = Arc::new(Running {
            deadline: Deadline::new(None),
            done: rx,
            answered: AtomicBool::new(false),
            claim: AtomicU8::new(PENDING),
        });
        tables.of::<Stats>().insert(stats("pod-a"), running);
        assert!(tables.of::<Stats>().contains_key(&stats("pod-a")));
        assert!(!tables.of::<Other>().contains_key(&Other(stats("pod-a"))));
        assert_eq!(tables.len(), 1);
        tables.of::<Stats>().remove(&stats("pod-a"));
        assert_eq!(tables.len(), 0);
        drop(tx);
    }

    #[tokio::test]
    async fn calls_end_and_leave_nothing_behind() {
        let (_t, calls) = calls(2);
        // No such sandbox: NOT_FOUND, and the maps are empty again.
        let e = calls.call(stats("pod-a"), None).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e}");
        let t = Instant::now();
        while calls.in_flight() != (0, 0) {
            assert!(t.elapsed() < SOON, "{:?}", calls.in_flight());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A call that has answered cannot be joined: the same call made again
    /// at once runs afresh: were it joined, an Unpublish made right after
    /// another would be handed the first one's answer, from before the
    /// sandbox's entry was written back.
    #[tokio::test]
    async fn an_answered_call_is_never_joined() {
        let (_t, calls) = calls(2);
        for _ in 0..2000 {
            let e = calls.call(stats("pod-a"), None).await.unwrap_err();
            assert_eq!(e.code(), Code::NotFound, "{e}");
            assert_eq!(calls.in_flight().0, 0, "an answered call is still joinable");
        }
    }

    #[tokio::test]
    async fn a_full_sandbox_refuses_at_the_callers_deadline_and_others_go_on() {
        let (_t, calls) = calls(1);
        let sem = calls.semaphore("pod-hung");
        let held = sem.clone().acquire_owned().await.unwrap();
        let t0 = Instant::now();
        let e = calls
            .call(
                stats("pod-hung"),
                Some(Instant::now() + Duration::from_millis(200)),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        assert!(e.to_string().contains("pod-hung"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        // Another sandbox is not kept waiting.
        let e = calls
            .call(
                stats("pod-b"),
                Some(Instant::now() + Duration::from_secs(5)),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e}");
        drop(held);
    }
}

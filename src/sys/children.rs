//! Children the agent waits for itself, kept from the reaper that collects
//! every other child. As PID 1 the agent reaps whatever the kernel hands it
//! (init.rs); a reaper that waited on any child would take an owned child's
//! exit status, and its owner's wait would fail with ECHILD. So:
//!
//! - an owned child is registered before anyone can see it exit: the
//!   registry's lock is held across the spawn and the registration;
//! - the reaper ([`reap_others`]) looks at each exited child with `WNOWAIT`
//!   under that lock and reaps only those nobody owns; when the first one
//!   it sees is owned, it waits for the owner to reap it and looks again;
//! - an [`Owned`] child leaves the registry only once it is reaped: on drop
//!   it is killed and reaped if its owner did not reap it.
//!
//! This leaf starts no program: its caller's closure does. A [`Cloned`]
//! child (userns.rs's) runs no program at all: it is a raw clone that
//! exits on its own; its owner reaps it the same way.

use std::collections::BTreeSet;
use std::io;
use std::process::{Child, ExitStatus};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The pids of the owned children not yet reaped.
static OWNED: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Signalled whenever a pid leaves [`OWNED`].
static RELEASED: Condvar = Condvar::new();

/// How long a dropped child, killed, may take to die before a thread of its
/// own waits for it (a process in uninterruptible I/O dies only once that
/// I/O ends; the dropping caller does not wait for that).
const KILL_GRACE: Duration = Duration::from_secs(1);

/// The longest the reaper waits for an owner before it looks again.
const OWNER_SLICE: Duration = Duration::from_millis(50);

fn owned() -> MutexGuard<'static, BTreeSet<i32>> {
    // A panic while holding the set leaves it consistent: every change is one insert or remove.
    OWNED.lock().unwrap_or_else(|p| p.into_inner())
}

fn release(pid: i32) {
    owned().remove(&pid);
    RELEASED.notify_all();
}

/// A child its owner waits for; the reaper leaves it alone.
#[derive(Debug)]
pub struct Owned {
    /// None once handed to a thread that waits for it.
    child: Option<Child>,
    pid: i32,
    /// Its exit, once reaped.
    status: Option<ExitStatus>,
}

impl Owned {
    /// Starts a child with `start` (which spawns it) and registers it, with
    /// the registry held so that the reaper cannot take it in between.
    pub fn start(start: impl FnOnce() -> io::Result<Child>) -> io::Result<Owned> {
        let mut set = owned();
        let mut child = start()?;
        let Ok(pid) = i32::try_from(child.id()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other("the kernel gave a child a pid past i32"));
        };
        set.insert(pid);
        Ok(Owned {
            child: Some(child),
            pid,
            status: None,
        })
    }

    /// Its pid: valid until it is reaped, since the registry keeps it unreaped until then.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The child, for its pipes.
    pub fn child(&mut self) -> &mut Child {
        // Only drop takes the child out.
        self.child
            .as_mut()
            .expect("an owned child is held until dropped")
    }

    /// Its exit, reaping it, if it has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child().try_wait()?;
        }
        Ok(self.status)
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if self.status.is_none() && !kill_and_reap(&mut child) {
            // Still dying after the grace: a thread waits for it and releases
            // it then. Without a thread to spare, it is released unreaped, and
            // the reaper of every other child takes it once it dies.
            let pid = self.pid;
            let waiter = move || {
                let _ = child.wait();
                release(pid);
            };
            if std::thread::Builder::new()
                .name("reap-owned".into())
                .spawn(waiter)
                .is_ok()
            {
                return;
            }
        }
        release(self.pid);
    }
}

/// A child made by a raw clone that runs no program (userns.rs), reaped by
/// its owner ([`Cloned::wait`]) or, dropped unreaped, killed and reaped.
#[derive(Debug)]
pub struct Cloned {
    pid: i32,
}

impl Cloned {
    /// Makes a child with `clone` (which answers its pid) and registers it,
    /// with the registry held so that the reaper cannot take it in between.
    pub fn start(clone: impl FnOnce() -> io::Result<i32>) -> io::Result<Cloned> {
        let mut set = owned();
        let pid = clone()?;
        set.insert(pid);
        Ok(Cloned { pid })
    }

    /// Its pid, valid until it is reaped.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Waits for it to exit (its maker saw to it that it does) and reaps
    /// it: its exit status.
    pub fn wait(self) -> io::Result<i32> {
        let r = reap(self.pid);
        std::mem::forget(self);
        r
    }
}

impl Drop for Cloned {
    fn drop(&mut self) {
        // SAFETY: kill(2) of a pid this process registered and has not
        // reaped: it is still this child's (a zombie keeps its pid).
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        let _ = reap(self.pid);
    }
}

/// Waits for child `pid` (blocking, through EINTR) and releases it: its
/// exit status.
fn reap(pid: i32) -> io::Result<i32> {
    let mut status = 0;
    let r = loop {
        // SAFETY: `status` is a valid int to write; waitpid touches nothing else.
        if unsafe { libc::waitpid(pid, &mut status, libc::__WALL) } >= 0 {
            break Ok(status);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            break Err(e);
        }
    };
    release(pid);
    r
}

/// SIGKILL, then waits up to [`KILL_GRACE`] for the child to die; true once it is reaped.
fn kill_and_reap(child: &mut Child) -> bool {
    let _ = child.kill();
    let until = Instant::now() + KILL_GRACE;
    loop {
        match child.try_wait() {
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => return false,
            Ok(Some(_)) | Err(_) => return true,
        }
    }
}

/// Reaps every exited child that nobody owns, without blocking on a running
/// one; returns once none is left to reap. Call it on SIGCHLD.
pub fn reap_others() {
    let mut set = owned();
    loop {
        let Some(pid) = first_exited() else {
            return;
        };
        if set.contains(&pid) {
            // Its owner reaps it (an owner looks at least every cancel::SLICE).
            set = RELEASED
                .wait_timeout(set, OWNER_SLICE)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        }
        let _ = rustix::process::waitpid(
            Some(rustix::process::Pid::from_raw(pid).expect("waitid answered a pid above 0")),
            rustix::process::WaitOptions::NOHANG,
        );
    }
}

/// The pid of an exited child, left unreaped; None when no child has exited
/// (or there is none). rustix's `waitid` does not give the pid: libc's does.
fn first_exited() -> Option<i32> {
    loop {
        // SAFETY: an all-zero siginfo_t is a valid value of this plain C struct.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid, writable siginfo_t for the call's duration;
        // WNOWAIT leaves the child as it is.
        let r = unsafe {
            libc::waitid(
                libc::P_ALL,
                0,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if r != 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return None;
        }
        // SAFETY: waitid filled a SIGCHLD siginfo (or left it zeroed, pid 0, under WNOHANG).
        let pid = unsafe { info.si_pid() };
        return (pid > 0).then_some(pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_testkit::child::start;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A process's state letter from /proc (`Z` for a zombie), None once it is gone.
    fn state(pid: i32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(") ")?.1.chars().next()
    }

    /// Waits up to 5 s for `pid` to be gone from /proc.
    fn gone(pid: i32) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if state(pid).is_none() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    fn exit_with(code: i32) -> io::Result<Child> {
        start("/bin/sh", &["-c", &format!("exit {code}")])
    }

    /// A raw clone that exits at once (the shape of userns.rs's child,
    /// which runs no program). The child's pid.
    fn clone_exiting(code: i32) -> io::Result<i32> {
        // SAFETY: a fork-like clone (no CLONE_VM, null stack); the child
        // makes one raw syscall, exit_group, and never returns here.
        let r =
            unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_long, 0, 0, 0, 0) };
        if r == 0 {
            // SAFETY: as above.
            unsafe { libc::syscall(libc::SYS_exit_group, code) };
        }
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(i32::try_from(r).expect("a pid fits i32"))
    }

    /// Runs `f` while a thread calls `reap_others` over and over, as the
    /// agent's reaper does at any moment.
    fn beside_a_reaper(f: impl FnOnce()) {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let reaper = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                reap_others();
                std::thread::yield_now();
            }
        });
        f();
        stop.store(true, Ordering::SeqCst);
        reaper.join().unwrap();
    }

    /// The reaper leaves cloned children to their owners too: each owner
    /// reaps its own and reads its status. Alone in a child process, as below.
    #[test]
    fn the_reaper_leaves_cloned_children_to_their_owners() {
        if !crust_testkit::child::is_child() {
            let (ok, out) = crust_testkit::child::rerun::<&str, &str>(&[]);
            assert!(ok, "{out}");
            return;
        }
        beside_a_reaper(|| {
            for i in 0..200 {
                let code = i % 100 + 1;
                let c = Cloned::start(|| clone_exiting(code)).unwrap();
                let pid = c.pid();
                let status = c.wait().expect("the owner reaps its own child");
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == code);
                assert!(!owned().contains(&pid));
            }
            // A dropped one is killed and reaped.
            let c = Cloned::start(|| clone_exiting(3)).unwrap();
            let pid = c.pid();
            drop(c);
            assert!(gone(pid) && !owned().contains(&pid));
        });
    }

    /// A reaper waiting on every child runs beside owners the whole time:
    /// each owner still gets its own child's status, and children nobody
    /// owns are reaped. Alone in a child process: the reaper would take the
    /// children of the tests beside it.
    #[test]
    fn the_reaper_leaves_owned_children_to_their_owners() {
        if !crust_testkit::child::is_child() {
            let (ok, out) = crust_testkit::child::rerun::<&str, &str>(&[]);
            assert!(ok, "{out}");
            return;
        }
        beside_a_reaper(|| {
            let owners: Vec<_> = (0..4)
                .map(|t| {
                    std::thread::spawn(move || {
                        for i in 0..25 {
                            let code = (t * 25 + i) % 100 + 1;
                            let mut c = Owned::start(|| exit_with(code)).unwrap();
                            let status = loop {
                                if let Some(s) =
                                    c.try_wait().expect("the owner reaps its own child")
                                {
                                    break s;
                                }
                                std::thread::sleep(Duration::from_millis(1));
                            };
                            assert_eq!(status.code(), Some(code));
                            let pid = c.pid();
                            drop(c);
                            assert!(!owned().contains(&pid));
                        }
                    })
                })
                .collect();
            // Children nobody owns (their Child dropped unwaited) are reaped.
            let strays: Vec<i32> = (0..10)
                .map(|_| i32::try_from(exit_with(0).unwrap().id()).unwrap())
                .collect();
            for o in owners {
                o.join().unwrap();
            }
            for pid in strays {
                assert!(gone(pid), "pid {pid} left as {:?}", state(pid));
            }
        });
    }

    #[test]
    fn a_dropped_child_is_killed_reaped_and_released() {
        let mut c = Owned::start(|| start("/bin/sh", &["-c", "exec sleep 600"])).unwrap();
        let pid = c.pid();
        assert_eq!(c.try_wait().unwrap(), None);
        assert!(owned().contains(&pid));
        drop(c);
        assert_eq!(state(pid), None, "killed and reaped, no zombie");
        assert!(!owned().contains(&pid));
    }

    #[test]
    fn a_failed_spawn_registers_nothing() {
        let e = Owned::start(|| start("/nonexistent/program", &[])).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}

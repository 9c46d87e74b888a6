//! User namespaces made only to idmap a mount: a namespace's id maps can be
//! written only through a process in it, so one is cloned into a new user
//! namespace, its maps are written from here, the namespace is opened
//! (`/proc/<pid>/ns/user`), and the child is killed and reaped. The fd keeps
//! the namespace; no process is left behind and no program runs.
//!
//! The agent is multi-threaded, so it cannot unshare(CLONE_NEWUSER) itself;
//! a raw clone makes a child that runs nothing but raw syscalls (after a
//! clone in a multi-threaded process only async-signal-safe calls are
//! sound in the child): it waits on a pipe until the parent closes it, then
//! exits. It shares the agent's fd table (CLONE_FILES) so that it holds no
//! extra reference to any file the agent has open (a device another thread
//! is about to remove, say); `children` keeps it from the reaper.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use rustix::pipe::PipeFlags;

use super::children::Cloned;
use crate::model::{IdMap, IdRange};

/// The kernel takes a uid_map or gid_map in one write of less than a page;
/// 4096, the smallest page, holds on every architecture.
pub const MAP_TEXT_MAX: usize = 4096;

/// A map as /proc/<pid>/uid_map takes it: `inside outside length` lines.
pub fn map_text(ranges: &[IdRange]) -> String {
    let mut s = String::new();
    for r in ranges {
        s += &format!("{} {} {}\n", r.container_id, r.host_id, r.length);
    }
    s
}

/// Which step of making a namespace failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// clone(CLONE_NEWUSER) refused: no user namespaces here.
    #[error("clone(CLONE_NEWUSER): {0}")]
    Clone(#[source] io::Error),
    /// Writing a map, or opening the namespace.
    #[error("{call} {path}: {source}")]
    Step {
        call: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Whether the kernel (or a sandbox around the agent) allows no new
    /// user namespace: built without them (EINVAL), a seccomp filter, a
    /// chroot or systemd's RestrictNamespaces= (EPERM), or
    /// user.max_user_namespaces reached (ENOSPC, EUSERS); or no map may be
    /// written (EPERM: no CAP_SETUID or CAP_SETGID; for a map of host id
    /// 0, no CAP_SETFCAP).
    pub fn unavailable(&self) -> bool {
        match self {
            Error::Clone(e) => matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::EPERM | libc::ENOSPC | libc::EUSERS)
            ),
            Error::Step { source, .. } => source.raw_os_error() == Some(libc::EPERM),
        }
    }

    /// The errno, for a refusal that says it.
    pub fn into_io(self) -> io::Error {
        match self {
            Error::Clone(e) => e,
            e @ Error::Step { .. } => io::Error::other(e),
        }
    }
}

/// A new user namespace whose uid and gid maps are `map`'s, as an fd (for
/// mount_setattr's `userns_fd`).
pub fn make(map: &IdMap) -> Result<OwnedFd, Error> {
    // Everything that allocates is done before the clone.
    let uid_map = map_text(&map.uids);
    let gid_map = map_text(&map.gids);
    let step = |call, path: String| move |source| Error::Step { call, path, source };
    let (rd, wr) = rustix::pipe::pipe_with(PipeFlags::CLOEXEC)
        .map_err(|e| step("pipe2", String::new())(e.into()))?;
    let parent = rustix::process::getpid().as_raw_nonzero().get();
    let child = Cloned::start(|| clone_waiting(rd.as_raw_fd(), parent)).map_err(Error::Clone)?;
    let pid = child.pid();
    let result = (|| {
        for (name, text) in [("uid_map", &uid_map), ("gid_map", &gid_map)] {
            let path = format!("/proc/{pid}/{name}");
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(step("open", path.clone()))?;
            // One write: the kernel takes a map whole or not at all.
            let n = f
                .write(text.as_bytes())
                .map_err(step("write", path.clone()))?;
            if n != text.len() {
                return Err(step("write", path)(io::Error::other("a short write")));
            }
        }
        let path = format!("/proc/{pid}/ns/user");
        std::fs::File::open(&path)
            .map(OwnedFd::from)
            .map_err(step("open", path))
    })();
    // EOF on the pipe lets the child exit; dropped, it is killed and
    // reaped too, so one stopped from outside (SIGSTOP, a debugger) ends
    // all the same and the bind never waits on it. Its status says
    // nothing: the namespace is what was made.
    drop(wr);
    drop(child);
    drop(rd);
    result
}

/// Clones a child into a new user namespace, sharing the fd table, that
/// waits until `rd` reads EOF (or its parent dies) and exits. The child's pid.
fn clone_waiting(rd: RawFd, parent: libc::pid_t) -> io::Result<i32> {
    // Every signal blocked across the clone, so no handler of the agent's
    // ever runs in the child (SIGKILL, its death signal, cannot be blocked).
    // SAFETY: an all-zero sigset_t is a valid value of this plain C type.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above: both sets are locals valid for the calls.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    let flags = (libc::CLONE_NEWUSER | libc::CLONE_FILES | libc::SIGCHLD) as libc::c_long;
    // SAFETY: clone without CLONE_VM and a null stack is fork: the child
    // runs on a copy of this stack and memory. It does nothing but
    // `child_waits`, raw syscalls only, and never returns here.
    let r = unsafe { libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) };
    if r == 0 {
        child_waits(rd, parent);
    }
    let err = io::Error::last_os_error();
    // SAFETY: `old` is the mask read above, restored as it was.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
    if r < 0 {
        return Err(err);
    }
    i32::try_from(r).map_err(|_| io::Error::other("clone gave a pid past i32"))
}

/// The child: dies with its parent, waits for EOF on `rd`, exits. Raw
/// syscalls only (the module doc).
fn child_waits(rd: RawFd, parent: libc::pid_t) -> ! {
    // SAFETY: raw syscalls with plain integer arguments, and `b`, a local
    // byte the read may write; nothing here allocates, locks or unwinds.
    unsafe {
        libc::syscall(
            libc::SYS_prctl,
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL,
            0,
            0,
            0,
        );
        if libc::syscall(libc::SYS_getppid) == libc::c_long::from(parent) {
            let mut b = 0u8;
            loop {
                let n = libc::syscall(libc::SYS_read, rd, std::ptr::addr_of_mut!(b), 1);
                if n >= 0 || *libc::__errno_location() != libc::EINTR {
                    break;
                }
            }
        }
        libc::syscall(libc::SYS_exit_group, 0);
    }
    // exit_group does not return.
    #[allow(clippy::empty_loop)]
    loop {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn range(container_id: u32, host_id: u32, length: u32) -> IdRange {
        IdRange {
            container_id,
            host_id,
            length,
        }
    }

    #[test]
    fn maps_are_written_inside_outside_length() {
        let t = map_text(&[range(0, 100000, 65536), range(65536, 5, 1)]);
        assert_eq!(t, "0 100000 65536\n65536 5 1\n");
        assert_eq!(map_text(&[]), "");
    }

    /// What says "no user namespace here" and what is a fault of ours.
    #[test]
    fn which_failures_mean_no_user_namespaces() {
        let errno = io::Error::from_raw_os_error;
        let step = |e| Error::Step {
            call: "write",
            path: "/proc/1/uid_map".into(),
            source: errno(e),
        };
        for e in [libc::EPERM, libc::EINVAL, libc::ENOSPC, libc::EUSERS] {
            assert!(Error::Clone(errno(e)).unavailable(), "{e}");
        }
        assert!(!Error::Clone(errno(libc::ENOMEM)).unavailable());
        assert!(step(libc::EPERM).unavailable(), "no CAP_SETUID");
        assert!(!step(libc::EINVAL).unavailable(), "a map we wrote wrong");
        assert_eq!(
            Error::Clone(errno(libc::EPERM)).into_io().raw_os_error(),
            Some(libc::EPERM)
        );
    }

    /// A namespace is made with the maps asked, and its child is gone.
    /// Alone in a child process: the tests beside it start children.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn makes_a_namespace_and_leaves_no_process() {
        crust_testkit::needs::root();
        if !crust_testkit::child::is_child() {
            let (ok, out) = crust_testkit::child::rerun::<&str, &str>(&[]);
            assert!(ok, "{out}");
            return;
        }
        let map = IdMap {
            uids: vec![range(0, 100000, 65536)],
            gids: vec![range(0, 200000, 1000), range(1000, 300000, 10)],
        };
        let before = children_of_self();
        let ns = make(&map).unwrap();
        assert_eq!(children_of_self(), before, "no child left behind");
        let st = rustix::fs::fstat(ns.as_fd()).unwrap();
        let own = std::fs::metadata("/proc/self/ns/user").unwrap();
        let own = std::os::unix::fs::MetadataExt::ino(&own);
        assert_ne!(st.st_ino, own, "a namespace of its own");
        // The namespace's maps, read through a process that enters it.
        let (uids, gids) = maps_seen_in(&ns);
        assert_eq!(
            uids.split_whitespace().collect::<Vec<_>>(),
            ["0", "100000", "65536"]
        );
        let g: Vec<_> = gids.split_whitespace().collect();
        assert_eq!(g, ["0", "200000", "1000", "1000", "300000", "10"]);
    }

    /// A bad map is the kernel's to refuse: the error names the step, and
    /// still no child is left.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_map_the_kernel_refuses_leaves_no_process() {
        crust_testkit::needs::root();
        if !crust_testkit::child::is_child() {
            let (ok, out) = crust_testkit::child::rerun::<&str, &str>(&[]);
            assert!(ok, "{out}");
            return;
        }
        let before = children_of_self();
        let overlapping = IdMap {
            uids: vec![range(0, 1, 10), range(5, 100, 10)],
            gids: vec![range(0, 1, 1)],
        };
        let e = make(&overlapping).unwrap_err();
        assert!(e.to_string().contains("uid_map"), "{e}");
        assert!(!e.unavailable());
        assert_eq!(children_of_self(), before);
    }

    /// A child stopped from outside (SIGSTOP, as a debugger attaching
    /// does) at any step: each namespace is still made, none waits on the
    /// child, and none is left. Alone in a child process, as above.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_child_stopped_from_outside_holds_up_nothing() {
        use std::sync::atomic::{AtomicBool, Ordering};
        crust_testkit::needs::root();
        if !crust_testkit::child::is_child() {
            let (ok, out) = crust_testkit::child::rerun::<&str, &str>(&[]);
            assert!(ok, "{out}");
            return;
        }
        let map = IdMap {
            uids: vec![range(0, 100000, 65536)],
            gids: vec![range(0, 100000, 65536)],
        };
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let stopper = std::thread::spawn(move || {
            let mut stopped = 0;
            while !s.load(Ordering::SeqCst) {
                for pid in children_of_self() {
                    // SAFETY: kill(2) with plain integers; a pid gone
                    // meanwhile answers ESRCH.
                    stopped +=
                        i32::from(unsafe { libc::kill(pid.parse().unwrap(), libc::SIGSTOP) } == 0);
                }
            }
            stopped
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..100 {
                tx.send(make(&map).map(drop)).unwrap();
            }
        });
        for i in 0..100 {
            let made = rx.recv_timeout(std::time::Duration::from_secs(10));
            assert!(matches!(made, Ok(Ok(()))), "{i}: {made:?}");
        }
        stop.store(true, Ordering::SeqCst);
        assert!(stopper.join().unwrap() > 0, "a child was stopped");
        assert_eq!(children_of_self(), Vec::<String>::new());
    }

    /// The pids of this process's children, from /proc.
    fn children_of_self() -> Vec<String> {
        let me = std::process::id();
        let mut out = Vec::new();
        for t in std::fs::read_dir(format!("/proc/{me}/task"))
            .unwrap()
            .flatten()
        {
            let p = t.path().join("children");
            if let Ok(s) = std::fs::read_to_string(p) {
                out.extend(s.split_whitespace().map(str::to_string));
            }
        }
        out.sort();
        out
    }

    /// uid_map and gid_map of the namespace `ns`, as a process in it reads them.
    fn maps_seen_in(ns: &OwnedFd) -> (String, String) {
        let script = "cat /proc/self/uid_map; echo --; cat /proc/self/gid_map";
        let out =
            crust_testkit::child::output_in_user_namespace(ns.as_fd(), "/bin/sh", &["-c", script]);
        let (u, g) = out.split_once("--").unwrap();
        (u.to_string(), g.to_string())
    }
}

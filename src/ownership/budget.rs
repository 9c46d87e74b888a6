//! What all fsGroup walks of the process share, so that several publishes
//! at once cannot multiply threads or descriptors: the helper threads (each
//! walk takes what is free, maybe none) and the directory descriptors held
//! for pending items (past the budget, a walk finishes subtrees depth first
//! with three descriptors). See "Bounds" in the module doc of `ownership`.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Directory fds that pending items of all walks may keep open together;
/// past it, a subtree with subdirectories is finished by one worker with
/// three fds (see the module doc).
pub const DIR_FD_BUDGET: usize = 256;
/// Workers of one walk per CPU, its caller's thread included.
pub const WORKERS_PER_CPU: usize = 2;
/// Helper threads of all walks together, per CPU.
pub const HELPERS_PER_CPU: usize = 4;
/// Upper bound on one walk's workers, whatever the CPU count.
const MAX_WORKERS: usize = 16;

/// Directory fds kept open for pending items, all walks of the process together.
pub(crate) static HELD_DIRS: AtomicUsize = AtomicUsize::new(0);
/// Helper threads running, all walks of the process together.
pub(crate) static HELPERS: AtomicUsize = AtomicUsize::new(0);

/// How wide and how deep a walk may spread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Workers of this walk, its caller's thread included.
    pub(crate) workers: usize,
    /// Helper threads of all walks together.
    pub(crate) helpers: usize,
    /// See [`DIR_FD_BUDGET`].
    pub(crate) dir_fds: usize,
}

impl Limits {
    pub(crate) fn for_this_machine() -> Limits {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Limits {
            workers: std::env::var("CRUST_WALK_WORKERS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or((WORKERS_PER_CPU * cpus).clamp(1, MAX_WORKERS)),
            helpers: HELPERS_PER_CPU * cpus,
            dir_fds: DIR_FD_BUDGET,
        }
    }
}

/// Helper threads taken from the process-wide allowance; given back on drop.
pub(crate) struct Helpers(pub(crate) usize);

impl Helpers {
    /// Up to `want` helpers, fewer (maybe none) when other walks hold them.
    pub(crate) fn take(want: usize, cap: usize) -> Helpers {
        let mut now = HELPERS.load(Ordering::Relaxed);
        loop {
            let n = want.min(cap.saturating_sub(now));
            if n == 0 {
                return Helpers(0);
            }
            match HELPERS.compare_exchange_weak(now, now + n, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Helpers(n),
                Err(seen) => now = seen,
            }
        }
    }

    /// Gives one back early (its thread could not be started).
    pub(crate) fn give_back_one(&mut self) {
        if self.0 > 0 {
            self.0 -= 1;
            HELPERS.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Helpers {
    fn drop(&mut self) {
        HELPERS.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// A directory kept open while items that need it are pending; the last
/// item done closes it.
pub(crate) struct DirFd {
    pub(crate) fd: OwnedFd,
    /// Levels below the root, for messages.
    pub(crate) depth: u64,
}

impl DirFd {
    pub(crate) fn new(fd: OwnedFd, depth: u64) -> DirFd {
        HELD_DIRS.fetch_add(1, Ordering::Relaxed);
        DirFd { fd, depth }
    }
}

impl Drop for DirFd {
    fn drop(&mut self) {
        HELD_DIRS.fetch_sub(1, Ordering::Relaxed);
    }
}

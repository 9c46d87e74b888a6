//! The fsGroup walk (kubelet's SetVolumeOwnership, done better): every entry
//! of a volume gets the pod's group and group access, in parallel, through
//! `*at()` calls relative to each directory's own fd, never following
//! symlinks and never crossing into other mounts; entries already right are
//! only read. docs/semantics.md §4 has the rules; this says how.
//!
//! # Depth and length do not matter
//!
//! No path is ever handed to the kernel below the root: a subdirectory is
//! opened by its one-component name from its parent's fd, with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)` (so a
//! symlink swapped in is refused, a mount point — another filesystem or a
//! bind of this one — is skipped, and a rename cannot lead a lookup
//! elsewhere), and every entry is changed by name relative to its
//! directory's fd. A tree 100,000 levels deep or with paths far beyond
//! PATH_MAX is walked like any other. Paths appear only in messages, built
//! lossily for display (`/proc/self/fd`).
//!
//! # What a failed or stopped walk leaves behind
//!
//! The entries changed before the walk failed (an unreadable directory, no
//! file descriptor left) or was stopped (the caller's deadline, its
//! disconnect, shutdown) keep their new group and mode: a chown cannot be
//! undone safely (the old owners may have been changed since by someone
//! else, and undoing would mean a second walk that can fail the same way).
//! The walk is idempotent, so a retry completes it and only reads what is
//! already right. Publish undoes the mount of a volume whose walk failed.
//!
//! # Bounds
//!
//! - File descriptors: a directory's fd is closed as soon as its last
//!   pending item (a subdirectory to open, a batch of entries) is done, so a
//!   pure chain of any depth holds O(1) fds. What stays open is the
//!   directories with pending siblings; when all walks of the process hold
//!   `budget::DIR_FD_BUDGET` of them, a worker that lists a directory with
//!   subdirectories finishes that subtree alone, depth first, with at most
//!   three fds (going back up by `..`, checked against the inode it left).
//!   So all walks together hold at most `DIR_FD_BUDGET` + 4 per thread. If
//!   the process runs out of fds anyway (EMFILE/ENFILE), the walk fails with
//!   RESOURCE_EXHAUSTED naming the directory, never skipping silently.
//! - Threads: a walk uses its caller's thread plus up to `budget::WORKERS_PER_CPU`
//!   × CPUs − 1 helpers, and all walks of the process together at most
//!   `budget::HELPERS_PER_CPU` × CPUs helpers: a walk that finds none free runs on
//!   its caller's thread alone, and several publishes at once cannot
//!   multiply threads.
//! - Memory: the names of the directories being worked on and of the
//!   subdirectories waiting their turn, plus, in a subtree walked alone, a
//!   name and an inode number per level.
//!
//! # Speed
//!
//! Per entry the walk does what cannot be avoided — one statx, and a chown
//! and a chmod only when needed — each by a one-component name from the
//! directory's fd (kubelet's calls each resolve the whole path). Entries go
//! in batches of up to 256, in inode order (neighbours share an inode
//! table block), in three passes (statx, chown, chmod); directories are read
//! with a 32 KiB getdents64 buffer (rustix's `Dir` reads ~30 entries a call).
//! What that buys against kubelet's serial walk, why a fresh tree stops at
//! about 2.4x on 2 CPUs, and what else was tried: bench/README.md, "fsGroup".
//!
//! # The files
//!
//! - `rules`: kubelet's rules, pure: the mode an entry should end with, and
//!   when the root is already right.
//! - `entries`: what is done to one entry, by name from its directory's fd
//!   (statx, chown, chmod without following a symlink).
//! - `walk`: the walk itself: who does which directory, the depth-first
//!   fallback past the descriptor budget, progress and cancellation.
//! - `budget`: what all walks of the process share: helper threads and
//!   directory descriptors.
//! - `mounts`: the mount points a walk did not enter, counted and named
//!   (bounded) for its report.
//! - `error`: what stops a walk.

pub mod budget;
pub mod entries;
pub mod error;
pub mod mounts;
pub mod rules;
pub mod walk;

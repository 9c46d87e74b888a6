//! One agent per root. The root is made private (0700, whatever the umask
//! the agent was started with), and its state directory is locked with
//! `flock(2)` for the life of the process: a second agent given the same
//! root would otherwise take the first one's volumes back as its own and,
//! finding them "left over", unpublish them under it.
//!
//! The lock is taken before the volume table is opened, so a refused agent
//! has read, mounted and removed nothing. It is released by the kernel when
//! the process ends, however it ends (kill -9 included), so there is never
//! a stale lock to clean up.

use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;

/// The mode of the root and of every directory the agent creates on the way
/// to it: only root may look inside.
pub const ROOT_MODE: u32 = 0o700;
use crate::validate::STATE_DIR;

/// Why the root could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another process holds the root's lock.
    #[error("another crust-agent is serving the root {root} (it holds the lock on {state}): stop it first, or give this agent another --root")]
    Busy {
        /// The root as given.
        root: PathBuf,
        /// The locked directory.
        state: PathBuf,
    },
    /// A syscall failed on the way.
    #[error("cannot take the root {path}: {call} failed: {source}")]
    Sys {
        /// The syscall.
        call: &'static str,
        /// The path it was applied to.
        path: PathBuf,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
}

fn sys(call: &'static str, path: &Path) -> impl FnOnce(Errno) -> Error {
    let path = path.to_path_buf();
    move |e| Error::Sys {
        call,
        path,
        source: e.into(),
    }
}

/// The lock on a root, held until dropped (or the process ends).
#[derive(Debug)]
pub struct RootLock {
    _state: OwnedFd,
}

/// Creates `root` (and any missing parent) with mode [`ROOT_MODE`], creates
/// its state directory (0700) if missing, and locks it. Fails with
/// [`Error::Busy`] while another process holds the lock; never waits.
pub fn lock_root(root: &Path) -> Result<RootLock, Error> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(ROOT_MODE)
        .create(root)
        .map_err(|e| Error::Sys {
            call: "mkdir",
            path: root.to_path_buf(),
            source: e,
        })?;
    // The root itself may be reached through a symlink (/var/run → /run), as
    // the volume table allows; nothing beneath it may.
    let dir = rustix::fs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("open", root))?;
    let state_path = root.join(STATE_DIR);
    match rustix::fs::mkdirat(&dir, STATE_DIR, Mode::from_raw_mode(ROOT_MODE)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(sys("mkdir", &state_path)(e)),
    }
    let state = rustix::fs::openat(
        &dir,
        STATE_DIR,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("open", &state_path))?;
    match rustix::fs::flock(&state, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(RootLock { _state: state }),
        Err(Errno::WOULDBLOCK) => Err(Error::Busy {
            root: root.to_path_buf(),
            state: state_path,
        }),
        Err(e) => Err(sys("flock", &state_path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn the_root_is_private_and_locked_once() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("a/b/root");
        let lock = lock_root(&root).unwrap();
        // Whatever the umask of the test (the agent's own is 077 besides):
        // the mode is given, and a umask only takes bits away.
        for p in [d.path().join("a"), d.path().join("a/b"), root.clone()] {
            assert_eq!(mode(&p) & 0o077, 0, "{}", p.display());
        }
        assert_eq!(mode(&root.join(STATE_DIR)) & 0o077, 0);
        // A second lock (another open file description, as another process
        // would have) is refused at once, naming the root.
        let e = lock_root(&root).unwrap_err();
        assert!(matches!(e, Error::Busy { .. }), "{e}");
        assert!(e.to_string().contains(&*root.to_string_lossy()), "{e}");
        drop(lock);
        let again = lock_root(&root).expect("free once the holder is gone");
        drop(again);
    }

    #[test]
    fn a_symlink_as_the_state_directory_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::fs::create_dir(d.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(d.path().join("elsewhere"), root.join(STATE_DIR)).unwrap();
        let e = lock_root(&root).unwrap_err();
        assert!(matches!(e, Error::Sys { call: "open", .. }), "{e}");
    }
}

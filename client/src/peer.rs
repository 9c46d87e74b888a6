//! Who is at the other end of a Unix socket, and connecting to a socket a
//! caller has already found and judged. A socket's path names whatever is
//! there when it is looked up; a caller that must know which process it
//! talks to opens the socket file itself (`O_PATH`), judges that file,
//! connects through the descriptor, and asks the kernel who listens.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

/// The process id of the peer of the connected Unix socket `fd`, as the
/// kernel recorded it (`SO_PEERCRED`): for a client, the process that called
/// `listen()` on the server's socket. 0 when that process is outside this
/// process's pid namespace.
pub fn peer_pid(fd: BorrowedFd<'_>) -> io::Result<u32> {
    // rustix's `socket_peercred` holds the pid in a non-zero type, and the
    // kernel answers 0 for a peer in another pid namespace: read it raw.
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::ucred>())
        .map_err(|_| io::Error::other("struct ucred does not fit a socklen_t"))?;
    // SAFETY: `fd` is a descriptor borrowed for the call; `cred` is a live,
    // writable `ucred` and `len` says its size, which is what SO_PEERCRED
    // writes; the kernel writes at most `len` bytes and updates `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u32::try_from(cred.pid).unwrap_or(0))
}

/// Who listens at the other end of a connected Unix socket: its pid, and a
/// handle on its process (a pidfd) that says whether it still lives. A pid
/// is only a number: once its process has exited and been reaped, the next
/// process may get it, and `/proc/<pid>` then shows that one. A process
/// that lives keeps its pid, so what `/proc/<pid>` showed before
/// [`Peer::lives`] answers true was that process's.
#[derive(Debug)]
pub struct Peer {
    /// The process that called `listen()` ([`peer_pid`]); 0 when it is
    /// outside this process's pid namespace.
    pub pid: u32,
    /// The handle on it.
    held: Held,
}

/// How a [`Peer`]'s process is held.
#[derive(Debug)]
enum Held {
    /// A pidfd of the very process that listened (`SO_PEERPIDFD`, Linux 6.5
    /// and later), whatever happened to its pid since.
    Exact(OwnedFd),
    /// On a kernel without `SO_PEERPIDFD`: a pidfd of whichever process had
    /// the pid just after the connect (`pidfd_open`). The listener's, unless
    /// it had exited and its pid was taken before then.
    ByPid(OwnedFd),
    /// The kernel has no live process for it: the process that listened has
    /// exited (its socket lives on in another that shares it).
    Exited,
    /// Outside this pid namespace, on a kernel without `SO_PEERPIDFD`: no
    /// handle at all.
    Unseen,
}

/// `SO_PEERPIDFD` (include/uapi/asm-generic/socket.h; sparc numbers its
/// own). The libc crate has it only in its new Linux tree.
#[cfg(not(target_arch = "sparc64"))]
const SO_PEERPIDFD: libc::c_int = 77;
#[cfg(target_arch = "sparc64")]
const SO_PEERPIDFD: libc::c_int = 0x56;

impl Peer {
    /// The peer of the connected Unix socket `fd`, asked of the kernel now.
    pub fn of(fd: BorrowedFd<'_>) -> io::Result<Peer> {
        let pid = peer_pid(fd)?;
        let held = match peer_pidfd(fd) {
            Ok(pidfd) => Held::Exact(pidfd),
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => match pid {
                0 => Held::Unseen,
                pid => match pidfd_open(pid) {
                    Ok(pidfd) => Held::ByPid(pidfd),
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Held::Exited,
                    Err(e) => return Err(e),
                },
            },
            // No live task behind the pid the socket holds (before Linux
            // 6.16 the kernel makes no pidfd of a reaped process).
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ESRCH)) => Held::Exited,
            Err(e) => return Err(e),
        };
        Ok(Peer { pid, held })
    }

    /// Whether the process held still lives (has not exited).
    pub fn lives(&self) -> io::Result<bool> {
        match &self.held {
            Held::Exact(fd) | Held::ByPid(fd) => pidfd_lives(fd.as_fd()),
            Held::Exited | Held::Unseen => Ok(false),
        }
    }
}

/// A pidfd of the process that called `listen()` on the peer of the
/// connected Unix socket `fd` (`SO_PEERPIDFD`).
fn peer_pidfd(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut pidfd: libc::c_int = -1;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
        .map_err(|_| io::Error::other("an int does not fit a socklen_t"))?;
    // SAFETY: `fd` is a descriptor borrowed for the call; `pidfd` is a live,
    // writable int and `len` says its size, which is what SO_PEERPIDFD
    // writes; the kernel writes at most `len` bytes and updates `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            std::ptr::addr_of_mut!(pidfd).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    own(pidfd)
}

/// A pidfd of the process that has `pid` now (`pidfd_open`).
fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    let flags: libc::c_uint = 0;
    // SAFETY: pidfd_open takes a pid and flags by value and answers a new
    // descriptor or -1; no memory of this process is passed.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, flags) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(r)
        .map_err(|_| io::Error::other("pidfd_open answered no descriptor"))?;
    own(fd)
}

/// The new descriptor `fd` the kernel just made, owned.
fn own(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::other("the kernel answered no descriptor"));
    }
    // SAFETY: `fd` was just made by the kernel for this call (getsockopt's
    // SO_PEERPIDFD or pidfd_open), so it is open and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process of `pidfd` still lives: a pidfd becomes readable
/// once its process has exited.
fn pidfd_lives(pidfd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `p` is one live, writable pollfd and 1 says so; a zero
        // timeout makes the call return at once.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        if r >= 0 {
            return Ok(p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) == 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Where to connect to the socket `fd` was opened on (`O_PATH`): its
/// `/proc/self/fd` link, which the kernel resolves to that very inode, so no
/// name is looked up again between the caller's checks and the connect.
fn proc_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Connects to the socket `fd` was opened on; `fd` stays open until the
/// connect returns.
pub(crate) fn connect_opened(fd: OwnedFd) -> io::Result<UnixStream> {
    let s = UnixStream::connect(proc_path(&fd));
    drop(fd);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn the_peer_of_a_socket_this_process_serves_is_this_process() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("s.sock");
        let _l = UnixListener::bind(&p).unwrap();
        let s = UnixStream::connect(&p).unwrap();
        assert_eq!(peer_pid(s.as_fd()).unwrap(), std::process::id());
        // Through an O_PATH descriptor of the socket: the same listener.
        let fd = rustix::fs::open(
            &p,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        let s = connect_opened(fd).unwrap();
        assert_eq!(peer_pid(s.as_fd()).unwrap(), std::process::id());
        // Something that is not a socket answers an error, not a pid.
        let f = std::fs::File::create(t.path().join("file")).unwrap();
        assert!(peer_pid(f.as_fd()).is_err());
    }

    /// The process that listened is held, not its pid: its exit is seen on
    /// a connection made before it, and on one made after (its socket
    /// served on by this process).
    #[test]
    fn the_process_that_listened_is_held_and_its_exit_seen() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("s.sock");
        let l = UnixListener::bind(&p).unwrap();
        let me = Peer::of(UnixStream::connect(&p).unwrap().as_fd()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert!(me.lives().unwrap());
        let mut h = crate::qmp::fake::Hypervisor::listening_on(&l, "sandbox-x");
        let before = Peer::of(UnixStream::connect(&p).unwrap().as_fd()).unwrap();
        assert_eq!(before.pid, h.pid());
        assert!(before.lives().unwrap());
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", h.pid())).unwrap();
        assert!(cmdline.ends_with(b"\0-name\0sandbox-x\0"), "{cmdline:?}");
        h.exit();
        assert!(!before.lives().unwrap(), "the held process exited");
        let after = Peer::of(UnixStream::connect(&p).unwrap().as_fd()).unwrap();
        assert_eq!(after.pid, before.pid, "the kernel keeps the listener's pid");
        assert!(!after.lives().unwrap());
    }
}

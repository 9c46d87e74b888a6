//! Who is at the other end of a Unix socket, and connecting to a socket a
//! caller has already found and judged. A socket's path names whatever is
//! there when it is looked up; a caller that must know which process it
//! talks to opens the socket file itself (`O_PATH`), judges that file,
//! connects through the descriptor, and asks the kernel who listens.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
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
    use std::os::fd::AsFd;
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
}

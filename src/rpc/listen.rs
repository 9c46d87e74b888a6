//! Listening sockets for the agent's addresses (`unix:///path`,
//! `vsock://CID:PORT`), made non-blocking for the event loop; who may
//! connect ([`Peers`]: a unix socket's mode, a vsock peer's context id);
//! and the descriptor limit the connections need.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;

use rustix::fs::Mode;
use rustix::io;
use rustix::net::addr::{SocketAddrArg, SocketAddrLen, SocketAddrOpaque};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use rustix::process::{Resource, Rlimit};

/// `vsock://-1:PORT`: any context id.
const VMADDR_CID_ANY: u32 = u32::MAX;
/// The host's context id, seen from a guest.
pub const VMADDR_CID_HOST: u32 = 2;
/// The mode of the agent's unix sockets: only its owner (root) may connect,
/// since whoever connects may unmount every volume and power the guest off.
pub const SOCKET_MODE: u32 = 0o600;
/// Connections waiting to be accepted; the loop accepts them as they come.
const BACKLOG: i32 = 1024;

/// Where the agent listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// A Unix stream socket at this path.
    Unix(PathBuf),
    /// AF_VSOCK on this context id (`u32::MAX` for any) and port.
    Vsock {
        /// The context id, or `u32::MAX` (written `-1`) for any.
        cid: u32,
        port: u32,
    },
}

impl Address {
    /// Parses `unix:///absolute/path` or `vsock://CID:PORT` (CID may be `-1`).
    pub fn parse(addr: &str) -> Result<Address, String> {
        let bad =
            || format!("listen address {addr:?} is not unix:///absolute/path or vsock://CID:PORT");
        if let Some(p) = addr.strip_prefix("unix://") {
            let p = PathBuf::from(p);
            return if p.is_absolute() {
                Ok(Address::Unix(p))
            } else {
                Err(bad())
            };
        }
        let (cid, port) = addr
            .strip_prefix("vsock://")
            .and_then(|r| r.split_once(':'))
            .ok_or_else(bad)?;
        let cid = match cid {
            "-1" => VMADDR_CID_ANY,
            c => c.parse().map_err(|_| bad())?,
        };
        Ok(Address::Vsock {
            cid,
            port: port.parse().map_err(|_| bad())?,
        })
    }
}

/// Which vsock peers may connect (`--vsock-peers`, `crust.vsock_peers=`).
/// Unix sockets are governed by their mode ([`SOCKET_MODE`]) instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peers {
    /// Only these context ids (`host` is 2). The default is the host alone:
    /// in a guest, a local process (over vsock loopback, CID 1 or the
    /// guest's own) or another guest must not drive the agent.
    Cids(Vec<u32>),
    /// Any peer (`any`).
    Any,
}

impl Default for Peers {
    fn default() -> Peers {
        Peers::Cids(vec![VMADDR_CID_HOST])
    }
}

impl Peers {
    /// Parses `host`, `any`, or a comma-separated list of context ids and
    /// `host` (e.g. `host,5`).
    pub fn parse(s: &str) -> Result<Peers, String> {
        let bad = || {
            format!("vsock peers {s:?} is not host, any, or a list of context ids such as host,5")
        };
        if s == "any" {
            return Ok(Peers::Any);
        }
        let mut cids = Vec::new();
        for item in s.split(',') {
            let cid = match item {
                "host" => VMADDR_CID_HOST,
                n => n.parse::<u32>().map_err(|_| bad())?,
            };
            // VMADDR_CID_ANY is no peer's address: listing it would read as "any".
            if cid == VMADDR_CID_ANY {
                return Err(bad());
            }
            if !cids.contains(&cid) {
                cids.push(cid);
            }
        }
        Ok(Peers::Cids(cids))
    }

    /// Whether a peer with context id `cid` may connect.
    pub fn allows(&self, cid: u32) -> bool {
        match self {
            Peers::Any => true,
            Peers::Cids(c) => c.contains(&cid),
        }
    }
}

impl std::fmt::Display for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peers::Any => f.write_str("any"),
            Peers::Cids(c) => {
                let names: Vec<String> = c
                    .iter()
                    .map(|&cid| {
                        if cid == VMADDR_CID_HOST {
                            "host".to_string()
                        } else {
                            cid.to_string()
                        }
                    })
                    .collect();
                f.write_str(&names.join(","))
            }
        }
    }
}

/// The peer of an accepted connection, as far as [`Peers`] cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Peer {
    /// Not a vsock connection (a unix socket: its mode decided).
    Local,
    /// A vsock peer: its context id and port.
    Vsock { cid: u32, port: u32 },
}

/// Who is at the other end of `fd`: for AF_VSOCK, the peer's context id
/// and port from getpeername(2).
pub(crate) fn peer_of(fd: BorrowedFd<'_>) -> io::Result<Peer> {
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_vm>())
        .map_err(|_| io::Errno::INVAL)?;
    // SAFETY: `sa` is a writable sockaddr_vm of `len` bytes on our stack;
    // the kernel writes at most `len` bytes and updates `len`.
    let r = unsafe {
        libc::getpeername(
            fd.as_raw_fd(),
            (&mut sa as *mut libc::sockaddr_vm).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Errno::from_raw_os_error(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        ));
    }
    if i32::from(sa.svm_family) != libc::AF_VSOCK {
        return Ok(Peer::Local);
    }
    Ok(Peer::Vsock {
        cid: sa.svm_cid,
        port: sa.svm_port,
    })
}

/// A `sockaddr_vm`, which rustix has no type for.
#[derive(Clone, Copy, Debug)]
pub struct VsockAddr {
    /// The context id.
    pub cid: u32,
    pub port: u32,
}

// SAFETY: `with_sockaddr` hands `f` a pointer to a fully initialised
// `sockaddr_vm` on its own stack, valid for the duration of the call, and
// exactly that struct's size as the length.
unsafe impl SocketAddrArg for VsockAddr {
    unsafe fn with_sockaddr<R>(
        &self,
        f: impl FnOnce(*const SocketAddrOpaque, SocketAddrLen) -> R,
    ) -> R {
        // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value
        // (and the reserved fields must be zero).
        let mut sa: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        #[allow(clippy::cast_possible_truncation)] // AF_VSOCK (40) fits sa_family_t.
        {
            sa.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        }
        sa.svm_cid = self.cid;
        sa.svm_port = self.port;
        // 16 bytes.
        let len = SocketAddrLen::try_from(std::mem::size_of::<libc::sockaddr_vm>()).unwrap_or(0);
        f((&sa as *const libc::sockaddr_vm).cast(), len)
    }
}

/// A non-blocking, close-on-exec listening socket at `addr`. A unix socket
/// is created with mode [`SOCKET_MODE`] whatever the umask: the mode is set
/// on the socket before bind(2), which creates the file with it (less the
/// umask, which can only take bits away), so there is no moment in which
/// the file exists with a wider mode.
pub fn listen(addr: &Address) -> io::Result<OwnedFd> {
    let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
    let fd = match addr {
        Address::Unix(path) => {
            let fd =
                rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)?;
            // Linux's unix_bind takes the new file's mode from the socket's
            // inode, which fchmod sets.
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(SOCKET_MODE))?;
            rustix::net::bind(&fd, &SocketAddrUnix::new(path.as_path())?)?;
            // A kernel that ignored the socket's mode would have made the
            // file wider: refuse to serve on it rather than widen access.
            let st = rustix::fs::lstat(path.as_path())?;
            if st.st_mode & 0o077 != 0 {
                let _ = rustix::fs::unlink(path.as_path());
                return Err(io::Errno::PERM);
            }
            fd
        }
        Address::Vsock { cid, port } => {
            let fd =
                rustix::net::socket_with(AddressFamily::VSOCK, SocketType::STREAM, flags, None)?;
            rustix::net::bind(
                &fd,
                &VsockAddr {
                    cid: *cid,
                    port: *port,
                },
            )?;
            fd
        }
    };
    rustix::net::listen(&fd, BACKLOG)?;
    Ok(fd)
}

/// Raises the soft limit on open descriptors towards `want` (never above the
/// hard limit, never lowering it) and returns the soft limit now in force.
pub fn raise_fd_limit(want: u64) -> u64 {
    let cur = rustix::process::getrlimit(Resource::Nofile);
    let soft = cur.current.unwrap_or(u64::MAX);
    if soft >= want {
        return soft;
    }
    let target = cur.maximum.map_or(want, |hard| hard.min(want));
    if target > soft
        && rustix::process::setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(target),
                maximum: cur.maximum,
            },
        )
        .is_ok()
    {
        return target;
    }
    soft
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            Address::parse("unix:///run/a.sock"),
            Ok(Address::Unix("/run/a.sock".into()))
        );
        assert_eq!(
            Address::parse("vsock://-1:1024"),
            Ok(Address::Vsock {
                cid: VMADDR_CID_ANY,
                port: 1024
            })
        );
        assert_eq!(
            Address::parse("vsock://3:5"),
            Ok(Address::Vsock { cid: 3, port: 5 })
        );
        for bad in [
            "unix://rel",
            "vsock://x:1",
            "vsock://3",
            "vsock://3:-1",
            "tcp://1:2",
            "",
        ] {
            assert!(Address::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn vsock_peers() {
        let host = Peers::default();
        assert_eq!(host, Peers::parse("host").unwrap());
        assert!(host.allows(VMADDR_CID_HOST));
        // Loopback (1), the guest's own or another guest's CID, the hypervisor (0): refused.
        for cid in [0, 1, 3, 4, 1000] {
            assert!(!host.allows(cid), "{cid}");
        }
        let list = Peers::parse("host,5,5").unwrap();
        assert_eq!(list, Peers::Cids(vec![2, 5]));
        assert!(list.allows(5) && list.allows(2) && !list.allows(3));
        assert_eq!(list.to_string(), "host,5");
        assert!(Peers::parse("any").unwrap().allows(1));
        for bad in ["", "nobody", "host,", "-1", "4294967295", "any,host", "2 3"] {
            assert!(Peers::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_unix_listener_is_private_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let _l = listen(&Address::Unix(path.clone())).unwrap();
        let mode = rustix::fs::lstat(&path).unwrap().st_mode;
        // The test's umask (022 as a rule) would have left 0755: connectable by no
        // one else, but readable, and 0777 under umask 0.
        assert_eq!(mode & 0o777, SOCKET_MODE, "{mode:o}");
        // A unix peer is no vsock peer: its mode decided.
        let c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        assert_eq!(peer_of(std::os::fd::AsFd::as_fd(&c)).unwrap(), Peer::Local);
    }

    #[test]
    fn a_unix_listener_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let l = listen(&Address::Unix(path.clone())).unwrap();
        let _c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let a = rustix::net::accept_with(&l, SocketFlags::NONBLOCK).unwrap();
        drop(a);
        // Non-blocking: nothing more to accept is EAGAIN, not a hang.
        assert_eq!(
            rustix::net::accept_with(&l, SocketFlags::empty()).unwrap_err(),
            io::Errno::AGAIN
        );
    }

    #[test]
    fn the_fd_limit_only_goes_up() {
        let before = rustix::process::getrlimit(Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        assert_eq!(raise_fd_limit(16), before.max(16).min(before));
        assert!(raise_fd_limit(before) >= before);
    }
}

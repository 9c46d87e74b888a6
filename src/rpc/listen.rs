//! Listening sockets for the agent's addresses (`unix:///path`,
//! `vsock://CID:PORT`), made non-blocking for the event loop, and the
//! descriptor limit the connections need.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use rustix::io;
use rustix::net::addr::{SocketAddrArg, SocketAddrLen, SocketAddrOpaque};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use rustix::process::{Resource, Rlimit};

/// `vsock://-1:PORT`: any context id.
const VMADDR_CID_ANY: u32 = u32::MAX;
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
        /// The port.
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

/// A `sockaddr_vm`, which rustix has no type for.
struct VsockAddr {
    cid: u32,
    port: u32,
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

/// A non-blocking, close-on-exec listening socket at `addr`.
pub fn listen(addr: &Address) -> io::Result<OwnedFd> {
    let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
    let fd = match addr {
        Address::Unix(path) => {
            let fd =
                rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)?;
            rustix::net::bind(&fd, &SocketAddrUnix::new(path.as_path())?)?;
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

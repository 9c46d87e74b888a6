//! Readiness, pushed: once the agent listens it tells whoever started it,
//! the way systemd tells its supervisor (sd_notify(3)): a `READY=1` message
//! to a notification socket. In a guest that socket is on the host, reached
//! over AF_VSOCK: `crust.notify=vsock-stream:2:PORT` on the kernel command
//! line, or systemd's own spelling, the `vmm.notify_socket` credential
//! (`systemd.set_credential=vmm.notify_socket:vsock-stream:2:PORT`), so a
//! VMM that waits for systemd guests waits for this one unchanged. On a
//! host, under a service manager, it is `$NOTIFY_SOCKET` (an AF_UNIX
//! datagram socket).
//!
//! Hybrid vsock backends (Firecracker, Cloud Hypervisor, vhost-device-vsock)
//! carry only streams, and hand the guest's connection to host port P to
//! the unix socket `<uds>_P`. So over vsock the agent connects a stream,
//! writes the message and closes; it never half-closes and waits, which
//! those backends do not relay. `vsock:` (systemd: datagram, else
//! seqpacket) is taken as a stream too; `vsock-seqpacket:` is honoured;
//! `vsock-dgram:` is refused (virtio-vsock has no datagrams).

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::rpc::listen::VsockAddr;

/// `SO_VM_SOCKETS_CONNECT_TIMEOUT` (linux/vm_sockets.h, the `struct
/// timeval` form; libc has no name for it).
const SO_VM_SOCKETS_CONNECT_TIMEOUT: libc::c_int = 6;

/// Where readiness goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// An AF_VSOCK address; `seqpacket` for `vsock-seqpacket:`, else a stream.
    Vsock {
        /// The context id (2: the host).
        cid: u32,
        port: u32,
        /// Whether to use SOCK_SEQPACKET instead of SOCK_STREAM.
        seqpacket: bool,
    },
    /// An AF_UNIX datagram socket: a path, or an abstract name (`@name`).
    Unix(String),
}

impl Target {
    /// Parses a notification address: `vsock:CID:PORT`,
    /// `vsock-stream:CID:PORT`, `vsock-seqpacket:CID:PORT`, `/path` or
    /// `@abstract`.
    pub fn parse(s: &str) -> Result<Target, String> {
        let bad = || {
            format!("notify address {s:?} is not vsock-stream:CID:PORT, vsock:CID:PORT, vsock-seqpacket:CID:PORT, /path or @name")
        };
        if s.starts_with('/') || (s.starts_with('@') && s.len() > 1) {
            return Ok(Target::Unix(s.to_string()));
        }
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        let seqpacket = match kind {
            "vsock" | "vsock-stream" => false,
            "vsock-seqpacket" => true,
            "vsock-dgram" => {
                return Err(format!(
                    "notify address {s:?}: virtio-vsock carries no datagrams; use vsock-stream:CID:PORT"
                ))
            }
            _ => return Err(bad()),
        };
        let (cid, port) = rest.split_once(':').ok_or_else(bad)?;
        Ok(Target::Vsock {
            cid: cid.parse().map_err(|_| bad())?,
            port: port.parse().map_err(|_| bad())?,
            seqpacket,
        })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Vsock {
                cid,
                port,
                seqpacket,
            } => {
                let kind = if *seqpacket {
                    "vsock-seqpacket"
                } else {
                    "vsock-stream"
                };
                write!(f, "{kind}:{cid}:{port}")
            }
            Target::Unix(p) => f.write_str(p),
        }
    }
}

fn set_timeval(
    fd: &OwnedFd,
    level: libc::c_int,
    name: libc::c_int,
    d: Duration,
) -> std::io::Result<()> {
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(d.subsec_micros()),
    };
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::timeval>())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `tv` is a valid timeval on our stack and `len` is its size;
    // the kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&tv as *const libc::timeval).cast(),
            len,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sends `message` to `target` once: connect (within `timeout`), write,
/// close. Every wait is bounded by `timeout`.
pub fn send(target: &Target, message: &str, timeout: Duration) -> std::io::Result<()> {
    match target {
        Target::Vsock {
            cid,
            port,
            seqpacket,
        } => {
            let kind = if *seqpacket {
                SocketType::SEQPACKET
            } else {
                SocketType::STREAM
            };
            let fd =
                rustix::net::socket_with(AddressFamily::VSOCK, kind, SocketFlags::CLOEXEC, None)?;
            set_timeval(&fd, libc::AF_VSOCK, SO_VM_SOCKETS_CONNECT_TIMEOUT, timeout)?;
            set_timeval(&fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, timeout)?;
            rustix::net::connect(
                &fd,
                &VsockAddr {
                    cid: *cid,
                    port: *port,
                },
            )?;
            let mut stream = std::fs::File::from(fd);
            stream.write_all(message.as_bytes())?;
            // Dropping closes it: the peer reads the message, then the end.
            Ok(())
        }
        Target::Unix(name) => {
            let fd = rustix::net::socket_with(
                AddressFamily::UNIX,
                SocketType::DGRAM,
                SocketFlags::CLOEXEC,
                None,
            )?;
            set_timeval(&fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, timeout)?;
            let addr = match name.strip_prefix('@') {
                Some(abs) => SocketAddrUnix::new_abstract_name(abs.as_bytes())?,
                None => SocketAddrUnix::new(name.as_str())?,
            };
            rustix::net::sendto(
                &fd,
                message.as_bytes(),
                rustix::net::SendFlags::NOSIGNAL,
                &addr,
            )?;
            Ok(())
        }
    }
}

/// Tries [`send`] up to `attempts` times, waiting a little longer after
/// each failure (the host end may not be up yet); the last error if none
/// got through.
pub fn announce(
    target: &Target,
    message: &str,
    attempts: u32,
    timeout: Duration,
) -> std::io::Result<u32> {
    let mut pause = Duration::from_millis(100);
    let mut last = None;
    for n in 1..=attempts.max(1) {
        match send(target, message, timeout) {
            Ok(()) => return Ok(n),
            Err(e) => last = Some(e),
        }
        if n < attempts {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            Target::parse("vsock-stream:2:1025"),
            Ok(Target::Vsock {
                cid: 2,
                port: 1025,
                seqpacket: false
            })
        );
        assert_eq!(
            Target::parse("vsock:2:9"),
            Ok(Target::Vsock {
                cid: 2,
                port: 9,
                seqpacket: false
            })
        );
        assert_eq!(
            Target::parse("vsock-seqpacket:3:7"),
            Ok(Target::Vsock {
                cid: 3,
                port: 7,
                seqpacket: true
            })
        );
        assert_eq!(
            Target::parse("/run/n.sock"),
            Ok(Target::Unix("/run/n.sock".into()))
        );
        assert_eq!(Target::parse("@n"), Ok(Target::Unix("@n".into())));
        for bad in [
            "",
            "@",
            "vsock",
            "vsock:2",
            "vsock:x:1",
            "vsock:2:-1",
            "tcp:1:2",
            "rel/path",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
        let e = Target::parse("vsock-dgram:2:1").unwrap_err();
        assert!(e.contains("no datagrams"), "{e}");
        assert_eq!(
            Target::parse("vsock:2:5").unwrap().to_string(),
            "vsock-stream:2:5"
        );
    }

    #[test]
    fn a_unix_datagram_socket_gets_the_message() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify");
        let rx = std::os::unix::net::UnixDatagram::bind(&p).unwrap();
        let t = Target::parse(p.to_str().unwrap()).unwrap();
        assert_eq!(
            announce(&t, "READY=1\n", 3, Duration::from_secs(1)).unwrap(),
            1
        );
        let mut b = [0u8; 64];
        let n = rx.recv(&mut b).unwrap();
        assert_eq!(&b[..n], b"READY=1\n");
        // Nobody there: every attempt fails, and the last error is returned.
        // The name goes too: a child another test thread forks holds a copy
        // of the socket until it execs, and would still take a datagram.
        drop(rx);
        std::fs::remove_file(&p).unwrap();
        assert!(announce(&t, "READY=1\n", 2, Duration::from_millis(100)).is_err());
    }
}

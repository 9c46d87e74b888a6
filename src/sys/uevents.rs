//! The kernel's uevents (NETLINK_KOBJECT_UEVENT): how the agent hears a
//! disk arrive or change size instead of polling sysfs. The datagrams are
//! an attacker's input (any process with CAP_NET_ADMIN in the guest, or a
//! device's own strings): [`parse_uevent`] is total.

use std::io;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{netlink, AddressFamily, RecvFlags, SocketFlags, SocketType};

use crate::cancel::{deadline_after, until};

/// One kernel uevent, the fields the agent cares about.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Uevent {
    /// "add", "change", "remove", …
    pub action: String,
    /// "block", "net", …
    pub subsystem: String,
    /// The node name under /dev ("vdb"), when there is one.
    pub devname: String,
    /// "disk" or "partition" for block devices.
    pub devtype: String,
}

/// Parses a kernel uevent datagram ("ACTION@DEVPATH\0KEY=VALUE\0…"); None for
/// anything else (such as udev's "libudev" messages).
pub fn parse_uevent(msg: &[u8]) -> Option<Uevent> {
    let mut parts = msg.split(|b| *b == 0);
    let header = parts.next()?;
    if !header.contains(&b'@') {
        return None;
    }
    let mut ev = Uevent::default();
    for kv in parts {
        let kv = String::from_utf8_lossy(kv);
        let Some((k, v)) = kv.split_once('=') else {
            continue;
        };
        let field = match k {
            "ACTION" => &mut ev.action,
            "SUBSYSTEM" => &mut ev.subsystem,
            "DEVNAME" => &mut ev.devname,
            "DEVTYPE" => &mut ev.devtype,
            _ => continue,
        };
        *field = v.to_string();
    }
    (!ev.action.is_empty()).then_some(ev)
}

/// A NETLINK_KOBJECT_UEVENT socket, or (if it cannot be opened) plain sleeping.
pub struct Uevents {
    fd: Option<OwnedFd>,
}

impl Uevents {
    /// Opens and binds the socket: do this before scanning, so no event falls in between.
    pub fn open() -> Uevents {
        let fd = (|| -> io::Result<OwnedFd> {
            let fd = rustix::net::socket_with(
                AddressFamily::NETLINK,
                SocketType::DGRAM,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
                Some(netlink::KOBJECT_UEVENT),
            )?;
            // Group 1: the kernel's own events (udev rebroadcasts on group 2).
            rustix::net::bind(&fd, &netlink::SocketAddrNetlink::new(0, 1))?;
            // A bigger buffer makes ENOBUFS (lost events) rarer during a hot-plug storm.
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size_force(&fd, 1 << 20);
            Ok(fd)
        })()
        .ok();
        Uevents { fd }
    }

    /// Waits up to `timeout` for an event `want` accepts; true when one came or
    /// events were lost (ENOBUFS), false on timeout.
    pub fn wait(&self, timeout: Duration, want: impl Fn(&Uevent) -> bool) -> bool {
        let Some(fd) = &self.fd else {
            std::thread::sleep(timeout);
            return false;
        };
        let deadline = deadline_after(Instant::now(), timeout);
        let mut buf = vec![0u8; 8192];
        loop {
            let left = until(deadline, timeout);
            if left.is_zero() {
                return false;
            }
            let ts = Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            let mut fds = [PollFd::new(fd, PollFlags::IN)];
            match poll(&mut fds, Some(&ts)) {
                Ok(0) => return false,
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => {
                    std::thread::sleep(left);
                    return false;
                }
            }
            let mut hit = false;
            loop {
                match rustix::net::recv(fd, &mut buf[..], RecvFlags::DONTWAIT) {
                    Ok((_, n)) => {
                        if parse_uevent(&buf[..n.min(buf.len())]).is_some_and(|ev| want(&ev)) {
                            hit = true;
                        }
                    }
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(rustix::io::Errno::NOBUFS) => hit = true,
                    Err(_) => {
                        // A broken socket: fall back to the periodic rescan.
                        std::thread::sleep(until(deadline, timeout));
                        return false;
                    }
                }
            }
            if hit {
                return true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_testkit::{needs, LoopDisk};

    #[test]
    fn parses_uevents() {
        let add = b"add@/devices/pci0000:00/virtio3/block/vdb\0ACTION=add\0DEVPATH=/devices/x\0SUBSYSTEM=block\0MAJOR=253\0MINOR=16\0DEVNAME=vdb\0DEVTYPE=disk\0SEQNUM=1\0";
        let ev = parse_uevent(add).unwrap();
        assert_eq!(
            ev,
            Uevent {
                action: "add".into(),
                subsystem: "block".into(),
                devname: "vdb".into(),
                devtype: "disk".into()
            }
        );
        assert!(parse_uevent(b"libudev\0\xfe\xed\xca\xfe").is_none());
        assert!(parse_uevent(b"").is_none());
        assert!(parse_uevent(b"change@/x\0SUBSYSTEM=block\0").is_none()); // no ACTION
        let change =
            parse_uevent(b"change@/x\0ACTION=change\0SUBSYSTEM=block\0DEVNAME=loop3\0RESIZE=1")
                .unwrap();
        assert_eq!(
            (change.action.as_str(), change.devname.as_str()),
            ("change", "loop3")
        );
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn hears_the_kernel_announce_a_resize() {
        needs::loop_devices();
        let disk = LoopDisk::new(16, None);
        let name = disk.name();
        let events = Uevents::open();
        assert!(
            events.fd.is_some(),
            "NETLINK_KOBJECT_UEVENT socket could not be opened"
        );
        let grower = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            disk.resize(32);
            disk
        });
        let started = Instant::now();
        let heard = events.wait(Duration::from_secs(5), |ev| {
            ev.subsystem == "block" && ev.action == "change" && ev.devname == name
        });
        let _disk = grower.join().unwrap();
        assert!(heard, "no change uevent for {name} within 5 s");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}

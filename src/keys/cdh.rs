//! A key fetched from the KBS by the Confidential Data Hub: one ttrpc call
//! of the CDH's `GetResource` (`api.GetResourceService`, cdh.proto) over
//! its unix socket, on a connection of its own. The client is the agent's
//! own, not the ttrpc crate's (whose client runs threads of its own): one
//! request frame out, one response frame in, each wait a poll bounded by
//! the caller's [`Cancel`] and by the agent's own limit on the CDH, the
//! answer's size checked from its header before any of it is read, and the
//! resource read in place from the frame (`field`), so the key lives only
//! in buffers that are zeroed when dropped.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use crust_protocols::cdh::{GetResourceRequest, METHOD, SERVICE};
use crust_protocols::protobuf::Message;
use crust_protocols::ttrpc::proto::{MESSAGE_HEADER_LENGTH, MESSAGE_TYPE_RESPONSE};
use crust_protocols::ttrpc::{self, MessageHeader};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SendFlags, SocketAddrUnix, SocketFlags, SocketType};
use zeroize::Zeroizing;

use super::error::Error;
use super::field;
use super::source::MAX_KEY_LEN;
use crate::cancel::{deadline_after, Cancel};
use crate::code::Code;

/// The largest answer read: a key of [`MAX_KEY_LEN`] bytes inside its two
/// envelopes, or a refusal with a long message.
const MAX_ANSWER: usize = MAX_KEY_LEN + (16 << 10);
/// The stream of the one call a connection carries (a client's are odd).
const STREAM: u32 = 1;
/// The most of the CDH's refusal message an error carries.
const MAX_MESSAGE: usize = 512;

/// One GetResource call under way.
struct Call<'a> {
    socket: &'a Path,
    /// The URI asked for, `kbs:///repository/type/tag`.
    resource: &'a str,
    cancel: &'a Cancel,
    /// When the agent stops waiting for the CDH, whatever the caller allows.
    give_up: Instant,
    /// How long that is from the start, for the message.
    limit: Duration,
}

/// The resource `resource` from the CDH listening at `socket`, waiting at
/// most `limit` for it (and no longer than `cancel` allows).
pub(crate) fn get_resource(
    socket: &Path,
    resource: &str,
    limit: Duration,
    cancel: &Cancel,
) -> Result<Zeroizing<Vec<u8>>, Error> {
    let call = Call {
        socket,
        resource,
        cancel,
        give_up: deadline_after(Instant::now(), limit),
        limit,
    };
    let fd = call.connect()?;
    call.send(&fd, &call.request())?;
    let answer = call.receive(&fd)?;
    call.decode(&answer)
}

impl Call<'_> {
    /// The request frame: GetResource's message in ttrpc's Request, whose
    /// timeout tells the CDH how long the agent will wait.
    fn request(&self) -> Vec<u8> {
        let mut get = GetResourceRequest::new();
        get.ResourcePath = self.resource.to_string();
        let mut req = ttrpc::Request::new();
        req.service = SERVICE.to_string();
        req.method = METHOD.to_string();
        // Messages of strings alone always encode.
        req.payload = get.write_to_bytes().unwrap_or_default();
        let until = self
            .cancel
            .deadline()
            .map_or(self.give_up, |d| d.min(self.give_up));
        let left = until.saturating_duration_since(Instant::now()).as_nanos();
        req.timeout_nano = i64::try_from(left).unwrap_or(i64::MAX).max(1);
        let body = req.write_to_bytes().unwrap_or_default();
        // The resource is at most a path's length: the request fits a frame.
        let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
        let mut frame: Vec<u8> = MessageHeader::new_request(STREAM, len).into();
        frame.extend_from_slice(&body);
        frame
    }

    /// What a wait is doing, for the message of a stopped caller.
    fn during(&self, what: &str) -> String {
        format!(
            "{what} the Confidential Data Hub at {} for {}",
            self.socket.display(),
            self.resource
        )
    }

    /// Waits until `fd` is ready for `flags`, in slices, while the caller
    /// and the agent's own limit allow.
    fn wait(&self, fd: impl AsFd, flags: PollFlags, what: &str) -> Result<(), Error> {
        loop {
            self.cancel.check(|| self.during(what))?;
            let left = self.give_up.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::CdhSilent {
                    socket: self.socket.to_path_buf(),
                    resource: self.resource.to_string(),
                    seconds: self.limit.as_secs(),
                });
            }
            let slice = self.cancel.slice(left);
            let ts = Timespec {
                tv_sec: i64::try_from(slice.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: i64::from(slice.subsec_nanos()),
            };
            let mut fds = [PollFd::new(&fd, flags)];
            match poll(&mut fds, Some(&ts)) {
                Ok(0) | Err(Errno::INTR) => continue,
                Ok(_) => return Ok(()),
                Err(errno) => return Err(self.io("waiting for", errno)),
            }
        }
    }

    fn io(&self, during: &'static str, errno: Errno) -> Error {
        Error::CdhIo {
            socket: self.socket.to_path_buf(),
            during,
            errno,
        }
    }

    /// A connected socket. A unix socket's connect does not wait: a full
    /// backlog (EAGAIN) is tried again a little later.
    fn connect(&self) -> Result<OwnedFd, Error> {
        let socket = self.socket.to_path_buf();
        let connect_error = |errno| match errno {
            Errno::NOENT | Errno::CONNREFUSED => Error::CdhNotRunning {
                socket: socket.clone(),
                errno,
            },
            _ => Error::CdhConnect {
                socket: socket.clone(),
                errno,
            },
        };
        let addr = SocketAddrUnix::new(self.socket).map_err(connect_error)?;
        let flags = SocketFlags::NONBLOCK | SocketFlags::CLOEXEC;
        let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)
            .map_err(connect_error)?;
        loop {
            self.cancel.check(|| self.during("connecting to"))?;
            match rustix::net::connect(&fd, &addr) {
                Ok(()) => return Ok(fd),
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => {
                    if Instant::now() >= self.give_up {
                        return Err(connect_error(Errno::AGAIN));
                    }
                    std::thread::sleep(self.cancel.slice(Duration::from_millis(20)));
                }
                Err(errno) => return Err(connect_error(errno)),
            }
        }
    }

    fn send(&self, fd: &OwnedFd, frame: &[u8]) -> Result<(), Error> {
        let mut sent = 0;
        while sent < frame.len() {
            match rustix::net::send(fd, &frame[sent..], SendFlags::NOSIGNAL) {
                Ok(n) => sent += n,
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => self.wait(fd, PollFlags::OUT, "sending the request to")?,
                Err(errno) => return Err(self.io("sending the request", errno)),
            }
        }
        Ok(())
    }

    /// Fills `buf` from `fd`.
    fn read_exact(&self, fd: &OwnedFd, buf: &mut [u8]) -> Result<(), Error> {
        let mut got = 0;
        while got < buf.len() {
            match rustix::io::read(fd, &mut buf[got..]) {
                Ok(0) => {
                    return Err(Error::CdhClosed {
                        socket: self.socket.to_path_buf(),
                    })
                }
                Ok(n) => got += n,
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => self.wait(fd, PollFlags::IN, "waiting for")?,
                Err(errno) => return Err(self.io("reading the answer", errno)),
            }
        }
        Ok(())
    }

    /// The response frame's payload (a ttrpc Response), its size checked
    /// from its header before any of it is read.
    fn receive(&self, fd: &OwnedFd) -> Result<Zeroizing<Vec<u8>>, Error> {
        let mut head = [0u8; MESSAGE_HEADER_LENGTH];
        self.read_exact(fd, &mut head)?;
        let h = MessageHeader::from(&head);
        if h.type_ != MESSAGE_TYPE_RESPONSE || h.stream_id != STREAM {
            return Err(self.protocol(format!(
                "a frame of type {} on stream {} came where the response on stream {STREAM} was due",
                h.type_, h.stream_id
            )));
        }
        let len = usize::try_from(h.length).unwrap_or(usize::MAX);
        if len > MAX_ANSWER {
            return Err(Error::CdhAnswerTooLarge {
                socket: self.socket.to_path_buf(),
                resource: self.resource.to_string(),
                len: h.length,
            });
        }
        let mut body = Zeroizing::new(vec![0u8; len]);
        self.read_exact(fd, &mut body)?;
        Ok(body)
    }

    fn protocol(&self, what: String) -> Error {
        Error::CdhProtocol {
            socket: self.socket.to_path_buf(),
            what,
        }
    }

    /// The resource in a ttrpc Response (`answer`), or the CDH's refusal.
    fn decode(&self, answer: &[u8]) -> Result<Zeroizing<Vec<u8>>, Error> {
        let bad = |what: &str| self.protocol(format!("its answer is not a ttrpc Response: {what}"));
        if let Some(status) = field::bytes(answer, 1).map_err(bad)? {
            let status =
                ttrpc::Status::parse_from_bytes(status).map_err(|_| bad("a bad status"))?;
            let number = status.code.value();
            if number != 0 {
                return Err(Error::CdhRefused {
                    socket: self.socket.to_path_buf(),
                    resource: self.resource.to_string(),
                    status: Code::from_number(number).unwrap_or(Code::Unknown),
                    message: cut(&status.message),
                });
            }
        }
        let payload = field::bytes(answer, 2).map_err(bad)?.unwrap_or_default();
        let resource = field::bytes(payload, 1)
            .map_err(|what| {
                self.protocol(format!("its answer is not a GetResourceResponse: {what}"))
            })?
            .unwrap_or_default();
        let from = || format!("the KBS resource {}", self.resource);
        if resource.len() > MAX_KEY_LEN {
            return Err(Error::TooLarge {
                from: from(),
                size: resource.len() as u64,
            });
        }
        if resource.is_empty() {
            return Err(Error::Empty { from: from() });
        }
        Ok(Zeroizing::new(resource.to_vec()))
    }
}

/// The CDH's message for an error: at most [`MAX_MESSAGE`] bytes, on one line.
fn cut(message: &str) -> String {
    let mut end = message.len().min(MAX_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let more = if end < message.len() { "…" } else { "" };
    let one_line: String = message[..end]
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    format!("{}{more}", one_line.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_names_the_cdhs_method_and_carries_the_uri() {
        let cancel = Cancel::never().with_timeout(Duration::from_secs(3));
        let call = Call {
            socket: Path::new("/s"),
            resource: "kbs:///default/key/1",
            cancel: &cancel,
            give_up: deadline_after(Instant::now(), Duration::from_secs(50)),
            limit: Duration::from_secs(50),
        };
        let frame = call.request();
        let h = MessageHeader::from(&frame[..MESSAGE_HEADER_LENGTH]);
        assert_eq!(h, MessageHeader::new_request(1, h.length));
        assert_eq!(h.length as usize, frame.len() - MESSAGE_HEADER_LENGTH);
        let req = ttrpc::Request::parse_from_bytes(&frame[MESSAGE_HEADER_LENGTH..]).unwrap();
        assert_eq!(
            (req.service.as_str(), req.method.as_str()),
            ("api.GetResourceService", "GetResource")
        );
        // The caller's deadline, the nearer one, is what the CDH is told.
        assert!(req.timeout_nano > 2_000_000_000 && req.timeout_nano <= 3_000_000_000);
        let get = GetResourceRequest::parse_from_bytes(&req.payload).unwrap();
        assert_eq!(get.ResourcePath, "kbs:///default/key/1");
    }

    #[test]
    fn the_cdhs_message_is_cut_to_one_short_line() {
        assert_eq!(cut("[CDH] [ERROR]: no\nway\t"), "[CDH] [ERROR]: no way");
        let long = "é".repeat(400);
        let c = cut(&long);
        assert!(
            c.len() <= MAX_MESSAGE + "…".len() && c.ends_with('…'),
            "{}",
            c.len()
        );
    }
}

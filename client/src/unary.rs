//! One unary call on a connection of its own, for a call whose deadline the
//! agent is told while the client waits a little longer for the answer.
//!
//! ttrpc's sync client waits exactly the deadline it sends (`timeout_nano`
//! is both what the agent is told and how long `recv` waits), and the agent
//! starts counting only once it has read the request. So an agent that
//! answers DEADLINE_EXCEEDED at its deadline ("the fsGroup walk continues,
//! N entries so far") is never heard: the client has given up a moment
//! before. Here the two differ: the agent is told `told`, the client waits
//! `wait` (longer) for the answer. The frames are ttrpc's: a 10-byte header
//! (length, stream id, type, flags; big-endian) and the `Request`/`Response`
//! envelopes of ttrpc's own protobuf.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crust_protocols::protobuf::Message;
use crust_protocols::{crust::PublishVolumeRequest, crust::PublishVolumeResponse, ttrpc};

use crate::{address::Address, connect::connect_stream, CallError};

/// The ttrpc frame header.
const HEADER: usize = 10;
/// ttrpc's frame types.
const REQUEST: u8 = 1;
const RESPONSE: u8 = 2;
/// The largest answer read (ttrpc's own frame limit).
const MAX_FRAME: usize = 4 << 20;
/// The only stream of the connection (client streams are odd).
const STREAM: u32 = 1;

/// PublishVolume on a fresh connection to `addr` (connecting within
/// `connect_timeout`): the agent is told the deadline `told`, and the answer
/// is awaited for `wait` after the request is sent. `wait` shorter than
/// `told` is raised to it.
pub fn publish_volume(
    addr: &Address,
    connect_timeout: Duration,
    req: &PublishVolumeRequest,
    told: Duration,
    wait: Duration,
) -> Result<PublishVolumeResponse, CallError> {
    let method = "PublishVolume";
    let payload = req.write_to_bytes().map_err(|e| CallError::Connection {
        method,
        detail: format!("cannot encode the request: {e}"),
    })?;
    let answer = call(addr, connect_timeout, method, payload, told, wait.max(told))?;
    PublishVolumeResponse::parse_from_bytes(&answer).map_err(|e| CallError::Connection {
        method,
        detail: format!("the answer is not a PublishVolumeResponse: {e}"),
    })
}

/// Sends `crust.v1.Agent/method` with `payload` and deadline `told`; answers
/// the response payload, or the agent's status as [`CallError::Status`].
fn call(
    addr: &Address,
    connect_timeout: Duration,
    method: &'static str,
    payload: Vec<u8>,
    told: Duration,
    wait: Duration,
) -> Result<Vec<u8>, CallError> {
    let broke = |detail: String| CallError::Connection { method, detail };
    let fd = connect_stream(addr, connect_timeout).map_err(|e| broke(e.to_string()))?;
    // std's UnixStream only reads, writes and sets SO_RCVTIMEO/SO_SNDTIMEO on
    // it, which are the same for a vsock stream.
    let mut s = UnixStream::from(fd);

    let mut envelope = ttrpc::Request::new();
    envelope.service = "crust.v1.Agent".into();
    envelope.method = method.into();
    envelope.payload = payload;
    envelope.timeout_nano = i64::try_from(told.as_nanos()).unwrap_or(i64::MAX);
    let body = envelope
        .write_to_bytes()
        .map_err(|e| broke(format!("cannot encode the request: {e}")))?;
    let len = u32::try_from(body.len()).map_err(|_| broke("the request is too large".into()))?;
    let mut frame = Vec::with_capacity(HEADER + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&STREAM.to_be_bytes());
    frame.extend_from_slice(&[REQUEST, 0]);
    frame.extend_from_slice(&body);

    let deadline = Instant::now() + wait;
    s.set_write_timeout(Some(wait.max(Duration::from_millis(1))))
        .map_err(|e| broke(format!("setsockopt: {e}")))?;
    s.write_all(&frame)
        .map_err(|e| timed_out_or(method, wait, e, "sending the request"))?;

    loop {
        let mut h = [0u8; HEADER];
        read_until(&mut s, &mut h, deadline, method, wait)?;
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > MAX_FRAME {
            return Err(broke(format!(
                "the agent sent a frame of {len} bytes, over ttrpc's {MAX_FRAME}"
            )));
        }
        let mut body = vec![0u8; len];
        read_until(&mut s, &mut body, deadline, method, wait)?;
        let stream = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
        if stream != STREAM || h[8] != RESPONSE {
            // Nothing else is asked on this connection: skip what is not our answer.
            continue;
        }
        let r = ttrpc::Response::parse_from_bytes(&body)
            .map_err(|e| broke(format!("the answer is not a ttrpc Response: {e}")))?;
        return match r.status.as_ref() {
            Some(st) if st.code.value() != 0 => {
                Err(CallError::status(st.code.value(), st.message.clone()))
            }
            _ => Ok(r.payload),
        };
    }
}

/// Fills `buf` from `s` before `deadline`.
fn read_until(
    s: &mut UnixStream,
    buf: &mut [u8],
    deadline: Instant,
    method: &'static str,
    wait: Duration,
) -> Result<(), CallError> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CallError::TimedOut {
                method,
                timeout: wait,
            });
        }
        s.set_read_timeout(Some(left))
            .map_err(|e| CallError::Connection {
                method,
                detail: format!("setsockopt: {e}"),
            })?;
        match s.read(&mut buf[at..]) {
            Ok(0) => {
                return Err(CallError::Connection {
                    method,
                    detail: "the agent closed the connection before answering".into(),
                })
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(timed_out_or(method, wait, e, "reading the answer")),
        }
    }
    Ok(())
}

fn timed_out_or(method: &'static str, wait: Duration, e: std::io::Error, doing: &str) -> CallError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => CallError::TimedOut {
            method,
            timeout: wait,
        },
        _ => CallError::Connection {
            method,
            detail: format!("{doing}: {e}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::crust_ttrpc::{create_agent, Agent};
    use std::sync::{Arc, Mutex};

    /// Answers PublishVolume DEADLINE_EXCEEDED exactly at the deadline it was
    /// told, as the agent does when its fsGroup walk outlives the caller.
    struct AtTheDeadline {
        told: Mutex<Option<i64>>,
    }

    impl Agent for AtTheDeadline {
        fn publish_volume(
            &self,
            ctx: &ttrpc::TtrpcContext,
            _: PublishVolumeRequest,
        ) -> ttrpc::Result<PublishVolumeResponse> {
            *self.told.lock().unwrap() = Some(ctx.timeout_nano);
            let n = u64::try_from(ctx.timeout_nano).unwrap_or(0);
            std::thread::sleep(Duration::from_nanos(n));
            Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
                ttrpc::Code::DEADLINE_EXCEEDED,
                "the walk continues, 42 entries so far",
            )))
        }
    }

    fn serve() -> (
        tempfile::TempDir,
        Address,
        Arc<AtTheDeadline>,
        ttrpc::Server,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("agent.sock");
        let fake = Arc::new(AtTheDeadline {
            told: Mutex::new(None),
        });
        let mut server = ttrpc::Server::new()
            .bind(&format!("unix://{}", sock.display()))
            .unwrap()
            .register_service(create_agent(fake.clone()));
        server.start().unwrap();
        let addr: Address = format!("unix://{}", sock.display()).parse().unwrap();
        (dir, addr, fake, server)
    }

    #[test]
    fn an_answer_at_the_told_deadline_is_heard() {
        let (_dir, addr, fake, _server) = serve();
        let told = Duration::from_millis(300);
        let r = publish_volume(
            &addr,
            Duration::from_secs(5),
            &PublishVolumeRequest::new(),
            told,
            told + Duration::from_millis(500),
        );
        assert_eq!(
            r.unwrap_err(),
            CallError::Status {
                code: crate::Code::DeadlineExceeded,
                message: "the walk continues, 42 entries so far".into()
            }
        );
        assert_eq!(*fake.told.lock().unwrap(), Some(300_000_000));
    }

    #[test]
    fn no_answer_within_the_wait_is_timed_out_and_the_wait_is_never_shorter_than_told() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("silent.sock");
        // Accepted by the kernel's backlog, never answered.
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let addr: Address = format!("unix://{}", sock.display()).parse().unwrap();
        let t0 = Instant::now();
        let r = publish_volume(
            &addr,
            Duration::from_secs(5),
            &PublishVolumeRequest::new(),
            Duration::from_millis(300),
            Duration::from_millis(50),
        );
        assert!(matches!(r, Err(CallError::TimedOut { .. })), "{r:?}");
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t0.elapsed()
        );
    }
}

//! The transport as a whole, in-process, with limits small enough to reach:
//! timeouts, the connection limit, a full queue, the caller-gone signal and
//! the shutdown grace, over a real unix socket.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::TryRecvError;
use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc;
use crust_protocols::protobuf::Message;
use crust_protocols::ttrpc::{self, TtrpcContext};

use super::frame::{Header, HEADER_LEN};
use super::limits::Limits;
use super::listen::{listen, Address, Peers};
use super::table::{Lane, Table};
use super::transport::Server;

/// GetCapabilities answers at once; PublishVolume holds its worker until its
/// caller goes (counting those it saw go) or 5 s pass.
struct Fake {
    gone: Arc<AtomicUsize>,
}

impl crust_ttrpc::Agent for Fake {
    fn get_capabilities(
        &self,
        _: &TtrpcContext,
        _: pb::GetCapabilitiesRequest,
    ) -> ttrpc::Result<pb::GetCapabilitiesResponse> {
        Ok(pb::GetCapabilitiesResponse::new())
    }

    fn publish_volume(
        &self,
        ctx: &TtrpcContext,
        _: pb::PublishVolumeRequest,
    ) -> ttrpc::Result<pb::PublishVolumeResponse> {
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            if ctx.cancel_rx.try_recv() == Err(TryRecvError::Disconnected) {
                self.gone.fetch_add(1, Ordering::SeqCst);
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(pb::PublishVolumeResponse::new())
    }
}

struct Running {
    server: Option<Server>,
    sock: PathBuf,
    gone: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
}

fn start(limits: Limits) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("t.sock");
    let fd = listen(&Address::Unix(sock.clone())).unwrap();
    let gone = Arc::new(AtomicUsize::new(0));
    let methods = crust_ttrpc::create_agent(Arc::new(Fake { gone: gone.clone() }));
    let server = Server::start(
        vec![("t".into(), fd)],
        Table::new(methods, lane),
        limits,
        Peers::default(),
        crate::logging::discard(),
        Duration::from_secs(1),
    )
    .unwrap();
    Running {
        server: Some(server),
        sock,
        gone,
        _dir: dir,
    }
}

/// Lanes like the agent's (`server::methods`; the transport's tests may not
/// name the service, so its rule is restated here for a fake service).
fn lane(path: &str) -> Lane {
    match path {
        "/crust.v1.Agent/GetCapabilities" | "/crust.v1.Agent/GetAgentInfo" => Lane::Inline,
        "/crust.v1.Agent/ListVolumes" => Lane::Quick,
        _ => Lane::Regular,
    }
}

fn small() -> Limits {
    Limits {
        max_connections: 3,
        workers: 1,
        quick_workers: 1,
        queue: 1,
        quick_queue: 1,
        in_flight_per_connection: 4,
        max_request: 1024,
        out_pause: 1024,
        out_max: 4096,
        frame_timeout: Duration::from_millis(300),
        stall_timeout: Duration::from_millis(300),
    }
}

fn request(stream: u32, method: &str) -> Vec<u8> {
    let mut r = ttrpc::Request::new();
    r.service = "crust.v1.Agent".into();
    r.method = method.into();
    let body = r.write_to_bytes().unwrap();
    let mut f = Header {
        len: u32::try_from(body.len()).unwrap_or(u32::MAX),
        stream,
        kind: 1,
        flags: 0,
    }
    .encode()
    .to_vec();
    f.extend(body);
    f
}

fn connect(r: &Running) -> UnixStream {
    let s = UnixStream::connect(&r.sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// The status code of the next answer, with its stream id.
fn answer(s: &mut UnixStream) -> (u32, i32) {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = Header::parse(&h);
    let mut body = vec![0u8; h.len as usize];
    s.read_exact(&mut body).unwrap();
    let r = ttrpc::Response::parse_from_bytes(&body).unwrap();
    (h.stream, r.status.code.value())
}

/// Whether the agent closed `s` (reads reach the end) within `within`.
fn closed(s: &mut UnixStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

fn eventually(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < end, "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_half_sent_frame_is_closed_after_the_frame_timeout() {
    let r = start(small());
    let mut s = connect(&r);
    s.write_all(&request(1, "GetCapabilities")[..5]).unwrap();
    let t = Instant::now();
    assert!(closed(&mut s, Duration::from_secs(3)));
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    // An idle connection with nothing half-sent is left alone.
    let mut idle = connect(&r);
    assert!(!closed(&mut idle, Duration::from_millis(800)));
}

#[test]
fn a_client_that_stops_reading_is_closed_after_the_stall_timeout() {
    let r = start(small());
    let mut s = connect(&r);
    s.set_nonblocking(true).unwrap();
    let t = Instant::now();
    let mut stream = 1;
    // Pipeline until the agent stops reading us, then wait for it to give up on us.
    let cut = loop {
        match s.write(&request(stream, "GetCapabilities")) {
            Ok(_) => stream += 2,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(_) => break true,
        }
        if t.elapsed() > Duration::from_secs(10) {
            break false;
        }
    };
    assert!(cut, "still open after {:?}", t.elapsed());
    // Others are served all along.
    let mut other = connect(&r);
    other.write_all(&request(1, "GetCapabilities")).unwrap();
    assert_eq!(answer(&mut other), (1, 0));
}

#[test]
fn at_the_connection_limit_the_idlest_goes_and_busy_ones_stay() {
    let r = start(small());
    let mut first = connect(&r);
    std::thread::sleep(Duration::from_millis(20));
    let mut a = connect(&r);
    let mut b = connect(&r);
    a.write_all(&request(1, "GetCapabilities")).unwrap();
    assert_eq!(answer(&mut a), (1, 0));
    // A fourth connection makes room by closing the longest idle: `first`.
    let mut c = connect(&r);
    assert!(closed(&mut first, Duration::from_secs(2)));
    c.write_all(&request(1, "GetCapabilities")).unwrap();
    assert_eq!(answer(&mut c), (1, 0));
    // With all three busy (each with a request in flight), a newcomer is refused.
    for s in [&mut a, &mut b, &mut c] {
        s.write_all(&request(101, "PublishVolume")).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut late = connect(&r);
    assert!(closed(&mut late, Duration::from_secs(2)));
    // The busy ones were kept, and their callers leaving is seen by their requests.
    drop((a, b, c));
    eventually("the held requests saw their callers go", || {
        r.gone.load(Ordering::SeqCst) >= 1
    });
}

#[test]
fn a_full_queue_answers_resource_exhausted_and_a_lone_request_still_gets_in() {
    let r = start(small());
    let mut a = connect(&r);
    // One worker: the first publish holds it, the second waits (queue of 1),
    // the third is refused at once.
    a.write_all(&request(1, "PublishVolume")).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    for stream in [3, 5] {
        a.write_all(&request(stream, "PublishVolume")).unwrap();
    }
    let (stream, code) = answer(&mut a);
    assert_eq!((stream, code), (5, ttrpc::Code::RESOURCE_EXHAUSTED as i32));
    // Another client's only request is queued even so (and waits its turn).
    let mut b = connect(&r);
    b.write_all(&request(1, "PublishVolume")).unwrap();
    // The caller leaving frees the worker: a's requests see it.
    drop(a);
    eventually("the running request saw its caller go", || {
        r.gone.load(Ordering::SeqCst) >= 1
    });
    // b's request runs and is answered... once its 5 s hold ends, or at
    // once if it is cancelled: close b too and check the agent answers c.
    drop(b);
    let mut c = connect(&r);
    c.write_all(&request(1, "GetCapabilities")).unwrap();
    assert_eq!(answer(&mut c), (1, 0));
}

#[test]
fn shutdown_lets_answers_in_flight_leave() {
    let mut r = start(small());
    let mut a = connect(&r);
    a.write_all(&request(1, "PublishVolume")).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let server = r.server.take().unwrap();
    let t = Instant::now();
    // The publish holds for 5 s; shutdown waits for it at most the grace (1 s).
    server.shutdown();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(closed(&mut a, Duration::from_secs(2)));
    assert!(UnixStream::connect(&r.sock).is_err(), "no longer listening");
}

#[test]
fn inline_methods_are_answered_while_every_worker_is_busy() {
    // One worker, no quick ones: a publish holds the only thread that could
    // run a queued request, for 5 s. The loop answers GetCapabilities (an
    // inline method by the service's rule) itself, at once, on the same
    // connection, before the publish's answer.
    let r = start(Limits {
        quick_workers: 0,
        ..small()
    });
    let mut a = connect(&r);
    a.write_all(&request(1, "PublishVolume")).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    a.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let t = Instant::now();
    a.write_all(&request(3, "GetCapabilities")).unwrap();
    assert_eq!(answer(&mut a), (3, 0));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // A ListVolumes (quick, not inline) waits for a worker like the rest:
    // nothing answers it while the publish holds the only one.
    let mut b = connect(&r);
    b.write_all(&request(1, "ListVolumes")).unwrap();
    b.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut h = [0u8; HEADER_LEN];
    assert!(b.read_exact(&mut h).is_err(), "answered without a worker");
}

//! "The server survives any client", against the built
//! agent over a unix socket: floods of every kind stay within fixed bounds
//! while the agent keeps answering (1), every frame gets an answer (2), a
//! caller that disconnects stops its request (3), and log lines cannot be
//! forged or swollen by a client's values (4).

mod support;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use support::raw::{self, Raw};
use support::*;

/// Threads, descriptors and resident memory of the agent, from /proc.
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    threads: u64,
    fds: usize,
    rss_kib: u64,
}

fn usage(a: &Agent) -> Usage {
    let p = procfs::process::Process::new(a.child.id() as i32).unwrap();
    let st = p.status().unwrap();
    Usage {
        threads: st.threads,
        fds: p.fd_count().unwrap(),
        rss_kib: st.vmrss.unwrap_or(0),
    }
}

fn max(a: Usage, b: Usage) -> Usage {
    Usage {
        threads: a.threads.max(b.threads),
        fds: a.fds.max(b.fds),
        rss_kib: a.rss_kib.max(b.rss_kib),
    }
}

/// Lets this test process hold a few thousand sockets.
fn raise_own_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    let want = l.maximum.unwrap_or(8192).min(8192);
    if l.current.unwrap_or(0) < want {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(want),
                maximum: l.maximum,
            },
        )
        .unwrap();
    }
}

fn caps_frame(stream: u32) -> Vec<u8> {
    raw::request(
        stream,
        "GetCapabilities",
        &pb::GetCapabilitiesRequest::new(),
    )
}

/// 500 idle connections, 20 half-sent frames, one frame announcing 4 GiB
/// (refused), and 20 clients that pipeline requests and never read an
/// answer: the connections held, and the one with the huge frame.
fn hostile_connections(sock: &Path) -> (Vec<UnixStream>, Raw) {
    let mut held: Vec<UnixStream> = (0..500)
        .map(|_| UnixStream::connect(sock).unwrap())
        .collect();
    // 20 half-sent frames, and one frame announcing 4 GiB.
    for _ in 0..20 {
        let mut s = UnixStream::connect(sock).unwrap();
        s.write_all(&caps_frame(1)[..7]).unwrap();
        held.push(s);
    }
    let mut huge = Raw::connect(sock);
    huge.send(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1, 1, 0]);
    huge.send(&vec![0u8; 1 << 20]);
    assert_eq!(huge.status(1).0, "RESOURCE_EXHAUSTED");
    // 20 clients that pipeline requests and never read an answer.
    for _ in 0..20 {
        let mut s = UnixStream::connect(sock).unwrap();
        s.set_nonblocking(true).unwrap();
        let mut stream = 1u32;
        let deadline = Instant::now() + Duration::from_millis(300);
        'fill: while Instant::now() < deadline {
            let mut batch = Vec::new();
            for _ in 0..256 {
                batch.extend(caps_frame(stream));
                stream += 2;
            }
            let mut off = 0;
            while off < batch.len() {
                match s.write(&batch[off..]) {
                    Ok(n) => off += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break 'fill,
                    Err(_) => break 'fill,
                }
            }
        }
        held.push(s);
    }

    (held, huge)
}

/// How many requests the pipelining client sends.
const PIPELINED: u32 = 100_000;

/// One client pipelining [`PIPELINED`] requests, reading on another thread:
/// the writer (its stream when done) and the reader (answers served, and
/// refused as RESOURCE_EXHAUSTED).
fn pipeline(
    sock: &Path,
) -> (
    std::thread::JoinHandle<UnixStream>,
    std::thread::JoinHandle<(u32, u32)>,
) {
    let pipe = UnixStream::connect(sock).unwrap();
    let mut reader = pipe.try_clone().unwrap();
    reader
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let writer = std::thread::spawn(move || {
        let mut w = pipe;
        let mut batch = Vec::new();
        for i in 0..PIPELINED {
            batch.extend(caps_frame(2 * i + 1));
            if batch.len() > 64 << 10 {
                w.write_all(&batch).unwrap();
                batch.clear();
            }
        }
        w.write_all(&batch).unwrap();
        w
    });
    let answers = std::thread::spawn(move || {
        let (mut ok, mut busy) = (0u32, 0u32);
        let mut seen = vec![false; PIPELINED as usize];
        let mut h = [0u8; raw::HEADER];
        for _ in 0..PIPELINED {
            reader.read_exact(&mut h).unwrap();
            let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
            let mut body = vec![0u8; len];
            reader.read_exact(&mut body).unwrap();
            let i = (id / 2) as usize;
            assert!(
                id % 2 == 1 && i < seen.len() && !seen[i],
                "stream {id} answered twice or never asked"
            );
            seen[i] = true;
            use crust_protocols::protobuf::Message;
            let r = crust_protocols::ttrpc::Response::parse_from_bytes(&body).unwrap();
            match r.status.code.value() {
                0 => ok += 1,
                8 => busy += 1, // RESOURCE_EXHAUSTED: a clear refusal
                c => panic!("stream {id}: code {c}: {}", r.status.message),
            }
        }
        (ok, busy)
    });
    (writer, answers)
}

/// (1) Pipelined requests, hundreds of idle connections, clients that
/// never read, half-sent and oversized frames, then more connections than
/// the limit — all at once, while a well-behaved client keeps calling. The
/// agent's threads never grow, its memory and descriptors stay bounded and
/// come back, and every call of the good client is answered promptly.
#[test]
fn floods_stay_bounded_and_the_agent_keeps_answering() {
    raise_own_fd_limit();
    let mut a = Agent::start();
    let good = a.client();
    good.get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let idle = usage(&a);
    let started = Instant::now();

    let (mut held, huge) = hostile_connections(&a.sock);
    let (writer, answers) = pipeline(&a.sock);

    // Meanwhile the good client is answered, promptly, every time.
    let mut peak = idle;
    let mut slowest = Duration::ZERO;
    let mut calls = 0;
    while !answers.is_finished() {
        let t = Instant::now();
        good.get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
            .unwrap();
        slowest = slowest.max(t.elapsed());
        calls += 1;
        peak = max(peak, usage(&a));
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "the flood took too long"
        );
    }
    let (ok, busy) = answers.join().unwrap();
    let _pipe = writer.join().unwrap();
    assert_eq!(ok + busy, PIPELINED, "every pipelined request answered");
    assert!(
        ok > PIPELINED / 2,
        "most served, not refused: {ok} ok, {busy} refused"
    );

    // Past the connection limit (1024): the longest-idle connections make room.
    for _ in 0..6 {
        for _ in 0..100 {
            held.push(UnixStream::connect(&a.sock).unwrap());
        }
        good.get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
            .unwrap();
        peak = max(peak, usage(&a));
    }
    std::thread::sleep(Duration::from_millis(300));
    peak = max(peak, usage(&a));
    // A newcomer is not locked out, and neither is the good client.
    let newcomer = a.client();
    newcomer
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
    good.list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    let log = a.log();
    assert!(
        log.contains("connection limit reached"),
        "the eviction is logged"
    );
    eprintln!(
        "idle {idle:?}; peak {peak:?}; good client: {calls} calls, slowest {slowest:?}; \
         pipeline: {ok} ok, {busy} refused; {:?} in all",
        started.elapsed()
    );

    // The bounds: no thread was ever added, descriptors never passed the
    // connection limit, memory stayed within a few MiB.
    assert_eq!(peak.threads, idle.threads, "threads grew");
    assert!(
        peak.fds <= idle.fds + 1024 + 8,
        "descriptors: {} at idle, {} at peak",
        idle.fds,
        peak.fds
    );
    assert!(
        peak.rss_kib <= idle.rss_kib + 24 * 1024,
        "RSS: {} KiB at idle, {} KiB at peak",
        idle.rss_kib,
        peak.rss_kib
    );
    assert!(slowest < Duration::from_secs(2), "a call took {slowest:?}");

    // Everything closed: descriptors come back, the agent is alive and answers.
    drop(held);
    drop(huge);
    drop(_pipe);
    drop(newcomer);
    let deadline = Instant::now() + Duration::from_secs(5);
    while usage(&a).fds > idle.fds + 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = usage(&a);
    assert!(
        after.fds <= idle.fds + 2,
        "descriptors left: {after:?} vs {idle:?}"
    );
    assert!(a.alive());
    good.get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(50));
}

/// A client that writes requests without end and never reads an answer:
/// the agent stops reading it once its answers wait (back-pressure), so it
/// holds a bounded amount for it, and goes on answering everyone else.
/// (Such a connection is closed after the stall timeout, 30 s: not waited
/// for here.)
#[test]
fn a_client_that_never_reads_is_held_back_not_buffered() {
    let a = Agent::start();
    // ListVolumes answers are small; Unpublish of unknown ids too. Send many
    // requests with big (but valid-sized) answers: stats of an unknown volume
    // answer NOT_FOUND naming the id, so a long id makes a long answer.
    let id = "v".repeat(128);
    let idle = usage(&a);
    let mut s = UnixStream::connect(&a.sock).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut stream = 1u32;
    let start = Instant::now();
    let mut closed = false;
    let mut blocked_since: Option<Instant> = None;
    // Until the agent has stopped reading us for a second (or closed us).
    while start.elapsed() < Duration::from_secs(10)
        && !matches!(blocked_since, Some(t) if t.elapsed() >= Duration::from_secs(1))
    {
        let f = raw::request(stream, "GetVolumeStats", &stats_req(id.clone()));
        match s.write(&f) {
            Ok(_) => {
                stream += 2;
                blocked_since = None;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                blocked_since.get_or_insert_with(Instant::now);
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    // Either the agent stopped reading (back-pressure: our writes block) or
    // it closed us; both keep its memory bounded. It must still answer others.
    let rss = usage(&a).rss_kib;
    assert!(
        rss < idle.rss_kib + 8 * 1024,
        "RSS {rss} KiB, {} KiB at idle",
        idle.rss_kib
    );
    a.client()
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
    eprintln!(
        "non-reader: {} requests written, closed: {closed}",
        stream / 2
    );
}

/// (2) The frame rules: a payload that is not the method's
/// protobuf message, an envelope that is not a ttrpc Request, an unknown
/// method, even or reused stream ids, a data frame, an oversized frame —
/// each is answered with a status on its stream, and the connection goes
/// on serving.
#[test]
fn every_frame_gets_an_answer() {
    let a = Agent::start();
    let mut c = Raw::connect(&a.sock);
    let t = Duration::from_secs(10);
    // Not protobuf: a length running past the end, a bad wire type, bad UTF-8.
    for (i, junk) in [&[0x0a, 0x10, b'a'][..], &[0x0f], &[0x0a, 0x01, 0xff]]
        .iter()
        .enumerate()
    {
        let stream = 2 * u32::try_from(i).unwrap() + 1;
        c.send(&raw::frame(
            stream,
            1,
            &raw::envelope("PublishVolume", junk, t),
        ));
        let (code, msg) = c.status(stream);
        assert_eq!(code, "INVALID_ARGUMENT", "{junk:?}: {msg}");
        assert!(msg.contains("PublishVolume"), "{msg}");
    }
    c.send(&raw::frame(7, 1, b"\xff\xff\xff not an envelope"));
    assert_eq!(c.status(7).0, "INVALID_ARGUMENT");
    c.send(&raw::frame(9, 1, &raw::envelope("Frobnicate", b"", t)));
    assert_eq!(c.status(9).0, "UNIMPLEMENTED");
    let mut other = crust_protocols::ttrpc::Request::new();
    other.service = "grpc.health.v1.Health".into();
    other.method = "Check".into();
    use crust_protocols::protobuf::Message;
    c.send(&raw::frame(11, 1, &other.write_to_bytes().unwrap()));
    assert_eq!(c.status(11).0, "UNIMPLEMENTED");
    c.send(&caps_frame(12));
    let (code, msg) = c.status(12);
    assert_eq!(code, "INVALID_ARGUMENT");
    assert!(msg.contains("odd"), "{msg}");
    c.send(&caps_frame(11));
    assert_eq!(c.status(11).0, "INVALID_ARGUMENT");
    c.send(&raw::frame(13, 3, b"data"));
    assert_eq!(c.status(13).0, "INVALID_ARGUMENT");
    // 4 MiB + 1: answered at its header, its bytes skipped, the stream in sync.
    c.send(&raw::frame(15, 1, &vec![b'x'; (4 << 20) + 1]));
    let (code, msg) = c.status(15);
    assert_eq!(code, "RESOURCE_EXHAUSTED");
    assert!(msg.contains("maximum request size"), "{msg}");
    // And after all that, the same connection serves a real call.
    c.send(&caps_frame(17));
    let (stream, _, r) = c.answer();
    assert_eq!((stream, r.status.code.value()), (17, 0));
    // The refusals were logged.
    let log = a.log();
    assert!(
        log.lines()
            .any(|l| l.contains("PublishVolume") && l.contains("INVALID_ARGUMENT")),
        "{log}"
    );
}

/// (3) A client that disconnects mid-request cancels it.
/// A publish waiting (60 s) for a disk that never comes stops within a
/// second of its caller closing the connection, and its volume is free.
#[test]
fn a_caller_that_disconnects_stops_its_wait() {
    let a = Agent::start();
    let mut r = pb::PublishVolumeRequest::new();
    r.volume_id = "v-gone".into();
    r.set_serial("never-there".into());
    r.fs_type = "ext4".into();
    r.timeout_ms = 60_000;
    let mut c = Raw::connect(&a.sock);
    c.send(&raw::frame(
        1,
        1,
        &raw::envelope(
            "PublishVolume",
            &crust_protocols::protobuf::Message::write_to_bytes(&r).unwrap(),
            Duration::from_secs(120),
        ),
    ));
    std::thread::sleep(Duration::from_millis(500));
    let closed = Instant::now();
    drop(c);
    let mut line = None;
    while closed.elapsed() < Duration::from_secs(10) && line.is_none() {
        line = a
            .log()
            .lines()
            .find(|l| l.contains("method=PublishVolume") && l.contains("volume=v-gone"))
            .map(str::to_string);
        std::thread::sleep(Duration::from_millis(20));
    }
    let line = line.expect("the abandoned publish ends and logs its line");
    assert!(line.contains("code=CANCELLED"), "{line}");
    assert!(
        closed.elapsed() < Duration::from_secs(2),
        "stopped {:?} after the caller left",
        closed.elapsed()
    );
    // The volume is not held by the abandoned request.
    let mut again = r.clone();
    again.timeout_ms = 200;
    let t = Instant::now();
    let e = a.client().publish_volume(ctx(), &again);
    assert_eq!(code(e), "DEADLINE_EXCEEDED");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

/// (4) Values with newlines, NULs and escape sequences cannot start a
/// line of their own, and a huge value does not make a huge line — in the
/// text and the JSON format.
#[test]
fn log_lines_cannot_be_forged_or_swollen() {
    for format in ["text", "json"] {
        let a = Agent::start_with(&["--log-format", format]);
        let c = a.client();
        let forged = "x\n2026-11-22T00:00:00.000Z INFO FORGED code=OK\r\0\x1b[2J";
        for id in [forged.to_string(), "y".repeat(60_000)] {
            let mut r = stats_req(id);
            r.volume_id.push('\u{2028}');
            assert_eq!(code(c.get_volume_stats(ctx(), &r)), "INVALID_ARGUMENT");
        }
        // 4 MiB of volume_id: refused at the frame, never decoded or logged whole.
        let mut raw = Raw::connect(&a.sock);
        raw.send(&raw::request(
            1,
            "GetVolumeStats",
            &stats_req("z".repeat(4 << 20)),
        ));
        assert_eq!(raw.status(1).0, "RESOURCE_EXHAUSTED");
        drop(raw);
        drop(c);
        std::thread::sleep(Duration::from_millis(200));
        let log = std::fs::read(a.dir.path().join("agent.log")).unwrap();
        let log = String::from_utf8(log).unwrap();
        let mut lines = 0;
        for l in log.lines() {
            lines += 1;
            assert!(
                !l.contains("FORGED code=OK") || !l.starts_with("2026-11-22"),
                "{l}"
            );
            assert!(
                !l.chars().any(|c| c.is_control() || c == '\u{2028}'),
                "a raw control character: {l:?}"
            );
            assert!(l.len() < 8 << 10, "a line of {} bytes", l.len());
            if format == "json" {
                assert!(l.starts_with('{') && l.ends_with('}'), "{l}");
            }
        }
        assert!(log.contains("FORGED"), "the value is logged, escaped");
        assert!(
            log.contains("more bytes]"),
            "the long value is cut and says so"
        );
        assert!(lines > 3);
    }
}

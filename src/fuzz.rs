//! The agent's side of the fuzz targets in `fuzz/`: one entry per parser that
//! a hostile host or a hostile disk feeds. Each takes arbitrary bytes and
//! panics only when something that must hold whatever the bytes does not (a
//! panic inside the parser counts the same). Requests go through the agent's
//! own service over a volume table that refuses every operation, so no
//! syscall is made beyond the stand-in descriptor a connection needs and the
//! service's reads of what the system is (/proc, /sys, the feature probes).
//! Not part of the agent's interface: it exists for `fuzz/` and is hidden
//! from the docs.
//!
//! Each entry is a thin call to its parser, so that a parser's signature can
//! change (text to bytes, say) with a one-line change here.

use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_protocols::protobuf::Message;
use crust_protocols::ttrpc::{self, Code};

use crate::cancel::Cancel;
use crate::code::Code as AgentCode;
use crate::error::Error;
use crate::model::FsType;
use crate::mount::options::parse_options;
use crate::mount::selinux::without_contexts;
use crate::probe::judge::{judge, signatures, PROBE_BYTES};
use crate::rpc::conn::{Admit, Conn};
use crate::rpc::dispatch::{self, Job, Outbox};
use crate::rpc::envelope;
use crate::rpc::frame::{self, Frame, Header, Reader, HEADER_LEN, TYPE_REQUEST, TYPE_RESPONSE};
use crate::rpc::table::Table;
use crate::server::methods::{table, METHODS};
use crate::server::service::Service;
use crate::server::volumes::VolumeTable;
use crate::stats::{Condition, Measured};
use crate::sys::mountinfo;
use crate::sys::uevents::parse_uevent;
use crate::system::{Gate, Timeline};
use crate::validate::{self, Invalid};
use crate::volumes::freeze::{Frozen, Thaw};
use crate::volumes::health::Said;
use crate::volumes::request::{
    BindOutcome, BindRequest, Expanded, PublishRequest, Published, VolumeInfo,
};
use crate::volumes::trim::Trimmed;

/// The root that requests and records are checked against (the guest's default).
const ROOT: &str = "/run/crust";

/// ttrpc frames as a hostile client streams them. The first byte picks the
/// payload limit and the size of the pieces the rest arrives in. Frames are
/// cut by the connection's reader, the event loop's rule applies (it reads
/// only while no whole frame waits), and each frame goes through the ttrpc
/// rules and the agent's own service table, up to the volume table, which
/// refuses it.
///
/// Must hold: no byte is lost or invented by the framing; the reader holds
/// at most one frame's worth; an envelope read in place reads as protobuf
/// reads it; every frame gets exactly one well-formed answer on its stream,
/// and never INTERNAL (a panic or an unexpected error).
pub fn frames(data: &[u8]) {
    let Some((&knobs, stream)) = data.split_first() else {
        return;
    };
    // Small limits too, so that short inputs reach the oversized-frame path.
    let max = [0usize, 1, 16, 100, 4096, 64 << 10][usize::from(knobs & 7) % 6];
    let piece = usize::from(knobs >> 3) + 1;
    let mut reader = Reader::new(max);
    let mut conn = Conn::new(stand_in(), max);
    let methods = methods();
    let out = Outbox::new();
    let (mut pushed, mut framed) = (0usize, 0usize);
    for chunk in stream.chunks(piece) {
        while let Some(frame) = reader.next_frame() {
            framed += checked_size(&frame, max);
            answer(&mut conn, &methods, &out, frame, max);
        }
        assert!(
            reader.wants_bytes(),
            "no whole frame waits, yet the reader wants none"
        );
        reader.spare().extend_from_slice(chunk);
        reader.pushed();
        pushed += chunk.len();
        // Before the read, less than one header and one payload were held.
        assert!(
            reader.held() < HEADER_LEN + max + chunk.len(),
            "the reader holds {} bytes with a limit of {max}",
            reader.held()
        );
    }
    while let Some(frame) = reader.next_frame() {
        framed += checked_size(&frame, max);
        answer(&mut conn, &methods, &out, frame, max);
    }
    if !reader.mid_frame() {
        assert_eq!(
            framed, pushed,
            "the frames do not add up to the bytes received"
        );
    }
}

/// One request as the agent decodes it: the first byte picks the method (by
/// its index in the service's list, `server::methods::METHODS`: crust.proto's
/// order, which fuzz/seeds.py follows), the rest is that method's protobuf
/// payload, sent in a ttrpc envelope as the first frame of a connection. The
/// checks of [`frames`]; here the fuzzer works on the request messages, which
/// the service translates and validates as it does when it serves them (in
/// a guest with SELinux as this host has it: `mount_options` covers both).
pub fn request(data: &[u8]) {
    let Some((&pick, payload)) = data.split_first() else {
        return;
    };
    let mut req = ttrpc::Request::new();
    req.service = "crust.v1.Agent".into();
    req.method = METHODS[usize::from(pick) % METHODS.len()].0.into();
    req.payload = payload.to_vec();
    let Ok(body) = req.write_to_bytes() else {
        return;
    };
    let max = 64 << 10;
    let header = Header {
        len: u32::try_from(body.len()).unwrap_or(u32::MAX),
        stream: 1,
        kind: TYPE_REQUEST,
        flags: 0,
    };
    let frame = if body.len() > max {
        Frame::TooLarge(header)
    } else {
        Frame::Whole(header, body)
    };
    let mut conn = Conn::new(stand_in(), max);
    answer(&mut conn, &methods(), &Outbox::new(), frame, max);
}

/// `/proc/self/mountinfo` as the kernel could write it, with whatever paths
/// a hostile host or guest process mounted (the agent reads it on every
/// bind, unmount and recovery). Must not panic or hang. And `data` as the
/// source and (after a `/`: the kernel writes absolute paths) as the path
/// mounted and mounted on, escaped as the kernel escapes them, must read
/// back as itself.
pub fn mountinfo(data: &[u8]) {
    if !data.contains(&0) {
        let path = [b"/", data].concat();
        let (p, source) = (kernel_escaped(&path), kernel_escaped(data));
        let mut line = b"36 22 7:3 ".to_vec();
        for field in [
            &p[..],
            b" ",
            &p[..],
            b" rw,nosuid shared:5 - ext4 ",
            &source,
            b" rw",
        ] {
            line.extend_from_slice(field);
        }
        let m = mountinfo::parse_line(&line).expect("a line as the kernel writes it");
        let path = std::ffi::OsStr::from_bytes(&path);
        assert_eq!(
            (m.root.as_os_str(), m.mount_point.as_os_str()),
            (path, path)
        );
        assert_eq!(m.source, String::from_utf8_lossy(data));
        assert_eq!(
            (m.mount_id.0, m.parent_id.0, m.major, m.minor),
            (36, 22, 7, 3)
        );
    }
    let table = mountinfo::parse(data);
    assert!(table.len() <= data.split(|&b| b == b'\n').count());
    for m in table.iter().take(4) {
        let _ = (m.read_only(), m.super_read_only());
        assert!(mountinfo::by_id(&table, m.mount_id).is_some());
        assert!(mountinfo::mount_at(&table, &m.mount_point).is_some());
        let _ = mountinfo::descendants(&table, m.mount_id);
        let _ = mountinfo::mounts_under(&table, &m.mount_point);
    }
}

/// A state record (`<root>/state/<id>.vol`) as a restart reads it: it is not
/// trusted. One that decodes must read back the same once written again.
pub fn state_record(data: &[u8]) {
    crate::volumes::state::fuzz_record(data, Path::new(ROOT));
}

/// A freeze's record (`<root>/state/freezes/<id>.freeze`) as a restart reads
/// it: not trusted. One that decodes must name a freeze id and volume ids
/// a request could, and read back the same once written again.
pub fn freeze_record(data: &[u8]) {
    crate::volumes::lease::fuzz_record(data);
}

/// A netlink uevent datagram: any process with CAP_NET_ADMIN in the guest,
/// or a device's own strings (names, serials), end up in it.
pub fn uevent(data: &[u8]) {
    if let Some(ev) = parse_uevent(data) {
        assert!(
            !ev.action.is_empty(),
            "an event without an action was accepted"
        );
    }
}

/// An untrusted disk as the probe reads it before the agent decides whether
/// to mount it: its first bytes, and the block an ext4 superblock names for
/// MMP. Up to the probe's length, `data` is the disk from its start (the
/// block is read from it too); bytes beyond are the block itself, wherever
/// the superblock put it. Judged as ext4 and as xfs, on devices of several
/// sizes: the verdict is an answer, never INTERNAL, and a disk judged fit
/// holds the filesystem asked for and nothing else.
pub fn superblock(data: &[u8]) {
    let (head, block) = match data.split_at_checked(PROBE_BYTES) {
        Some((head, block)) => (head, Some(block)),
        None => (data, None),
    };
    let found = signatures(head);
    for (i, s) in found.iter().enumerate() {
        assert!(!found[..i].contains(s), "{s} found twice: {found:?}");
    }
    let sizes = [0, data.len() as u64, 1 << 30, 1 << 50, u64::MAX];
    for fs in [FsType::Ext4, FsType::Xfs] {
        for size in sizes {
            let read = |offset: u64, len: usize| {
                Ok(match block {
                    Some(b) => b.get(..len).unwrap_or(b).to_vec(),
                    None => usize::try_from(offset)
                        .ok()
                        .and_then(|o| head.get(o..))
                        .map(|b| b.get(..len).unwrap_or(b).to_vec())
                        .unwrap_or_default(),
                })
            };
            match judge(head, fs, Path::new("/dev/fuzz"), || Ok(size), read) {
                Ok(()) => assert_eq!(found, [fs.name()], "judged fit as {fs}"),
                Err(e) => assert_ne!(e.code(), AgentCode::Internal, "{e}"),
            }
        }
    }
}

/// A LUKS2 header on an untrusted disk: the disk's first bytes, zeros
/// after them (`crate::luks2::fuzz` says what must hold).
pub fn luks2_header(data: &[u8]) {
    crate::luks2::fuzz::fuzz_header(data);
}

/// A request's `mount_options`: the first byte's low bit is `read_only`,
/// the next bit whether the guest has SELinux, the rest is the list, one
/// option string per line, taken as the server takes it (SELinux context
/// options left out without SELinux, then parsed). What is accepted must
/// keep the promises of docs/api.md and docs/semantics.md: no NUL, data that
/// fits a page, read-only when asked, no option naming another device or a
/// backup superblock, and an ext4 whose errors behaviour is the agent's
/// (remount-ro) or the request's (continue, remount-ro), never panic. Only
/// context options are left out, and all of them.
pub fn mount_options(data: &[u8]) {
    let Some((&knobs, rest)) = data.split_first() else {
        return;
    };
    let (read_only, selinux) = (knobs & 1 == 1, knobs & 2 == 2);
    // Protobuf strings are UTF-8.
    let options: Vec<String> = rest
        .split(|b| *b == b'\n')
        .map(|o| String::from_utf8_lossy(o).into_owned())
        .collect();
    let (options, left_out) = without_contexts(&options, selinux);
    for o in &left_out {
        let key = o.split_once('=').map_or(o.as_str(), |(k, _)| k);
        assert!(
            ["context", "fscontext", "defcontext", "rootcontext"].contains(&key),
            "{o:?} left out"
        );
    }
    assert!(selinux || without_contexts(&options, false).1.is_empty());
    match parse_options(&options, read_only) {
        Ok(m) => {
            assert!(m.data.len() <= 4000, "{} bytes of data", m.data.len());
            assert!(!m.data.contains('\0'), "a NUL in {:?}", m.data);
            for fs in ["ext4", "xfs"] {
                let data = m.kernel_data(fs);
                let keys = data
                    .split(',')
                    .map(|o| o.split_once('=').map_or(o, |(k, _)| k));
                for key in keys {
                    assert!(
                        ![
                            "journal_dev",
                            "journal_path",
                            "logdev",
                            "rtdev",
                            "sb",
                            "source"
                        ]
                        .contains(&key),
                        "{key} passed: {data:?}"
                    );
                }
                let errors: Vec<&str> = data
                    .split(',')
                    .filter_map(|o| o.strip_prefix("errors="))
                    .collect();
                assert!(
                    errors
                        .iter()
                        .all(|e| ["continue", "remount-ro"].contains(e)),
                    "{fs} mounted with {data:?}"
                );
                if fs == "ext4" {
                    assert!(!errors.is_empty(), "ext4 mounted without errors=: {data:?}");
                }
            }
            #[allow(clippy::unnecessary_cast)]
            let rdonly = libc::MS_RDONLY as u64;
            assert!(!read_only || m.flags & rdonly != 0, "read_only lost");
        }
        Err(e) => assert_eq!(
            crate::mount::error::Error::from(e).code(),
            AgentCode::InvalidArgument
        ),
    }
}

/// A path as the kernel writes it in mountinfo (fs/proc_namespace.c): space,
/// tab, newline and backslash as `\ooo`, every other byte as it is.
fn kernel_escaped(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    for &b in path {
        if b" \t\n\\".contains(&b) {
            out.extend_from_slice(format!("\\{b:03o}").as_bytes());
        } else {
            out.push(b);
        }
    }
    out
}

/// The size a frame took on the wire, after checking it against the limit.
fn checked_size(frame: &Frame, max: usize) -> usize {
    let h = match frame {
        Frame::Whole(h, body) => {
            assert_eq!(
                body.len(),
                h.len as usize,
                "a frame's payload is not its length"
            );
            assert!(body.len() <= max, "a payload over the limit was stored");
            h
        }
        Frame::TooLarge(h) => {
            assert!(h.len as usize > max, "a frame within the limit was refused");
            h
        }
    };
    HEADER_LEN + h.len as usize
}

/// Puts one frame through the connection's rules and, if admitted, the
/// service table, and checks the answer.
fn answer(conn: &mut Conn, methods: &Table, out: &Outbox, frame: Frame, max: usize) {
    let stream = match &frame {
        Frame::Whole(h, _) | Frame::TooLarge(h) => h.stream,
    };
    if let Frame::Whole(_, body) = &frame {
        same_envelope(body);
    }
    match conn.admit(frame, methods, max) {
        Admit::Refuse(f, code, why) => {
            assert_ne!(code, Code::INTERNAL, "{why}");
            check_answer(&f, stream);
        }
        Admit::Run {
            stream,
            method,
            req,
        } => {
            let job = Job {
                conn: 1,
                fd: -1,
                stream,
                method,
                req,
                gone: conn.gone_rx(),
                wire: conn.wire.clone(),
            };
            let (answer, failure) = dispatch::run(methods, job, out);
            if let Some((code, why)) = failure {
                assert_ne!(code, Code::INTERNAL, "{why}");
            }
            let f = frame::response(stream, &answer).expect("an answer too large for a frame");
            check_answer(&f, stream);
        }
    }
}

/// An envelope the agent reads in place is the one protobuf decodes.
fn same_envelope(body: &[u8]) {
    let Some(p) = envelope::plain(body) else {
        return;
    };
    let r = ttrpc::Request::parse_from_bytes(body).expect("protobuf refuses a plain envelope");
    assert_eq!(
        (
            r.service.as_str(),
            r.method.as_str(),
            &r.payload[..],
            r.timeout_nano
        ),
        (p.service, p.method, p.payload, p.timeout_nano),
    );
    assert!(r.metadata.is_empty(), "a plain envelope with metadata");
    assert!(
        r.special_fields.unknown_fields().iter().next().is_none(),
        "a plain envelope with unknown fields"
    );
}

/// A response frame on `stream` whose payload is a ttrpc Response, not INTERNAL.
fn check_answer(f: &[u8], stream: u32) {
    let head: &[u8; HEADER_LEN] = f
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .expect("an answer shorter than a frame header");
    let h = Header::parse(head);
    assert_eq!((h.kind, h.stream), (TYPE_RESPONSE, stream));
    assert_eq!(h.len as usize, f.len() - HEADER_LEN);
    let res = ttrpc::Response::parse_from_bytes(&f[HEADER_LEN..]).expect("an undecodable answer");
    assert_ne!(
        res.status.code.value(),
        Code::INTERNAL as i32,
        "{}",
        res.status.message
    );
}

/// A descriptor for a connection that is never read or written.
fn stand_in() -> OwnedFd {
    rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .expect("/dev/null")
}

/// The agent's own service table (lanes, direct answers and all) over a
/// volume table that refuses every operation ([`Refusing`]).
fn methods() -> Table {
    let (tx, _rx) = std::sync::mpsc::channel();
    let service = Service::new(
        Arc::new(Refusing),
        crate::logging::discard(),
        Instant::now(),
        Arc::new(Mutex::new(Timeline::default())),
        tx,
        Arc::new(Gate::new(true)),
    );
    table(Arc::new(service))
}

/// A volume table that refuses every operation, as a table shutting down
/// does: the service has translated and validated the request by then, so
/// a request reaches it only as the agent would act on it. Its root is the
/// guest's default, spelled canonically: a target is checked beneath it by
/// validate.rs's rule, as the agent's table checks one beneath its own.
struct Refusing;

fn refused<T>() -> Result<T, Error> {
    Err(crate::volumes::error::Error::ShuttingDown.into())
}

impl VolumeTable for Refusing {
    fn target(&self, given: &str) -> Result<PathBuf, Invalid> {
        validate::target(Path::new(ROOT), given)
    }
    fn publish(&self, _: &PublishRequest, _: &Cancel) -> Result<Published, Error> {
        refused()
    }
    fn unpublish(&self, _: &str, _: &Cancel) -> Result<bool, Error> {
        refused()
    }
    fn stats(&self, _: &str, _: &Cancel) -> Result<(Option<Measured>, Condition), Error> {
        refused()
    }
    fn expand(&self, _: &str, _: u64, _: Duration, _: &Cancel) -> Result<Expanded, Error> {
        refused()
    }
    fn bind(&self, _: &BindRequest, _: &Cancel) -> Result<BindOutcome, Error> {
        refused()
    }
    fn unmount(&self, _: &Path, _: &Cancel) -> Result<bool, Error> {
        refused()
    }
    fn list(&self) -> Vec<VolumeInfo> {
        Vec::new()
    }
    fn freeze(
        &self,
        _: &[String],
        _: Duration,
        _: Option<&str>,
        _: &Cancel,
    ) -> Result<Frozen, Error> {
        refused()
    }
    fn thaw(&self, _: &Thaw) -> Result<Vec<String>, Error> {
        refused()
    }
    fn trim(&self, _: &str, _: u64, _: &Cancel) -> Result<Trimmed, Error> {
        refused()
    }
    fn health(&self, _: &str, _: &Cancel) -> Result<Vec<Said>, Error> {
        refused()
    }
    fn shutdown(&self) -> u32 {
        0
    }
    fn state_problem(&self) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records a real agent wrote (fuzz/seeds.py) decode against the
    /// root the target uses, so fuzzing starts from records that are accepted.
    #[test]
    fn the_seed_records_decode() {
        for text in [
            include_bytes!("../fuzz/corpus/state_record/vol-1.vol").as_slice(),
            include_bytes!("../fuzz/corpus/state_record/blk-1.vol").as_slice(),
        ] {
            assert!(
                crate::volumes::state::fuzz_record(text, Path::new(ROOT)),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
    }

    /// The heads of real mkfs'd disks (fuzz/seeds.py) are judged fit at the
    /// size they were made, so fuzzing starts from disks that are accepted.
    #[test]
    fn the_seed_superblocks_are_judged_fit() {
        let fit = |head: &[u8], fs, mib: u64| {
            judge(
                head,
                fs,
                Path::new("seed"),
                || Ok(mib << 20),
                |_, _| Ok(Vec::new()),
            )
        };
        let ext4 = include_bytes!("../fuzz/corpus/superblock/ext4");
        let xfs = include_bytes!("../fuzz/corpus/superblock/xfs");
        fit(ext4, FsType::Ext4, 64).unwrap();
        fit(xfs, FsType::Xfs, 320).unwrap();
        assert!(fit(ext4, FsType::Ext4, 63).is_err());
        assert!(fit(xfs, FsType::Ext4, 320).is_err());
    }

    /// One request for `method` carrying `payload`, through the connection's
    /// rules and the service table: the decoded ttrpc Response.
    fn run_one(method: &str, payload: Vec<u8>) -> ttrpc::Response {
        let mut env = ttrpc::Request::new();
        env.service = "crust.v1.Agent".into();
        env.method = method.into();
        env.payload = payload;
        let body = env.write_to_bytes().unwrap();
        let mut conn = Conn::new(stand_in(), 1024);
        let methods = methods();
        let frame = Frame::Whole(
            Header {
                len: u32::try_from(body.len()).unwrap(),
                stream: 1,
                kind: TYPE_REQUEST,
                flags: 0,
            },
            body,
        );
        let Admit::Run {
            stream,
            method,
            req,
        } = conn.admit(frame, &methods, 1024)
        else {
            panic!("refused");
        };
        let job = Job {
            conn: 1,
            fd: -1,
            stream,
            method,
            req,
            gone: conn.gone_rx(),
            wire: conn.wire.clone(),
        };
        let (answer, failure) = dispatch::run(&methods, job, &Outbox::new());
        assert!(failure.is_none(), "{failure:?}");
        ttrpc::Response::parse_from_bytes(&answer).unwrap()
    }

    /// The entries reject nothing silently: a good request is admitted, runs
    /// through the service's translation and validation and reaches the
    /// table (whose refusal it gets), and a bad one is refused before it.
    #[test]
    fn a_good_request_reaches_the_table_and_a_bad_one_does_not() {
        use crust_protocols::crust as pb;
        let mut req = pb::UnpublishVolumeRequest::new();
        req.volume_id = "vol-1".into();
        let res = run_one("UnpublishVolume", req.write_to_bytes().unwrap());
        assert_eq!(
            res.status.code.value(),
            Code::FAILED_PRECONDITION as i32,
            "{}",
            res.status.message
        );
        assert!(
            res.status.message.contains("shutting down"),
            "{}",
            res.status.message
        );
        req.volume_id = "../vol-1".into();
        let res = run_one("UnpublishVolume", req.write_to_bytes().unwrap());
        assert_eq!(res.status.code.value(), Code::INVALID_ARGUMENT as i32);
        let mut bind = pb::BindMountRequest::new();
        bind.volume_id = "vol-1".into();
        bind.target = "/elsewhere".into();
        let res = run_one("BindMount", bind.write_to_bytes().unwrap());
        assert_eq!(res.status.code.value(), Code::INVALID_ARGUMENT as i32);
        assert!(
            res.status.message.contains("outside the agent's root"),
            "{}",
            res.status.message
        );
    }

    /// Every method the target can pick is served by the agent's service,
    /// none by ttrpc's default for a method a service leaves out.
    #[test]
    fn every_method_is_the_services() {
        for (name, _) in METHODS {
            let res = run_one(name, Vec::new());
            assert!(
                !res.status.message.contains("is not supported"),
                "{name}: {}",
                res.status.message
            );
        }
    }

    /// fuzz/seeds.py names each recorded request's method by its index in
    /// the list the target picks from: the two lists are one.
    #[test]
    fn the_seeds_number_the_methods_as_the_target_does() {
        let seeds = include_str!("../fuzz/seeds.py");
        let list = seeds
            .split_once("\nMETHODS = [")
            .and_then(|(_, rest)| rest.split_once(']'))
            .expect("seeds.py has a METHODS list")
            .0;
        let names: Vec<&str> = list
            .split(',')
            .map(|n| n.trim().trim_matches('"'))
            .filter(|n| !n.is_empty())
            .collect();
        let ours: Vec<&str> = METHODS.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ours);
    }
}

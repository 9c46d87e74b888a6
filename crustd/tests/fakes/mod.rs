//! Stand-ins for a sandbox, so crustd's own process can be tested on the host
//! without a VM: crust-client's stand-in QEMU monitor (`qmp::fake`: block
//! nodes and devices kept the way QEMU keeps them, each node's device open
//! while it is plugged; [`die`] is the VM's process ending, its devices
//! closed), and a crust.v1 agent over ttrpc whose answers a test chooses,
//! keeping freezes as leases the way the agent does (`leases`). Both log
//! what they were asked. [`lossy`] puts a connection that loses answers
//! between crustd and an agent.
#![allow(dead_code, unused_imports)]

pub mod leases;

use std::io::Write;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc;
use crust_protocols::protobuf::MessageField;
use crust_protocols::ttrpc;
use serde_json::json;

pub use crust_client::qmp::fake::{die, qemu, qemu_of, Hypervisor, Qemu};

/// How the fake agent answers PublishVolume.
#[derive(Clone)]
pub enum OnPublish {
    Ok,
    /// An error status with this code and message.
    Fail(ttrpc::Code, &'static str),
    /// Sleep, then answer Ok.
    Slow(Duration),
    /// Mount, then walk past the caller's deadline, as the agent does with a
    /// huge volume: list the volume as publishing, and answer
    /// DEADLINE_EXCEEDED with this message when the deadline it was told
    /// (`timeout_nano`) passes.
    Outlive(&'static str),
    /// Answer OK with this guest path (a hostile guest's).
    Path(String),
}

/// How the fake agent answers FreezeVolumes (after its lease rules).
#[derive(Clone, Debug)]
pub enum OnFreeze {
    Ok,
    /// Refuses with this code and message, freezing nothing.
    Fail(ttrpc::Code, &'static str),
    /// Freezes at once, then answers only after this long (an answer that
    /// comes after crustd stopped waiting).
    Late(Duration),
    /// FIFREEZE returns once the test opens this gate (sets it), whatever
    /// the time (a busy pod's flush, as long as a test needs): the freeze
    /// is being made meanwhile.
    Until(Arc<AtomicBool>),
}

/// What the fake agent was asked, and how it answers.
pub struct AgentState {
    pub on_publish: OnPublish,
    /// "publish VOLUME SERIAL FS GID [OnRootMismatch] [-o OPTION]... [ro]",
    /// "unpublish VOLUME", "stats VOLUME", "expand VOLUME BYTES".
    pub log: Vec<String>,
    /// The deadline each PublishVolume was told (its ttrpc `timeout_nano`).
    pub told: Vec<Duration>,
    /// Each PublishVolume request as it arrived, whole.
    pub published: Vec<pb::PublishVolumeRequest>,
    /// Each FreezeVolumes as it arrived: (unix ms then, its timeout_ms).
    pub freezes_told: Vec<(u64, u32)>,
    /// What ListVolumes lists: volume id → still publishing.
    pub listed: std::collections::BTreeMap<String, bool>,
    /// How FreezeVolumes answers.
    pub on_freeze: OnFreeze,
    /// Its freezes.
    pub leases: leases::Leases,
    /// What GetVolumeHealth answers: (status, reason, message).
    pub health: Vec<(pb::volume_health::Status, String, String)>,
    /// A discard that cuts the host's image: TrimVolume truncates this
    /// file to this many bytes (microsandbox #1472's trap).
    pub trim_truncates: Option<(PathBuf, u64)>,
}

pub struct FakeAgent {
    state: Arc<Mutex<AgentState>>,
}

impl FakeAgent {
    /// Logs a call (see [`AgentState::log`]).
    fn note(&self, line: String) {
        self.state.lock().unwrap().log.push(line);
    }
}

impl crust_ttrpc::Agent for FakeAgent {
    fn publish_volume(
        &self,
        ctx: &ttrpc::TtrpcContext,
        r: pb::PublishVolumeRequest,
    ) -> ttrpc::Result<pb::PublishVolumeResponse> {
        let told = Duration::from_nanos(u64::try_from(ctx.timeout_nano).unwrap_or(0));
        let on = {
            let mut s = self.state.lock().unwrap();
            s.told.push(told);
            s.published.push(r.clone());
            let mut line = format!(
                "publish {} {} {} {}",
                r.volume_id,
                r.serial(),
                r.fs_type,
                r.fs_group.as_ref().map_or(-1, |g| i64::from(g.gid))
            );
            if r.fs_group.as_ref().is_some_and(|g| {
                g.change_policy.enum_value() == Ok(pb::FsGroupChangePolicy::ON_ROOT_MISMATCH)
            }) {
                line.push_str(" OnRootMismatch");
            }
            for o in &r.mount_options {
                line.push_str(&format!(" -o {o}"));
            }
            if r.read_only {
                line.push_str(" ro");
            }
            s.log.push(line);
            s.on_publish.clone()
        };
        match on {
            OnPublish::Fail(code, msg) => return Err(leases::status(code, msg)),
            OnPublish::Slow(d) => std::thread::sleep(d),
            OnPublish::Outlive(msg) => {
                self.state
                    .lock()
                    .unwrap()
                    .listed
                    .insert(r.volume_id.clone(), true);
                std::thread::sleep(told);
                return Err(leases::status(ttrpc::Code::DEADLINE_EXCEEDED, msg));
            }
            OnPublish::Path(p) => {
                let mut resp = pb::PublishVolumeResponse::new();
                resp.guest_path = p;
                return Ok(resp);
            }
            OnPublish::Ok => {}
        }
        self.state
            .lock()
            .unwrap()
            .listed
            .insert(r.volume_id.clone(), false);
        let mut resp = pb::PublishVolumeResponse::new();
        resp.guest_path = format!("/run/crust/volumes/{}", r.volume_id);
        resp.device = "/dev/vdb".into();
        Ok(resp)
    }

    fn unpublish_volume(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::UnpublishVolumeRequest,
    ) -> ttrpc::Result<pb::UnpublishVolumeResponse> {
        let mut s = self.state.lock().unwrap();
        s.log.push(format!("unpublish {}", r.volume_id));
        s.listed.remove(&r.volume_id);
        s.leases
            .end_volume(&r.volume_id, "thawed when the volume was unpublished");
        Ok(pb::UnpublishVolumeResponse::new())
    }

    fn list_volumes(
        &self,
        _: &ttrpc::TtrpcContext,
        _: pb::ListVolumesRequest,
    ) -> ttrpc::Result<pb::ListVolumesResponse> {
        let s = self.state.lock().unwrap();
        let mut resp = pb::ListVolumesResponse::new();
        for (id, publishing) in &s.listed {
            let mut v = pb::VolumeInfo::new();
            v.volume_id = id.clone();
            if *publishing {
                v.state = pb::VolumeState::VOLUME_STATE_PUBLISHING.into();
                v.ownership_done = 5000;
            }
            resp.volumes.push(v);
        }
        Ok(resp)
    }

    fn get_volume_stats(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::GetVolumeStatsRequest,
    ) -> ttrpc::Result<pb::GetVolumeStatsResponse> {
        self.note(format!("stats {}", r.volume_id));
        let mut resp = pb::GetVolumeStatsResponse::new();
        for (unit, (a, t, u)) in [
            (pb::volume_usage::Unit::BYTES, (700, 1000, 300)),
            (pb::volume_usage::Unit::INODES, (90, 100, 10)),
        ] {
            let mut x = pb::VolumeUsage::new();
            x.available = a;
            x.total = t;
            x.used = u;
            x.unit = unit.into();
            resp.usage.push(x);
        }
        let mut c = pb::VolumeCondition::new();
        c.abnormal = true;
        c.message = "3 I/O errors".into();
        resp.condition = MessageField::some(c);
        Ok(resp)
    }

    fn expand_volume(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::ExpandVolumeRequest,
    ) -> ttrpc::Result<pb::ExpandVolumeResponse> {
        self.note(format!("expand {} {}", r.volume_id, r.required_bytes));
        let mut resp = pb::ExpandVolumeResponse::new();
        resp.capacity_bytes = r.required_bytes;
        Ok(resp)
    }

    fn freeze_volumes(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::FreezeVolumesRequest,
    ) -> ttrpc::Result<pb::FreezeVolumesResponse> {
        let (on, id) = {
            let mut s = self.state.lock().unwrap();
            s.freezes_told.push((leases::unix_ms(), r.timeout_ms));
            s.log.push(format!(
                "freeze {} {} {}",
                r.volume_ids.join(","),
                r.timeout_ms,
                r.freeze_id
            ));
            let on = s.on_freeze.clone();
            if let OnFreeze::Fail(code, msg) = on {
                return Err(leases::status(code, msg));
            }
            let AgentState { leases, listed, .. } = &mut *s;
            let begun = leases.begin(&r.freeze_id, &r.volume_ids, r.timeout_ms, |v| {
                listed.contains_key(v)
            })?;
            (on, begun)
        };
        let id = match id {
            Some(id) => {
                if let OnFreeze::Until(gate) = &on {
                    let t0 = std::time::Instant::now();
                    while !gate.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(60) {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                self.state.lock().unwrap().leases.complete(&id)?;
                if let OnFreeze::Late(d) = on {
                    std::thread::sleep(d);
                }
                id
            }
            None => r.freeze_id.clone(),
        };
        let s = self.state.lock().unwrap();
        let l = &s.leases.leases[&id];
        let mut resp = pb::FreezeVolumesResponse::new();
        resp.freeze_id = id.clone();
        resp.timeout_ms = l.timeout_ms;
        resp.thaw_at_unix_ms = l.thaw_at_unix_ms;
        Ok(resp)
    }

    fn thaw_volumes(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::ThawVolumesRequest,
    ) -> ttrpc::Result<pb::ThawVolumesResponse> {
        let mut s = self.state.lock().unwrap();
        let invalid = |m: &str| Err(leases::status(ttrpc::Code::INVALID_ARGUMENT, m));
        let thawed = match (r.force, r.freeze_id.is_empty(), r.volume_ids.is_empty()) {
            (false, false, true) => {
                s.log.push(format!("thaw {}", r.freeze_id));
                s.leases.thaw(&r.freeze_id)?
            }
            (true, true, false) => {
                s.log
                    .push(format!("thaw --force {}", r.volume_ids.join(",")));
                let AgentState { leases, listed, .. } = &mut *s;
                leases.force(&r.volume_ids, |v| listed.contains_key(v))?
            }
            (false, _, false) => return invalid("volume_ids without force"),
            (true, false, _) => return invalid("force with a freeze_id"),
            _ => return invalid("neither a freeze_id nor volume_ids"),
        };
        let mut resp = pb::ThawVolumesResponse::new();
        resp.thawed = thawed;
        Ok(resp)
    }

    fn trim_volume(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::TrimVolumeRequest,
    ) -> ttrpc::Result<pb::TrimVolumeResponse> {
        let mut s = self.state.lock().unwrap();
        s.log
            .push(format!("trim {} {}", r.volume_id, r.min_extent_bytes));
        if let Some((image, bytes)) = &s.trim_truncates {
            let f = std::fs::OpenOptions::new().write(true).open(image).unwrap();
            f.set_len(*bytes).unwrap();
        }
        let mut resp = pb::TrimVolumeResponse::new();
        resp.trimmed_bytes = 12345;
        Ok(resp)
    }

    fn get_volume_health(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::GetVolumeHealthRequest,
    ) -> ttrpc::Result<pb::GetVolumeHealthResponse> {
        let mut s = self.state.lock().unwrap();
        s.log.push(format!("health {}", r.volume_id));
        let mut resp = pb::GetVolumeHealthResponse::new();
        for (status, reason, message) in &s.health {
            let mut h = pb::VolumeHealth::new();
            h.status = (*status).into();
            h.reason = reason.clone();
            h.message = message.clone();
            resp.health.push(h);
        }
        Ok(resp)
    }
}

/// A fake agent serving on `unix://path`; keep the server alive while in use.
pub fn agent(path: &Path) -> (Arc<Mutex<AgentState>>, ttrpc::Server) {
    let state = Arc::new(Mutex::new(AgentState {
        on_publish: OnPublish::Ok,
        log: Vec::new(),
        told: Vec::new(),
        published: Vec::new(),
        freezes_told: Vec::new(),
        listed: Default::default(),
        on_freeze: OnFreeze::Ok,
        leases: leases::Leases::default(),
        health: Vec::new(),
        trim_truncates: None,
    }));
    let svc: Arc<dyn crust_ttrpc::Agent + Send + Sync> = Arc::new(FakeAgent {
        state: state.clone(),
    });
    let mut server = ttrpc::Server::new()
        .bind(&format!("unix://{}", path.display()))
        .unwrap()
        .register_service(crust_ttrpc::create_agent(svc));
    server.start().unwrap();
    (state, server)
}

/// Loop devices (the test fails where there are none) and a fresh
/// temporary directory whose `sandboxes` is the registry, holding a
/// [`sandbox`] for each of `ids`: (the directory, the registry, the
/// sandboxes). The registry is made only for a sandbox.
pub fn sandboxes<const N: usize>(ids: [&str; N]) -> (tempfile::TempDir, PathBuf, [Sandbox; N]) {
    crust_testkit::needs::loop_devices();
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let sbs = ids.map(|id| sandbox(&reg, id));
    (t, reg, sbs)
}

/// What most tests start from: [`sandboxes`] with pod-a, a
/// disk of `mib` MiB with no filesystem, and crustd serving the registry,
/// run with `extra`: (the directory, the registry, the sandbox, the disk,
/// crustd). Bound as locals in that order, crustd goes first and the
/// directory last.
pub fn pod_a(
    mib: u64,
    extra: &[&str],
) -> (
    tempfile::TempDir,
    PathBuf,
    Sandbox,
    crust_testkit::LoopDisk,
    crust_testkit::crustd::Crustd,
) {
    let (t, reg, [sb]) = sandboxes(["pod-a"]);
    let disk = crust_testkit::LoopDisk::new(mib, None);
    let d = crust_testkit::crustd::Crustd::start(&reg, extra);
    (t, reg, sb, disk, d)
}

/// A registry entry for sandbox `id` in `reg` with a fake QEMU and agent.
pub struct Sandbox {
    pub id: String,
    pub dir: PathBuf,
    pub qemu: Qemu,
    pub agent: Arc<Mutex<AgentState>>,
    _server: ttrpc::Server,
}

pub fn sandbox(reg: &Path, id: &str) -> Sandbox {
    let dir = reg.join(id);
    std::fs::create_dir_all(&dir).unwrap();
    let qemu = qemu(&dir.join("qmp.sock"));
    let (agent, server) = agent(&dir.join("agent.sock"));
    std::fs::write(
        dir.join("sandbox.json"),
        json!({"qmp": dir.join("qmp.sock"), "agent": format!("unix://{}", dir.join("agent.sock").display())})
            .to_string(),
    )
    .unwrap();
    Sandbox {
        id: id.into(),
        dir,
        qemu,
        agent,
        _server: server,
    }
}

impl Sandbox {
    /// What the fake agent was asked so far (see [`AgentState::log`]).
    pub fn agent_log(&self) -> Vec<String> {
        self.agent.lock().unwrap().log.clone()
    }

    /// The PublishVolume requests the fake agent was sent so far, whole.
    pub fn published(&self) -> Vec<pb::PublishVolumeRequest> {
        self.agent.lock().unwrap().published.clone()
    }

    /// Whether the fake agent was asked a call whose log line starts with
    /// `call` (see [`AgentState::log`]).
    pub fn agent_was_asked(&self, call: &str) -> bool {
        self.agent
            .lock()
            .unwrap()
            .log
            .iter()
            .any(|l| l.starts_with(call))
    }
}

/// A hybrid vsock backend at `path` in front of a fake agent, as a VMM's
/// (Firecracker, Cloud Hypervisor) is in front of its guest: each
/// connection's `CONNECT PORT` line is answered `OK`, then its bytes are
/// carried to and from the fake agent (served at `path` + `.agent`) whatever
/// the port. For sandboxes whose agent address must be `hvsock://`, as
/// Kata's `persist.json` names it.
pub fn hvsock_agent(path: &Path) -> (Arc<Mutex<AgentState>>, ttrpc::Server) {
    let inner = path.with_extension("agent");
    let served = agent(&inner);
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            let inner = inner.clone();
            std::thread::spawn(move || carry(s, &inner));
        }
    });
    served
}

/// Answers one hybrid vsock `CONNECT`, then carries bytes both ways.
fn carry(mut outer: std::os::unix::net::UnixStream, inner: &Path) {
    use std::io::Read;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        if outer.read_exact(&mut b).is_err() {
            return;
        }
        line.push(b[0]);
    }
    if !line.starts_with(b"CONNECT ") || writeln!(outer, "OK 1").is_err() {
        return;
    }
    let Ok(mut to_agent) = std::os::unix::net::UnixStream::connect(inner) else {
        return;
    };
    let (Ok(mut from_agent), Ok(mut to_outer)) = (to_agent.try_clone(), outer.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from_agent, &mut to_outer);
        let _ = to_outer.shutdown(std::net::Shutdown::Both);
    });
    let _ = std::io::copy(&mut outer, &mut to_agent);
    let _ = to_agent.shutdown(std::net::Shutdown::Both);
}

/// Puts a connection that loses answers between crustd and `sb`'s agent:
/// sandbox.json names a socket beside the agent's, which passes every byte
/// on, except that while the counter answered is above 0, a FreezeVolumes
/// request reaches the agent but its answer never comes back: the
/// connection is cut once the agent has answered (the counter counts down).
pub fn lossy(sb: &Sandbox) -> Arc<AtomicU32> {
    let lose = Arc::new(AtomicU32::new(0));
    let front = sb.dir.join("agent-lossy.sock");
    let back = sb.dir.join("agent.sock");
    let l = UnixListener::bind(&front).unwrap();
    let lose2 = lose.clone();
    std::thread::spawn(move || {
        for client in l.incoming() {
            let Ok(client) = client else { return };
            let Ok(agent) = std::os::unix::net::UnixStream::connect(&back) else {
                continue;
            };
            let lose = lose2.clone();
            std::thread::spawn(move || relay(client, agent, &lose));
        }
    });
    std::fs::write(
        sb.dir.join("sandbox.json"),
        json!({"qmp": sb.dir.join("qmp.sock"), "agent": format!("unix://{}", front.display())})
            .to_string(),
    )
    .unwrap();
    lose
}

/// Passes ttrpc frames from `client` to `agent` and bytes back, until a
/// FreezeVolumes is to be lost (see [`lossy`]).
fn relay(
    client: std::os::unix::net::UnixStream,
    agent: std::os::unix::net::UnixStream,
    lose: &AtomicU32,
) {
    use std::io::Read;
    let cut = Arc::new(AtomicBool::new(false));
    let (answered, answer) = std::sync::mpsc::channel::<()>();
    let (mut from_agent, mut to_client) = (agent.try_clone().unwrap(), client.try_clone().unwrap());
    let cut2 = cut.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while let Ok(n) = from_agent.read(&mut buf) {
            if n == 0 {
                break;
            }
            if cut2.load(Ordering::SeqCst) {
                // The answer to the lost request: dropped.
                let _ = answered.send(());
                break;
            }
            if to_client.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });
    let (mut from_client, mut to_agent) = (client.try_clone().unwrap(), agent.try_clone().unwrap());
    loop {
        // A ttrpc frame: a 10-byte header whose first 4 bytes are the
        // payload's length (big-endian), then the payload.
        let mut head = [0u8; 10];
        if from_client.read_exact(&mut head).is_err() {
            break;
        }
        let len =
            usize::try_from(u32::from_be_bytes([head[0], head[1], head[2], head[3]])).unwrap();
        let mut payload = vec![0u8; len];
        if from_client.read_exact(&mut payload).is_err() {
            break;
        }
        let freeze = payload.windows(13).any(|w| w == b"FreezeVolumes");
        let lost = freeze
            && lose
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if lost {
            cut.store(true, Ordering::SeqCst);
        }
        if to_agent.write_all(&head).is_err() || to_agent.write_all(&payload).is_err() {
            break;
        }
        if lost {
            let _ = answer.recv_timeout(Duration::from_secs(30));
            break;
        }
    }
    let _ = client.shutdown(std::net::Shutdown::Both);
    let _ = agent.shutdown(std::net::Shutdown::Both);
}

//! Stand-ins for a sandbox, so crustd's own process can be tested on the host
//! without a VM: a QEMU monitor that keeps block nodes and devices the way
//! QEMU does (it opens each node's device read-write at blockdev-add and
//! closes it at blockdev-del, as QEMU does, and sends DEVICE_DELETED after
//! device_del's reply, as QEMU does once the guest lets go), and a crust.v1
//! agent over ttrpc whose answers a test chooses, keeping freezes as leases
//! the way the agent does (`leases`). Both log what they were asked.
//! [`die`] is the VM's process ending: its devices closed; [`lossy`] puts
//! a connection that loses answers between crustd and an agent.
#![allow(dead_code)]

pub mod leases;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc;
use crust_protocols::protobuf::MessageField;
use crust_protocols::ttrpc;
use serde_json::{json, Value};

/// What the fake QEMU holds and was asked.
#[derive(Default)]
pub struct QemuState {
    /// Block nodes: name → size in bytes.
    pub nodes: BTreeMap<String, u64>,
    /// Devices: id → (node, serial).
    pub devices: BTreeMap<String, (String, String)>,
    /// Every command but qmp_capabilities and the queries, with its arguments.
    pub log: Vec<String>,
    /// device_add fails (as for a full PCI bus).
    pub refuse_device_add: bool,
    /// device_del is accepted but the guest never lets go.
    pub never_release: bool,
    /// The device each node has open, read-write, as QEMU's host_device driver does.
    pub open: BTreeMap<String, std::fs::File>,
    /// How long a command takes before QEMU answers it (a busy monitor).
    pub delay: BTreeMap<String, Duration>,
    /// blockdev-del answers "in use" this many more times after its device
    /// left the list, as QEMU does while the device's finalization lags.
    pub node_in_use: u32,
}

pub type Qemu = Arc<Mutex<QemuState>>;

/// Serves QMP at `path`, one client at a time, as QEMU does.
pub fn qemu(path: &Path) -> Qemu {
    let l = UnixListener::bind(path).unwrap();
    let st: Qemu = Arc::default();
    let st2 = st.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            let mut w = s.try_clone().unwrap();
            let _ = writeln!(w, "{}", json!({"QMP": {"version": {}, "capabilities": []}}));
            for line in BufReader::new(s).lines() {
                let Ok(line) = line else { break };
                let m: Value = serde_json::from_str(&line).unwrap();
                let delay = m["execute"]
                    .as_str()
                    .and_then(|c| st2.lock().unwrap().delay.get(c).copied());
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                let (reply, events) = answer(&st2, &m);
                let _ = writeln!(w, "{reply}");
                for e in events {
                    let _ = writeln!(w, "{e}");
                }
            }
        }
    });
    st
}

/// The VM's process ends: every device it had open is closed (its monitor
/// is whatever the test leaves at its socket path).
pub fn die(q: &Qemu) {
    let files = std::mem::take(&mut q.lock().unwrap().open);
    drop(files);
}

fn answer(st: &Qemu, m: &Value) -> (Value, Vec<Value>) {
    let mut s = st.lock().unwrap();
    let cmd = m["execute"].as_str().unwrap();
    let a = &m["arguments"];
    let ok = json!({"return": {}});
    let err = |d: &str| json!({"error": {"class": "GenericError", "desc": d}});
    if !matches!(
        cmd,
        "qmp_capabilities" | "qom-list" | "query-named-block-nodes"
    ) {
        s.log.push(format!("{cmd} {a}"));
    }
    match cmd {
        "qmp_capabilities" => (ok, vec![]),
        "qom-list" => {
            let list: Vec<Value> = s
                .devices
                .keys()
                .map(|d| json!({"name": d, "type": "child<virtio-blk-pci>"}))
                .chain([json!({"name": "type", "type": "string"})])
                .collect();
            (json!({ "return": list }), vec![])
        }
        "query-named-block-nodes" => {
            let list: Vec<Value> = s
                .nodes
                .iter()
                .map(|(n, size)| json!({"node-name": n, "image": {"virtual-size": size}}))
                .collect();
            (json!({ "return": list }), vec![])
        }
        "blockdev-add" => {
            let n = a["node-name"].as_str().unwrap().to_string();
            if s.nodes.contains_key(&n) {
                return (
                    err(&format!("Duplicate nodes with node-name='{n}'")),
                    vec![],
                );
            }
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(!a["read-only"].as_bool().unwrap_or(false))
                .open(a["filename"].as_str().unwrap());
            let mut file = match file {
                Ok(f) => f,
                Err(e) => return (err(&format!("Could not open: {e}")), vec![]),
            };
            let size = std::io::Seek::seek(&mut file, std::io::SeekFrom::End(0)).unwrap_or(0);
            s.nodes.insert(n.clone(), size);
            s.open.insert(n, file);
            (ok, vec![])
        }
        "device_add" => {
            let id = a["id"].as_str().unwrap().to_string();
            if s.refuse_device_add {
                return (err("Bus 'pci.0' does not support hotplugging"), vec![]);
            }
            if s.devices.contains_key(&id) {
                return (err(&format!("Duplicate device ID '{id}'")), vec![]);
            }
            let node = a["drive"].as_str().unwrap().to_string();
            s.devices
                .insert(id, (node, a["serial"].as_str().unwrap().to_string()));
            (ok, vec![])
        }
        "device_del" => {
            let id = a["id"].as_str().unwrap().to_string();
            if !s.devices.contains_key(&id) {
                return (err(&format!("Device '{id}' not found")), vec![]);
            }
            if s.never_release {
                return (ok, vec![]);
            }
            s.devices.remove(&id);
            let ev =
                |data: Value| json!({"event": "DEVICE_DELETED", "data": data, "timestamp": {}});
            (
                ok,
                vec![
                    ev(json!({"path": format!("/machine/peripheral/{id}/virtio-backend")})),
                    ev(json!({"device": id, "path": format!("/machine/peripheral/{id}")})),
                ],
            )
        }
        "blockdev-del" => {
            let n = a["node-name"].as_str().unwrap();
            if s.devices.values().any(|(node, _)| node == n) {
                return (err(&format!("Node '{n}' is busy")), vec![]);
            }
            if s.node_in_use > 0 {
                s.node_in_use -= 1;
                return (err(&format!("Node {n} is in use")), vec![]);
            }
            if s.nodes.remove(n).is_none() {
                return (
                    err(&format!("Failed to find node with node-name='{n}'")),
                    vec![],
                );
            }
            s.open.remove(n);
            (ok, vec![])
        }
        "block_resize" => {
            let n = a["node-name"].as_str().unwrap().to_string();
            s.nodes.insert(n, a["size"].as_u64().unwrap());
            (ok, vec![])
        }
        other => (
            err(&format!("The command {other} has not been found")),
            vec![],
        ),
    }
}

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
    /// What ListVolumes lists: volume id → still publishing.
    pub listed: std::collections::BTreeMap<String, bool>,
    /// How FreezeVolumes answers.
    pub on_freeze: OnFreeze,
    /// Its freezes.
    pub leases: leases::Leases,
    /// What GetVolumeHealth answers: (status, reason, message).
    pub health: Vec<(pb::volume_health::Status, String, String)>,
}

pub struct FakeAgent {
    state: Arc<Mutex<AgentState>>,
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
            OnPublish::Fail(code, msg) => {
                return Err(ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg)))
            }
            OnPublish::Slow(d) => std::thread::sleep(d),
            OnPublish::Outlive(msg) => {
                self.state
                    .lock()
                    .unwrap()
                    .listed
                    .insert(r.volume_id.clone(), true);
                std::thread::sleep(told);
                return Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
                    ttrpc::Code::DEADLINE_EXCEEDED,
                    msg,
                )));
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
        self.state
            .lock()
            .unwrap()
            .log
            .push(format!("stats {}", r.volume_id));
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
        self.state
            .lock()
            .unwrap()
            .log
            .push(format!("expand {} {}", r.volume_id, r.required_bytes));
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
            s.log.push(format!(
                "freeze {} {} {}",
                r.volume_ids.join(","),
                r.timeout_ms,
                r.freeze_id
            ));
            let on = s.on_freeze.clone();
            if let OnFreeze::Fail(code, msg) = on {
                return Err(ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg)));
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
        let invalid = |m: &str| {
            Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
                ttrpc::Code::INVALID_ARGUMENT,
                m,
            )))
        };
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
        listed: Default::default(),
        on_freeze: OnFreeze::Ok,
        leases: leases::Leases::default(),
        health: Vec::new(),
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

//! Stand-ins for a sandbox, so crustd's own process can be tested on the host
//! without a VM: a QEMU monitor that keeps block nodes and devices the way
//! QEMU does (it opens each node's device read-write at blockdev-add and
//! closes it at blockdev-del, as QEMU does, and sends DEVICE_DELETED after
//! device_del's reply, as QEMU does once the guest lets go), and a crust.v1
//! agent over ttrpc whose answers a test chooses. Both log what they were
//! asked. [`die`] is the VM's process ending: its devices closed.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
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
    /// FreezeVolumes answers this error instead of OK.
    pub fail_freeze: Option<(ttrpc::Code, &'static str)>,
    /// ThawVolumes answers ABORTED (the guest's freeze ended by itself).
    pub thaw_aborted: bool,
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
        let mut s = self.state.lock().unwrap();
        s.log.push(format!(
            "freeze {} {}",
            r.volume_ids.join(","),
            r.timeout_ms
        ));
        if let Some((code, msg)) = s.fail_freeze {
            return Err(ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg)));
        }
        let mut resp = pb::FreezeVolumesResponse::new();
        resp.freeze_id = "freeze-1-1".into();
        resp.timeout_ms = r.timeout_ms;
        Ok(resp)
    }

    fn thaw_volumes(
        &self,
        _: &ttrpc::TtrpcContext,
        r: pb::ThawVolumesRequest,
    ) -> ttrpc::Result<pb::ThawVolumesResponse> {
        let mut s = self.state.lock().unwrap();
        s.log.push(format!("thaw {}", r.volume_ids.join(",")));
        if s.thaw_aborted {
            return Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
                ttrpc::Code::ABORTED,
                "freeze-1-1 of volume x ended by itself 3 s ago",
            )));
        }
        Ok(pb::ThawVolumesResponse::new())
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
        fail_freeze: None,
        thaw_aborted: false,
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

//! A stand-in QEMU monitor for tests, one for every crate that drives QMP
//! (this one's, crustd's, crust-vm's): it keeps block nodes and devices the
//! way QEMU does, opens each node's file at blockdev-add (read-write unless
//! the node is read-only) and closes it at blockdev-del, sends
//! DEVICE_DELETED after device_del's reply as QEMU does once the guest lets
//! go, refuses as QEMU refuses (a second device_del of a device on its way
//! out, a node still in use), serves one client at a time, and logs what
//! it was asked. Built for this crate's tests, and for other crates' tests
//! with the `test-util` feature.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_protocols::sync::LockExt;
use serde_json::{json, Value};

/// What the fake QEMU holds and was asked; a test reads and sets it.
#[derive(Debug, Default)]
pub struct QemuState {
    /// Block nodes: name → size in bytes.
    pub nodes: BTreeMap<String, u64>,
    /// Devices: id → (node, serial).
    pub devices: BTreeMap<String, (String, String)>,
    /// Every command but qmp_capabilities and the two queries
    /// (`qom-list`, `query-named-block-nodes`), as `"CMD ARGS"` (`null`
    /// without arguments).
    pub log: Vec<String>,
    /// device_add fails (as for a full PCI bus).
    pub refuse_device_add: bool,
    /// device_del is accepted but the guest never lets go: the device
    /// stays, and another device_del of it is refused as under way.
    pub never_release: bool,
    /// Devices whose device_del the guest has not answered.
    pub leaving: BTreeSet<String>,
    /// The file each node has open, as QEMU's drivers do.
    pub open: BTreeMap<String, std::fs::File>,
    /// How long a command takes before QEMU answers it (a busy monitor).
    pub delay: BTreeMap<String, Duration>,
    /// blockdev-del answers "in use" this many more times after its device
    /// left the list, as QEMU does while the device's finalization lags.
    pub node_in_use: u32,
}

/// The fake's state, shared with the thread that serves it.
pub type Qemu = Arc<Mutex<QemuState>>;

/// Serves QMP at `path`, one client at a time, as QEMU does, for as long
/// as the test process lives. The kernel names this process as the one
/// that listens there.
pub fn qemu(path: &Path) -> Qemu {
    serve(UnixListener::bind(path).unwrap())
}

/// [`qemu`] at `path`, with `hypervisor` named by the kernel as the process
/// that listens there (SO_PEERCRED, SO_PEERPIDFD), as a real QEMU would be:
/// a [`Hypervisor`] whose command line holds `-name NAME`.
pub fn qemu_of(path: &Path, name: &str) -> (Qemu, Hypervisor) {
    let l = UnixListener::bind(path).unwrap();
    let hypervisor = Hypervisor::listening_on(&l, name);
    (serve(l), hypervisor)
}

/// A process standing in for a VM's hypervisor: `sh` waiting on its stdin,
/// its command line holding `-name NAME` as QEMU's does. Made the listener
/// of a fake monitor's socket (it calls `listen()` on the socket this
/// process bound, and the kernel records the last caller as the one who
/// listens), while the fake serves the socket from this process, so a test
/// can let it exit while its socket is still served. It ends when dropped,
/// or with the test process (its stdin then closes).
pub struct Hypervisor {
    child: std::process::Child,
}

impl Hypervisor {
    /// One whose command line holds `-name NAME`, and which calls
    /// `listen()` on `l` before it starts.
    pub fn listening_on(l: &UnixListener, name: &str) -> Hypervisor {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let fd = l.as_raw_fd();
        let listen = move || {
            // SAFETY: listen(2) takes a descriptor and a number by value; the
            // descriptor is the test's listener, inherited by this child.
            match unsafe { libc::listen(fd, 128) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        };
        let mut cmd = Hypervisor::command(name);
        // SAFETY: between fork and exec the child calls only listen(2),
        // which is async-signal-safe, and allocates nothing.
        unsafe { cmd.pre_exec(listen) };
        Hypervisor {
            child: cmd.spawn().unwrap(),
        }
    }

    /// One whose command line holds `-name NAME`, listening nowhere.
    pub fn named(name: &str) -> Hypervisor {
        Hypervisor {
            child: Hypervisor::command(name).spawn().unwrap(),
        }
    }

    fn command(name: &str) -> std::process::Command {
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "read -r line", "-name", name])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        cmd
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// It exits, and is reaped: its pid is free for the next process.
    pub fn exit(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Hypervisor {
    fn drop(&mut self) {
        self.exit();
    }
}

/// Serves QMP on `l`, one client at a time, for as long as the test
/// process lives.
fn serve(l: UnixListener) -> Qemu {
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
                    .and_then(|c| st2.locked().delay.get(c).copied());
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                let (reply, events) = answer(&mut st2.locked(), &m);
                let _ = writeln!(w, "{reply}");
                for e in events {
                    let _ = writeln!(w, "{e}");
                }
            }
        }
    });
    st
}

/// The VM's process ends: every file it had open is closed (its monitor is
/// whatever the test leaves at its socket path).
pub fn die(q: &Qemu) {
    let files = std::mem::take(&mut q.locked().open);
    drop(files);
}

/// QEMU's error reply.
fn error(class: &str, desc: &str) -> Value {
    json!({"error": {"class": class, "desc": desc}})
}

fn refused(desc: &str) -> (Value, Vec<Value>) {
    (error("GenericError", desc), vec![])
}

fn ok() -> (Value, Vec<Value>) {
    (json!({"return": {}}), vec![])
}

/// The reply to one command, and the events that follow it.
fn answer(s: &mut QemuState, m: &Value) -> (Value, Vec<Value>) {
    let cmd = m["execute"].as_str().unwrap_or_default();
    let a = &m["arguments"];
    if !matches!(
        cmd,
        "qmp_capabilities" | "qom-list" | "query-named-block-nodes"
    ) {
        s.log.push(format!("{cmd} {a}"));
    }
    let name = |k: &str| a[k].as_str().unwrap_or_default().to_string();
    match cmd {
        "qmp_capabilities" => ok(),
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
        "blockdev-add" => blockdev_add(s, a),
        "device_add" => {
            let id = name("id");
            if s.refuse_device_add {
                return refused("Bus 'pci.0' does not support hotplugging");
            }
            if s.devices.contains_key(&id) {
                return refused(&format!("Duplicate device ID '{id}'"));
            }
            s.devices.insert(id, (name("drive"), name("serial")));
            ok()
        }
        "device_del" => device_del(s, &name("id")),
        "blockdev-del" => {
            let n = name("node-name");
            if s.devices.values().any(|(node, _)| *node == n) {
                return refused(&format!("Node '{n}' is busy"));
            }
            if s.node_in_use > 0 {
                s.node_in_use -= 1;
                return refused(&format!("Node {n} is in use"));
            }
            if s.nodes.remove(&n).is_none() {
                return refused(&format!("Failed to find node with node-name='{n}'"));
            }
            s.open.remove(&n);
            ok()
        }
        "block_resize" => {
            s.nodes
                .insert(name("node-name"), a["size"].as_u64().unwrap_or(0));
            ok()
        }
        other => (
            error(
                "CommandNotFound",
                &format!("The command {other} has not been found"),
            ),
            vec![],
        ),
    }
}

/// blockdev-add: a host device (`filename`) or an image under a raw node
/// (`file.filename`), opened as QEMU opens it.
fn blockdev_add(s: &mut QemuState, a: &Value) -> (Value, Vec<Value>) {
    let n = a["node-name"].as_str().unwrap_or_default().to_string();
    if s.nodes.contains_key(&n) {
        return refused(&format!("Duplicate nodes with node-name='{n}'"));
    }
    let filename = a["filename"]
        .as_str()
        .or_else(|| a["file"]["filename"].as_str())
        .unwrap_or_default();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(!a["read-only"].as_bool().unwrap_or(false))
        .open(filename);
    let mut file = match file {
        Ok(f) => f,
        Err(e) => return refused(&format!("Could not open '{filename}': {e}")),
    };
    let size = std::io::Seek::seek(&mut file, std::io::SeekFrom::End(0)).unwrap_or(0);
    s.nodes.insert(n.clone(), size);
    s.open.insert(n, file);
    ok()
}

/// device_del: the guest lets go at once (DEVICE_DELETED follows the
/// reply), or never ([`QemuState::never_release`]).
fn device_del(s: &mut QemuState, id: &str) -> (Value, Vec<Value>) {
    if !s.devices.contains_key(id) {
        return (
            error("DeviceNotFound", &format!("Device '{id}' not found")),
            vec![],
        );
    }
    if s.never_release {
        if !s.leaving.insert(id.to_string()) {
            return refused(&format!("Device {id} is already in the process of unplug"));
        }
        return ok();
    }
    s.leaving.remove(id);
    s.devices.remove(id);
    let ev = |data: Value| json!({"event": "DEVICE_DELETED", "data": data, "timestamp": {}});
    (
        json!({"return": {}}),
        vec![
            ev(json!({"path": format!("/machine/peripheral/{id}/virtio-backend")})),
            ev(json!({"device": id, "path": format!("/machine/peripheral/{id}")})),
        ],
    )
}

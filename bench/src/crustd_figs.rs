//! crustd figures: RuntimePublishVolume end to end (hot-plug + publish) and a
//! RuntimeGetVolumeStats round trip through crustd, each beside the same
//! work done by calling QMP and the agent directly (what a runtime shim
//! without crustd would do). One VM started by crust-vm in a sandbox
//! registry, ext4 loop devices as host volumes, the release crustd.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crust_client::proto::{GetVolumeStatsRequest, PublishVolumeRequest, UnpublishVolumeRequest};
use crust_client::qmp::{unplug, BlockDisk, Patience, Qmp, Source};
use crust_client::{Address, CrustClient};
use crust_kubelet::{pb, Kubelet};
use crust_vm::{Vm, VmOptions};
use serde_json::json;

use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{self, median, secs, Loop, R};

const PUBLISH: (&str, &str, &str) = (
    "crustd_publish",
    "RuntimePublishVolume through crustd, end to end (hot-plug + mount, ext4 64 MiB; median over the disks)",
    "report, beside QMP + agent called directly",
);
const STATS: (&str, &str, &str) = (
    "crustd_stats",
    "RuntimeGetVolumeStats round trip through crustd (median of 200)",
    "report, beside the agent's GetVolumeStats called directly",
);
const SANDBOX: &str = "bench";
const STATS_CALLS: usize = 200;

pub fn keys() -> [(&'static str, &'static str, &'static str); 2] {
    [PUBLISH, STATS]
}

fn not_measured(why: &str) -> Vec<Figure> {
    keys()
        .iter()
        .map(|(k, t, g)| Figure::not_measured(k, t, g, why))
        .collect()
}

/// The crustd process; killed on drop.
pub(crate) struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        sys::unregister_child(self.0.id());
    }
}

pub fn figures(work: &Path, disks: usize) -> Vec<Figure> {
    match run(work, disks.max(3)) {
        Ok(f) => f,
        Err(e) => not_measured(&e),
    }
}

/// The release crustd, if it was built.
pub(crate) fn binary() -> R<std::path::PathBuf> {
    let crustd = sys::workspace_root().join("target/x86_64-unknown-linux-gnu/release/crustd");
    if !crustd.is_file() {
        return Err(format!(
            "{} is missing (cargo build --release -p crustd)",
            crustd.display()
        ));
    }
    Ok(crustd)
}

/// Starts `crustd` for the registry `reg` on `work/crustd.sock` and waits
/// until it listens.
pub(crate) fn daemon(work: &Path, reg: &Path, crustd: &Path) -> R<(Daemon, std::path::PathBuf)> {
    let socket = work.join("crustd.sock");
    // Its log (one JSON line per call) beside the work, for a look afterwards.
    let log = std::fs::File::create(work.join("crustd.log"))
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null());
    let child = Command::new(crustd)
        .arg("--socket")
        .arg(&socket)
        .arg("--sandboxes")
        .arg(reg)
        .stdin(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start crustd: {e}"))?;
    sys::register_child(child.id());
    let d = Daemon(child);
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if t.elapsed() > Duration::from_secs(20) {
            return Err("crustd did not listen".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((d, socket))
}

impl Daemon {
    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.0.id()
    }
}

fn run(work: &Path, disks: usize) -> R<Vec<Figure>> {
    let crustd = binary()?;
    let reg = work.join("sandboxes");
    let opts = VmOptions::new(reg.join(SANDBOX));
    if !opts.initrd.is_file() {
        return Err(format!(
            "{} is missing (make initrd)",
            opts.initrd.display()
        ));
    }
    let mut vm = Vm::up(opts).map_err(|e| format!("the VM did not come up: {e}"))?;
    let out = measure(work, &reg, &crustd, &vm, disks);
    let _ = vm.down();
    out
}

fn measure(work: &Path, reg: &Path, crustd: &Path, vm: &Vm, disks: usize) -> R<Vec<Figure>> {
    let (_d, socket) = daemon(work, reg, crustd)?;
    let k = Kubelet::connect(&socket, Duration::from_secs(120))?;
    let addr: Address = vm.address().parse().map_err(|e| format!("{e}"))?;
    let qmp_path = vm.dir().join("qmp.sock");

    let mut loops = Vec::new();
    for i in 0..disks * 2 {
        let img = work.join(format!("crustd-{i}.img"));
        sys::sparse_file(&img, 64 << 20)?;
        sys::run("mkfs.ext4", &["-q", "-F", &img.to_string_lossy()])?;
        loops.push(Loop::attach(&img)?);
    }
    let (mut through, mut direct) = (Vec::new(), Vec::new());
    let mut stats_out = None;
    for i in 0..disks {
        // Through crustd.
        let dev = loops[2 * i].dev.clone();
        let t = Instant::now();
        k.publish(pb::RuntimePublishVolumeRequest {
            sandbox_id: SANDBOX.into(),
            host_volume_id: dev.clone(),
            file_system: "ext4".into(),
            ..Default::default()
        })
        .map_err(|s| format!("crustd publish: {s}"))?;
        through.push(secs(t.elapsed()));
        if i == 0 {
            // Stats on the first volume, both ways.
            stats_out = Some(stats(&k, &addr, &dev)?);
        }
        k.unpublish(SANDBOX, &dev)
            .map_err(|s| format!("crustd unpublish: {s}"))?;

        // The same by hand.
        direct.push(by_hand(&qmp_path, &addr, &loops[2 * i + 1].dev, i)?);
    }
    drop(loops);
    let (ours, base) = (median(&through), median(&direct));
    let publish = Figure {
        key: PUBLISH.0.into(),
        title: PUBLISH.1.into(),
        ours: fmt_secs(ours),
        baseline: format!("{} (QMP + agent by hand)", fmt_secs(base)),
        ratio: signed(ours - base),
        target: PUBLISH.2.into(),
        verdict: Verdict::Report,
        data: json!({"crustd_s": through, "direct_s": direct,
                     "note": "crustd adds: registry and state reads, the one-device-one-sandbox scan, three atomic state writes (fsync), QMP queries before each step, a gRPC hop; the guest's part (hot-plug seen, mount) is the same"}),
    };
    let (s_ours, s_conn, s_kept) = stats_out.take().ok_or("no stats measured")?;
    let stats_fig = Figure {
        key: STATS.0.into(),
        title: STATS.1.into(),
        ours: fmt_secs(s_ours),
        baseline: format!(
            "{} (the agent on one kept connection, as crustd keeps it); {} with a new connection per call",
            fmt_secs(s_kept),
            fmt_secs(s_conn)
        ),
        ratio: signed(s_ours - s_kept),
        target: STATS.2.into(),
        verdict: Verdict::Report,
        data: json!({"crustd_s": s_ours, "direct_new_connection_s": s_conn, "direct_kept_connection_s": s_kept}),
    };
    Ok(vec![publish, stats_fig])
}

/// One publish by hand, as a runtime without crustd would do it: a QMP
/// session plugging the disk (crust-client's plug: blockdev-add and
/// device_add, as crustd adds them), then the agent's publish; its seconds,
/// after taking it all down again (crust-client's unplug).
fn by_hand(qmp_path: &Path, addr: &Address, dev: &str, i: usize) -> R<f64> {
    let serial = format!("bench-direct-{i}");
    let (node, device) = (format!("bd-{i}"), format!("bd-dev-{i}"));
    let disk = BlockDisk {
        node: &node,
        device: &device,
        serial: &serial,
    };
    let session = || Qmp::connect(qmp_path, Duration::from_secs(10));
    let t = Instant::now();
    session()
        .and_then(|mut q| q.plug(&disk, Source::HostDevice(Path::new(dev)), false))
        .map_err(|e| e.to_string())?;
    let c = CrustClient::connect(addr, Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let mut r = PublishVolumeRequest::new();
    r.volume_id = format!("direct-{i}");
    r.set_serial(serial.clone());
    r.fs_type = "ext4".into();
    r.timeout_ms = 30_000;
    c.publish_volume(&r).map_err(|e| e.to_string())?;
    let took = secs(t.elapsed());
    let mut u = UnpublishVolumeRequest::new();
    u.volume_id = format!("direct-{i}");
    c.unpublish_volume(&u).map_err(|e| e.to_string())?;
    let patience = Patience {
        each: Duration::from_secs(60),
        deadline: None,
    };
    unplug(session, &device, &node, patience).map_err(|e| format!("unplugging {device}: {e}"))?;
    Ok(took)
}

/// Medians of (through crustd, agent with a new connection per call, agent
/// on one kept connection) for GetVolumeStats of the volume on `dev`.
fn stats(k: &Kubelet, addr: &Address, dev: &str) -> R<(f64, f64, f64)> {
    let vol = crustd_volume_id(k, dev)?;
    let mut r = GetVolumeStatsRequest::new();
    r.volume_id = vol;
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    let kept = CrustClient::connect(addr, Duration::from_secs(30)).map_err(|e| e.to_string())?;
    for _ in 0..STATS_CALLS {
        let t = Instant::now();
        k.stats(SANDBOX, dev)
            .map_err(|s| format!("crustd stats: {s}"))?;
        a.push(secs(t.elapsed()));
        let t = Instant::now();
        CrustClient::connect(addr, Duration::from_secs(30))
            .map_err(|e| e.to_string())?
            .get_volume_stats(&r)
            .map_err(|e| e.to_string())?;
        b.push(secs(t.elapsed()));
        let t = Instant::now();
        kept.get_volume_stats(&r).map_err(|e| e.to_string())?;
        c.push(secs(t.elapsed()));
    }
    Ok((median(&a), median(&b), median(&c)))
}

/// The agent volume id crustd gave `dev`: the guest path's last component.
fn crustd_volume_id(k: &Kubelet, dev: &str) -> R<String> {
    let p = k
        .publish(pb::RuntimePublishVolumeRequest {
            sandbox_id: SANDBOX.into(),
            host_volume_id: dev.into(),
            file_system: "ext4".into(),
            ..Default::default()
        })
        .map_err(|s| format!("crustd publish: {s}"))?;
    p.guest_path
        .rsplit('/')
        .next()
        .map(str::to_string)
        .ok_or_else(|| format!("odd guest path {}", p.guest_path))
}

/// A difference in seconds with its sign: "+596.3 µs", "-5.06 ms".
fn signed(d: f64) -> String {
    if d < 0.0 {
        format!("-{}", fmt_secs(-d))
    } else {
        format!("+{}", fmt_secs(d))
    }
}

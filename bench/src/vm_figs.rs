//! Figures 5, 7, 8 (VM) and 11: one microVM booted by crust-vm (the agent
//! as PID 1, TCG here), driven over hybrid vsock: boot timeline, the
//! GetCapabilities round trip, hot-plug to publish complete (ext4, and a
//! raw block volume), and ext4 online growth after block_resize.

use std::path::Path;
use std::time::{Duration, Instant};

use crust_client::proto::{ExpandVolumeRequest, GetVolumeStatsRequest, PublishVolumeRequest};
use crust_client::{Address, CrustClient};
use crust_vm::{Vm, VmOptions};
use serde_json::json;

use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{self, median, secs, R};

const MIB: u64 = 1 << 20;
const DISK_FROM: u64 = 256 * MIB;
const DISK_TO: u64 = 1024 * MIB;

struct Keys {
    boot: (&'static str, &'static str, &'static str),
    rtt: (&'static str, &'static str, &'static str),
    hotplug: (&'static str, &'static str, &'static str),
    block: (&'static str, &'static str, &'static str),
    ext4: (&'static str, &'static str, &'static str),
    crypt: (&'static str, &'static str, &'static str),
}

const KEYS: Keys = Keys {
    boot: (
        "start_vm",
        "agent as PID 1 in the VM: kernel boot → listening, and agent start → listening (BootTimeline)",
        "report; aim < 20 ms of agent time",
    ),
    rtt: (
        "rtt_hvsock",
        "GetCapabilities round trip over hybrid vsock into the VM (median of 1,000)",
        "report",
    ),
    hotplug: (
        "hotplug_to_publish",
        "hot-plug to publish complete in the VM (PublishVolume by serial pending, then device_add; median over the disks)",
        "report",
    ),
    block: (
        "hotplug_to_block_publish",
        "hot-plug to BLOCK publish complete in the VM (a raw block volume: PublishVolume by serial with volume_mode BLOCK pending, then device_add; median over the disks)",
        "report",
    ),
    ext4: (
        "ext4_grow_vm",
        "ext4 online growth in the VM, 256 MiB → 1 GiB (ExpandVolume sent right after block_resize; median over the disks)",
        "report",
    ),
    crypt: (
        "encrypted_publish_vm",
        "PublishVolume of a plugged LUKS2 ext4 disk (cryptsetup-made, PBKDF2 1,000 iterations: the unlock costs ~nothing, so the difference is the header read, the mapping and its node) against the same plain ext4 disk (median over the disks)",
        "report: the added latency",
    ),
};

fn all_not_measured(why: &str) -> Vec<Figure> {
    [
        KEYS.boot,
        KEYS.rtt,
        KEYS.hotplug,
        KEYS.ext4,
        KEYS.block,
        KEYS.crypt,
    ]
    .iter()
    .map(|(k, t, g)| Figure::not_measured(k, t, g, why))
    .collect()
}

/// One boot as the agent saw it (BootTimeline, ms since the kernel started)
/// and as the host saw it (Vm::up: QEMU start → the agent answers).
#[derive(Clone, Copy, Debug)]
struct Boot {
    agent_start_ms: u64,
    mounts_done_ms: u64,
    modules_loaded_ms: u64,
    listening_ms: u64,
    up_s: f64,
}

fn boot(opts: &VmOptions, boots: &mut Vec<Boot>) -> R<Vm> {
    let t = Instant::now();
    let vm = Vm::up(opts.clone()).map_err(|e| format!("the VM did not come up: {e}"))?;
    let up_s = secs(t.elapsed());
    let b = vm
        .boot_info()
        .and_then(|i| i.boot.as_ref())
        .ok_or("the agent's first GetAgentInfo had no boot timeline")?;
    eprintln!(
        "bench: VM up in {}; agent listening at {} ms after kernel start",
        fmt_secs(up_s),
        b.listening_ms
    );
    boots.push(Boot {
        agent_start_ms: b.agent_start_ms,
        mounts_done_ms: b.mounts_done_ms,
        modules_loaded_ms: b.modules_loaded_ms,
        listening_ms: b.listening_ms,
        up_s,
    });
    Ok(vm)
}

/// Figures 5, 7, 8 (VM), 11: the first VM does everything; `boots - 1`
/// more are booted only for the boot timeline's median.
pub fn figures(work: &Path, disks: usize, boots: usize) -> Vec<Figure> {
    let opts = VmOptions::new(work.join("vm"));
    for f in [&opts.kernel, &opts.initrd] {
        if !f.is_file() {
            return all_not_measured(&format!("{} is missing (make initrd)", f.display()));
        }
    }
    // The same choice Vm::up makes (cached per host boot).
    let accel = format!("{:?}", crust_vm::choose_accel(&opts.kernel)).to_uppercase();
    let mut timeline = Vec::new();
    let mut vm = match boot(&opts, &mut timeline) {
        Ok(vm) => vm,
        Err(e) => return all_not_measured(&e),
    };
    let mut out = Vec::new();
    match vm.address().parse::<Address>() {
        Ok(addr) => {
            out.push(match rtt(&addr) {
                Ok(f) => f,
                Err(e) => Figure::not_measured(KEYS.rtt.0, KEYS.rtt.1, KEYS.rtt.2, e),
            });
            match disks_figures(work, &mut vm, &addr, disks) {
                Ok((a, b)) => {
                    out.push(a);
                    out.push(b);
                }
                Err(e) => {
                    let (h, g) = (KEYS.hotplug, KEYS.ext4);
                    out.push(Figure::not_measured(h.0, h.1, h.2, e.clone()));
                    out.push(Figure::not_measured(g.0, g.1, g.2, e));
                }
            }
            out.push(match block_figure(work, &mut vm, &addr, disks) {
                Ok(f) => f,
                Err(e) => Figure::not_measured(KEYS.block.0, KEYS.block.1, KEYS.block.2, e),
            });
            out.push(match crypt_figure(work, &mut vm, &addr, disks) {
                Ok(f) => f,
                Err(e) => Figure::not_measured(KEYS.crypt.0, KEYS.crypt.1, KEYS.crypt.2, e),
            });
        }
        Err(e) => {
            let why = format!("bad agent address {}: {e}", vm.address());
            out.extend(all_not_measured(&why).into_iter().skip(1));
        }
    }
    match vm.down() {
        Ok(how) => eprintln!("bench: VM down: {how}"),
        Err(e) => eprintln!("bench: VM down failed: {e}"),
    }
    drop(vm);
    for _ in 1..boots {
        match boot(&opts, &mut timeline) {
            Ok(mut vm) => {
                if let Err(e) = vm.down() {
                    eprintln!("bench: VM down failed: {e}");
                }
            }
            Err(e) => {
                eprintln!("bench: an extra boot failed: {e}");
                break;
            }
        }
    }
    out.insert(0, boot_figure(&timeline, &accel));
    out
}

fn boot_figure(boots: &[Boot], accel: &str) -> Figure {
    let (key, title, target) = KEYS.boot;
    let m = |f: &dyn Fn(&Boot) -> f64| median(&boots.iter().map(f).collect::<Vec<_>>());
    let agent = |b: &Boot| b.listening_ms.saturating_sub(b.agent_start_ms) as f64;
    let (listening, agent_ms, up_s) = (m(&|b| b.listening_ms as f64), m(&agent), m(&|b| b.up_s));
    let first = boots[0];
    Figure {
        key: key.into(),
        title: title.into(),
        ours: format!(
            "kernel start→listening {listening:.0} ms; agent start→listening {agent_ms:.0} ms (median of {} boots)",
            boots.len()
        ),
        baseline: "—".into(),
        ratio: "—".into(),
        target: target.into(),
        verdict: Verdict::from(agent_ms < 20.0),
        data: json!({
            "boots": boots.iter().map(|b| json!({
                "agent_start_ms": b.agent_start_ms, "mounts_done_ms": b.mounts_done_ms,
                "modules_loaded_ms": b.modules_loaded_ms, "listening_ms": b.listening_ms,
                "host_vm_up_s": b.up_s,
            })).collect::<Vec<_>>(),
            "median_listening_ms": listening, "median_agent_ms": agent_ms, "median_host_vm_up_s": up_s,
            "accel": accel,
            "note": format!(
                "QEMU with {accel}; first boot: agent start {} ms, early mounts done {} ms, modules loaded {} ms (0: after listening, in the background), listening {} ms; the host's Vm::up (QEMU start → agent answers) took {} (median)",
                first.agent_start_ms, first.mounts_done_ms, first.modules_loaded_ms, first.listening_ms, fmt_secs(up_s)
            ),
        }),
    }
}

fn client(addr: &Address, timeout: Duration) -> R<CrustClient> {
    CrustClient::connect(addr, timeout).map_err(|e| format!("cannot connect to {addr}: {e}"))
}

fn rtt(addr: &Address) -> R<Figure> {
    const CALLS: usize = 1000;
    let c = client(addr, Duration::from_secs(10))?;
    for _ in 0..50 {
        c.get_capabilities()
            .map_err(|e| format!("GetCapabilities: {e}"))?;
    }
    let mut s = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        c.get_capabilities()
            .map_err(|e| format!("GetCapabilities: {e}"))?;
        s.push(secs(t.elapsed()));
    }
    let m = median(&s);
    // The PID 1 agent's own VmRSS after these calls, for the record.
    let rss = c.get_agent_info().map(|i| i.rss_bytes).unwrap_or(0);
    let (key, title, target) = KEYS.rtt;
    Ok(Figure {
        key: key.into(),
        title: title.into(),
        ours: fmt_secs(m),
        baseline: "— (a raw echo in the guest would need a guest tool)".into(),
        ratio: "—".into(),
        target: target.into(),
        verdict: Verdict::Report,
        data: json!({ "calls": CALLS, "median_s": m, "samples_min_s": s.iter().cloned().fold(f64::INFINITY, f64::min),
            "guest_agent_rss_bytes": rss,
            "note": format!("through vhost-device-vsock under QEMU; the guest agent (PID 1) reported VmRSS {} after {} calls", crate::report::fmt_mib(rss), CALLS + 50) }),
    })
}

fn make_ext4(path: &Path) -> R<()> {
    sys::sparse_file(path, DISK_FROM)?;
    sys::run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            &path.to_string_lossy(),
        ],
    )
    .map(|_| ())
}

fn disks_figures(work: &Path, vm: &mut Vm, addr: &Address, n: usize) -> R<(Figure, Figure)> {
    let mut plug_s = Vec::new();
    let mut vols = Vec::new();
    for i in 0..n {
        let serial = format!("bench-{i}-{}", std::process::id() % 100_000);
        let img = work.join(format!("vm-disk{i}.img"));
        make_ext4(&img)?;
        let id = format!("bench-vol-{i}");
        // The publish goes first and waits for the disk, as a runtime that
        // sends it right after asking the VMM for the hot-plug would.
        let c = client(addr, Duration::from_secs(60))?;
        let mut req = PublishVolumeRequest::new();
        req.volume_id = id.clone();
        req.set_serial(serial.clone());
        req.fs_type = "ext4".into();
        req.timeout_ms = 30_000;
        let d = publish_then_hotplug(vm, c, req, &img, "PublishVolume")?;
        eprintln!("bench: hot-plug → publish {serial}: {}", fmt_secs(secs(d)));
        plug_s.push(secs(d));
        vols.push((id, serial));
    }
    let mut grow_s = Vec::new();
    let c = client(addr, Duration::from_secs(60))?;
    for (id, serial) in &vols {
        let total = |c: &CrustClient| -> R<i64> {
            let mut q = GetVolumeStatsRequest::new();
            q.volume_id = id.clone();
            let s = c
                .get_volume_stats(&q)
                .map_err(|e| format!("GetVolumeStats {id}: {e}"))?;
            s.usage
                .iter()
                .find(|u| u.unit.value() == 1)
                .map(|u| u.total)
                .ok_or_else(|| format!("GetVolumeStats {id} has no byte usage"))
        };
        let before = total(&c)?;
        vm.resize(serial, DISK_TO)
            .map_err(|e| format!("resize {serial}: {e}"))?;
        let mut req = ExpandVolumeRequest::new();
        req.volume_id = id.clone();
        req.required_bytes = DISK_TO as i64;
        req.timeout_ms = 30_000;
        let t = Instant::now();
        let r = c
            .expand_volume(&req)
            .map_err(|e| format!("ExpandVolume {id}: {e}"))?;
        let d = secs(t.elapsed());
        let after = total(&c)?;
        if (r.capacity_bytes as u64) < DISK_TO - DISK_TO / 16 || after < 3 * before {
            return Err(format!(
                "ExpandVolume {id} answered capacity {} but statfs total went {before} → {after}: not grown",
                r.capacity_bytes
            ));
        }
        eprintln!("bench: ext4 growth in the VM {id}: {}", fmt_secs(d));
        grow_s.push(d);
    }
    let plug = reported_median(
        KEYS.hotplug,
        &plug_s,
        "from the start of crust-vm's hotplug (blockdev-add + device_add over QMP) to the PublishVolume response; the publish was already waiting; ext4, no fsGroup",
    );
    let grow = reported_median(
        KEYS.ext4,
        &grow_s,
        "the ExpandVolume call alone, sent right after block_resize returned: it includes the guest noticing the new size; checked by GetVolumeStats before and after",
    );
    Ok((plug, grow))
}

/// Sends `req` on `c` (named `what` in errors) and, half a second later
/// while it waits, hot-plugs `img` with the request's serial: the time from
/// the start of the hot-plug to the answer, which must be a new publish.
fn publish_then_hotplug(
    vm: &mut Vm,
    c: CrustClient,
    req: PublishVolumeRequest,
    img: &Path,
    what: &str,
) -> R<Duration> {
    let serial = req.serial().to_string();
    let pending = std::thread::spawn(move || {
        let r = c.publish_volume(&req);
        (r, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    vm.hotplug(img, &serial, false)
        .map_err(|e| format!("hotplug {serial}: {e}"))?;
    let (r, t1) = pending
        .join()
        .map_err(|_| "the publish thread panicked".to_string())?;
    let resp = r.map_err(|e| format!("{what} by serial {serial}: {e}"))?;
    if resp.guest_path.is_empty() || resp.device.is_empty() || resp.already_published {
        return Err(format!("PublishVolume answered {resp:?}"));
    }
    Ok(t1.saturating_duration_since(t0))
}

/// A figure reported, not judged: the median of `samples_s`, the samples
/// and `note` in its data.
fn reported_median(
    (key, title, target): (&str, &str, &str),
    samples_s: &[f64],
    note: &str,
) -> Figure {
    Figure {
        key: key.into(),
        title: title.into(),
        ours: fmt_secs(median(samples_s)),
        baseline: "—".into(),
        ratio: "—".into(),
        target: target.into(),
        verdict: Verdict::Report,
        data: json!({ "samples_s": samples_s, "median_s": median(samples_s), "note": note }),
    }
}

/// Hot-plug to BLOCK publish complete: a raw disk (no filesystem: nothing
/// to probe) published as a block volume by serial before it is plugged.
fn block_figure(work: &Path, vm: &mut Vm, addr: &Address, n: usize) -> R<Figure> {
    let mut plug_s = Vec::new();
    for i in 0..n {
        let serial = format!("bblk-{i}-{}", std::process::id() % 100_000);
        let img = work.join(format!("vm-raw{i}.img"));
        sys::sparse_file(&img, 64 * MIB)?;
        let c = client(addr, Duration::from_secs(60))?;
        let mut req = PublishVolumeRequest::new();
        req.volume_id = format!("bench-blk-{i}");
        req.set_serial(serial.clone());
        req.volume_mode = crust_client::proto::VolumeMode::BLOCK.into();
        req.timeout_ms = 30_000;
        let d = publish_then_hotplug(vm, c, req, &img, "BLOCK PublishVolume")?;
        eprintln!(
            "bench: hot-plug → BLOCK publish {serial}: {}",
            fmt_secs(secs(d))
        );
        plug_s.push(secs(d));
    }
    Ok(reported_median(
        KEYS.block,
        &plug_s,
        "from the start of crust-vm's hotplug (blockdev-add + device_add over QMP) to the PublishVolume response; the publish was already waiting; 64 MiB raw disk, read-write (no BLKROSET)",
    ))
}

/// A plain ext4 image at `plain`, and the same made LUKS2 in place by
/// cryptsetup at `luks` (PBKDF2, 1,000 iterations), its passphrase in `pass`.
fn make_pair(plain: &Path, luks: &Path, pass: &Path) -> R<()> {
    make_ext4(plain)?;
    sys::sparse_file(luks, DISK_FROM)?;
    let l = luks.to_string_lossy();
    sys::run("mkfs.ext4", &["-q", "-F", &l, "240M"])?;
    sys::run(
        "cryptsetup",
        &[
            "reencrypt",
            "-q",
            "--encrypt",
            "--type",
            "luks2",
            "--reduce-device-size",
            "16M",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            &pass.to_string_lossy(),
            &l,
        ],
    )
    .map(|_| ())
}

/// The time of one PublishVolume of an already plugged disk.
fn timed_publish(c: &CrustClient, req: &PublishVolumeRequest) -> R<f64> {
    let t = Instant::now();
    let r = c
        .publish_volume(req)
        .map_err(|e| format!("PublishVolume {}: {e}", req.volume_id))?;
    if r.already_published {
        return Err(format!(
            "PublishVolume {} was not a new publish",
            req.volume_id
        ));
    }
    Ok(secs(t.elapsed()))
}

/// The added publish latency of an encrypted volume: the same ext4, plain
/// and LUKS2, each plugged first, then published, alternating.
fn crypt_figure(work: &Path, vm: &mut Vm, addr: &Address, n: usize) -> R<Figure> {
    let pass = work.join("vm-crypt.pass");
    std::fs::write(&pass, b"bench passphrase").map_err(|e| format!("{}: {e}", pass.display()))?;
    let c = client(addr, Duration::from_secs(60))?;
    let (mut plain_s, mut luks_s) = (Vec::new(), Vec::new());
    for i in 0..n {
        let (plain, luks) = (
            work.join(format!("vm-p{i}.img")),
            work.join(format!("vm-l{i}.img")),
        );
        make_pair(&plain, &luks, &pass)?;
        let tag = std::process::id() % 100_000;
        for (img, kind) in [(&plain, "p"), (&luks, "l")] {
            let serial = format!("bc{kind}-{i}-{tag}");
            vm.hotplug(img, &serial, false)
                .map_err(|e| format!("hotplug {serial}: {e}"))?;
            let mut req = PublishVolumeRequest::new();
            req.volume_id = format!("bench-c{kind}-{i}");
            req.set_serial(serial);
            req.fs_type = "ext4".into();
            req.timeout_ms = 30_000;
            if kind == "l" {
                let mut e = crust_client::proto::Encryption::new();
                e.kind = crust_client::proto::encryption::Kind::LUKS2.into();
                e.set_passphrase(b"bench passphrase".to_vec());
                req.encryption = Some(e).into();
                luks_s.push(timed_publish(&c, &req)?);
            } else {
                plain_s.push(timed_publish(&c, &req)?);
            }
        }
    }
    let (p, l) = (median(&plain_s), median(&luks_s));
    eprintln!(
        "bench: publish plain {} · LUKS2 {}",
        fmt_secs(p),
        fmt_secs(l)
    );
    let mut f = reported_median(
        KEYS.crypt,
        &luks_s,
        "the PublishVolume call alone, the disk plugged before; the baseline is the same ext4 in the clear",
    );
    f.baseline = fmt_secs(p);
    f.ratio = format!("{:.2}x (+{})", l / p.max(1e-9), fmt_secs((l - p).max(0.0)));
    f.data["plain_samples_s"] = json!(plain_s);
    Ok(f)
}

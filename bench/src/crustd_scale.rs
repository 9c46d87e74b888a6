//! crustd at node scale: what one sandbox costs the others. Real VMs
//! started by crust-vm in one registry, one release crustd, fresh ext4 loop
//! devices as host volumes.
//!
//! - `crustd_paused_neighbour`: RuntimePublishVolume latency into a healthy
//!   sandbox, alone, then while another sandbox's guest is paused (QMP
//!   `stop`) and its calls keep failing, made as kubelet makes them (stats
//!   and a publish, each with a deadline, retried 500 ms after a failure,
//!   kubelet's first back-off) from several threads. Goal: within 1.2x.
//! - `crustd_concurrent`: one publish into each of 8 sandboxes at once,
//!   beside the same 8 made one after another.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_client::qmp::Qmp;
use crust_kubelet::{code_name, pb, Kubelet};
use crust_protocols::sync::LockExt;
use crust_vm::{Vm, VmOptions};
use serde_json::json;

use crate::crustd_figs;
use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{self, median, secs, Loop, R};

const PAUSED: (&str, &str, &str) = (
    "crustd_paused_neighbour",
    "RuntimePublishVolume into a healthy sandbox while another's guest is paused and its calls keep failing (median)",
    "within 1.2x of the same publishes alone",
);
const CONCURRENT: (&str, &str, &str) = (
    "crustd_concurrent",
    "one RuntimePublishVolume into each of 8 sandboxes at once (wall time)",
    "report, beside the same 8 one after another",
);
/// Sandboxes publishing at once.
const SANDBOXES: usize = 8;
/// Threads keeping the paused sandbox's calls failing.
const FLOOD_THREADS: usize = 8;
/// kubelet's first back-off after a failed call.
const BACKOFF: Duration = Duration::from_millis(500);

pub fn keys() -> [(&'static str, &'static str, &'static str); 2] {
    [PAUSED, CONCURRENT]
}

pub fn figures(work: &Path, publishes: usize) -> Vec<Figure> {
    match run(work, publishes.max(5)) {
        Ok(f) => f,
        Err(e) => keys()
            .iter()
            .map(|(k, t, g)| Figure::not_measured(k, t, g, e.clone()))
            .collect(),
    }
}

/// `n` fresh 64 MiB ext4 loop devices.
fn volumes(work: &Path, tag: &str, n: usize) -> R<Vec<Loop>> {
    (0..n)
        .map(|i| {
            let img = work.join(format!("scale-{tag}-{i}.img"));
            sys::sparse_file(&img, 64 << 20)?;
            sys::run("mkfs.ext4", &["-q", "-F", &img.to_string_lossy()])?;
            Loop::attach(&img)
        })
        .collect()
}

fn publish(k: &Kubelet, sandbox: &str, dev: &str) -> R<f64> {
    let t = Instant::now();
    k.publish_within(
        pb::RuntimePublishVolumeRequest {
            sandbox_id: sandbox.into(),
            host_volume_id: dev.into(),
            file_system: "ext4".into(),
            fsgroup_gid: Some(2000),
            ..Default::default()
        },
        Duration::from_secs(120),
    )
    .map_err(|s| format!("publish into {sandbox}: {s}"))?;
    Ok(secs(t.elapsed()))
}

fn unpublish(k: &Kubelet, sandbox: &str, dev: &str) -> R<()> {
    k.unpublish(sandbox, dev)
        .map_err(|s| format!("unpublish in {sandbox}: {s}"))
}

/// Boots the sandboxes `names` in `reg`, at once.
fn boot(reg: &Path, names: &[String]) -> R<Vec<Vm>> {
    let booted: Vec<R<Vm>> = std::thread::scope(|s| {
        let hs: Vec<_> = names
            .iter()
            .map(|n| {
                let dir = reg.join(n);
                s.spawn(move || {
                    let mut o = VmOptions::new(dir);
                    o.boot_timeout = Duration::from_secs(300);
                    Vm::up(o).map_err(|e| format!("sandbox {n} did not come up: {e}"))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a boot panicked".into())))
            .collect()
    });
    let mut vms = Vec::new();
    let mut failed = None;
    for b in booted {
        match b {
            Ok(vm) => vms.push(vm),
            Err(e) => failed = Some(e),
        }
    }
    if let Some(e) = failed {
        down(&mut vms);
        return Err(e);
    }
    Ok(vms)
}

fn down(vms: &mut [Vm]) {
    for vm in vms {
        let _ = vm.down();
    }
}

fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn run(work: &Path, publishes: usize) -> R<Vec<Figure>> {
    let crustd = crustd_figs::binary()?;
    let reg = work.join("scale-sandboxes");
    let names: Vec<String> = (0..SANDBOXES).map(|i| format!("s{i}")).collect();
    let mut vms = boot(&reg, &names)?;
    let out = (|| {
        let (d, socket) = crustd_figs::daemon(work, &reg, &crustd)?;
        let k = Kubelet::connect(&socket, Duration::from_secs(300))?;
        // Concurrent first: pausing a guest may cost it its vsock for good
        // (vhost-device-vsock 0.3.0), and with it that sandbox's calls.
        let concurrent = concurrent(work, &socket, &k, &names)?;
        let paused = paused_neighbour(work, &socket, &k, &vms, d.pid(), publishes)?;
        Ok(vec![paused, concurrent])
    })();
    down(&mut vms);
    out
}

/// Kubelet-like calls into `sandbox` until `stop`: stats of `vol` and a
/// publish of `other`, each with a deadline, 500 ms after each failure.
/// Answers the codes seen.
fn flood(
    socket: &Path,
    sandbox: &str,
    vol: &str,
    other: &str,
    stop: &AtomicBool,
    codes: &Mutex<std::collections::BTreeMap<String, usize>>,
) {
    let k = match Kubelet::connect(socket, Duration::from_secs(60)) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("bench: a flood thread cannot connect: {e}");
            return;
        }
    };
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        i += 1;
        let r = if i.is_multiple_of(2) {
            k.stats_within(sandbox, vol, Duration::from_secs(2))
                .map(|_| ())
        } else {
            let req = pb::RuntimePublishVolumeRequest {
                sandbox_id: sandbox.into(),
                host_volume_id: other.into(),
                file_system: "ext4".into(),
                ..Default::default()
            };
            k.publish_within(req, Duration::from_secs(5)).map(|_| ())
        };
        let code = r.map_or_else(|s| code_name(s.code()), |()| "OK".into());
        let failed = code != "OK";
        *codes.locked().entry(code).or_default() += 1;
        if failed {
            std::thread::sleep(BACKOFF);
        }
    }
}

fn paused_neighbour(
    work: &Path,
    socket: &Path,
    k: &Kubelet,
    vms: &[Vm],
    pid: u32,
    publishes: usize,
) -> R<Figure> {
    let (healthy, victim) = ("s0", "s1");
    let vols = volumes(work, "healthy", publishes)?;
    let mut alone = Vec::new();
    for v in &vols {
        alone.push(publish(k, healthy, &v.dev)?);
        unpublish(k, healthy, &v.dev)?;
    }
    let theirs = volumes(work, "paused", 2)?;
    publish(k, victim, &theirs[0].dev)?;
    eprintln!("bench: {healthy} alone: {alone:?}; pausing {victim}");
    let qmp = vms[1].dir().join("qmp.sock");
    let mut q = Qmp::connect(&qmp, Duration::from_secs(10)).map_err(|e| e.to_string())?;
    q.execute("stop", None).map_err(|e| e.to_string())?;
    drop(q);
    let files_before = open_files(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let codes = Arc::new(Mutex::new(std::collections::BTreeMap::new()));
    let loaded = std::thread::scope(|s| {
        for _ in 0..FLOOD_THREADS {
            let (stop, codes) = (stop.clone(), codes.clone());
            let (vol, other) = (theirs[0].dev.clone(), theirs[1].dev.clone());
            s.spawn(move || flood(socket, victim, &vol, &other, &stop, &codes));
        }
        // Let the flood reach its pace (its first calls wait out their deadlines).
        std::thread::sleep(Duration::from_secs(6));
        eprintln!(
            "bench: {victim} paused and flooded: {:?}",
            codes.lock().map(|c| c.clone())
        );
        let mut loaded = Vec::new();
        let mut err = None;
        for v in &vols {
            match publish(k, healthy, &v.dev)
                .and_then(|t| unpublish(k, healthy, &v.dev).map(|()| t))
            {
                Ok(t) => loaded.push(t),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        stop.store(true, Ordering::SeqCst);
        match err {
            Some(e) => Err(e),
            None => Ok(loaded),
        }
    })?;
    let files_after = open_files(pid);
    let mut q = Qmp::connect(&qmp, Duration::from_secs(10)).map_err(|e| e.to_string())?;
    q.execute("cont", None).map_err(|e| e.to_string())?;
    drop(q);
    // The guest runs again; its volume comes out if its vsock came back
    // (vhost-device-vsock 0.3.0 loses a queue that gets a host connection
    // while the guest is paused: vm/vhost-device-vsock-0.3.0.patch). The
    // VM is torn down either way.
    let victim_back = k
        .unpublish_within(victim, &theirs[0].dev, Duration::from_secs(60))
        .map_err(|s| s.message().to_string());
    let (a, l) = (median(&alone), median(&loaded));
    let ratio = l / a;
    let codes = codes.locked().clone();
    let calls: usize = codes.values().sum();
    Ok(Figure {
        key: PAUSED.0.into(),
        title: PAUSED.1.into(),
        ours: fmt_secs(l),
        baseline: format!("{} alone", fmt_secs(a)),
        ratio: format!("{ratio:.2}x"),
        target: PAUSED.2.into(),
        verdict: Verdict::from(ratio <= 1.2),
        data: json!({
            "alone_s": alone, "with_paused_neighbour_s": loaded,
            "neighbour_calls": calls, "neighbour_codes": codes,
            "crustd_open_files_before": files_before, "crustd_open_files_after": files_after,
            "paused_sandbox_unpublished_after_cont": victim_back,
            "flood": format!("{FLOOD_THREADS} threads, stats (2 s deadline) and publish (5 s), 500 ms after each failure"),
        }),
    })
}

fn concurrent(work: &Path, socket: &Path, k: &Kubelet, names: &[String]) -> R<Figure> {
    let vols = volumes(work, "concurrent", names.len() * 3)?;
    // Each guest's first hot-plug is slower (TCG warms its paths): one
    // publish into each first, not measured, so both ways compare warm guests.
    for (n, v) in names.iter().zip(&vols[2 * names.len()..]) {
        publish(k, n, &v.dev)?;
        unpublish(k, n, &v.dev)?;
    }
    // At once: one thread (and one connection) per sandbox.
    let t = Instant::now();
    let each: Vec<R<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = names
            .iter()
            .zip(&vols)
            .map(|(n, v)| {
                s.spawn(move || {
                    let k = Kubelet::connect(socket, Duration::from_secs(300))?;
                    publish(&k, n, &v.dev)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a publish panicked".into()))
            })
            .collect()
    });
    let together = secs(t.elapsed());
    let each: Vec<f64> = each.into_iter().collect::<R<_>>()?;
    for (n, v) in names.iter().zip(&vols) {
        unpublish(k, n, &v.dev)?;
    }
    // One after another, fresh devices.
    let t = Instant::now();
    let mut one_by_one = Vec::new();
    for (n, v) in names.iter().zip(&vols[names.len()..2 * names.len()]) {
        one_by_one.push(publish(k, n, &v.dev)?);
    }
    let serial = secs(t.elapsed());
    for (n, v) in names.iter().zip(&vols[names.len()..2 * names.len()]) {
        unpublish(k, n, &v.dev)?;
    }
    Ok(Figure {
        key: CONCURRENT.0.into(),
        title: CONCURRENT.1.into(),
        ours: fmt_secs(together),
        baseline: format!("{} one after another", fmt_secs(serial)),
        ratio: format!("{:.2}x faster", serial / together),
        target: CONCURRENT.2.into(),
        verdict: Verdict::Report,
        data: json!({
            "at_once_wall_s": together, "at_once_each_s": each,
            "one_after_another_wall_s": serial, "one_after_another_each_s": one_by_one,
            "note": "warm guests (one publish each first, not measured); the 8 guests share the machine's CPUs under TCG: the hot-plug and mount in each guest, not crustd, bound the speed-up",
        }),
    })
}

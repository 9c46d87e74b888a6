//! The idmap's cost: a BindMount of an ext4 volume (a loop device over a
//! sparse image) on the real agent, with uid and gid mappings (a pod in a
//! user namespace: its 0 is the host's 100000, 65536 ids) against the same
//! bind without, each followed by its Unmount. The difference is the user
//! namespace the agent makes for the bind (a clone, its two maps, the
//! namespace's fd) and MOUNT_ATTR_IDMAP.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use crust_client::proto;
use crust_client::{Address, CrustClient};
use serde_json::json;

use crate::host_agent::spawn_agent;
use crate::report::{Figure, Verdict};
use crate::sys::{self, Loop, R};

/// The keys, titles and targets of this section.
pub fn keys() -> Vec<(&'static str, &'static str, &'static str)> {
    vec![(
        "idmap_bind",
        "BindMount of an ext4 volume with uid/gid mappings (0:100000:65536) against without, on the host",
        "reported (the user namespace's cost)",
    )]
}

pub fn figures(work: &Path, runs: usize) -> Vec<Figure> {
    match measure(&work.join("idmap"), runs.max(1) * 40) {
        Ok(f) => vec![f],
        Err(e) => keys()
            .into_iter()
            .map(|(k, t, g)| Figure::not_measured(k, t, g, e.clone()))
            .collect(),
    }
}

fn range() -> proto::IDMapping {
    proto::IDMapping {
        container_id: 0,
        host_id: 100_000,
        length: 65_536,
        ..Default::default()
    }
}

/// `n` binds and unmounts at `target`, idmapped or not: each bind's time in ms.
fn binds(c: &CrustClient, target: &Path, idmapped: bool, n: usize) -> R<Vec<f64>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut b = proto::BindMountRequest::new();
        b.volume_id = "idm".into();
        b.target = target.display().to_string();
        if idmapped {
            b.uid_mappings = vec![range()];
            b.gid_mappings = vec![range()];
        }
        let t0 = Instant::now();
        c.bind_mount(&b).map_err(|e| format!("bind {i}: {e}"))?;
        out.push(t0.elapsed().as_secs_f64() * 1000.0);
        let mut u = proto::UnmountRequest::new();
        u.target = b.target.clone();
        c.unmount(&u).map_err(|e| format!("unmount {i}: {e}"))?;
    }
    out.sort_by(f64::total_cmp);
    Ok(out)
}

fn measure(work: &Path, n: usize) -> R<Figure> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work).map_err(|e| e.to_string())?;
    let img = work.join("idm.img");
    sys::sparse_file(&img, 64 << 20)?;
    sys::run("mkfs.ext4", &["-q", "-F", &img.to_string_lossy()])?;
    let disk = Loop::attach(&img)?;
    let (agent, _) = spawn_agent(work, "idmap")?;
    let c = CrustClient::connect(&Address::Unix(agent.sock.clone()), Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let mut r = proto::PublishVolumeRequest::new();
    r.volume_id = "idm".into();
    r.set_device_path(disk.dev.clone());
    r.fs_type = "ext4".into();
    c.publish_volume(&r).map_err(|e| format!("publish: {e}"))?;
    let root = fs::canonicalize(work.join("idmap-root")).map_err(|e| e.to_string())?;
    let target = root.join("pods/bench/data");
    // Alternating rounds, so that the machine's load falls on both alike.
    let (mut plain, mut mapped) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        plain.extend(binds(&c, &target, false, n / 4)?);
        mapped.extend(binds(&c, &target, true, n / 4)?);
    }
    let mut u = proto::UnpublishVolumeRequest::new();
    u.volume_id = "idm".into();
    c.unpublish_volume(&u)
        .map_err(|e| format!("unpublish: {e}"))?;
    plain.sort_by(f64::total_cmp);
    mapped.sort_by(f64::total_cmp);
    let (p, m) = (median(&plain), median(&mapped));
    Ok(Figure {
        key: "idmap_bind".into(),
        title: keys()[0].1.into(),
        ours: format!("{m:.2} ms idmapped, median of {}", mapped.len()),
        baseline: format!("{p:.2} ms without mappings"),
        ratio: format!("{:.2}x (+{:.2} ms)", m / p, m - p),
        target: keys()[0].2.into(),
        verdict: Verdict::Report,
        data: json!({"idmapped_ms": mapped, "plain_ms": plain, "median_idmapped_ms": m, "median_plain_ms": p}),
    })
}

fn median(s: &[f64]) -> f64 {
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

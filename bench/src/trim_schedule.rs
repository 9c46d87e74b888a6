//! Trim on a schedule at scale: 100 ext4 volumes (loop devices over sparse
//! images) on one real agent, each with a trim interval.
//!
//! - idle: an interval of an hour, so nothing comes due: the agent's CPU
//!   over 20 s (its one runner thread asleep);
//! - busy: the shortest interval, 10 s, for 60 s: the agent's CPU, and when
//!   the trims ended (ListVolumes' `last_unix_ms`, read once a second): the
//!   most in any one second against the 100 that would come together
//!   without jitter.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use crust_client::proto;
use crust_client::{Address, CrustClient};
use serde_json::json;

use crate::host_agent::spawn_agent;
use crate::report::{Figure, Verdict};
use crate::sys::{self, Loop, R};

const VOLUMES: usize = 100;

/// The keys, titles and targets of this section.
pub fn keys() -> Vec<(&'static str, &'static str, &'static str)> {
    vec![
        (
            "trim_schedule_idle_cpu",
            "agent CPU, 100 volumes scheduled hourly, 20 s idle",
            "< 0.1% of a CPU",
        ),
        (
            "trim_schedule_spread",
            "100 volumes trimmed every 10 s for 60 s: most trims ending in one second",
            "<= 25 (100 without jitter); agent CPU reported",
        ),
    ]
}

pub fn figures(work: &Path) -> Vec<Figure> {
    match measure(&work.join("trim-schedule")) {
        Ok(f) => f,
        Err(e) => keys()
            .into_iter()
            .map(|(k, t, g)| Figure::not_measured(k, t, g, e.clone()))
            .collect(),
    }
}

/// CPU seconds (user + system) the process has used.
fn cpu_secs(pid: u32) -> R<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    let after = s.rsplit_once(')').ok_or("bad stat")?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().map_err(|e| e.to_string())?
        + f[12].parse::<u64>().map_err(|e| e.to_string())?;
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    Ok(ticks as f64 / hz as f64)
}

fn publish_all(c: &CrustClient, disks: &[Loop], every: u32) -> R<()> {
    for (i, d) in disks.iter().enumerate() {
        let mut r = proto::PublishVolumeRequest::new();
        r.volume_id = format!("t{i}");
        r.set_device_path(d.dev.clone());
        r.fs_type = "ext4".into();
        r.trim_interval_s = every;
        c.publish_volume(&r)
            .map_err(|e| format!("publish t{i}: {e}"))?;
    }
    Ok(())
}

fn unpublish_all(c: &CrustClient) -> R<()> {
    for i in 0..VOLUMES {
        let mut r = proto::UnpublishVolumeRequest::new();
        r.volume_id = format!("t{i}");
        c.unpublish_volume(&r)
            .map_err(|e| format!("unpublish t{i}: {e}"))?;
    }
    Ok(())
}

fn measure(work: &Path) -> R<Vec<Figure>> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work).map_err(|e| e.to_string())?;
    let mut disks = Vec::new();
    for i in 0..VOLUMES {
        let img = work.join(format!("t{i}.img"));
        sys::sparse_file(&img, 64 << 20)?;
        sys::run("mkfs.ext4", &["-q", "-F", &img.to_string_lossy()])?;
        disks.push(Loop::attach(&img)?);
    }
    let (agent, _) = spawn_agent(work, "trim-schedule")?;
    let c = CrustClient::connect(&Address::Unix(agent.sock.clone()), Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    publish_all(&c, &disks, 3600)?;
    std::thread::sleep(Duration::from_secs(1));
    let cpu0 = cpu_secs(agent.pid())?;
    let idle = Duration::from_secs(20);
    std::thread::sleep(idle);
    let idle_pct = (cpu_secs(agent.pid())? - cpu0) / idle.as_secs_f64() * 100.0;
    unpublish_all(&c)?;
    publish_all(&c, &disks, crust_agent::validate::MIN_TRIM_INTERVAL_S)?;
    let (ends, busy_pct) = watch(&c, agent.pid(), Duration::from_secs(60))?;
    unpublish_all(&c)?;
    let mut per_sec = std::collections::BTreeMap::<i64, usize>::new();
    for &(_, ms) in &ends {
        *per_sec.entry(ms / 1000).or_default() += 1;
    }
    let most = per_sec.values().copied().max().unwrap_or(0);
    Ok(vec![
        Figure {
            key: "trim_schedule_idle_cpu".into(),
            title: keys()[0].1.into(),
            ours: format!("{idle_pct:.3}%"),
            baseline: "—".into(),
            ratio: "—".into(),
            target: keys()[0].2.into(),
            verdict: Verdict::from(idle_pct < 0.1),
            data: json!({"cpu_percent": idle_pct, "volumes": VOLUMES, "window_s": 20}),
        },
        Figure {
            key: "trim_schedule_spread".into(),
            title: keys()[1].1.into(),
            ours: format!(
                "{} trims, at most {most} in one second over {} seconds; agent CPU {busy_pct:.2}%",
                ends.len(),
                per_sec.len()
            ),
            baseline: "—".into(),
            ratio: "—".into(),
            target: keys()[1].2.into(),
            verdict: Verdict::from(most <= 25 && ends.len() >= VOLUMES),
            data: json!({"trims": ends.len(), "most_in_one_second": most,
                         "seconds_with_trims": per_sec.len(), "cpu_percent": busy_pct,
                         "per_second": per_sec.values().collect::<Vec<_>>()}),
        },
    ])
}

/// Every trim that ended within `window` (volume, unix ms), read from
/// ListVolumes once a second, and the agent's CPU meanwhile (percent).
fn watch(c: &CrustClient, pid: u32, window: Duration) -> R<(Vec<(String, i64)>, f64)> {
    let mut seen = std::collections::BTreeSet::new();
    let cpu0 = cpu_secs(pid)?;
    let t0 = Instant::now();
    while t0.elapsed() < window {
        std::thread::sleep(Duration::from_secs(1));
        for v in c.list_volumes().map_err(|e| e.to_string())?.volumes {
            if let Some(t) = v.trim.as_ref().filter(|t| t.last_unix_ms > 0) {
                seen.insert((v.volume_id.clone(), t.last_unix_ms));
            }
        }
    }
    let pct = (cpu_secs(pid)? - cpu0) / t0.elapsed().as_secs_f64() * 100.0;
    Ok((seen.into_iter().collect(), pct))
}

//! Freeze plus thaw, and trim, on a loop device's ext4: the agent's own
//! calls (`crust_agent::quiesce`, what FreezeVolumes, ThawVolumes and
//! TrimVolume run under the table's bookkeeping) beside util-linux's
//! `fsfreeze -f`/`-u` and `fstrim` on the same filesystem in the same run,
//! alternating who goes first.
//!
//! - idle: nothing dirty, so the figure is the calls' own cost;
//! - dirty: 256 MiB written and not synced before each freeze, so the
//!   figure is mostly the flush FIFREEZE waits for;
//! - trim: 512 MiB written, synced and deleted before each trim; the
//!   figure is the filesystem's bytes covered per second.

use std::io::Write;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Instant;

use crust_agent::model::FsType;
use crust_agent::sys::sysfs::Sysfs;
use crust_agent::{grow, quiesce};
use serde_json::json;

use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{self, median, secs, Loop, Mount, R};

const MIB: u64 = 1 << 20;
const DIRTY: u64 = 256 * MIB;
const DELETED: u64 = 512 * MIB;

/// The keys, titles and targets of this section.
pub fn keys() -> Vec<(&'static str, &'static str, &'static str)> {
    vec![
        (
            "freeze_thaw_idle",
            "freeze + thaw, idle ext4",
            "no slower than fsfreeze -f/-u",
        ),
        (
            "freeze_thaw_dirty",
            "freeze + thaw, ext4 with 256 MiB dirty",
            "within 10% of fsfreeze -f/-u",
        ),
        (
            "trim",
            "trim after deleting 512 MiB, ext4 2 GiB",
            "within 10% of fstrim",
        ),
    ]
}

/// Writes `bytes` of data to `path`, not synced.
fn write_dirty(path: &Path, bytes: u64) -> R<()> {
    let mut f = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..bytes / MIB {
        f.write_all(&chunk).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The agent's freeze and thaw of the filesystem mounted at `m`.
fn crust_freeze_thaw(m: &Path) -> R<f64> {
    let t = Instant::now();
    let at = std::fs::File::open(m).map_err(|e| e.to_string())?;
    let dir = quiesce::open(at.as_fd(), m).map_err(|e| e.to_string())?;
    quiesce::freeze(&dir, m).map_err(|e| e.to_string())?;
    quiesce::thaw(&dir, m).map_err(|e| e.to_string())?;
    Ok(secs(t.elapsed()))
}

/// util-linux's.
fn fsfreeze(m: &Path) -> R<f64> {
    let p = m.to_string_lossy();
    let t = Instant::now();
    sys::run("fsfreeze", &["-f", &p])?;
    sys::run("fsfreeze", &["-u", &p])?;
    Ok(secs(t.elapsed()))
}

/// The agent's trim of the whole filesystem, in its ranges (its size as
/// the filesystem says it, as TrimVolume reads it).
fn crust_trim(m: &Path, dev: &str) -> R<f64> {
    let device = crust_agent::device::from_path(&Sysfs::system(), Path::new(dev))
        .map_err(|e| format!("device::from_path: {e}"))?;
    let t = Instant::now();
    let at = std::fs::File::open(m).map_err(|e| e.to_string())?;
    let total =
        grow::fs_size_bytes(at.as_fd(), m, &device, FsType::Ext4).map_err(|e| e.to_string())?;
    let dir = quiesce::open(at.as_fd(), m).map_err(|e| e.to_string())?;
    let mut start = 0;
    while start < total {
        let len = crust_agent::volumes::trim::RANGE_BYTES.min(total - start);
        quiesce::trim(&dir, m, start, len, 0).map_err(|e| e.to_string())?;
        start += len;
    }
    Ok(secs(t.elapsed()))
}

fn fstrim(m: &Path) -> R<f64> {
    let t = Instant::now();
    sys::run("fstrim", &[&m.to_string_lossy()])?;
    Ok(secs(t.elapsed()))
}

/// `runs` alternating pairs of (ours, util-linux's), each after `prepare`.
fn pairs(
    runs: usize,
    m: &Path,
    prepare: &dyn Fn() -> R<()>,
    ours: &dyn Fn(&Path) -> R<f64>,
    theirs: &dyn Fn(&Path) -> R<f64>,
) -> R<(Vec<f64>, Vec<f64>)> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..runs {
        for first in [i % 2 == 0, i % 2 != 0] {
            prepare()?;
            if first {
                a.push(ours(m)?);
            } else {
                b.push(theirs(m)?);
            }
        }
    }
    Ok((a, b))
}

fn figure(
    key: &str,
    (ours_s, base_s): (Vec<f64>, Vec<f64>),
    baseline: &str,
    slack: f64,
    note: &str,
) -> Figure {
    let (_, title, target) = keys().into_iter().find(|k| k.0 == key).unwrap_or_default();
    let (ours, base) = (median(&ours_s), median(&base_s));
    Figure {
        key: key.into(),
        title: title.into(),
        ours: fmt_secs(ours),
        baseline: format!("{baseline} {}", fmt_secs(base)),
        ratio: if ours <= base {
            format!("{:.2}x faster", base / ours)
        } else {
            format!("{:.2}x slower", ours / base)
        },
        target: target.into(),
        verdict: Verdict::from(ours <= base * slack),
        data: json!({ "crust_s": ours_s, "baseline_s": base_s, "median_crust_s": ours,
                      "median_baseline_s": base, "note": note }),
    }
}

/// This section's figures.
pub fn figures(work: &Path, runs: usize) -> Vec<Figure> {
    match measure(work, runs) {
        Ok(f) => f,
        Err(e) => keys()
            .into_iter()
            .map(|(k, t, g)| Figure::not_measured(k, t, g, e.clone()))
            .collect(),
    }
}

fn measure(work: &Path, runs: usize) -> R<Vec<Figure>> {
    let img = work.join("snapshot.img");
    sys::sparse_file(&img, 2048 * MIB)?;
    sys::run("mkfs.ext4", &["-q", "-F", &img.to_string_lossy()])?;
    let lo = Loop::attach(&img)?;
    let mount = Mount::new(&lo.dev, &work.join("snapshot"), "ext4", "")?;
    let m = mount.path.clone();
    let idle = || sys::syncfs(&m);
    let dirty = || write_dirty(&m.join("dirty"), DIRTY);
    let deleted = || {
        write_dirty(&m.join("deleted"), DELETED)?;
        sys::syncfs(&m)?;
        std::fs::remove_file(m.join("deleted")).map_err(|e| e.to_string())?;
        sys::syncfs(&m)
    };
    let n = runs * 4;
    let mut out = vec![
        figure(
            "freeze_thaw_idle",
            pairs(n, &m, &idle, &crust_freeze_thaw, &fsfreeze)?,
            "fsfreeze",
            1.0,
            "ext4 2 GiB on a loop device, synced before each; fsfreeze is two processes",
        ),
        figure(
            "freeze_thaw_dirty",
            pairs(runs * 2, &m, &dirty, &crust_freeze_thaw, &fsfreeze)?,
            "fsfreeze",
            1.1,
            "256 MiB written and not synced before each freeze: the flush dominates",
        ),
        figure(
            "trim",
            pairs(runs * 2, &m, &deleted, &|m| crust_trim(m, &lo.dev), &fstrim)?,
            "fstrim",
            1.1,
            "512 MiB written, synced and deleted before each trim; the agent trims in 1 GiB ranges",
        ),
    ];
    // Trim as a throughput: the filesystem's bytes covered per second.
    if let Some(t) = out.last_mut() {
        let gib_s = |s: f64| 2.0 / s;
        let (a, b) = (
            t.data["median_crust_s"].as_f64().unwrap_or(f64::NAN),
            t.data["median_baseline_s"].as_f64().unwrap_or(f64::NAN),
        );
        t.ours = format!("{} ({:.1} GiB/s)", t.ours, gib_s(a));
        t.baseline = format!("{} ({:.1} GiB/s)", t.baseline, gib_s(b));
    }
    drop(mount);
    drop(lo);
    let _ = std::fs::remove_file(&img);
    Ok(out)
}

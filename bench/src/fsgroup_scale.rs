//! fsGroup at scale: a 1,000,000-entry tree on a loop ext4, fresh
//! and already correct, crust's walk (`ownership::apply`) beside the serial
//! kubelet-style walk of `fsgroup.rs`, with the CPU-time bound; and the walk
//! time of both against entries (100k, 300k, 1M), drawn as
//! `<out>/fsgroup.svg` by the code at the end of this file.
//!
//! One image holds every size, so it is built once: ten units of exactly
//! 100,000 entries (271 dirs × (367 files + 1 symlink), and the unit's own
//! dir), laid out so that a subtree is each size:
//!
//! ```text
//! root/p100k            one unit                 100,000 entries
//! root/p300k/u1..u3     three units              300,001
//! root/rest/u4..u9      six units                600,001
//! root                  all, with lost+found   1,000,004
//! ```
//!
//! Every fresh run starts from its subtree reset (group 0, modes 0755/0644,
//! synced, untimed) and every run is verified after; the reset and the
//! checks walk the tree on every CPU, as they are not what is measured.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crust_agent::model::Policy;
use crust_agent::ownership::walk as ownership;
use crust_protocols::sync::{CondvarExt, LockExt};
use serde_json::json;

use crate::fsgroup::{
    beside_serial, bound, cpu_time, ext4, files_and_a_link, fresh, kubelet_walk, machine_cpu,
    right_for_fsgroup, BOUND_TARGET, GID,
};
use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{self, median, secs, Loop, Mount, R};

/// Directories in a unit, and entries in each (files + one symlink).
const UNIT_DIRS: usize = 271;
const UNIT_FILES: usize = 367;
/// Entries in a unit, its own directory included.
const UNIT: u64 = 1 + (UNIT_DIRS * (UNIT_FILES + 2)) as u64;
const UNITS: usize = 10;

/// The keys, titles and targets of this section's figures, for main.rs.
pub fn keys() -> [(&'static str, &'static str, &'static str); 4] {
    [
        (
            "fsgroup_1m_fresh",
            "fsGroup Always, fresh 1M-entry tree, warm cache",
            BOUND_TARGET,
        ),
        (
            "fsgroup_1m_correct",
            "fsGroup Always, already-correct 1M-entry tree, warm cache",
            BOUND_TARGET,
        ),
        (
            "fsgroup_scaling",
            "fsGroup Always, fresh tree: walk time against entries (plot: fsgroup.svg)",
            "report",
        ),
        crate::publish_retry::key(),
    ]
}

/// The three sizes: (label, subtree below the root, entries).
fn points() -> [(&'static str, &'static str, u64); 3] {
    [
        ("100k", "p100k", UNIT),
        ("300k", "p300k", 3 * UNIT + 1),
        // The root, its lost+found, p100k, p300k and rest (6 units + itself).
        ("1M", "", 2 + UNIT + (3 * UNIT + 1) + (6 * UNIT + 1)),
    ]
}

/// The volume with the tree.
struct Tree {
    // Field order is drop order: unmount before detaching the loop device.
    mount: Mount,
    _loop: Loop,
}

impl Tree {
    fn at(&self, sub: &str) -> PathBuf {
        if sub.is_empty() {
            self.mount.path.clone()
        } else {
            self.mount.path.join(sub)
        }
    }
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A 3 GiB ext4 with 1.1M inodes, initialised up front, holding the ten
/// units, built on every CPU. Its journal is 1 GiB: mke2fs's default for
/// 3 GiB (64 MiB) is too small for the metadata a fresh 1M walk changes
/// (about 250 MB of inode tables), and its commits and checkpoints then
/// stall every writer, both walks alike (about 1 s each, measured), which
/// is the filesystem's figure, not the walk's (bench/README.md).
fn build(work: &Path) -> R<Tree> {
    let img = work.join("fsgroup-1m.img");
    let at = work.join("fsgroup-1m");
    let (lo, mount) = ext4(&img, 3 << 30, "1100000", &["-J", "size=1024"], &at)?;
    let root = mount.path.clone();
    let mut units = vec![root.join("p100k")];
    for (parent, range) in [("p300k", 1..4), ("rest", 4..UNITS)] {
        let p = root.join(parent);
        fs::create_dir(&p).map_err(|e| format!("mkdir {}: {e}", p.display()))?;
        units.extend(range.map(|u| p.join(format!("u{u}"))));
    }
    let next = Mutex::new(units.into_iter());
    let failed = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads() {
            s.spawn(|| loop {
                let Some(unit) = next.locked().next() else {
                    return;
                };
                if let Err(e) = build_unit(&unit) {
                    *failed.locked() = Some(e);
                    return;
                }
            });
        }
    });
    if let Some(e) = failed.locked().take() {
        return Err(e);
    }
    sys::syncfs(&root)?;
    Ok(Tree { mount, _loop: lo })
}

fn build_unit(unit: &Path) -> R<()> {
    fs::create_dir(unit).map_err(|e| format!("mkdir {}: {e}", unit.display()))?;
    for d in 0..UNIT_DIRS {
        files_and_a_link(&unit.join(format!("d{d:03}")), UNIT_FILES)?;
    }
    Ok(())
}

/// Calls `f` on every entry below and including `root` (no symlink
/// followed), directories shared out to every CPU. Answers the count.
fn par_visit(root: &Path, f: &(dyn Fn(&Path, &fs::Metadata) -> R<()> + Sync)) -> R<u64> {
    let md = fs::symlink_metadata(root).map_err(|e| format!("lstat {}: {e}", root.display()))?;
    f(root, &md)?;
    if !md.is_dir() {
        return Ok(1);
    }
    // (directories to list, workers listing one)
    let queue = Mutex::new((vec![root.to_path_buf()], 0usize));
    let more = Condvar::new();
    let count = Mutex::new(1u64);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads() {
            s.spawn(|| loop {
                let dir = {
                    let mut q = queue.locked();
                    loop {
                        if failed.locked().is_some() {
                            more.notify_all();
                            return;
                        }
                        if let Some(d) = q.0.pop() {
                            q.1 += 1;
                            break d;
                        }
                        if q.1 == 0 {
                            more.notify_all();
                            return;
                        }
                        q = more.waited(q);
                    }
                };
                let listed = (|| -> R<(u64, Vec<PathBuf>)> {
                    let mut n = 0;
                    let mut dirs = Vec::new();
                    let rd = fs::read_dir(&dir)
                        .map_err(|e| format!("readdir {}: {e}", dir.display()))?;
                    for e in rd {
                        let p = e
                            .map_err(|e| format!("readdir {}: {e}", dir.display()))?
                            .path();
                        let md = fs::symlink_metadata(&p)
                            .map_err(|e| format!("lstat {}: {e}", p.display()))?;
                        f(&p, &md)?;
                        n += 1;
                        if md.is_dir() {
                            dirs.push(p);
                        }
                    }
                    Ok((n, dirs))
                })();
                let mut q = queue.locked();
                q.1 -= 1;
                match listed {
                    Ok((n, dirs)) => {
                        *count.locked() += n;
                        q.0.extend(dirs);
                    }
                    Err(e) => *failed.locked() = Some(e),
                }
                more.notify_all();
            });
        }
    });
    if let Some(e) = failed.locked().take() {
        return Err(e);
    }
    let count = *count.locked();
    Ok(count)
}

/// Makes `path`'s subtree fresh: group 0, modes 0755/0644, no setgid; synced.
fn reset(path: &Path) -> R<()> {
    par_visit(path, &fresh)?;
    sys::syncfs(path)
}

/// Checks `path`'s subtree is right for fsGroup (as fsgroup.rs does) and has `entries`.
fn verify(path: &Path, entries: u64) -> R<()> {
    let n = par_visit(path, &|p, md| {
        if right_for_fsgroup(md, true) {
            Ok(())
        } else {
            Err(format!(
                "{} is not right after the run (gid {}, mode {:o})",
                p.display(),
                md.gid(),
                md.mode()
            ))
        }
    })?;
    if n != entries {
        return Err(format!(
            "{n} entries under {} after the run, {entries} expected",
            path.display()
        ));
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Walk {
    Crust,
    Serial,
}

impl Walk {
    fn name(self) -> &'static str {
        match self {
            Walk::Crust => "crust",
            Walk::Serial => "serial kubelet-style walk",
        }
    }
}

/// One timed walk of `path`: (wall, CPU seconds of this process's threads,
/// and the machine's other busy and idle CPU seconds meanwhile).
fn walk(w: Walk, path: &Path, entries: u64) -> R<(Duration, f64, Machine)> {
    let cpu = cpu_time();
    let (busy, idle) = machine_cpu();
    let t = Instant::now();
    let visited = match w {
        Walk::Crust => {
            let r = ownership::apply(path, GID, Policy::Always, false)
                .map_err(|e| format!("ownership::apply: {e}"))?;
            if r.errors != 0 {
                return Err(format!("ownership::apply: {} errors", r.errors));
            }
            r.visited
        }
        Walk::Serial => {
            let (n, errors) = kubelet_walk(path, GID)?;
            if errors != 0 {
                return Err(format!("the serial walk: {errors} errors"));
            }
            n
        }
    };
    let d = t.elapsed();
    let cpu = cpu_time() - cpu;
    let (busy2, idle2) = machine_cpu();
    let machine = Machine {
        others: (busy2 - busy - cpu).max(0.0),
        idle: idle2 - idle,
    };
    if visited != entries {
        return Err(format!(
            "{} visited {visited} of {entries} entries",
            w.name()
        ));
    }
    Ok((d, cpu, machine))
}

/// What the rest of the machine did during a walk, in CPU seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Machine {
    /// Busy outside this process: the kernel's journal commits and
    /// writeback, which a walk's changes cause but its rusage does not show.
    others: f64,
    /// Idle (iowait included): CPU the walk left unused.
    idle: f64,
}

/// One point of the plot: (size label, entries, crust seconds, serial seconds).
pub type Point<'a> = (&'a str, u64, f64, f64);

/// Wall and CPU seconds of each walk's runs.
#[derive(Clone, Default)]
struct Samples {
    wall: Vec<f64>,
    cpu: Vec<f64>,
    others: Vec<f64>,
    idle: Vec<f64>,
}

/// `runs` rounds of both walks over `path`, the order alternating; `fresh`:
/// each run from a reset subtree, else from the right one.
fn measure(path: &Path, entries: u64, runs: usize, fresh: bool, label: &str) -> R<[Samples; 2]> {
    let mut s: [Samples; 2] = Default::default();
    for i in 0..runs {
        for k in 0..2 {
            let j = (i + k) % 2;
            let w = [Walk::Crust, Walk::Serial][j];
            if fresh {
                reset(path)?;
            }
            let (d, cpu, m) = walk(w, path, entries).map_err(|e| format!("{}: {e}", w.name()))?;
            verify(path, entries).map_err(|e| format!("{}: {e}", w.name()))?;
            s[j].wall.push(secs(d));
            s[j].cpu.push(cpu);
            s[j].others.push(m.others);
            s[j].idle.push(m.idle);
            eprintln!(
                "bench: fsGroup {label} {} run {}: {} {} (CPU {}; the rest of the machine busy {}, idle {})",
                if fresh { "fresh" } else { "correct" },
                i + 1,
                w.name(),
                fmt_secs(secs(d)),
                fmt_secs(cpu),
                fmt_secs(m.others),
                fmt_secs(m.idle)
            );
        }
    }
    Ok(s)
}

/// The figure of one size: ours beside the serial walk, with the CPU bound.
fn figure(key: &str, title: &str, target: &str, s: &[Samples; 2], entries: u64) -> Figure {
    let (ours, serial) = (median(&s[0].wall), median(&s[1].wall));
    let (cpu_ours, cpu_serial) = (median(&s[0].cpu), median(&s[1].cpu));
    let per_entry_us = |cpu: f64| cpu * 1e6 / entries as f64;
    let cpus = threads();
    let ceiling = bound(cpu_ours, cpu_serial);
    beside_serial(
        (key, title, target),
        ours,
        serial,
        ceiling,
        json!({
            "entries": entries, "runs": s[0].wall.len(), "cache": "warm: the reset (or the previous run) just touched every entry",
            "crust_s": s[0].wall, "serial_s": s[1].wall,
            "median_crust_s": ours, "median_serial_s": serial,
            "crust_cpu_s": s[0].cpu, "serial_cpu_s": s[1].cpu,
            "others_busy_s": { "crust": s[0].others, "serial": s[1].others },
            "idle_s": { "crust": s[0].idle, "serial": s[1].idle },
            "cpu_per_entry_us": { "crust": per_entry_us(cpu_ours), "serial": per_entry_us(cpu_serial) },
            "cpu_bound_ceiling": ceiling,
            "note": format!(
                "{entries} entries; CPU per entry (median): crust {:.1} µs, serial {:.1} µs, so on {cpus} CPUs the best possible speed-up is {ceiling:.2}x; we reach {:.0}% of it",
                per_entry_us(cpu_ours),
                per_entry_us(cpu_serial),
                100.0 * (serial / ours) / ceiling
            ),
        }),
    )
}

/// The section's figures; writes `<out>/fsgroup.svg`. `runs` rounds at
/// 100k and 300k, at most 2 at 1M (each 1M round is two walks and two
/// resets of a million entries).
pub fn figures(work: &Path, out: &Path, runs: usize) -> Vec<Figure> {
    let [k_fresh, k_correct, k_scaling, _] = keys();
    let fail = |why: String| Figure::none_measured(&keys(), &why);
    let t = Instant::now();
    let tree = match build(work) {
        Ok(t) => t,
        Err(e) => return fail(format!("could not make the 1M-entry volume: {e}")),
    };
    eprintln!(
        "bench: fsGroup 1M-entry tree made in {}",
        fmt_secs(secs(t.elapsed()))
    );
    let runs_small = runs.clamp(1, 2);
    let runs_1m = runs.clamp(1, 2);
    let mut fresh: Vec<(&str, u64, R<[Samples; 2]>)> = Vec::new();
    for (label, sub, entries) in points() {
        let n = if label == "1M" { runs_1m } else { runs_small };
        fresh.push((
            label,
            entries,
            measure(&tree.at(sub), entries, n, true, label),
        ));
    }
    let mut figs = Vec::new();
    let (_, entries_1m, ref s_1m) = fresh[2];
    let (key, title, target) = k_fresh;
    figs.push(match s_1m {
        Ok(s) => figure(key, title, target, s, entries_1m),
        Err(e) => Figure::not_measured(key, title, target, e.clone()),
    });
    // Already correct: the last fresh run left it so (every run is
    // verified); each timed run keeps it so.
    let (key, title, target) = k_correct;
    figs.push(
        match measure(&tree.at(""), entries_1m, runs_1m, false, "1M") {
            Ok(s) => figure(key, title, target, &s, entries_1m),
            Err(e) => Figure::not_measured(key, title, target, e),
        },
    );
    let (key, title, target) = k_scaling;
    let measured: Vec<Point> = fresh
        .iter()
        .filter_map(|(l, n, s)| {
            s.as_ref()
                .ok()
                .map(|s| (*l, *n, median(&s[0].wall), median(&s[1].wall)))
        })
        .collect();
    if measured.len() != fresh.len() {
        let why = fresh
            .iter()
            .filter_map(|(l, _, s)| s.as_ref().err().map(|e| format!("{l}: {e}")))
            .collect::<Vec<_>>()
            .join("; ");
        figs.push(Figure::not_measured(key, title, target, why));
        let (k, t, g) = crate::publish_retry::key();
        figs.push(Figure::not_measured(
            k,
            t,
            g,
            "the 1M-entry tree was not walked",
        ));
        return figs;
    }
    let svg_path = out.join("fsgroup.svg");
    let svg = plot(&measured);
    let written = fs::create_dir_all(out).and_then(|()| fs::write(&svg_path, svg));
    let cell = |f: &dyn Fn(&Point) -> String| measured.iter().map(f).collect::<Vec<_>>().join(", ");
    figs.push(Figure {
        key: key.into(),
        title: title.into(),
        ours: cell(&|(l, _, c, _)| format!("{l} {}", fmt_secs(*c))),
        baseline: format!("serial walk {}", cell(&|(l, _, _, k)| format!("{l} {}", fmt_secs(*k)))),
        ratio: cell(&|(l, _, c, k)| format!("{l} {:.2}x", k / c)),
        target: target.into(),
        verdict: Verdict::Report,
        data: json!({
            "points": measured.iter().map(|(l, n, c, k)| json!({
                "size": l, "entries": n, "median_crust_s": c, "median_serial_s": k,
            })).collect::<Vec<_>>(),
            "runs": { "100k": runs_small, "300k": runs_small, "1M": runs_1m },
            "plot": "fsgroup.svg",
            "note": match written {
                Ok(()) => "fresh trees, warm cache, medians; plot: [fsgroup.svg](fsgroup.svg)".to_string(),
                Err(e) => format!("the plot could not be written to {}: {e}", svg_path.display()),
            },
        }),
    });
    // Last, as it takes the volume off the host: the publish whose walk
    // outlives its caller's 2 s deadline, beside an uninterrupted one.
    let Tree { mount, _loop: lo } = tree;
    drop(mount);
    figs.push(crate::publish_retry::figure(&lo.dev, work, entries_1m));
    figs
}

// ---------------------------------------------------------------------------
// The plot: walk time against entries, one polyline per walk, hand-written SVG.
// ---------------------------------------------------------------------------

/// A "nice" axis step (1, 2 or 5 × 10^k) giving about `ticks` ticks up to `max`
/// (the last tick may fall a little short of `max`; the axis ends at the next).
fn nice_step(max: f64, ticks: f64) -> f64 {
    let raw = (max / ticks).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let unit = raw / mag;
    // 5% of slack: 1,000,004 entries in steps of 200k, not 500k.
    let m = if unit <= 1.05 {
        1.0
    } else if unit <= 2.1 {
        2.0
    } else if unit <= 5.25 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// The SVG of (label, entries, crust seconds, serial seconds) points.
pub fn plot(points: &[Point]) -> String {
    use std::fmt::Write;
    let (w, h) = (640.0, 400.0);
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 55.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let max_n = points.iter().map(|p| p.1).max().unwrap_or(1) as f64;
    let max_t = points.iter().flat_map(|p| [p.2, p.3]).fold(0.0, f64::max);
    let x_step = nice_step(max_n, 5.0);
    let y_step = nice_step(max_t, 5.0);
    let x_max = (max_n / x_step).ceil() * x_step;
    let y_max = ((max_t / y_step).ceil() * y_step).max(y_step);
    let x = |n: f64| left + pw * n / x_max;
    let y = |t: f64| top + ph * (1.0 - t / y_max);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">fsGroup Always on a fresh ext4 tree (warm cache): walk time against entries</text>"#,
        w / 2.0
    );
    // Grid and ticks.
    let mut v = 0.0;
    while v <= y_max + y_step / 2.0 {
        let yy = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0,
            trim(v)
        );
        v += y_step;
    }
    let mut v = 0.0;
    while v <= x_max + x_step / 2.0 {
        let xx = x(v);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#000"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            top + ph,
            top + ph + 5.0,
            top + ph + 18.0,
            entries_label(v)
        );
        v += x_step;
    }
    // Axes and their names.
    let _ = writeln!(
        s,
        r##"<polyline points="{left},{top} {left},{:.1} {:.1},{:.1}" fill="none" stroke="#000"/>"##,
        top + ph,
        left + pw,
        top + ph
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">entries</text>"#,
        left + pw / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">seconds</text>"#,
        top + ph / 2.0,
        top + ph / 2.0
    );
    draw_series(&mut s, points, &x, &y, (left, top));
    s.push_str("</svg>\n");
    s
}

/// One polyline with its points per walk, and its legend line at the top
/// left inside the plot (`corner`: the plot's left and top).
fn draw_series(
    s: &mut String,
    points: &[Point],
    x: &dyn Fn(f64) -> f64,
    y: &dyn Fn(f64) -> f64,
    corner: (f64, f64),
) {
    use std::fmt::Write;
    let (left, top) = corner;
    type Series = (&'static str, &'static str, fn(&Point) -> f64);
    let series: [Series; 2] = [
        ("crust (ownership::apply)", "#d62728", |p| p.2),
        ("serial kubelet-style walk", "#1f77b4", |p| p.3),
    ];
    for (i, (name, color, t)) in series.iter().enumerate() {
        let pts: Vec<String> = points
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.1 as f64), y(t(p))))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            pts.join(" ")
        );
        for p in points {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{color}"><title>{name}, {}: {:.2} s</title></circle>"#,
                x(p.1 as f64),
                y(t(p)),
                p.0,
                t(p)
            );
        }
        // Legend, top left inside the plot.
        let ly = top + 14.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><circle cx="{:.1}" cy="{ly:.1}" r="4" fill="{color}"/><text x="{:.1}" y="{:.1}">{name}</text>"#,
            left + 12.0,
            left + 36.0,
            left + 24.0,
            left + 42.0,
            ly + 4.0
        );
    }
}

/// A tick value without a useless fraction: 2, 2.5, 0.25.
fn trim(v: f64) -> String {
    let t = format!("{v:.2}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// 0, 200k, 1M, 1.2M.
fn entries_label(n: f64) -> String {
    if n >= 1e6 {
        format!("{}M", trim(n / 1e6))
    } else if n >= 1e3 {
        format!("{}k", trim(n / 1e3))
    } else {
        trim(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sizes_add_up() {
        assert_eq!(UNIT, 100_000);
        let p = points();
        assert_eq!(p.map(|p| p.2), [100_000, 300_001, 1_000_004]);
    }

    #[test]
    fn axis_steps_are_nice() {
        for (max, want) in [
            (1_000_004.0, 200_000.0),
            (23.4, 5.0),
            (7.0, 2.0),
            (0.9, 0.2),
        ] {
            assert_eq!(nice_step(max, 5.0), want, "{max}");
        }
        assert_eq!(entries_label(1_200_000.0), "1.2M");
        assert_eq!(entries_label(200_000.0), "200k");
        assert_eq!(trim(2.5), "2.5");
        assert_eq!(trim(10.0), "10");
    }

    #[test]
    fn the_plot_has_both_walks_their_points_and_a_legend() {
        let svg = plot(&[
            ("100k", 100_000, 0.5, 1.2),
            ("300k", 300_001, 1.6, 3.7),
            ("1M", 1_000_004, 5.1, 12.4),
        ]);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        // Two series polylines (plus the axes'), three points each, two legend dots.
        assert_eq!(svg.matches("stroke-width=\"2\"/>").count(), 4);
        assert_eq!(svg.matches("<circle").count(), 8);
        assert!(svg.contains(">crust (ownership::apply)</text>"));
        assert!(svg.contains(">serial kubelet-style walk</text>"));
        assert!(svg.contains(">1M</text>") && svg.contains(">entries</text>"));
        // The slowest point is inside the plot: y of 12.4 s on a 0..15 s axis.
        assert!(svg.contains("<title>serial kubelet-style walk, 1M: 12.40 s</title>"));
    }
}

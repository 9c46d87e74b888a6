//! crust-bench (`make bench`): every figure of the bench issue, each against
//! its baseline on the same machine in the same run, medians over several
//! runs; writes target/bench/report.md and report.json and says which
//! targets are met. A figure whose prerequisite is missing says so instead.

mod crustd_figs;
mod crustd_scale;
mod fsgroup;
mod fsgroup_scale;
mod grow_xfs;
mod host_agent;
mod idmap;
mod luks2;
mod publish_retry;
mod report;
mod snapshot;
mod sys;
mod trim_schedule;
mod vm_figs;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;

use report::{Figure, Verdict};

const USAGE: &str =
    "usage: crust-bench [--runs N] [--vm-disks N] [--vm-boots N] [--only SECTION,...] [--out DIR] [--strict]
  SECTION: fsgroup, xfs, host, snapshot, trim-schedule, idmap, luks2, size, vm, crustd, crustd-scale (default: all)
  --runs N      runs per contender for the heavy figures (default 5)
  --vm-disks N  disks hot-plugged (and grown) in the VM (default 5)
  --vm-boots N  VM boots for the boot timeline (default 3)
  --out DIR     where report.md/report.json go (default <workspace>/target/bench)
  --strict      exit 1 when a target is not met or a figure not measured
Needs root (loop devices, mounts, chown).";

struct Args {
    runs: usize,
    vm_disks: usize,
    vm_boots: usize,
    only: Vec<String>,
    out: PathBuf,
    strict: bool,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        runs: 5,
        vm_disks: 5,
        vm_boots: 3,
        only: Vec::new(),
        out: sys::workspace_root().join("target/bench"),
        strict: false,
    };
    let num = |v: Option<String>, what: &str| -> Result<usize, String> {
        v.and_then(|v| v.parse().ok())
            .filter(|n: &usize| *n > 0)
            .ok_or_else(|| format!("{what} needs a positive number"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--runs" => a.runs = num(it.next(), "--runs")?,
            "--vm-disks" => a.vm_disks = num(it.next(), "--vm-disks")?,
            "--vm-boots" => a.vm_boots = num(it.next(), "--vm-boots")?,
            "--only" => {
                let v = it.next().ok_or("--only needs sections")?;
                for s in v.split(',') {
                    if ![
                        "fsgroup",
                        "xfs",
                        "host",
                        "size",
                        "vm",
                        "crustd",
                        "crustd-scale",
                        "snapshot",
                        "trim-schedule",
                        "idmap",
                        "luks2",
                    ]
                    .contains(&s)
                    {
                        return Err(format!("unknown section {s}"));
                    }
                    a.only.push(s.to_string());
                }
            }
            "--out" => a.out = PathBuf::from(it.next().ok_or("--out needs a directory")?),
            "--strict" => a.strict = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// Runs one section; a panic inside becomes "not measured" rows (the
/// guards in it have unmounted, detached and stopped what it started).
fn section(
    name: &str,
    keys: &[(&str, &str, &str)],
    f: impl FnOnce() -> Vec<Figure>,
) -> Vec<Figure> {
    eprintln!("bench: --- {name} ---");
    let t = Instant::now();
    let out = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Figure::none_measured(keys, &format!("the bench panicked: {msg}"))
        }
    };
    eprintln!(
        "bench: {name} took {}",
        report::fmt_secs(t.elapsed().as_secs_f64())
    );
    out
}

/// Brings down the VMs an earlier (interrupted) run left in `work/vm` and
/// `work/sandboxes/bench` (the crustd section's).
fn stop_stale_vm(work: &Path) {
    let scale = (0..8).map(|i| work.join(format!("scale-sandboxes/s{i}")));
    for dir in [work.join("vm"), work.join("sandboxes/bench")]
        .into_iter()
        .chain(scale)
    {
        if !dir.join("state.json").exists() {
            continue;
        }
        match crust_vm::Vm::attach(&dir).and_then(|mut vm| vm.down()) {
            Ok(how) => eprintln!("bench: stopped the VM in {}: {how}", dir.display()),
            Err(e) => eprintln!("bench: could not stop the VM in {}: {e}", dir.display()),
        }
    }
}

/// Leaves nothing behind: children, the VM, mounts, loop devices.
fn cleanup_all(work: &Path) {
    sys::kill_children();
    stop_stale_vm(work);
    sys::cleanup_stale(work);
}

/// On SIGINT, SIGTERM or SIGHUP, cleans up and exits. The signals are
/// blocked in every thread (set here, before any thread starts, and
/// inherited) and taken by one thread with sigwait; children get a clean
/// mask from std's spawn.
fn cleanup_on_signals(work: PathBuf) {
    // SAFETY: an all-zero sigset_t is valid storage for sigemptyset to initialise.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid for these calls; pthread_sigmask changes only this
    // thread's mask, and no other thread exists yet.
    unsafe {
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: `set` is an initialised sigset and `sig` a valid out-pointer.
        if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
            eprintln!("bench: interrupted (signal {sig}): stopping children and the VM, unmounting, detaching loop devices");
            cleanup_all(&work);
            std::process::exit(128 + sig);
        }
    });
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn environment(load_start: &str) -> serde_json::Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let commit = sys::run(
        "git",
        &[
            "-C",
            &sys::workspace_root().to_string_lossy(),
            "rev-parse",
            "HEAD",
        ],
    )
    .map(|s| s.trim().to_string())
    .unwrap_or_default();
    json!({
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "cpu_model": cpu,
        "commit": commit,
        "loadavg_at_start": load_start,
        "loadavg_at_end": loadavg(),
        "unix_time": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
    })
}

fn main() {
    let mut argv = std::env::args().skip(1).peekable();
    if one_figure_command(&mut argv) {
        return;
    }
    let args = match parse_args(argv) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("crust-bench: {e}");
            }
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("crust-bench: run as root (loop devices, mounts, chown, drop_caches)");
        std::process::exit(2);
    }
    let work = work_dir(&args);
    let started = Instant::now();
    let load_start = loadavg();
    let figures = measure(&args, &work);
    cleanup_all(&work);
    let _ = std::fs::remove_dir_all(&work);
    finish(&args, &figures, started, &load_start);
}

/// The commands that are not the bench (the echo server the round-trip
/// figure runs, and the retry figure alone): true when one ran.
fn one_figure_command(argv: &mut std::iter::Peekable<impl Iterator<Item = String>>) -> bool {
    if argv.peek().map(String::as_str) == Some("echo-server") {
        argv.next();
        let (Some(sock), Some(req), Some(resp)) = (
            argv.next(),
            argv.next().and_then(|v| v.parse().ok()),
            argv.next().and_then(|v| v.parse().ok()),
        ) else {
            eprintln!("usage: crust-bench echo-server SOCKET REQUEST_BYTES RESPONSE_BYTES");
            std::process::exit(2);
        };
        if let Err(e) = host_agent::echo_server(Path::new(&sock), req, resp) {
            eprintln!("echo-server: {e}");
            std::process::exit(1);
        }
        return true;
    }
    // The retry figure alone, on a volume already made (a loop ext4 with
    // ENTRIES entries, not mounted): for trying the walk's deadlines
    // without building the 1M-entry tree.
    if argv.peek().map(String::as_str) == Some("publish-retry") {
        argv.next();
        let (Some(dev), Some(entries)) = (argv.next(), argv.next().and_then(|v| v.parse().ok()))
        else {
            eprintln!("usage: crust-bench publish-retry DEVICE ENTRIES");
            std::process::exit(2);
        };
        let work = std::env::temp_dir().join(format!("crust-bench-retry-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&work);
        let f = publish_retry::figure(&dev, &work, entries);
        println!("{}", report::markdown(std::slice::from_ref(&f), ""));
        let _ = std::fs::remove_dir_all(&work);
        return true;
    }
    false
}

/// The bench's scratch directory, emptied of an earlier run's leftovers,
/// cleaned up on signals.
fn work_dir(args: &Args) -> PathBuf {
    let work = args.out.join("work");
    cleanup_all(&work);
    let _ = std::fs::remove_dir_all(&work);
    if let Err(e) = std::fs::create_dir_all(&work) {
        eprintln!("crust-bench: cannot create {}: {e}", work.display());
        std::process::exit(1);
    }
    let work = std::fs::canonicalize(&work).unwrap_or(work);
    cleanup_on_signals(work.clone());
    work
}

/// Every section the arguments ask for, in order.
fn measure(args: &Args, work: &Path) -> Vec<Figure> {
    let want = |s: &str| args.only.is_empty() || args.only.iter().any(|o| o == s);
    let work = work.to_path_buf();
    let mut figures = Vec::new();
    if want("fsgroup") {
        figures.extend(section(
            "fsGroup",
            &[
                (
                    "fsgroup_fresh_warm",
                    "fsGroup Always, fresh 100k tree, warm cache",
                    fsgroup::BOUND_TARGET,
                ),
                (
                    "fsgroup_fresh_cold",
                    "fsGroup Always, fresh 100k tree, cold cache",
                    fsgroup::BOUND_TARGET,
                ),
                (
                    "fsgroup_correct",
                    "fsGroup Always, already-correct 100k tree",
                    fsgroup::BOUND_TARGET,
                ),
                (
                    "fsgroup_onrootmismatch",
                    "fsGroup OnRootMismatch, root already right",
                    "< 1 ms",
                ),
            ],
            || fsgroup::figures(&work, args.runs),
        ));
        figures.extend(section("fsGroup at scale", &fsgroup_scale::keys(), || {
            fsgroup_scale::figures(&work, &args.out, args.runs)
        }));
    }
    if want("xfs") {
        figures.extend(section(
            "xfs growth",
            &[(
                "xfs_grow",
                "xfs online growth 1 GiB → 8 GiB",
                "faster than xfs_growfs, never a false success",
            )],
            || vec![grow_xfs::figure(&work, args.runs)],
        ));
    }
    if want("host") {
        figures.extend(section(
            "agent on the host",
            &[
                (
                    "start_host",
                    "agent start to listening, host mode",
                    "report; aim < 20 ms of agent time",
                ),
                (
                    "rtt_unix",
                    "GetCapabilities round trip, unix socket",
                    "≤ 1.5x the raw echo",
                ),
                (
                    "rss",
                    "agent RSS idle and after 10,000 calls",
                    "< 4 MiB idle, no growth",
                ),
            ],
            || host_agent::figures(&work),
        ));
    }
    figures.extend(volume_sections(&want, &work, args));
    if want("luks2") {
        figures.extend(section("LUKS2 unlock", &luks2::keys(), || {
            luks2::figures(&work.join("luks2"), args.runs)
        }));
    }
    if want("size") {
        figures.extend(section(
            "binary size",
            &[(
                "binary_size",
                "stripped static binary size",
                host_agent::SIZE_TARGET,
            )],
            || vec![host_agent::size_figure()],
        ));
    }
    figures.extend(vm_sections(&want, &work, args));
    figures
}

/// The sections that publish volumes on the host's loop devices.
fn volume_sections(want: &dyn Fn(&str) -> bool, work: &Path, args: &Args) -> Vec<Figure> {
    let mut figures = Vec::new();
    if want("snapshot") {
        figures.extend(section("snapshots and space", &snapshot::keys(), || {
            snapshot::figures(work, args.runs)
        }));
    }
    if want("trim-schedule") {
        figures.extend(section(
            "trim on a schedule",
            &trim_schedule::keys(),
            || trim_schedule::figures(work),
        ));
    }
    if want("idmap") {
        figures.extend(section("idmapped binds", &idmap::keys(), || {
            idmap::figures(work, args.runs)
        }));
    }
    figures
}

/// The sections that boot VMs.
fn vm_sections(want: &dyn Fn(&str) -> bool, work: &Path, args: &Args) -> Vec<Figure> {
    let work = work.to_path_buf();
    let mut figures = Vec::new();
    if want("vm") {
        figures.extend(section(
            "microVM",
            &[
                (
                    "start_vm",
                    "agent as PID 1 in the VM, BootTimeline",
                    "report",
                ),
                (
                    "rtt_hvsock",
                    "GetCapabilities round trip over hybrid vsock",
                    "report",
                ),
                (
                    "hotplug_to_publish",
                    "hot-plug to publish complete in the VM",
                    "report",
                ),
                ("ext4_grow_vm", "ext4 online growth in the VM", "report"),
                (
                    "hotplug_to_block_publish",
                    "hot-plug to BLOCK publish complete in the VM",
                    "report",
                ),
            ],
            || vm_figs::figures(&work, args.vm_disks, args.vm_boots),
        ));
    }
    if want("crustd") {
        figures.extend(section("crustd", &crustd_figs::keys(), || {
            crustd_figs::figures(&work, args.vm_disks)
        }));
    }
    if want("crustd-scale") {
        figures.extend(section(
            "crustd at node scale",
            &crustd_scale::keys(),
            || crustd_scale::figures(&work, args.vm_disks),
        ));
    }
    figures
}

/// The report written and printed, a line per figure, and the exit status
/// `--strict` asks for.
fn finish(args: &Args, figures: &[Figure], started: Instant, load_start: &str) {
    let total = started.elapsed().as_secs_f64();
    let env = environment(load_start);
    let preamble = format!(
        "Medians; every baseline measured on this machine in this run. Total bench time {}.\n\n\
         Machine: Linux {}, {} CPUs ({}); commit {}. Load average {} at the start, {} at the end \
         (a shared machine: parallel speed-ups need idle CPUs).\n",
        report::fmt_secs(total),
        env["kernel"].as_str().unwrap_or(""),
        env["cpus"],
        env["cpu_model"].as_str().unwrap_or(""),
        env["commit"].as_str().unwrap_or(""),
        load_start,
        env["loadavg_at_end"].as_str().unwrap_or(""),
    );
    let md = report::markdown(figures, &preamble);
    let js = report::json(figures, env);
    if let Err(e) = report::write(&args.out, &md, &js) {
        eprintln!("crust-bench: {e}");
        std::process::exit(1);
    }
    println!("{md}");
    let count = |v: &dyn Fn(&Verdict) -> bool| figures.iter().filter(|f| v(&f.verdict)).count();
    let met = count(&|v| *v == Verdict::Met);
    let not_met = count(&|v| *v == Verdict::NotMet);
    let unmeasured = count(&|v| matches!(v, Verdict::NotMeasured(_)));
    for f in figures {
        let mark = match &f.verdict {
            Verdict::Met => "MET    ",
            Verdict::NotMet => "NOT MET",
            Verdict::Report => "report ",
            Verdict::NotMeasured(_) => "NOT MEASURED",
        };
        println!(
            "{mark} {}: {} (target: {})",
            f.title,
            if f.ours.is_empty() { "-" } else { &f.ours },
            f.target
        );
    }
    println!(
        "targets met: {met}; not met: {not_met}; not measured: {unmeasured}. Report: {}/report.md, report.json",
        args.out.display()
    );
    if args.strict && (not_met > 0 || unmeasured > 0) {
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Args, String> {
        parse_args(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn parses_arguments() {
        let a = args(&["--runs", "3", "--only", "fsgroup,vm", "--strict"]).unwrap();
        assert_eq!((a.runs, a.only.len(), a.strict), (3, 2, true));
        for bad in [
            &["--runs", "0"][..],
            &["--runs"],
            &["--only", "gpu"],
            &["--frobnicate"],
        ] {
            assert!(args(bad).is_err(), "{bad:?}");
        }
    }
}

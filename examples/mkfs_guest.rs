//! `mkfs` against a real guest, until publish formats encrypted volumes and
//! a VM test does it through the agent. This program is PID 1 of a guest of
//! its own, booted from an initrd that `crust-vm initrd` packed with the mkfs
//! programs: it does what the agent does as PID 1 (signals blocked before
//! any thread, the reaper thread running), then with `mkfs::make` and
//! `Tools::find()` runs mke2fs under deadlines from 5 to 800 ms, makes ext4 on
//! /dev/vda and xfs on /dev/vdb, looks for zombies, and prints
//! `MKFS_GUEST OK` (or `MKFS_GUEST FAILED <why>`) and powers off.
//! `scripts/mkfs-guest.sh` runs it and checks the disks on the host.

use std::path::Path;
use std::time::{Duration, Instant};

use crust_agent::cancel::Cancel;
use crust_agent::init;
use crust_agent::mkfs::{self, Error, Tools};
use crust_agent::model::FsType;

fn say(s: &str) {
    println!("MKFS_GUEST {s}");
}

/// Waits up to 10 s for `dev` to appear (devtmpfs makes it as the driver probes).
fn wait_for(dev: &Path) -> Result<(), String> {
    let until = Instant::now() + Duration::from_secs(10);
    while !dev.exists() {
        if Instant::now() > until {
            return Err(format!("{} did not appear", dev.display()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The processes left as zombies, from /proc.
fn zombies() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec!["no /proc".into()];
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z'))
        })
        .collect()
}

fn run() -> Result<(), String> {
    for w in init::early_mounts() {
        say(&format!("mount warning: {w}"));
    }
    let modules = Path::new("/lib/modules").join(crust_agent::system::kernel_release());
    let report = init::load_modules(&modules, &[]);
    say(&format!(
        "modules {:?}, failed {:?}",
        report.loaded, report.failed
    ));
    init::start_reaper_and_signals(|| {});
    let tools = Tools::find();
    say(&format!("{tools:?}"));
    let (vda, vdb) = (Path::new("/dev/vda"), Path::new("/dev/vdb"));
    wait_for(vda)?;
    wait_for(vdb)?;

    // Deadlines before, during and after the run, with PID 1's reaper
    // running: each ends stopped (killed, reaped by its owner) or done,
    // never with a status the reaper took.
    for ms in [5, 20, 50, 100, 200, 400, 800] {
        let short = Cancel::never().with_timeout(Duration::from_millis(ms));
        match mkfs::make(FsType::Ext4, vda, &tools, &short) {
            Err(e @ Error::Stopped(_)) => say(&format!("{ms} ms: {e}")),
            Ok(()) => say(&format!("{ms} ms: done")),
            Err(e) => return Err(format!("a {ms} ms deadline: {e}")),
        }
    }
    for (fs, dev) in [(FsType::Ext4, vda), (FsType::Xfs, vdb)] {
        let start = Instant::now();
        let cancel = Cancel::never().with_timeout(Duration::from_secs(120));
        mkfs::make(fs, dev, &tools, &cancel).map_err(|e| e.to_string())?;
        say(&format!(
            "{fs} on {} in {:.2} s",
            dev.display(),
            start.elapsed().as_secs_f64()
        ));
    }
    std::thread::sleep(Duration::from_millis(200));
    let z = zombies();
    if !z.is_empty() {
        return Err(format!("zombies left: {z:?}"));
    }
    rustix::fs::sync();
    Ok(())
}

fn main() {
    init::block_signals();
    match run() {
        Ok(()) => say("OK"),
        Err(e) => say(&format!("FAILED {e}")),
    }
    init::power_off();
}

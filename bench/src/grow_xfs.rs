//! Figure 4: xfs online growth 1 GiB → 8 GiB on a loop device — crust's
//! `grow::grow` (device size by BLKGETSIZE64, then the growfs ioctl, as
//! ExpandVolume does) against `xfs_growfs` on an identical copy.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crust_agent::grow;
use crust_agent::model::FsType;
use crust_agent::sys::sysfs::Sysfs;
use serde_json::json;

use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{self, median, secs, Loop, Mount, R};

const GIB: u64 = 1 << 30;
const FROM: u64 = GIB;
const TO: u64 = 8 * GIB;

/// A mounted copy of the pristine image, its device already grown to 8 GiB.
struct Grown {
    mount: Mount,
    lo: Loop,
}

/// A sparse copy of the pristine image, on a loop device, mounted.
fn mounted_copy(work: &Path, pristine: &Path, name: &str) -> R<(PathBuf, Loop, Mount)> {
    let img = work.join(format!("{name}.img"));
    let _ = std::fs::remove_file(&img);
    sys::run(
        "cp",
        &[
            "--sparse=always",
            &pristine.to_string_lossy(),
            &img.to_string_lossy(),
        ],
    )?;
    let lo = Loop::attach(&img)?;
    // Copies share the pristine image's UUID, which xfs refuses twice without nouuid.
    let mount = Mount::new(&lo.dev, &work.join(name), "xfs", "nouuid")?;
    Ok((img, lo, mount))
}

fn prepare(work: &Path, pristine: &Path, name: &str) -> R<Grown> {
    let (img, lo, mount) = mounted_copy(work, pristine, name)?;
    let before = sys::statfs_total(&mount.path)?;
    if before > FROM {
        return Err(format!("{name}: the fresh copy is already {before} bytes"));
    }
    // The host grows the disk: the file (truncate), then the loop device (losetup -c).
    sys::grow_file(&img, TO)?;
    lo.refresh_size()?;
    let dev = lo.size_bytes()?;
    if dev != TO {
        return Err(format!(
            "{}: {dev} bytes after losetup -c, not {TO}",
            lo.dev
        ));
    }
    sys::syncfs(&mount.path)?;
    Ok(Grown { mount, lo })
}

/// Growth is only counted when statfs afterwards shows it (never a false success).
fn check_grown(path: &Path, who: &str) -> R<u64> {
    let total = sys::statfs_total(path)?;
    if total < TO - TO / 16 {
        return Err(format!(
            "{who} reported success but statfs shows {total} bytes, not ~{TO}: no growth happened"
        ));
    }
    Ok(total)
}

fn crust(g: &Grown) -> R<f64> {
    // The agent knows its volume's device from the publish: found before the clock starts.
    let device = crust_agent::device::from_path(&Sysfs::system(), Path::new(&g.lo.dev))
        .map_err(|e| format!("device::from_path: {e}"))?;
    let t = Instant::now();
    let dev = crust_agent::device::size_bytes(&device.path)
        .map_err(|e| format!("device::size_bytes: {e}"))?;
    let dir = std::fs::File::open(&g.mount.path).map_err(|e| e.to_string())?;
    let size = grow::grow(
        dir.as_fd(),
        &g.mount.path,
        &device,
        FsType::Xfs,
        dev,
        &Sysfs::system(),
    )
    .map_err(|e| format!("grow::grow: {e}"))?;
    let d = secs(t.elapsed());
    let total = check_grown(&g.mount.path, "grow::grow")?;
    let own = grow::fs_size_bytes(dir.as_fd(), &g.mount.path, &device, FsType::Xfs)
        .map_err(|e| e.to_string())?;
    if own != size || total > size {
        return Err(format!(
            "grow::grow said {size} bytes; the filesystem says {own}, statfs {total}"
        ));
    }
    Ok(d)
}

/// The baseline: what mount-utils' ResizeFs runs for xfs, `xfs_growfs -d MOUNTPOINT`.
fn xfs_growfs(g: &Grown) -> R<f64> {
    let t = Instant::now();
    let st = Command::new("xfs_growfs")
        .args(["-d"])
        .arg(&g.mount.path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run xfs_growfs: {e}"))?;
    let d = secs(t.elapsed());
    if !st.success() {
        return Err(format!("xfs_growfs failed: {st}"));
    }
    check_grown(&g.mount.path, "xfs_growfs")?;
    Ok(d)
}

/// crust asked to grow past the device must fail, not claim success.
fn no_false_success(work: &Path, pristine: &Path) -> R<()> {
    let (img, lo, mount) = mounted_copy(work, pristine, "xfs-false")?;
    let device = crust_agent::device::from_path(&Sysfs::system(), Path::new(&lo.dev))
        .map_err(|e| format!("device::from_path: {e}"))?;
    let dir = std::fs::File::open(&mount.path).map_err(|e| e.to_string())?;
    let r = grow::grow(
        dir.as_fd(),
        &mount.path,
        &device,
        FsType::Xfs,
        TO,
        &Sysfs::system(),
    );
    let total = sys::statfs_total(&mount.path)?;
    drop(mount);
    drop(lo);
    let _ = std::fs::remove_file(&img);
    match r {
        Err(_) if total <= FROM => Ok(()),
        Err(e) => Err(format!("grow::grow failed ({e}) but the filesystem changed to {total} bytes")),
        Ok(n) => Err(format!(
            "grow::grow reported {n} bytes on a device of {FROM} bytes (statfs {total}): a false success"
        )),
    }
}

/// Figure 4. Each run takes milliseconds, so it makes four times the heavy figures' runs.
pub fn figure(work: &Path, runs: usize) -> Figure {
    let runs = runs * 4;
    let (key, title, target) = (
        "xfs_grow",
        "xfs online growth 1 GiB → 8 GiB (loop device)",
        "faster than xfs_growfs, never a false success",
    );
    match measure(work, runs) {
        Ok((ours_s, base_s, false_ok)) => {
            let (ours, base) = (median(&ours_s), median(&base_s));
            Figure {
                key: key.into(),
                title: title.into(),
                ours: fmt_secs(ours),
                baseline: format!("xfs_growfs {}", fmt_secs(base)),
                ratio: format!("{:.2}x faster", base / ours),
                target: target.into(),
                verdict: Verdict::from(ours < base && false_ok),
                data: json!({
                    "runs": runs, "crust_s": ours_s, "xfs_growfs_s": base_s,
                    "median_crust_s": ours, "median_xfs_growfs_s": base,
                    "grow_past_device_refused": false_ok,
                    "note": "each run: two sparse copies of one pristine 1 GiB xfs image on two loop devices, both files grown to 8 GiB + losetup -c before timing; crust's time includes reading the device size; both checked by statfs afterwards; asking crust to grow past a 1 GiB device was refused",
                }),
            }
        }
        Err(e) => Figure::not_measured(key, title, target, e),
    }
}

fn measure(work: &Path, runs: usize) -> R<(Vec<f64>, Vec<f64>, bool)> {
    let pristine = work.join("xfs-pristine.img");
    sys::sparse_file(&pristine, FROM)?;
    sys::run("mkfs.xfs", &["-q", "-f", &pristine.to_string_lossy()])?;
    no_false_success(work, &pristine)?;
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for i in 0..runs {
        let a = prepare(work, &pristine, "xfs-crust")?;
        let b = prepare(work, &pristine, "xfs-growfs")?;
        // Alternate who goes first.
        if i % 2 == 0 {
            ours.push(crust(&a)?);
            base.push(xfs_growfs(&b)?);
        } else {
            base.push(xfs_growfs(&b)?);
            ours.push(crust(&a)?);
        }
        eprintln!(
            "bench: xfs growth run {}: crust {}, xfs_growfs {}",
            i + 1,
            fmt_secs(ours[i]),
            fmt_secs(base[i])
        );
        drop(a);
        drop(b);
    }
    for n in ["xfs-crust.img", "xfs-growfs.img", "xfs-pristine.img"] {
        let _ = std::fs::remove_file(work.join(n));
    }
    Ok((ours, base, true))
}

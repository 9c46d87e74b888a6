//! The bench's own plumbing on the host: running tools, loop devices and
//! mounts that clean up after themselves (also when a figure fails or
//! panics), stale state from an interrupted run, caches, statfs, medians.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crust_protocols::sync::LockExt;

/// Children the bench started and has not reaped yet (agents, the echo
/// server), so a signal can stop them too.
static CHILDREN: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// Records a child to kill if the bench is interrupted.
pub fn register_child(pid: u32) {
    CHILDREN.locked().push(pid);
}

/// Forgets a child that has been reaped.
pub fn unregister_child(pid: u32) {
    CHILDREN.locked().retain(|p| *p != pid);
}

/// SIGKILLs every registered child (on interruption).
pub fn kill_children() {
    for pid in CHILDREN.locked().drain(..) {
        // SAFETY: kill() has no memory effects; the pid is a child not yet reaped, so not reused.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
}

/// The bench's error: a sentence saying what failed.
pub type R<T> = Result<T, String>;

/// Runs a tool to completion; its stderr (and stdout) go into the error.
pub fn run(prog: &str, args: &[&str]) -> R<String> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {prog}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{prog} {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn sparse_file(path: &Path, bytes: u64) -> R<()> {
    let _ = fs::remove_file(path);
    let f = fs::File::create(path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    f.set_len(bytes)
        .map_err(|e| format!("cannot size {}: {e}", path.display()))
}

/// Grows (never shrinks) a file to `bytes`.
pub fn grow_file(path: &Path, bytes: u64) -> R<()> {
    let f = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    f.set_len(bytes)
        .map_err(|e| format!("cannot grow {}: {e}", path.display()))
}

/// A loop device over an image file; detached on drop.
pub struct Loop {
    /// `/dev/loopN`.
    pub dev: String,
}

impl Loop {
    /// `losetup --find --show FILE`.
    pub fn attach(image: &Path) -> R<Loop> {
        let img = image.to_string_lossy();
        let dev = run("losetup", &["--find", "--show", &img])?
            .trim()
            .to_string();
        if dev.is_empty() {
            return Err(format!("losetup gave no device for {img}"));
        }
        Ok(Loop { dev })
    }

    /// Tells the kernel the backing file changed size (`losetup -c`).
    pub fn refresh_size(&self) -> R<()> {
        run("losetup", &["-c", &self.dev]).map(|_| ())
    }

    /// The device's size from the kernel (BLKGETSIZE64).
    pub fn size_bytes(&self) -> R<u64> {
        let s = fs::read_to_string(format!(
            "/sys/block/{}/size",
            self.dev.trim_start_matches("/dev/")
        ))
        .map_err(|e| format!("cannot read the size of {}: {e}", self.dev))?;
        s.trim()
            .parse::<u64>()
            .map(|sectors| sectors * 512)
            .map_err(|e| format!("bad size of {}: {e}", self.dev))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = run("losetup", &["-d", &self.dev]);
    }
}

/// A mount; unmounted on drop (lazily if it is busy).
pub struct Mount {
    /// The mount point.
    pub path: PathBuf,
}

impl Mount {
    /// `mount -t fs [-o opts] dev path`, creating `path`.
    pub fn new(dev: &str, path: &Path, fs: &str, opts: &str) -> R<Mount> {
        fs::create_dir_all(path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let p = path.to_string_lossy();
        let mut args = vec!["-t", fs];
        if !opts.is_empty() {
            args.extend(["-o", opts]);
        }
        args.extend([dev, &p]);
        run("mount", &args)?;
        Ok(Mount {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let p = self.path.to_string_lossy().into_owned();
        if run("umount", &[&p]).is_err() {
            let _ = run("umount", &["-l", &p]);
        }
    }
}

/// Undoes what an interrupted earlier run left under `work`: mounts
/// (deepest first) and loop devices backed by files there.
pub fn cleanup_stale(work: &Path) {
    let prefix = work.to_string_lossy().into_owned();
    if let Ok(table) = crust_agent::sys::mountinfo::read() {
        let points: Vec<String> = crust_agent::sys::mountinfo::mounts_under(&table, work)
            .into_iter()
            .map(|m| m.mount_point.display().to_string())
            .collect();
        for p in points {
            eprintln!("bench: unmounting {p}, left behind");
            if run("umount", &[&p]).is_err() {
                let _ = run("umount", &["-l", &p]);
            }
        }
    }
    if let Ok(list) = run("losetup", &["-n", "-O", "NAME,BACK-FILE", "-l"]) {
        for line in list.lines() {
            let mut it = line.split_whitespace();
            if let (Some(dev), Some(file)) = (it.next(), it.next()) {
                if file.starts_with(&prefix) {
                    eprintln!("bench: detaching {dev} ({file}), left behind");
                    let _ = run("losetup", &["-d", dev]);
                }
            }
        }
    }
}

/// Flushes one filesystem (syncfs on a directory of it).
pub fn syncfs(path: &Path) -> R<()> {
    let f = fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: syncfs only reads the fd, which `f` keeps open for the call.
    let rc = unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)) };
    if rc != 0 {
        return Err(format!(
            "syncfs {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Drops the page, dentry and inode caches (`sync; echo 3 > drop_caches`).
pub fn drop_caches() -> R<()> {
    // SAFETY: sync() takes no arguments and cannot fail.
    unsafe { libc::sync() };
    fs::write("/proc/sys/vm/drop_caches", "3\n")
        .map_err(|e| format!("cannot drop caches (/proc/sys/vm/drop_caches): {e}"))
}

/// statvfs: total bytes (f_blocks × f_frsize).
pub fn statfs_total(path: &Path) -> R<u64> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: an all-zero statvfs is a valid value for the kernel to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(format!(
            "statvfs {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(st.f_blocks * st.f_frsize)
}

/// The CPUs a task (a thread id; 0: the calling thread) may run on.
pub fn affinity(tid: i32) -> R<libc::cpu_set_t> {
    // SAFETY: an all-zero cpu_set_t is the empty set, a valid value.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid out-pointer of the size passed.
    let rc = unsafe { libc::sched_getaffinity(tid, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(format!(
            "sched_getaffinity {tid}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(set)
}

/// Lets a task (a thread id; 0: the calling thread) run only on `set`.
pub fn set_affinity(tid: i32, set: &libc::cpu_set_t) -> R<()> {
    // SAFETY: `set` is a valid cpu_set_t of the size passed; the kernel only reads it.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(set), set) };
    if rc != 0 {
        return Err(format!(
            "sched_setaffinity {tid}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// The set of one CPU: the first the calling thread may run on.
pub fn first_cpu() -> R<libc::cpu_set_t> {
    let mine = affinity(0)?;
    let n = usize::try_from(libc::CPU_SETSIZE).unwrap_or(1024);
    // SAFETY: `mine` is a valid cpu_set_t and every index is below CPU_SETSIZE.
    let cpu = (0..n)
        .find(|&c| unsafe { libc::CPU_ISSET(c, &mine) })
        .ok_or("the calling thread may run on no CPU")?;
    // SAFETY: an all-zero cpu_set_t is the empty set, a valid value.
    let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut one) };
    Ok(one)
}

/// Sets the affinity of every thread of process `pid` (threads it starts
/// later inherit it from the one that starts them).
pub fn set_process_affinity(pid: u32, set: &libc::cpu_set_t) -> R<()> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task"))
        .map_err(|e| format!("cannot list the threads of {pid}: {e}"))?;
    for t in tasks.flatten() {
        if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
            set_affinity(tid, set)?;
        }
    }
    Ok(())
}

/// VmRSS of a process, in bytes.
pub fn vm_rss(pid: u32) -> R<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("cannot read /proc/{pid}/status: {e}"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| format!("no VmRSS in /proc/{pid}/status"))
}

/// The median of samples (the mean of the middle two for an even count).
pub fn median(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Seconds as f64.
pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The workspace root (where `target/` and `build/` live).
pub fn workspace_root() -> PathBuf {
    if let Some(p) = std::env::var_os("CRUST_WORKSPACE") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        for (input, want) in [
            (vec![3.0], 3.0),
            (vec![5.0, 1.0, 3.0], 3.0),
            (vec![4.0, 1.0, 3.0, 2.0], 2.5),
            (vec![1.0, 100.0, 2.0, 3.0, 2.5], 2.5),
        ] {
            assert_eq!(median(&input), want, "{input:?}");
        }
        assert!(median(&[]).is_nan());
    }
}

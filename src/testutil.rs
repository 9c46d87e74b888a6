//! Fixtures shared by the unit tests that need real kernel objects: loop
//! devices over sparse images, filesystems made by mkfs and mounted on
//! temporary directories, all torn down on drop even when an assertion fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::device::{self, Device};

/// True when loop devices and mounts are possible (root); otherwise prints why the test skips.
pub(crate) fn root_or_skip(test: &str) -> bool {
    let ok = rustix::process::geteuid().is_root() && Path::new("/dev/loop-control").exists();
    if !ok {
        eprintln!("skipping {test}: needs root and /dev/loop-control");
    }
    ok
}

/// True when running as root (chown, tmpfs mounts; no loop device needed);
/// otherwise prints why the test skips.
pub(crate) fn root_only_or_skip(test: &str) -> bool {
    let ok = rustix::process::geteuid().is_root();
    if !ok {
        eprintln!("skipping {test}: needs root");
    }
    ok
}

/// Runs a command and returns its stdout; panics with its stderr if it fails.
pub(crate) fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loop device over a sparse image in a temporary directory; detached on
/// drop, after whatever is still mounted on its scratch directories.
pub(crate) struct LoopDisk {
    /// The backing file.
    pub image: PathBuf,
    /// "/dev/loopN".
    pub device: PathBuf,
    dir: tempfile::TempDir,
}

impl LoopDisk {
    /// `size_mb` MiB, formatted with `fs` ("ext4", "xfs", "swap") or left zeroed (None).
    pub(crate) fn new(size_mb: u64, fs: Option<&str>) -> LoopDisk {
        LoopDisk::with_mkfs(size_mb, fs, &[])
    }

    /// As `new`, with `extra` arguments for mkfs (e.g. `["-N", "300000"]`).
    pub(crate) fn with_mkfs(size_mb: u64, fs: Option<&str>, extra: &[&str]) -> LoopDisk {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(size_mb << 20)
            .unwrap();
        let img = image.to_str().unwrap();
        let (mkfs, base): (&str, &[&str]) = match fs {
            None => ("", &[]),
            Some("ext4") => ("mkfs.ext4", &["-q", "-F"]),
            Some("xfs") => ("mkfs.xfs", &["-q", "-f"]),
            Some("swap") => ("mkswap", &[]),
            Some(other) => panic!("LoopDisk cannot make {other}"),
        };
        if !mkfs.is_empty() {
            let args: Vec<&str> = base.iter().chain(extra).copied().chain([img]).collect();
            run(mkfs, &args);
        }
        let device = PathBuf::from(run("losetup", &["--find", "--show", img]).trim());
        LoopDisk { image, device, dir }
    }

    /// The kernel name ("loop3").
    pub(crate) fn name(&self) -> String {
        self.device
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned()
    }

    /// The device as the agent's lookup sees it.
    pub(crate) fn dev(&self) -> Device {
        device::from_path(&self.device).unwrap()
    }

    /// Resizes the image and tells the loop driver (what a host's block_resize does).
    pub(crate) fn resize(&self, size_mb: u64) {
        run(
            "truncate",
            &["-s", &format!("{size_mb}M"), self.image.to_str().unwrap()],
        );
        run("losetup", &["-c", self.device.to_str().unwrap()]);
    }

    /// A fresh directory `name` beside the image (canonical, as mountinfo
    /// shows it), for mount points; anything left mounted on it is
    /// detached when the disk is dropped.
    pub(crate) fn scratch(&self, name: &str) -> PathBuf {
        let p = self.scratch_root().join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    fn scratch_root(&self) -> PathBuf {
        self.dir.path().canonicalize().unwrap().join("scratch")
    }
}

impl Drop for LoopDisk {
    fn drop(&mut self) {
        // A test that failed half-way leaves mounts behind: detach them all,
        // or the tempdir cannot be removed and the device stays busy.
        if let Ok(rd) = self
            .dir
            .path()
            .canonicalize()
            .and_then(|d| std::fs::read_dir(d.join("scratch")))
        {
            for e in rd.flatten() {
                let _ = Command::new("umount")
                    .args(["-R", "-l"])
                    .arg(e.path())
                    .output();
            }
        }
        // Only if it is still ours: a test may have detached it, and the
        // number may since belong to someone else's loop device.
        let backing = format!("/sys/block/{}/loop/backing_file", self.name());
        let ours =
            std::fs::read_to_string(backing).is_ok_and(|b| Path::new(b.trim()) == self.image);
        if ours {
            let _ = Command::new("losetup").arg("-d").arg(&self.device).output();
        }
    }
}

/// A filesystem mounted on a temporary directory; unmounted on drop.
pub(crate) struct Mounted {
    /// The mount point.
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Mounted {
    /// `mount -t fs -o options device <tmpdir>`.
    pub(crate) fn new(device: &Path, fs: &str, options: &str) -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let mut args = vec!["-t", fs];
        if !options.is_empty() {
            args.extend(["-o", options]);
        }
        args.extend([device.to_str().unwrap(), path.to_str().unwrap()]);
        run("mount", &args);
        Mounted { path, _dir: dir }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.path)
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.path).output();
        }
    }
}

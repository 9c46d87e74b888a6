//! What a test needs beyond a plain developer machine, said once.
//!
//! Such a test is marked `#[ignore = "needs root: make test runs it"]` (or
//! "needs go …", "needs python grpcio …", "needs a VM: make test-vm runs
//! it"), so that a plain `cargo test` reports it as ignored, never as
//! passed; `make test` runs it with `--include-ignored`. Its first line calls
//! one of these, so that when it is run without what it needs it fails with
//! a sentence saying what is missing instead of passing without having run.

use std::path::Path;
use std::process::Command;

/// Fails the calling test: it cannot run because `why`.
#[track_caller]
pub fn missing(why: &str) -> ! {
    panic!(
        "this test cannot run: {why}. A plain `cargo test` leaves it ignored; \
         `make test` runs it as root with what it needs (scripts/deps.sh installs that)"
    )
}

/// Root: chown, tmpfs and bind mounts, a process of another user.
#[track_caller]
pub fn root() {
    let uid = rustix::process::geteuid();
    if !uid.is_root() {
        missing(&format!("it needs root, and runs as uid {}", uid.as_raw()));
    }
}

/// Root and the loop driver: loop devices and mounts.
#[track_caller]
pub fn loop_devices() {
    root();
    if !Path::new("/dev/loop-control").exists() {
        missing("it needs loop devices, and /dev/loop-control is missing (modprobe loop)");
    }
}

/// Loop devices, and losetup, mkfs.ext4 and mkfs.xfs to make filesystems on them.
#[track_caller]
pub fn loop_devices_and_mkfs() {
    loop_devices();
    tools(
        &["losetup", "mkfs.ext4", "mkfs.xfs"],
        "apt-get install util-linux e2fsprogs xfsprogs",
    );
}

/// Each of `names` on PATH; `install` says how to get them.
#[track_caller]
pub fn tools(names: &[&str], install: &str) {
    let absent: Vec<&str> = names.iter().copied().filter(|t| !on_path(t)).collect();
    if !absent.is_empty() {
        missing(&format!(
            "it needs {} on PATH ({install})",
            absent.join(", ")
        ));
    }
}

/// Whether `tool` is on PATH.
pub fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

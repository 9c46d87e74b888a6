//! What the mount tests share: fds, mountinfo lookups and fresh disks,
//! built on the leaves alone (so that every test module of `mount` may use
//! it without tying its files to one another).

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{Mode, OFlags};

use crate::sys::mountinfo::{self, MountEntry};
use crust_testkit::LoopDisk;

pub(crate) fn opts(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

pub(crate) fn dir_fd(p: &Path) -> OwnedFd {
    rustix::fs::open(
        p,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .unwrap()
}

pub(crate) fn entry(path: &Path) -> Option<MountEntry> {
    let t = mountinfo::read().unwrap();
    mountinfo::mount_at(&t, path).cloned()
}

pub(crate) fn mounted_under(path: &Path) -> usize {
    let t = mountinfo::read().unwrap();
    mountinfo::mounts_under(&t, path).len()
}

pub(crate) fn write(path: &Path) -> io::Result<()> {
    std::fs::write(path, b"data")
}

pub(crate) fn is_erofs(r: io::Result<()>) -> bool {
    matches!(r, Err(e) if e.raw_os_error() == Some(libc::EROFS))
}

/// A loop device with a fresh `fs` (xfs wants 300 MiB at least).
pub(crate) fn loop_disk(fs: &str) -> LoopDisk {
    LoopDisk::new(if fs == "xfs" { 320 } else { 64 }, Some(fs))
}

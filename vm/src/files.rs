//! The files crust-vm writes in a VM's directory (state, the sandbox entry,
//! logs). Someone else may be able to write in that directory, so a name
//! there may hold a symlink planted to make crust-vm overwrite another file.
//! Every file is therefore created relative to the directory's descriptor
//! (opened without following a symlink), with `O_CREAT | O_EXCL |
//! O_NOFOLLOW`, which never opens what is already there; a file that
//! replaces another is written under a fresh temporary name and renamed
//! over it (rename replaces a symlink, it does not follow it).

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;

/// Mode of the files crust-vm creates.
const FILE_MODE: u32 = 0o644;
/// Temporary names tried before giving up (each taken one is skipped).
const TMP_TRIES: u32 = 16;

/// Opens the directory `dir` itself without following a symlink there.
pub(crate) fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

fn create_new(dir: &OwnedFd, name: &str) -> Result<File, Errno> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(FILE_MODE),
    )
    .map(File::from)
}

/// A new, empty file `name` in `dir`, replacing whatever was there (a
/// symlink is removed, never followed).
pub(crate) fn create(dir: &OwnedFd, name: &str) -> io::Result<File> {
    loop {
        match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        match create_new(dir, name) {
            // Planted again between the two calls: remove it again.
            Err(Errno::EXIST) => continue,
            r => return Ok(r?),
        }
    }
}

/// Replaces `name` in `dir` with `data`, atomically: written and synced
/// under a temporary name no one can have planted, then renamed over it.
pub(crate) fn write_atomic(dir: &OwnedFd, name: &str, data: &[u8]) -> io::Result<()> {
    static N: AtomicU64 = AtomicU64::new(0);
    let mut last = Errno::EXIST;
    for _ in 0..TMP_TRIES {
        let tmp = format!(
            ".{name}.{}.{}.tmp",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let mut f = match create_new(dir, &tmp) {
            Ok(f) => f,
            Err(e @ Errno::EXIST) => {
                last = e;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let written = f
            .write_all(data)
            .and_then(|()| f.sync_data())
            .and_then(|()| Ok(rustix::fs::renameat(dir, &tmp, dir, name)?));
        if written.is_err() {
            let _ = rustix::fs::unlinkat(dir, &tmp, AtFlags::empty());
        }
        return written;
    }
    Err(last.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planted_symlinks_are_replaced_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let dir = d.path().join("vm");
        std::fs::create_dir(&dir).unwrap();
        for name in ["a.json", "log"] {
            std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
        }
        let fd = open_dir(&dir).unwrap();
        write_atomic(&fd, "a.json", b"{}").unwrap();
        let mut f = create(&fd, "log").unwrap();
        f.write_all(b"line").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert_eq!(std::fs::read(dir.join("a.json")).unwrap(), b"{}");
        assert_eq!(std::fs::read(dir.join("log")).unwrap(), b"line");
        for name in ["a.json", "log"] {
            assert!(std::fs::symlink_metadata(dir.join(name))
                .unwrap()
                .file_type()
                .is_file());
        }
        // No temporary is left behind.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // The directory itself as a symlink is refused.
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(open_dir(&link).is_err());
    }
}

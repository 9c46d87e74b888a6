//! A block device as the agent handles it: opened by its node and checked by
//! number, and the block layer's ioctls, each wrapped once: its size
//! (BLKGETSIZE64), its kernel read-only flag (BLKROGET/BLKROSET), and its
//! flush. Nothing here reads or writes a disk's contents: the agent never
//! looks inside a block volume (opening a node, ioctls and fsync do not
//! touch the data). A leaf: the finder of disks, the condition checks and
//! the table's block volumes all use it.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::model::Device;
use crate::sys::error::SysError;

crate::code::coded_errors! {
/// What can go wrong with a block volume's device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error(
        "the node {node} of disk {name} ({major}:{minor}) is gone; the host detached the disk"
    )]
    Gone {
        node: String,
        /// The disk's kernel name.
        name: String,
        major: u32,
        minor: u32,
    },
    #[code(FailedPrecondition)]
    #[error("{node} is no longer block device {major}:{minor} ({found}); the disk was replaced behind the agent's back")]
    Replaced {
        node: String,
        /// The major number published.
        major: u32,
        /// The minor number published.
        minor: u32,
        /// What the node is now.
        found: String,
    },
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

/// Checks that `fd` is the node of block device `dev`.
fn check(fd: &impl AsFd, dev: &Device) -> Result<(), Error> {
    let st = rustix::fs::fstat(fd).map_err(|e| SysError::new("fstat", dev.path.display(), e))?;
    let kind = FileType::from_raw_mode(st.st_mode);
    let num = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
    if kind != FileType::BlockDevice || num != (dev.major, dev.minor) {
        return Err(Error::Replaced {
            node: dev.path.display().to_string(),
            major: dev.major,
            minor: dev.minor,
            found: if kind == FileType::BlockDevice {
                format!("it is block device {}:{}", num.0, num.1)
            } else {
                format!("it is a {kind:?}")
            },
        });
    }
    Ok(())
}

fn open_error(dev: &Device, e: impl Into<std::io::Error>) -> Error {
    let e = e.into();
    match e.raw_os_error().map(Errno::from_raw_os_error) {
        Some(Errno::NOENT | Errno::NXIO | Errno::NODEV) => Error::Gone {
            node: dev.path.display().to_string(),
            name: dev.name.clone(),
            major: dev.major,
            minor: dev.minor,
        },
        _ => SysError::new("open", dev.path.display(), e).into(),
    }
}

/// An O_PATH fd of the device's node, checked to be that very device: what
/// a block volume's bind is cloned from (it pins the node, not a name).
pub fn open_node(dev: &Device) -> Result<OwnedFd, Error> {
    let fd = rustix::fs::open(
        &dev.path,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| open_error(dev, e))?;
    check(&fd, dev)?;
    Ok(fd)
}

/// The device opened for ioctls and fsync: read-only and non-blocking (no
/// data is read), checked to be the device published.
pub fn open(dev: &Device) -> Result<File, Error> {
    let f = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(&dev.path)
        .map_err(|e| open_error(dev, e))?;
    check(&f, dev)?;
    Ok(f)
}

/// BLKROGET: whether the kernel refuses writes to the device (set with
/// BLKROSET, or the disk itself is read-only, as a virtio-blk disk the host
/// attached read-only).
pub fn read_only(f: &File, dev: &Device) -> Result<bool, Error> {
    const BLKROGET: rustix::ioctl::Opcode = rustix::ioctl::opcode::none(0x12, 94);
    // SAFETY: BLKROGET writes exactly one int into the pointer it is given,
    // which Getter provides for a c_int it owns.
    let v = unsafe {
        let get = rustix::ioctl::Getter::<BLKROGET, libc::c_int>::new();
        rustix::ioctl::ioctl(f, get)
    }
    .map_err(|e| SysError::new("BLKROGET", dev.path.display(), e))?;
    Ok(v != 0)
}

/// BLKROSET: makes the kernel refuse (or allow again) every write to the
/// device, through any node or bind of it, until it is cleared.
pub fn set_read_only(f: &File, dev: &Device, ro: bool) -> Result<(), Error> {
    const BLKROSET: rustix::ioctl::Opcode = rustix::ioctl::opcode::none(0x12, 93);
    // SAFETY: BLKROSET reads exactly one int through the pointer it is
    // given, which Setter provides for the c_int it holds.
    unsafe {
        let set = rustix::ioctl::Setter::<BLKROSET, libc::c_int>::new(libc::c_int::from(ro));
        rustix::ioctl::ioctl(f, set)
    }
    .map_err(|e| SysError::new("BLKROSET", dev.path.display(), e))?;
    Ok(())
}

/// BLKGETSIZE64: the device's size in bytes now.
pub fn size(f: &File, dev: &Device) -> Result<u64, Error> {
    Ok(size_of(f, &dev.path)?)
}

/// BLKGETSIZE64 of an open device; `device` names it in messages.
pub fn size_of(file: &File, device: &Path) -> Result<u64, SysError> {
    const BLKGETSIZE64: rustix::ioctl::Opcode = rustix::ioctl::opcode::read::<u64>(0x12, 114);
    // SAFETY: BLKGETSIZE64 writes exactly one u64 (size_t on 64-bit Linux) into the output.
    unsafe {
        let get = rustix::ioctl::Getter::<BLKGETSIZE64, u64>::new();
        rustix::ioctl::ioctl(file, get)
    }
    .map_err(|e| SysError::new("BLKGETSIZE64", device.display(), e))
}

/// Flushes what was written to the device (its page cache and the disk's
/// write cache): fsync of the block device.
pub fn flush(f: &File, dev: &Device) -> Result<(), Error> {
    rustix::fs::fsync(f).map_err(|e| SysError::new("fsync", dev.path.display(), e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testdisk::AgentDevice;
    use crust_testkit::{needs, LoopDisk};

    fn device(d: &LoopDisk) -> Device {
        d.agent_device()
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn read_only_is_set_read_and_cleared_and_writes_fail_meanwhile() {
        needs::loop_devices();
        let disk = LoopDisk::new(8, None);
        let dev = device(&disk);
        let f = open(&dev).unwrap();
        assert!(!read_only(&f, &dev).unwrap());
        set_read_only(&f, &dev, true).unwrap();
        assert!(read_only(&f, &dev).unwrap());
        let sys = format!("/sys/block/{}/ro", dev.name);
        assert_eq!(std::fs::read_to_string(&sys).unwrap().trim(), "1");
        // The open for writing succeeds; the write itself is refused.
        let w = std::fs::OpenOptions::new().write(true).open(&dev.path);
        if let Ok(mut w) = w {
            use std::io::Write;
            let e = w.write_all(&[1u8; 512]).and_then(|_| w.sync_all());
            assert_eq!(e.unwrap_err().raw_os_error(), Some(libc::EPERM));
        }
        set_read_only(&f, &dev, false).unwrap();
        assert!(!read_only(&f, &dev).unwrap());
        assert_eq!(std::fs::read_to_string(&sys).unwrap().trim(), "0");
        assert_eq!(size(&f, &dev).unwrap(), 8 << 20);
        flush(&f, &dev).unwrap();
    }

    #[test]
    #[ignore = "needs root: make test runs it"]
    fn a_node_that_is_another_device_is_refused() {
        needs::loop_devices();
        let (a, b) = (LoopDisk::new(8, None), LoopDisk::new(8, None));
        let mut dev = device(&a);
        dev.path = b.device.clone();
        let e = open(&dev).unwrap_err();
        assert!(matches!(e, Error::Replaced { .. }), "{e}");
        assert!(matches!(open_node(&dev), Err(Error::Replaced { .. })));
        dev.path = "/dev/crust-no-such-node".into();
        assert!(matches!(open(&dev), Err(Error::Gone { .. })));
    }
}

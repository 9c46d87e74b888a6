//! A loop device over the device crustd holds, for mkfs. mkfs opens its
//! target with O_EXCL, which crustd's own exclusive hold on the device
//! would refuse; over a loop device, mkfs holds the loop device, and crustd
//! never lets go of the real one, so nothing can mount or claim it between
//! the blank check and the end of the format. The loop device is bound to
//! a read-write reopen of the very device crustd checked (its open fd,
//! through /proc/self/fd), with partition scanning off, and lets go of it
//! when its last opener closes it (LO_FLAGS_AUTOCLEAR).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustix::fs::{self as rfs, Mode, OFlags};
use rustix::io::Errno;
use rustix::ioctl::{Ioctl, IoctlOutput, NoArg, Opcode, Setter};

use crate::hostdev::LoopInfo64;

/// LOOP_CTL_GET_FREE, LOOP_CONFIGURE and LOOP_CLR_FD (linux/loop.h).
const LOOP_CTL_GET_FREE: Opcode = 0x4C82;
const LOOP_CONFIGURE: Opcode = 0x4C0A;
const LOOP_CLR_FD: Opcode = 0x4C01;
/// Detach when the last opener closes it.
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// How many free loop devices to try when others take them first.
const TRIES: usize = 8;
/// How long the kernel may take to let go of a closed loop device.
const LET_GO: Duration = Duration::from_secs(5);

/// `struct loop_config` of linux/loop.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// LOOP_CTL_GET_FREE: the ioctl's return value is the free device's number.
struct GetFree;

// SAFETY: LOOP_CTL_GET_FREE takes no argument (the pointer is null) and
// writes no memory; its result is the ioctl's return value.
unsafe impl Ioctl for GetFree {
    type Output = IoctlOutput;
    const IS_MUTATING: bool = false;
    fn opcode(&self) -> Opcode {
        LOOP_CTL_GET_FREE
    }
    fn as_ptr(&mut self) -> *mut core::ffi::c_void {
        core::ptr::null_mut()
    }
    unsafe fn output_from_ptr(
        out: IoctlOutput,
        _: *mut core::ffi::c_void,
    ) -> rustix::io::Result<IoctlOutput> {
        Ok(out)
    }
}

/// A loop device bound to a device crustd holds; detached when dropped.
#[derive(Debug)]
pub struct LoopDevice {
    /// `/dev/loopN`, what mkfs is given.
    pub path: PathBuf,
    /// `loopN`, for sysfs.
    name: String,
    /// The loop device, open: it stays bound while crustd has it.
    file: Option<File>,
    /// The read-write reopen of the device it is bound to, for fsync.
    backing: File,
}

impl LoopDevice {
    /// Binds a free loop device to the device open as `dev` (read-write,
    /// through /proc/self/fd, not exclusively).
    pub fn over(dev: BorrowedFd<'_>) -> io::Result<LoopDevice> {
        let again = format!("/proc/self/fd/{}", dev.as_raw_fd());
        let backing = File::from(rfs::open(
            again.as_str(),
            OFlags::RDWR | OFlags::CLOEXEC,
            Mode::empty(),
        )?);
        let control = rfs::open(
            "/dev/loop-control",
            OFlags::RDWR | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut last = io::Error::other("no free loop device");
        for _ in 0..TRIES {
            // SAFETY: GetFree's opcode takes no argument and writes nothing.
            let n = unsafe { rustix::ioctl::ioctl(&control, GetFree) }?;
            let name = format!("loop{n}");
            let path = PathBuf::from("/dev").join(&name);
            let file = match rfs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
                Ok(f) => File::from(f),
                Err(e) => {
                    last = e.into();
                    continue;
                }
            };
            // SAFETY: loop_info64 is plain integers and byte arrays, for
            // which all zeros is a valid value (what the kernel reads as "no
            // offset, no size limit, no name").
            let zero: LoopInfo64 = unsafe { std::mem::zeroed() };
            let cfg = LoopConfig {
                fd: u32::try_from(backing.as_raw_fd()).map_err(io::Error::other)?,
                block_size: 0,
                info: LoopInfo64 {
                    lo_flags: LO_FLAGS_AUTOCLEAR,
                    ..zero
                },
                reserved: [0; 8],
            };
            // SAFETY: LOOP_CONFIGURE reads one struct loop_config, which
            // LoopConfig mirrors field for field (repr(C), same types and order).
            let set = unsafe { Setter::<LOOP_CONFIGURE, LoopConfig>::new(cfg) };
            // SAFETY: the opcode and its input type match (above).
            match unsafe { rustix::ioctl::ioctl(&file, set) } {
                Ok(()) => {
                    return Ok(LoopDevice {
                        path,
                        name,
                        file: Some(file),
                        backing,
                    })
                }
                // Taken by someone else between GET_FREE and CONFIGURE: the next one.
                Err(Errno::BUSY) => last = Errno::BUSY.into(),
                Err(e) => return Err(e.into()),
            }
        }
        Err(last)
    }

    /// Flushes what was written through it to the device, closes it, and
    /// waits for the kernel to let it go. A loop device someone else opened
    /// meanwhile stays bound to the device: that is an error, and crustd
    /// must not plug the device (the caller refuses the publish).
    pub fn detach(mut self) -> io::Result<()> {
        self.backing.sync_all()?;
        drop(self.file.take());
        let bound = PathBuf::from("/sys/block")
            .join(&self.name)
            .join("loop/backing_file");
        let t = Instant::now();
        while bound.exists() {
            if t.elapsed() > LET_GO {
                // One more try, as losetup -d would.
                if let Ok(f) =
                    rfs::open(&self.path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
                {
                    // SAFETY: LOOP_CLR_FD takes no argument and writes nothing.
                    let clear = unsafe { NoArg::<LOOP_CLR_FD>::new() };
                    // SAFETY: the opcode takes no argument (above).
                    let _ = unsafe { rustix::ioctl::ioctl(&f, clear) };
                }
                if bound.exists() {
                    return Err(io::Error::other(format!(
                        "{} is still bound to the device: something else opened it during the format",
                        self.path.display()
                    )));
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.backing.sync_all()
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        // Closing it is enough (autoclear); a detach() above waited for it.
        drop(self.file.take());
    }
}

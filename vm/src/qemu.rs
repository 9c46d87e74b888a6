//! QEMU's command line for the guest (the machine, memory shared with the
//! vhost-user backend, the kernel and its command line, the console, the
//! vsock device, the QMP socket), and the vsock backend's.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::accel::Accel;
use crate::error::{io_err, Error, Result};
use crate::files;
use crate::options::{VmOptions, NOTIFY_PORT};
use crate::process::tail;
use crate::process::{find_program, log_file};
use crate::vm::Vm;

/// The descriptor QEMU gets the console file on.
const CONSOLE_FD: i32 = 3;

/// The guest kernel's command line.
fn kernel_append(opts: &VmOptions) -> String {
    let mut append = String::from("console=ttyS0 quiet panic=-1");
    if opts.notify {
        append.push_str(&format!(" crust.notify=vsock-stream:2:{NOTIFY_PORT}"));
    }
    if opts.root_disk.is_some() {
        append.push_str(" root=/dev/vda rw");
    }
    if !opts.append.trim().is_empty() {
        append.push(' ');
        append.push_str(opts.append.trim());
    }
    append
}

/// QEMU's arguments for the guest of `opts` in `dir`, its vsock through the
/// backend at `vhost_socket`, its console on [`CONSOLE_FD`].
fn qemu_command(opts: &VmOptions, accel: Accel, dir: &Path, vhost_socket: &Path) -> Command {
    let mem = format!("{}M", opts.memory_mib);
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args([
        "-name",
        opts.name.as_str(),
        "-machine",
        "pc",
        "-accel",
        accel.name(),
    ])
    .args(["-cpu", if accel == Accel::Kvm { "host" } else { "max" }])
    .args(["-m", &mem, "-smp", &opts.cpus.to_string()])
    .args([
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ])
    .arg("-serial")
    .arg(format!("file:/proc/self/fd/{CONSOLE_FD}"))
    .arg("-kernel")
    .arg(&opts.kernel)
    .arg("-initrd")
    .arg(&opts.initrd)
    .arg("-append")
    .arg(kernel_append(opts))
    .arg("-object")
    .arg(format!("memory-backend-memfd,id=mem,size={mem},share=on"))
    .args(["-numa", "node,memdev=mem"])
    .arg("-chardev")
    .arg(format!("socket,id=vs,path={}", vhost_socket.display()))
    .args(["-device", "vhost-user-vsock-pci,chardev=vs"])
    .arg("-qmp")
    .arg(format!(
        "unix:{},server=on,wait=off",
        dir.join("qmp.sock").display()
    ))
    .stdin(Stdio::null())
    .process_group(0);
    if let Some(root) = &opts.root_disk {
        qemu.arg("-drive")
            .arg(format!(
                "file={},if=none,id=root,format=raw,cache=writeback",
                root.display()
            ))
            .args(["-device", "virtio-blk-pci,drive=root,serial=crust-root"]);
    }
    qemu
}

/// The vsock backend program to start, or `None` when `opts` names a
/// running one.
pub(crate) fn backend_program(opts: &VmOptions) -> Result<Option<PathBuf>> {
    if opts.vhost_socket.is_some() {
        return Ok(None);
    }
    find_program("vhost-device-vsock", "CRUST_VHOST_DEVICE_VSOCK")
        .map(Some)
        .ok_or_else(|| {
            Error::Invalid(
                "vhost-device-vsock not found: cargo install vhost-device-vsock --locked".into(),
            )
        })
}

impl Vm {
    /// Starts the vsock backend (`bin`), or uses the one `opts` names;
    /// answers its vhost-user socket. From here on, Drop stops what was started.
    pub(crate) fn start_backend(
        &mut self,
        opts: &VmOptions,
        bin: Option<PathBuf>,
    ) -> Result<PathBuf> {
        let Some(bin) = bin else {
            return opts
                .vhost_socket
                .clone()
                .ok_or_else(|| Error::Invalid("no vsock backend was found or given".into()));
        };
        let (out, err) = log_file(&self.dir_fd, &self.dir, "vhost.log")?;
        let vhost = Command::new(&bin)
            .arg("--guest-cid")
            .arg(opts.cid.to_string())
            .arg("--socket")
            .arg(self.dir.join("vhost.sock"))
            .arg("--uds-path")
            .arg(self.dir.join("vsock.sock"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(io_err(format!("cannot start {}", bin.display())))?;
        self.state.vhost_pid = vhost.id();
        self.vhost = Some(vhost);
        let socket = self.dir.join("vhost.sock");
        self.wait_for_socket(&socket, Duration::from_secs(10))?;
        Ok(socket)
    }

    /// Starts QEMU, its console on a file created here (no symlink followed)
    /// and handed over as [`CONSOLE_FD`], which QEMU reopens by
    /// /proc/self/fd. Answers when it started.
    pub(crate) fn start_qemu(
        &mut self,
        opts: &VmOptions,
        accel: Accel,
        vhost_socket: &Path,
    ) -> Result<Instant> {
        let console = files::create(&self.dir_fd, "console.log").map_err(io_err(format!(
            "cannot create console.log in {}",
            self.dir.display()
        )))?;
        let console_fd = console.as_raw_fd();
        let (qout, qerr) = log_file(&self.dir_fd, &self.dir, "qemu.log")?;
        let mut qemu = qemu_command(opts, accel, &self.dir, vhost_socket);
        qemu.stdout(qout).stderr(qerr);
        // SAFETY: between fork and exec the closure only calls dup2 and
        // fcntl, which are async-signal-safe, on a descriptor this process
        // keeps open until spawn returns.
        unsafe {
            qemu.pre_exec(move || {
                if console_fd == CONSOLE_FD {
                    if libc::fcntl(CONSOLE_FD, libc::F_SETFD, 0) == -1 {
                        return Err(io::Error::last_os_error());
                    }
                } else if libc::dup2(console_fd, CONSOLE_FD) == -1 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let qemu = qemu.spawn().map_err(io_err(
            "cannot start qemu-system-x86_64 (apt-get install qemu-system-x86)",
        ))?;
        drop(console);
        let started = Instant::now();
        self.state.qemu_pid = qemu.id();
        self.qemu = Some(qemu);
        self.save()?;
        Ok(started)
    }
    fn wait_for_socket(&mut self, path: &Path, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !path.exists() {
            if Instant::now() > deadline || !self.vhost_running() {
                return Err(Error::Boot(format!(
                    "vhost-device-vsock did not create {}: {}",
                    path.display(),
                    tail(&self.dir.join("vhost.log"), 2000)
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}

//! Booting a VM: its directory prepared, the vsock backend and QEMU
//! started, the agent's readiness waited for, the sandbox entry written.
//! On failure nothing is left running (the VM's Drop stops what started).

use std::fs;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use crate::accel::choose_accel;
use crate::error::{io_err, Error, Result};
use crate::files;
use crate::options::{VmOptions, SANDBOX_FILE};
use crate::process::alive;
use crate::qemu::backend_program;
use crate::ready::listen_for_ready;
use crate::vm::{notify_socket_name, read_state, State, Vm};

impl Vm {
    /// Starts the vsock backend and QEMU, waits until the agent says it is
    /// ready (module documentation), then asks it GetAgentInfo. On failure
    /// nothing is left running.
    pub fn up(opts: VmOptions) -> Result<Vm> {
        let (dir, dir_fd) = Vm::prepare_dir(&opts)?;
        let notify_name = notify_socket_name();
        let vhost_bin = backend_program(&opts)?;
        let accel = opts.accel.unwrap_or_else(|| choose_accel(&opts.kernel));
        // The agent's READY arrives here: the backend connects the guest's
        // connection to host port NOTIFY_PORT to `<uds-path>_NOTIFY_PORT`.
        let notify = listen_for_ready(&dir, &notify_name, opts.notify)?;
        let mut vm = Vm {
            dir,
            dir_fd,
            state: State {
                port: opts.port,
                ..Default::default()
            },
            qemu: None,
            vhost: None,
            boot_info: None,
            ready: None,
            released: false,
        };
        let vhost_socket = vm.start_backend(&opts, vhost_bin)?;
        let started = vm.start_qemu(&opts, accel, &vhost_socket)?;
        let deadline = started + opts.boot_timeout;
        let how = vm.wait_ready(notify.as_ref(), deadline, &opts, accel)?;
        vm.ready = Some((how, started.elapsed()));
        vm.boot_info = Some(vm.first_info(deadline, &opts, accel)?);
        vm.write_sandbox_entry()?;
        drop(notify);
        let _ = rustix::fs::unlinkat(
            &vm.dir_fd,
            notify_name.as_str(),
            rustix::fs::AtFlags::empty(),
        );
        Ok(vm)
    }

    /// The VM's directory, made and opened: refused while a VM runs there,
    /// its kernel and image checked, and what an earlier VM left removed.
    fn prepare_dir(opts: &VmOptions) -> Result<(PathBuf, OwnedFd)> {
        fs::create_dir_all(&opts.dir)
            .map_err(io_err(format!("cannot create {}", opts.dir.display())))?;
        let dir = fs::canonicalize(&opts.dir)
            .map_err(io_err(format!("cannot resolve {}", opts.dir.display())))?;
        let dir_fd =
            files::open_dir(&dir).map_err(io_err(format!("cannot open {}", dir.display())))?;
        if let Ok(old) = read_state(&dir) {
            if alive(old.qemu_pid, &dir) {
                return Err(Error::Invalid(format!(
                    "a VM already runs in {} (QEMU pid {}): run crust-vm down --dir {} first",
                    dir.display(),
                    old.qemu_pid,
                    dir.display()
                )));
            }
        }
        for f in [&opts.kernel, &opts.initrd] {
            if !f.is_file() {
                return Err(Error::Invalid(format!(
                    "{} does not exist: run make initrd first",
                    f.display()
                )));
            }
        }
        // A shared backend's sockets are its own.
        let ours: &[&str] = if opts.vhost_socket.is_some() {
            &[]
        } else {
            &["vhost.sock", "vsock.sock"]
        };
        let notify_name = notify_socket_name();
        for f in ours.iter().chain(&[
            "qmp.sock",
            "console.log",
            "state.json",
            SANDBOX_FILE,
            notify_name.as_str(),
        ]) {
            let _ = rustix::fs::unlinkat(&dir_fd, *f, rustix::fs::AtFlags::empty());
        }
        Ok((dir, dir_fd))
    }
}

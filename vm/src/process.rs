//! The VM's processes: programs found, started with their logs, watched
//! (a recycled pid is never taken for ours), and stopped, leaving nothing
//! behind.

use std::fs;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crust_protocols::crust::ShutdownRequest;

use crate::error::{io_err, Error, Result};
use crate::files;
use crate::options::SANDBOX_FILE;
use crate::vm::{ctx, notify_socket_name, Vm};

/// Finds a program: `$env_var`, then PATH, then ~/.cargo/bin.
pub(crate) fn find_program(name: &str, env_var: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var) {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// True while `pid` runs (not a zombie) and its command line mentions
/// `dir`, so a recycled pid is never taken for ours.
pub fn alive(pid: u32, dir: &Path) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next());
    if state == Some("Z") || state == Some("X") {
        return false;
    }
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let needle = dir.to_string_lossy();
    String::from_utf8_lossy(&cmdline).contains(needle.as_ref())
}

pub(crate) fn signal(pid: u32, sig: i32) {
    // SAFETY: kill() has no memory effects; pid is one we started and checked alive.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A log file `name` in the VM's directory (files.rs), for a child's
/// stdout and stderr: one open file, so their lines do not overwrite each other.
pub(crate) fn log_file(dir_fd: &OwnedFd, dir: &Path, name: &str) -> Result<(Stdio, Stdio)> {
    let f = files::create(dir_fd, name)
        .map_err(io_err(format!("cannot create {name} in {}", dir.display())))?;
    let g = f
        .try_clone()
        .map_err(io_err(format!("cannot create {name} in {}", dir.display())))?;
    Ok((Stdio::from(f), Stdio::from(g)))
}

/// Whether a process runs: through its Child when we have it (which also
/// reaps it), else by pid.
pub(crate) fn running(child: &mut Option<Child>, pid: u32, dir: &Path) -> bool {
    match child {
        Some(c) => matches!(c.try_wait(), Ok(None)),
        None => alive(pid, dir),
    }
}

/// Reads the last `n` bytes of a log, for error messages.
pub(crate) fn tail(path: &Path, n: usize) -> String {
    let data = fs::read(path).unwrap_or_default();
    let start = data.len().saturating_sub(n);
    String::from_utf8_lossy(&data[start..]).into_owned()
}
impl Vm {
    pub(crate) fn qemu_running(&mut self) -> bool {
        running(&mut self.qemu, self.state.qemu_pid, &self.dir)
    }

    pub(crate) fn vhost_running(&mut self) -> bool {
        running(&mut self.vhost, self.state.vhost_pid, &self.dir)
    }

    /// Stops the VM: asks the agent to Shutdown (it powers off), waits for
    /// QEMU to exit (QMP quit, then SIGKILL, if it will not), then stops the
    /// vsock backend. Leaves no process behind. Returns how it went down.
    pub fn down(&mut self) -> Result<String> {
        let mut how;
        if self.qemu_running() {
            match self.agent().and_then(|c| {
                c.shutdown(ctx(Duration::from_secs(10)), &ShutdownRequest::new())
                    .map_err(|e| Error::Qmp(format!("Shutdown: {e}")))
            }) {
                Ok(r) => {
                    how = format!(
                        "agent shut down ({} volumes unmounted)",
                        r.volumes_unmounted
                    )
                }
                Err(e) => how = format!("agent Shutdown failed ({e})"),
            }
            if !self.wait_exit(true, Duration::from_secs(20)) {
                let _ = self.qmp().map(|mut q| q.execute("quit", None));
                how.push_str("; QEMU did not power off, sent quit");
                if !self.wait_exit(true, Duration::from_secs(5)) {
                    signal(self.state.qemu_pid, libc::SIGKILL);
                    self.wait_exit(true, Duration::from_secs(5));
                    how.push_str("; killed QEMU");
                }
            }
        } else {
            how = "QEMU was not running".into();
        }
        if self.vhost_running() {
            signal(self.state.vhost_pid, libc::SIGTERM);
            if !self.wait_exit(false, Duration::from_secs(3)) {
                signal(self.state.vhost_pid, libc::SIGKILL);
                self.wait_exit(false, Duration::from_secs(3));
            }
        }
        let left: Vec<u32> = [(self.state.qemu_pid, true), (self.state.vhost_pid, false)]
            .into_iter()
            .filter(|(_, q)| {
                if *q {
                    self.qemu_running()
                } else {
                    self.vhost_running()
                }
            })
            .map(|(p, _)| p)
            .collect();
        if !left.is_empty() {
            return Err(Error::Timeout(format!(
                "processes {left:?} of the VM in {} would not end",
                self.dir.display()
            )));
        }
        // A shared backend (vhost_pid 0) keeps its sockets: it serves on.
        let backend: &[&str] = if self.state.vhost_pid == 0 {
            &[]
        } else {
            &["vhost.sock", "vsock.sock"]
        };
        for f in backend.iter().chain(&[
            SANDBOX_FILE,
            "qmp.sock",
            "state.json",
            notify_socket_name().as_str(),
        ]) {
            let _ = fs::remove_file(self.dir.join(f));
        }
        self.released = true;
        Ok(how)
    }

    /// Waits up to `timeout` for QEMU to end on its own (the guest powered
    /// off); true if it did.
    pub fn wait_powered_off(&mut self, timeout: Duration) -> bool {
        self.wait_exit(true, timeout)
    }

    fn wait_exit(&mut self, qemu: bool, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let up = if qemu {
                self.qemu_running()
            } else {
                self.vhost_running()
            };
            if !up {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Vm {
    /// A VM that was neither brought down nor detached is killed, so tests
    /// that fail halfway leave nothing running.
    fn drop(&mut self) {
        if self.released {
            return;
        }
        for (child, pid) in [
            (&mut self.qemu, self.state.qemu_pid),
            (&mut self.vhost, self.state.vhost_pid),
        ] {
            match child {
                Some(c) => {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                None if alive(pid, &self.dir) => signal(pid, libc::SIGKILL),
                None => {}
            }
        }
    }
}

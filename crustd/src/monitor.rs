//! A sandbox's QMP monitor: where it is, how crustd reaches it, and the
//! proof, made on every connection, that the process behind it is the
//! hypervisor recorded for the sandbox. A socket is only a name in a
//! directory others write: a link there leads to another VM's monitor, and
//! a disk plugged through it lands in that VM, read-write, recorded as this
//! sandbox's. So crustd asks the kernel who listens (`SO_PEERCRED`) before
//! it sends a byte, and refuses any process but the recorded one.
//!
//! Kata's monitor is resolved beneath Kata's runtime directory with no
//! symbolic link in any component, and connected through that descriptor;
//! its hypervisor's pid must be recorded. A `sandbox.json`'s monitor is its
//! path as written, and is proved only when the entry records `qemu_pid`.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crust_client::qmp::{self, Qmp, Socket};

use crate::error::{Error, Result};
use crate::files::{self, SocketError};
use crate::hotplug;

/// A sandbox's QMP monitor.
#[derive(Debug, Clone)]
pub struct Monitor {
    /// The socket's path: for messages, and where a `sandbox.json`'s is reached.
    pub path: PathBuf,
    /// How the socket is found.
    place: Place,
    /// Whose process must serve it.
    owner: Owner,
}

/// How a monitor's socket is found.
#[derive(Debug, Clone)]
enum Place {
    /// At its path, symbolic links followed: whoever writes `sandbox.json`
    /// names the socket, and may name it through a link.
    Path,
    /// `rel` beneath the directory `root`, with no symbolic link in any
    /// component, connected through the descriptor found.
    Beneath { root: Arc<OwnedFd>, rel: PathBuf },
}

/// Whose process must serve a monitor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// Nothing is recorded: whoever listens is taken.
    Anyone,
    /// The hypervisor's pid, and who recorded it where, for messages
    /// ("Kata recorded for sandbox S (HypervisorState.Pid in …)").
    Pid { pid: u32, recorded: String },
    /// The record had to name the hypervisor and does not: why. No
    /// connection is made.
    Unproven(String),
}

impl Owner {
    /// Whether `peer`, the process listening on the socket at `path`, is the one recorded.
    fn vet(&self, peer: u32, path: &Path) -> std::result::Result<(), String> {
        match self {
            Owner::Anyone => Ok(()),
            Owner::Pid { pid, .. } if *pid == peer => Ok(()),
            Owner::Pid { pid, recorded } => {
                let who = if peer == 0 {
                    "a process outside crustd's pid namespace".to_string()
                } else {
                    format!("process {peer}")
                };
                Err(format!(
                    "the QMP socket {} is served by {who}, not by process {pid}, the hypervisor {recorded}: crustd sends nothing to a monitor it cannot prove is this sandbox's VM's (is the socket a link to another VM's monitor?)",
                    path.display()
                ))
            }
            Owner::Unproven(why) => Err(why.clone()),
        }
    }
}

impl Monitor {
    /// The monitor at `path`, found as the path says (a `sandbox.json`'s).
    pub fn at(path: PathBuf, owner: Owner) -> Monitor {
        Monitor {
            path,
            place: Place::Path,
            owner,
        }
    }

    /// The monitor at `rel` beneath `root` (the directory `root_path`), found
    /// with no symbolic link on the way.
    pub fn beneath(root: Arc<OwnedFd>, root_path: &Path, rel: PathBuf, owner: Owner) -> Monitor {
        Monitor {
            path: root_path.join(&rel),
            place: Place::Beneath { root, rel },
            owner,
        }
    }

    /// Whose process must serve it.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Finds the socket now: `None` for one reached by its path, else a
    /// descriptor of the socket found beneath its directory.
    pub fn find(&self) -> std::result::Result<Option<OwnedFd>, SocketError> {
        match &self.place {
            Place::Path => Ok(None),
            Place::Beneath { root, rel } => files::open_socket_beneath(root.as_fd(), rel).map(Some),
        }
    }

    /// A QMP session on the monitor, greeted and in command mode, every step
    /// bounded by `timeout`, once its socket is found anew and its process
    /// proved to be the recorded one. FAILED_PRECONDITION when the socket or
    /// its process is not the sandbox's (nothing sent); UNAVAILABLE when
    /// there is no monitor to talk to (the VM gone, the monitor wedged or
    /// held by another client).
    pub fn connect(&self, timeout: Duration) -> Result<Qmp> {
        if let Owner::Unproven(why) = &self.owner {
            return Err(Error::precondition(why.clone()));
        }
        let found = self.find().map_err(|e| self.not_found(e))?;
        let socket = match &found {
            Some(fd) => Socket::Opened(fd.as_fd(), &self.path),
            None => Socket::Path(&self.path),
        };
        hotplug::connect(socket, timeout, |peer| self.owner.vet(peer, &self.path))
    }

    /// Why the VMM behind the monitor is gone, if it is (crust-client's
    /// `gone`): the socket does not exist, or nobody listens there. A socket
    /// crustd cannot find for another reason (a link on the way) does not
    /// say the VM is gone. The connect sends nothing, so proves nothing.
    pub fn gone(&self, timeout: Duration) -> Option<String> {
        match self.find() {
            Ok(None) => qmp::gone(&self.path, timeout),
            Ok(Some(fd)) => qmp::gone_at(Socket::Opened(fd.as_fd(), &self.path), timeout),
            Err(SocketError::Missing) => Some(format!(
                "its QMP socket {} does not exist",
                self.path.display()
            )),
            Err(_) => None,
        }
    }

    /// A socket not found beneath its directory as crustd's error.
    fn not_found(&self, e: SocketError) -> Error {
        match e {
            SocketError::Missing => Error::unavailable(format!(
                "cannot connect to QEMU's QMP socket {}: it does not exist (has the VM gone?)",
                self.path.display()
            )),
            e => Error::precondition(format!(
                "{} is not the socket its QEMU makes: {e}",
                self.path.display()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;
    use crust_client::qmp::fake;

    fn pid(pid: u32) -> Owner {
        Owner::Pid {
            pid,
            recorded: "the test recorded".into(),
        }
    }

    #[test]
    fn the_process_behind_the_socket_must_be_the_one_recorded() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let _q = fake::qemu(&p);
        let timeout = Duration::from_secs(5);
        let me = std::process::id();
        assert!(Monitor::at(p.clone(), Owner::Anyone)
            .connect(timeout)
            .is_ok());
        assert!(Monitor::at(p.clone(), pid(me)).connect(timeout).is_ok());
        // Another process recorded (init, which serves no test's socket).
        let e = Monitor::at(p.clone(), pid(1)).connect(timeout).unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition);
        assert!(
            e.message
                .contains(&format!("served by process {me}, not by process 1"))
                && e.message.contains(p.to_str().unwrap()),
            "{e}"
        );
        let e = Monitor::at(p.clone(), Owner::Unproven("no pid".into()))
            .connect(timeout)
            .unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::FailedPrecondition, "no pid")
        );
    }

    #[test]
    fn a_socket_beneath_is_found_anew_with_no_link_on_the_way() {
        let t = tempfile::tempdir().unwrap();
        let root = Arc::new(files::open_dir(t.path()).unwrap());
        std::fs::create_dir_all(t.path().join("vm/a")).unwrap();
        let _q = fake::qemu(&t.path().join("vm/a/m.sock"));
        let timeout = Duration::from_secs(5);
        let me = std::process::id();
        let at = |rel: &str| Monitor::beneath(root.clone(), t.path(), rel.into(), pid(me));
        assert!(at("vm/a/m.sock").connect(timeout).is_ok());
        assert_eq!(at("vm/a/m.sock").path, t.path().join("vm/a/m.sock"));
        std::os::unix::fs::symlink(t.path().join("vm/a"), t.path().join("vm/b")).unwrap();
        std::fs::create_dir_all(t.path().join("vm/c")).unwrap();
        std::os::unix::fs::symlink(t.path().join("vm/a/m.sock"), t.path().join("vm/c/m.sock"))
            .unwrap();
        std::fs::write(t.path().join("vm/c/f.sock"), "").unwrap();
        for (rel, says) in [
            ("vm/b/m.sock", "a symbolic link lies on its path"),
            ("vm/c/m.sock", "a symbolic link lies on its path"),
            ("vm/c/f.sock", "it is a regular file, not a socket"),
        ] {
            let e = at(rel).connect(timeout).unwrap_err();
            assert_eq!(e.code, Code::FailedPrecondition, "{rel}: {e}");
            assert!(e.message.contains(says), "{rel}: {e}");
            assert_eq!(at(rel).gone(timeout), None, "{rel}");
        }
        let e = at("vm/d/m.sock").connect(timeout).unwrap_err();
        assert_eq!(e.code, Code::Unavailable, "{e}");
        assert!(at("vm/d/m.sock").gone(timeout).is_some());
        // Found anew for each connection: the socket replaced by a link after
        // one good session is refused on the next.
        let m = at("vm/a/m.sock");
        assert!(m.connect(timeout).is_ok());
        std::fs::rename(t.path().join("vm/a/m.sock"), t.path().join("vm/a/old.sock")).unwrap();
        std::os::unix::fs::symlink(t.path().join("vm/a/old.sock"), t.path().join("vm/a/m.sock"))
            .unwrap();
        assert_eq!(
            m.connect(timeout).unwrap_err().code,
            Code::FailedPrecondition
        );
    }
}

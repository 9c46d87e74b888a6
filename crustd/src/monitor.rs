//! A sandbox's QMP monitor: where it is, how crustd reaches it, and the
//! proof, made on every connection, that the process behind it is the
//! hypervisor recorded for the sandbox. A socket is only a name in a
//! directory others write: a link there leads to another VM's monitor, and
//! a disk plugged through it lands in that VM, read-write, recorded as this
//! sandbox's. So crustd asks the kernel who listens (`SO_PEERCRED`) before
//! it sends a byte, and refuses any process but the recorded one; and, the
//! connection open, that this process still lives (held by a pidfd of the
//! very process that listened, `SO_PEERPIDFD`), since a pid alone may be
//! another process's once its own has exited.
//!
//! Kata's monitor is resolved beneath Kata's runtime directory with no
//! symbolic link in any component and no other name, and connected through
//! that descriptor; its hypervisor's pid must be recorded, and that
//! process's command line must name the sandbox as Kata names its QEMU
//! (`hypervisor`): the record is a file anyone who writes there can copy
//! from another sandbox's, the command line is not. A `sandbox.json`'s
//! monitor is its path as written, and is proved only when the entry
//! records `qemu_pid`.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crust_client::qmp::{self, Qmp, QmpError, Socket};
use crust_client::Peer as Listener;

use crate::files::{self, SocketError};
use crate::hotplug;
use crate::hypervisor::{self, NotNamed};

crust_protocols::coded_errors! {
/// Why crustd has no session with a sandbox's monitor.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The record had to name the hypervisor and does not.
    #[code(FailedPrecondition)]
    #[error("{0}")]
    Unproven(Unproven),
    /// Nothing at the socket's place beneath its directory.
    #[code(Unavailable)]
    #[error("cannot connect to QEMU's QMP socket {}: it does not exist (has the VM gone?)", .path.display())]
    Missing { path: PathBuf },
    /// Something that is not the socket QEMU makes, or reached through a link.
    #[code(FailedPrecondition)]
    #[error("{} is not the socket its QEMU makes: {why}", .path.display())]
    NotTheSocket { path: PathBuf, why: SocketError },
    /// The process that listens there is not the one recorded: nothing was sent.
    #[code(FailedPrecondition)]
    #[error("the QMP socket {} is served by {}, not by process {pid}, the hypervisor {recorded}: crustd sends nothing to a monitor it cannot prove is this sandbox's VM's (is the socket a link to another VM's monitor?)", .path.display(), Peer(*.peer))]
    Stranger { path: PathBuf, peer: u32, pid: u32, recorded: Recorder },
    /// The recorded process listened there, but has exited since: the
    /// socket lives on in another process that shares it, and the pid may
    /// be another process's by now.
    #[code(FailedPrecondition)]
    #[error("process {pid}, the hypervisor {recorded}, listened on the QMP socket {} but has exited, and another process that shares the socket serves it (the pid may be another process's by now): crustd sends nothing to a monitor it cannot prove is this sandbox's VM's", .path.display())]
    Exited { path: PathBuf, pid: u32, recorded: Recorder },
    /// The recorded process serves the socket, but is not the sandbox's
    /// QEMU by its own command line.
    #[code(FailedPrecondition)]
    #[error("process {pid}, which serves the QMP socket {}, is not sandbox {sandbox}'s QEMU: Kata starts that with -name {}, and {why}; crustd sends nothing to another sandbox's VM (is {} a copy of another sandbox's, or the socket moved from another sandbox's directory?)", .path.display(), hypervisor::kata_name(.sandbox), .persist.display())]
    Unnamed { path: PathBuf, pid: u32, sandbox: String, persist: PathBuf, why: Box<NotNamed> },
    /// The kernel could not say whether the process still lives.
    #[code(Unavailable)]
    #[error("cannot tell whether process {pid}, which serves the QMP socket {}, still lives: {source}", .path.display())]
    Unknowable { path: PathBuf, pid: u32, source: Arc<io::Error> },
    #[code(inner)]
    #[error(transparent)]
    Qmp(#[from] hotplug::Error),
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

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
    /// The hypervisor's pid, and who recorded it where, for messages.
    Pid { pid: u32, recorded: Recorder },
    /// The record had to name the hypervisor and does not. No connection
    /// is made.
    Unproven(Unproven),
}

/// Who recorded a hypervisor's pid, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorder {
    /// `qemu_pid` in a `sandbox.json`.
    Entry { file: PathBuf },
    /// `HypervisorState.Pid` in Kata's `persist.json` for the sandbox.
    Kata { sandbox: String, persist: PathBuf },
}

impl fmt::Display for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recorder::Entry { file } => write!(f, "recorded as qemu_pid in {}", file.display()),
            Recorder::Kata { sandbox, persist } => write!(
                f,
                "Kata recorded for sandbox {sandbox} (HypervisorState.Pid in {})",
                persist.display()
            ),
        }
    }
}

/// A Kata sandbox whose `persist.json` records no hypervisor: its extra
/// monitor `qmp` cannot be proved its VM's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unproven {
    pub sandbox: String,
    pub persist: PathBuf,
    pub qmp: PathBuf,
}

impl fmt::Display for Unproven {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Kata recorded no hypervisor process for sandbox {} (HypervisorState.Pid in {} is 0 or absent; Kata records it while the sandbox's QEMU runs): crustd cannot prove that {} is this sandbox's VM's monitor, and sends it nothing",
            self.sandbox,
            self.persist.display(),
            self.qmp.display()
        )
    }
}

/// The process listening on a socket, in words.
struct Peer(u32);

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => f.write_str("a process outside crustd's pid namespace"),
            pid => write!(f, "process {pid}"),
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
        if let Owner::Unproven(u) = &self.owner {
            return Err(Error::Unproven(u.clone()));
        }
        let found = self.find().map_err(|e| self.not_found(e))?;
        let socket = match &found {
            Some(fd) => Socket::Opened(fd.as_fd(), &self.path),
            None => Socket::Path(&self.path),
        };
        // crust-client hears the sentence; crustd keeps its own error.
        let mut refused = None;
        let vet = |peer: &Listener| {
            self.vet(peer).map_err(|e| {
                let said = e.to_string();
                refused = Some(e);
                said
            })
        };
        let out = Qmp::connect_vetted(socket, timeout, vet);
        out.map_err(|e| match (e, refused) {
            (QmpError::Vetoed { .. }, Some(e)) => e,
            (other, _) => hotplug::no_session(other).into(),
        })
    }

    /// Whether `peer`, which listens on the monitor, is the recorded
    /// hypervisor: its pid, its command line (Kata's), and, last, that the
    /// process that listened still lives. A live process keeps its pid, so
    /// the command line read before was that process's, not a newer one's
    /// with the same pid.
    fn vet(&self, peer: &Listener) -> Result<()> {
        let Owner::Pid { pid, recorded } = &self.owner else {
            return Ok(());
        };
        if peer.pid != *pid {
            return Err(self.stranger(peer.pid, *pid, recorded));
        }
        let named = match recorded {
            Recorder::Kata { sandbox, persist } => {
                hypervisor::named(*pid, &hypervisor::kata_name(sandbox)).map_err(|why| {
                    Error::Unnamed {
                        path: self.path.clone(),
                        pid: *pid,
                        sandbox: sandbox.clone(),
                        persist: persist.clone(),
                        why: Box::new(why),
                    }
                })
            }
            Recorder::Entry { .. } => Ok(()),
        };
        match peer.lives() {
            Ok(true) => named,
            Ok(false) => Err(Error::Exited {
                path: self.path.clone(),
                pid: *pid,
                recorded: recorded.clone(),
            }),
            Err(e) => Err(Error::Unknowable {
                path: self.path.clone(),
                pid: *pid,
                source: Arc::new(e),
            }),
        }
    }

    /// The refusal of `peer`, which listens on the socket instead of `pid`,
    /// the hypervisor `recorded`.
    fn stranger(&self, peer: u32, pid: u32, recorded: &Recorder) -> Error {
        Error::Stranger {
            path: self.path.clone(),
            peer,
            pid,
            recorded: recorded.clone(),
        }
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
            SocketError::Missing => Error::Missing {
                path: self.path.clone(),
            },
            why => Error::NotTheSocket {
                path: self.path.clone(),
                why,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_client::qmp::fake;
    use crust_protocols::code::Code;

    fn pid(pid: u32) -> Owner {
        Owner::Pid {
            pid,
            recorded: Recorder::Entry {
                file: "/test/sandbox.json".into(),
            },
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
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.to_string()
                .contains(&format!("served by process {me}, not by process 1"))
                && e.to_string().contains(p.to_str().unwrap()),
            "{e}"
        );
        assert!(e
            .to_string()
            .contains("recorded as qemu_pid in /test/sandbox.json"));
        let why = Unproven {
            sandbox: "s".into(),
            persist: "/run/vc/sbs/s/persist.json".into(),
            qmp: p.clone(),
        };
        let e = Monitor::at(p.clone(), Owner::Unproven(why.clone()))
            .connect(timeout)
            .unwrap_err();
        assert_eq!(
            (e.code(), e.to_string()),
            (Code::FailedPrecondition, why.to_string())
        );
    }

    /// The recorded process must still live, whoever serves its socket on:
    /// its pid may be another's once it has exited.
    #[test]
    fn the_recorded_process_must_still_live() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("qmp.sock");
        let (_q, mut h) = fake::qemu_of(&p, "crust-vm");
        let timeout = Duration::from_secs(5);
        let m = Monitor::at(p.clone(), pid(h.pid()));
        assert!(m.connect(timeout).is_ok());
        h.exit();
        let e = m.connect(timeout).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(
            e.to_string().contains(&format!(
                "process {}, the hypervisor recorded as qemu_pid",
                h.pid()
            )) && e.to_string().contains("has exited"),
            "{e}"
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
            assert_eq!(e.code(), Code::FailedPrecondition, "{rel}: {e}");
            assert!(e.to_string().contains(says), "{rel}: {e}");
            assert_eq!(at(rel).gone(timeout), None, "{rel}");
        }
        let e = at("vm/d/m.sock").connect(timeout).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        assert!(at("vm/d/m.sock").gone(timeout).is_some());
        // Found anew for each connection: the socket replaced by a link after
        // one good session is refused on the next.
        let m = at("vm/a/m.sock");
        assert!(m.connect(timeout).is_ok());
        std::fs::rename(t.path().join("vm/a/m.sock"), t.path().join("vm/a/old.sock")).unwrap();
        std::os::unix::fs::symlink(t.path().join("vm/a/old.sock"), t.path().join("vm/a/m.sock"))
            .unwrap();
        assert_eq!(
            m.connect(timeout).unwrap_err().code(),
            Code::FailedPrecondition
        );
    }
}

//! Where a sandbox is: `DIR/<sandbox>/sandbox.json`, written by whoever
//! starts the VM (`crust-vm up` does), holding the VM's QMP socket and the
//! agent's address:
//!
//! ```json
//! {"qmp": "/run/vm/qmp.sock", "agent": "hvsock:///run/vm/vsock.sock:2857", "qemu_pid": 4242}
//! ```
//!
//! `agent` is any address crust-client accepts. A relative `qmp` path is taken
//! relative to the sandbox's directory. `qemu_pid`, optional, is the process
//! that serves `qmp`: when given, every QMP connection must reach that
//! process (monitor.rs), so a socket replaced by a link to another VM's
//! monitor plugs nothing there. Other keys are ignored, so the file can carry
//! more for other readers. Nothing else about the VM is assumed.
//!
//! Whoever starts VMs writes here, so `DIR/<sandbox>` must be a real
//! directory (a symlink there is refused, not followed) and is opened once
//! per call; crustd's own state beside `sandbox.json` is reached through
//! that directory fd. `sandbox.json` must be a regular file of at most
//! 64 KiB (a FIFO, a device or a symlink is refused without being read).

use std::fmt;
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crust_client::{Address, AddressError};
use crust_protocols::names::BadName;
use serde::Deserialize;

use crate::files::{self, ReadError};
use crate::kata;
use crate::monitor::{Monitor, Owner, Recorder};

crust_protocols::coded_errors! {
/// Why a sandbox was not found, or cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The rule for sandbox ids.
    #[code(InvalidArgument)]
    #[error(transparent)]
    BadId(#[from] BadName),
    /// No `DIR/<id>/sandbox.json`, nor a Kata sandbox when crustd looks there.
    #[code(NotFound)]
    #[error("no sandbox {id}: {} does not exist (whoever starts the VM writes it; crust-vm up --dir {} does)", .dir.join(SANDBOX_FILE).display(), .dir.display())]
    Unknown { id: String, dir: PathBuf },
    #[code(FailedPrecondition)]
    #[error("{} is not a directory (a symbolic link is not followed): a sandbox is a real directory holding sandbox.json", .dir.display())]
    NotADirectory { dir: PathBuf },
    #[code(Internal)]
    #[error("cannot make {} for Kata's sandbox {id}: {source}", .dir.display())]
    MakeDir { id: String, dir: PathBuf, source: Arc<io::Error> },
    #[code(Internal)]
    #[error("cannot open the sandbox registry {}: {source}", .dir.display())]
    Registry { dir: PathBuf, source: Arc<io::Error> },
    /// A sandbox's directory, or its entry, that cannot be read.
    #[code(Internal)]
    #[error("cannot {} {}: {source}", if *.read { "read" } else { "open" }, .path.display())]
    Io { path: PathBuf, read: bool, source: Arc<io::Error> },
    /// `sandbox.json` is not a regular file crustd may read.
    #[code(FailedPrecondition)]
    #[error("{} is not a valid sandbox entry: {why} (at most {MAX_SANDBOX_FILE} bytes); it must be a regular file written by whoever starts the VM", .path.display())]
    Unreadable { path: PathBuf, why: ReadError },
    /// `sandbox.json` does not say what the entry must.
    #[code(FailedPrecondition)]
    #[error("{} is not a valid sandbox entry: {why}; it must be {{\"qmp\": \"/path/qmp.sock\", \"agent\": \"hvsock:///path/vsock.sock:2857\"}}, with \"qemu_pid\": PID if you will", .path.display())]
    Invalid { path: PathBuf, why: Invalid },
    #[code(inner)]
    #[error(transparent)]
    Kata(#[from] kata::Error),
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// What makes a `sandbox.json` not an entry.
#[derive(Debug, Clone)]
pub enum Invalid {
    /// Not JSON of the entry's shape.
    Json(Arc<serde_json::Error>),
    EmptyQmp,
    /// `agent` is not an address crustd can connect to.
    Agent(AddressError),
    /// `qemu_pid` is not a process id.
    Pid(i64),
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::Json(e) => write!(f, "{e}"),
            Invalid::EmptyQmp => f.write_str("qmp is empty"),
            Invalid::Agent(e) => write!(f, "agent: {e}"),
            Invalid::Pid(n) => write!(f, "qemu_pid {n} is not a process id"),
        }
    }
}

/// The file name of the registry entry inside a sandbox's directory.
pub const SANDBOX_FILE: &str = "sandbox.json";
/// The largest `sandbox.json` read (two paths and a few keys need far less).
pub const MAX_SANDBOX_FILE: u64 = 64 << 10;

/// What `sandbox.json` holds.
#[derive(Debug, Deserialize)]
struct Entry {
    /// QEMU's QMP unix socket.
    qmp: String,
    /// The agent's address.
    agent: String,
    /// The process serving `qmp`, when the writer records it.
    #[serde(default)]
    qemu_pid: Option<i64>,
}

/// Kata's sandboxes, found from Kata's files (`--kata-runtime-dir`,
/// kata.rs): its runtime directory, and the port crust-agent listens on in
/// Kata's guests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kata {
    pub run: PathBuf,
    pub port: u32,
}

/// A sandbox's directory, `DIR/<id>`: where `sandbox.json` and crustd's own
/// state live. It can outlast the VM's entry (a runtime that removed, or is
/// rewriting, `sandbox.json`): crustd's records, and the devices they hold,
/// are still there.
#[derive(Debug, Clone)]
pub struct Home {
    /// The sandbox id, as kubelet sent it.
    pub id: String,
    /// `DIR/<id>`, for messages.
    pub dir: PathBuf,
    /// That directory, opened without following a symlink: every file crustd
    /// reads or writes there is reached through it.
    dirfd: Arc<OwnedFd>,
    /// Where Kata's sandboxes are, when crustd looks there too.
    kata: Option<Kata>,
}

impl Home {
    /// The sandbox's directory fd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.dirfd.as_fd()
    }

    /// The VM's entry, `sandbox.json`: NOT_FOUND when there is none, and
    /// FAILED_PRECONDITION when it is not as documented.
    pub fn vm(&self) -> Result<Sandbox> {
        let path = self.dir.join(SANDBOX_FILE);
        let text = match files::read_bounded(self.fd(), SANDBOX_FILE, MAX_SANDBOX_FILE) {
            Ok(t) => t,
            Err(ReadError::Missing) => {
                return match &self.kata {
                    Some(k) => {
                        let (qmp, agent) = kata::vm(&k.run, &self.id, k.port)?;
                        Ok(Sandbox {
                            home: self.clone(),
                            qmp,
                            agent,
                        })
                    }
                    None => Err(unknown(&self.id, &self.dir)),
                }
            }
            Err(ReadError::Io(source)) => {
                return Err(Error::Io {
                    path,
                    read: true,
                    source,
                })
            }
            Err(why) => return Err(Error::Unreadable { path, why }),
        };
        let (qmp, agent) = parse(&self.dir, &text)?;
        Ok(Sandbox {
            home: self.clone(),
            qmp,
            agent,
        })
    }
}

/// A sandbox whose VM has its entry: where its monitor and its agent are.
#[derive(Debug, Clone)]
pub struct Sandbox {
    /// Its directory.
    pub home: Home,
    /// QEMU's QMP monitor, and whose process must serve it.
    pub qmp: Monitor,
    /// The agent's address.
    pub agent: Address,
}

impl Sandbox {
    pub fn id(&self) -> &str {
        &self.home.id
    }
}

/// Checks a sandbox id (`crust_protocols::names::sandbox_id`: 1–128
/// characters of `[A-Za-z0-9._-]`, not `.` or `..`), so that it names
/// exactly one directory beneath DIR.
pub fn check_id(id: &str) -> Result<(), BadName> {
    crust_protocols::names::sandbox_id(id)
}

/// NOT_FOUND for sandbox `id` (directory `sdir`) that has no entry.
fn unknown(id: &str, sdir: &Path) -> Error {
    Error::Unknown {
        id: id.to_string(),
        dir: sdir.to_path_buf(),
    }
}

/// Opens the directory of sandbox `id` in the registry `dir`: NOT_FOUND when
/// there is none, FAILED_PRECONDITION when it is not a real directory.
pub fn home(dir: &Path, id: &str) -> Result<Home> {
    home_with(dir, id, None)
}

/// [`home`], and with `kata`, a sandbox Kata has (its `persist.json`) gets
/// its directory in the registry made (0700), for crustd's own state.
pub fn home_with(dir: &Path, id: &str, kata: Option<&Kata>) -> Result<Home> {
    check_id(id)?;
    let sdir = dir.join(id);
    if let Some(k) = kata {
        if !sdir.exists() && kata::has(&k.run, id) {
            use std::os::unix::fs::DirBuilderExt;
            let made = fs::DirBuilder::new().mode(0o700).create(&sdir);
            if let Err(e) = made {
                if e.kind() != io::ErrorKind::AlreadyExists {
                    return Err(Error::MakeDir {
                        id: id.to_string(),
                        dir: sdir,
                        source: Arc::new(e),
                    });
                }
            }
        }
    }
    let root = files::open_dir(dir).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => unknown(id, &sdir),
        _ => Error::Registry {
            dir: dir.to_path_buf(),
            source: Arc::new(e),
        },
    })?;
    let fd = match files::open_dir_at(root.as_fd(), id) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(unknown(id, &sdir)),
        Err(e) if matches!(e.raw_os_error(), Some(code) if code == rustix::io::Errno::LOOP.raw_os_error() || code == rustix::io::Errno::NOTDIR.raw_os_error()) => {
            return Err(Error::NotADirectory { dir: sdir })
        }
        Err(e) => {
            return Err(Error::Io {
                path: sdir,
                read: false,
                source: Arc::new(e),
            })
        }
    };
    Ok(Home {
        id: id.to_string(),
        dir: sdir,
        dirfd: Arc::new(fd),
        kata: kata.cloned(),
    })
}

/// Reads sandbox `id` from the registry `dir`.
/// Unknown sandbox: NOT_FOUND; a file or directory that is not as
/// documented: FAILED_PRECONDITION.
pub fn open(dir: &Path, id: &str) -> Result<Sandbox> {
    home(dir, id)?.vm()
}

/// [`open`], with Kata's sandboxes too.
pub fn open_with(dir: &Path, id: &str, kata: Option<&Kata>) -> Result<Sandbox> {
    home_with(dir, id, kata)?.vm()
}

/// [`alive`], with Kata's sandboxes too.
pub fn alive_with(dir: &Path, id: &str, kata: Option<&Kata>) -> bool {
    alive(dir, id) || kata.is_some_and(|k| check_id(id).is_ok() && crate::kata::has(&k.run, id))
}

/// Whether sandbox `id` in `dir` has its `sandbox.json` (its VM is up, as
/// far as crustd can tell). Looks, reads nothing.
pub fn alive(dir: &Path, id: &str) -> bool {
    check_id(id).is_ok()
        && files::open_dir(dir)
            .and_then(|root| files::open_dir_at(root.as_fd(), id))
            .is_ok_and(|fd| files::exists_at(fd.as_fd(), SANDBOX_FILE))
}

/// Parses the text of `DIR/<id>/sandbox.json`: the QMP monitor (and whose
/// process serves it, when recorded) and the agent's address.
pub fn parse(sdir: &Path, text: &[u8]) -> Result<(Monitor, Address)> {
    let path = sdir.join(SANDBOX_FILE);
    let bad = |why| Error::Invalid {
        path: path.clone(),
        why,
    };
    let entry: Entry = serde_json::from_slice(text).map_err(|e| bad(Invalid::Json(Arc::new(e))))?;
    if entry.qmp.is_empty() {
        return Err(bad(Invalid::EmptyQmp));
    }
    let agent: Address = entry.agent.parse().map_err(|e| bad(Invalid::Agent(e)))?;
    agent
        .check_connectable()
        .map_err(|e| bad(Invalid::Agent(e)))?;
    let owner = match entry.qemu_pid {
        None => Owner::Anyone,
        Some(n) => Owner::Pid {
            pid: u32::try_from(n)
                .ok()
                .filter(|&p| p > 0 && i32::try_from(p).is_ok())
                .ok_or_else(|| bad(Invalid::Pid(n)))?,
            recorded: Recorder::Entry { file: path.clone() },
        },
    };
    Ok((Monitor::at(sdir.join(entry.qmp), owner), agent))
}

/// The ids of every sandbox directory in `dir` (for the one-device-one-sandbox check).
pub fn all_ids(dir: &Path) -> Vec<String> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|id| check_id(id).is_ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::code::Code;

    #[test]
    fn ids() {
        for (id, ok) in [
            ("a", true),
            (
                "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                true,
            ),
            ("pod_1.x-y", true),
            ("", false),
            (".", false),
            ("..", false),
            ("a/b", false),
            ("../etc", false),
            ("has space", false),
            (&"x".repeat(129), false),
        ] {
            let r = check_id(id);
            assert_eq!(r.is_ok(), ok, "{id:?}");
            if !ok {
                assert_eq!(Error::from(r.unwrap_err()).code(), Code::InvalidArgument);
            }
        }
    }

    #[test]
    fn entries() {
        let d = Path::new("/reg/s1");
        let (qmp, agent) = parse(
            d,
            br#"{"qmp": "/vm/qmp.sock", "agent": "hvsock:///vm/vsock.sock:1024", "extra": 1}"#,
        )
        .unwrap();
        assert_eq!(qmp.path, Path::new("/vm/qmp.sock"));
        assert_eq!(qmp.owner(), &Owner::Anyone);
        assert_eq!(agent.to_string(), "hvsock:///vm/vsock.sock:1024");
        let (qmp, _) = parse(d, br#"{"qmp": "qmp.sock", "agent": "vsock://3:1024"}"#).unwrap();
        assert_eq!(qmp.path, Path::new("/reg/s1/qmp.sock"));
        // The process serving qmp, when the writer records it.
        let (qmp, _) = parse(
            d,
            br#"{"qmp": "q", "agent": "vsock://3:1024", "qemu_pid": 4242}"#,
        )
        .unwrap();
        assert_eq!(
            qmp.owner(),
            &Owner::Pid {
                pid: 4242,
                recorded: Recorder::Entry {
                    file: "/reg/s1/sandbox.json".into()
                }
            }
        );
        let (qmp, _) = parse(
            d,
            br#"{"qmp": "q", "agent": "vsock://3:1024", "qemu_pid": null}"#,
        )
        .unwrap();
        assert_eq!(qmp.owner(), &Owner::Anyone);
        for bad in [
            "",
            "{",
            "[]",
            r#"{"qmp": "/q"}"#,
            r#"{"agent": "vsock://3:1024"}"#,
            r#"{"qmp": "", "agent": "vsock://3:1024"}"#,
            r#"{"qmp": "/q", "agent": "tcp://1.2.3.4:5"}"#,
            r#"{"qmp": "/q", "agent": "vsock://-1:1024"}"#,
            r#"{"qmp": 7, "agent": "vsock://3:1024"}"#,
            r#"{"qmp": "/q", "agent": "vsock://3:1024", "qemu_pid": 0}"#,
            r#"{"qmp": "/q", "agent": "vsock://3:1024", "qemu_pid": -7}"#,
            r#"{"qmp": "/q", "agent": "vsock://3:1024", "qemu_pid": 2147483648}"#,
            r#"{"qmp": "/q", "agent": "vsock://3:1024", "qemu_pid": "42"}"#,
        ] {
            let e = parse(d, bad.as_bytes()).unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{bad}: {e}");
            assert!(e.to_string().contains("/reg/s1/sandbox.json"), "{e}");
        }
    }

    #[test]
    fn open_unknown_and_malformed() {
        let t = tempfile::tempdir().unwrap();
        let e = open(t.path(), "nope").unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        assert!(e.to_string().contains("no sandbox nope"), "{e}");
        fs::create_dir(t.path().join("s")).unwrap();
        fs::write(t.path().join("s/sandbox.json"), "not json").unwrap();
        assert_eq!(
            open(t.path(), "s").unwrap_err().code(),
            Code::FailedPrecondition
        );
        assert_eq!(
            open(t.path(), "../x").unwrap_err().code(),
            Code::InvalidArgument
        );
        assert_eq!(all_ids(t.path()), vec!["s".to_string()]);
    }

    #[test]
    fn only_a_bounded_regular_file_in_a_real_directory_is_read() {
        use std::os::unix::fs::symlink;
        let t = tempfile::tempdir().unwrap();
        let good = r#"{"qmp": "q", "agent": "vsock://3:1024"}"#;
        let entry = |id: &str| t.path().join(id).join(SANDBOX_FILE);
        for id in ["fifo", "zero", "big", "ok", "elsewhere"] {
            fs::create_dir(t.path().join(id)).unwrap();
        }
        rustix::fs::mknodat(
            rustix::fs::CWD,
            entry("fifo"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        symlink("/dev/zero", entry("zero")).unwrap();
        fs::File::create(entry("big"))
            .unwrap()
            .set_len(1 << 30)
            .unwrap();
        fs::write(entry("ok"), good).unwrap();
        for (id, says) in [
            ("fifo", "a FIFO"),
            ("zero", "a symbolic link"),
            ("big", "1073741824 bytes"),
        ] {
            let e = open(t.path(), id).unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{id}: {e}");
            assert!(e.to_string().contains(says), "{id}: {e}");
        }
        let sb = open(t.path(), "ok").unwrap();
        assert_eq!(sb.qmp.path, t.path().join("ok/q"));
        // A sandbox directory that is a symlink to another one is not followed.
        fs::write(entry("elsewhere"), good).unwrap();
        symlink(t.path().join("elsewhere"), t.path().join("link")).unwrap();
        let e = open(t.path(), "link").unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains("not a directory"), "{e}");
        assert!(alive(t.path(), "ok") && alive(t.path(), "fifo"));
        assert!(!alive(t.path(), "link") && !alive(t.path(), "none"));
        assert!(!all_ids(t.path()).contains(&"link".to_string()));
    }
}

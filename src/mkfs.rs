//! Making the filesystem inside a new encrypted volume: the one place the
//! agent runs another program (docs/encryption.md, "Making the filesystem
//! inside"). Everything else the agent does is a syscall or an ioctl.
//!
//! The programs are Debian's `mke2fs` and `mkfs.xfs`: in the initrd, in
//! [`PRIVATE_DIR`] with exactly their libraries and the ELF interpreter,
//! run through that interpreter so the guest needs no /lib and no PATH; in
//! a guest with its own userspace, the guest's own. A run is bounded: a
//! clean environment, no stdin, at most [`KEEP`] bytes kept of each output,
//! and the caller's [`Cancel`]: once it fires, the program is killed and
//! reaped. It is a child its owner reaps (`sys::children`), which PID 1's
//! reaper leaves alone.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::process::{Pid, PidfdFlags, Signal};

use crate::cancel::{Cancel, Stopped, SLICE};
use crate::model::FsType;
use crate::sys::children::Owned;
use crate::sys::mountinfo::shown;

/// Where the initrd ships the programs, their libraries and the interpreter.
pub const PRIVATE_DIR: &str = "/usr/lib/crust/mkfs";

/// The ELF interpreter's name in [`PRIVATE_DIR`] (x86-64 glibc's).
pub const INTERPRETER: &str = "ld-linux-x86-64.so.2";

/// Where a guest with its own userspace keeps its programs, in this order.
/// Never the environment's PATH: the agent's environment is its caller's.
const SYSTEM_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// The only PATH the programs see (they run no other program).
const CHILD_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// Bytes kept of each of a program's outputs: the last ones, where its
/// error is. The rest is read and dropped, so the program never blocks on
/// a full pipe.
pub const KEEP: usize = 64 * 1024;

/// How often a wait looks at a child when the kernel has no pidfd for it.
const POLL: Duration = Duration::from_millis(10);

/// How long, after the program exits, its pipes may stay open (a child of
/// its own holding them) before they are closed unread.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Lines, and characters, of a failed program's output an error quotes.
const SAID_LINES: usize = 8;
const SAID_CHARS: usize = 1000;

crate::code::coded_errors! {
/// What can go wrong making a filesystem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("the guest has no {program} to make an {fs} filesystem with (looked in {looked}): the initrd ships it in /usr/lib/crust/mkfs unless `crust-vm initrd --no-mkfs` left it out, and a guest with its own userspace needs {package} installed")]
    Missing {
        fs: FsType,
        /// The program looked for.
        program: &'static str,
        /// The Debian package that has it.
        package: &'static str,
        /// The directories looked in.
        looked: String,
    },
    #[code(Internal)]
    #[error("cannot start {} to make an {fs} filesystem on {}: {source}", shown(program), shown(device))]
    Start {
        fs: FsType,
        program: PathBuf,
        device: PathBuf,
        #[source]
        source: io::Error,
    },
    #[code(Internal)]
    #[error("cannot wait for {} making an {fs} filesystem on {}: {source}; it was killed", shown(program), shown(device))]
    Wait {
        fs: FsType,
        program: PathBuf,
        device: PathBuf,
        #[source]
        source: io::Error,
    },
    #[code(Internal)]
    #[error("{} failed to make an {fs} filesystem on {} (exit status {status}); it said: {said}", shown(program), shown(device))]
    Failed {
        fs: FsType,
        program: PathBuf,
        device: PathBuf,
        status: i32,
        /// Its last lines, printable.
        said: String,
    },
    #[code(Internal)]
    #[error("{} was killed by signal {signal} while making an {fs} filesystem on {} (the guest may be out of memory); it said: {said}", shown(program), shown(device))]
    Killed {
        fs: FsType,
        program: PathBuf,
        device: PathBuf,
        signal: i32,
        /// Its last lines, printable.
        said: String,
    },
    #[code(inner)]
    #[error("{why} while {during}", why = .0.why.text(), during = .0.during)]
    Stopped(#[from] Stopped),
}
}

/// How one program is run.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Program {
    /// `dir/ld-linux-x86-64.so.2 --library-path dir dir/name`: the
    /// interpreter and the libraries beside the program, none from /lib.
    Private { dir: PathBuf, name: &'static str },
    /// The guest's own program, linked against the guest's /lib.
    System(PathBuf),
}

impl Program {
    /// The program's file.
    fn path(&self) -> PathBuf {
        match self {
            Program::Private { dir, name } => dir.join(name),
            Program::System(p) => p.clone(),
        }
    }

    /// The command that runs it, before its arguments.
    fn command(&self) -> Command {
        match self {
            Program::Private { dir, name } => {
                let mut c = Command::new(dir.join(INTERPRETER));
                c.arg("--library-path").arg(dir).arg(dir.join(name));
                c
            }
            Program::System(p) => Command::new(p),
        }
    }
}

/// The programs that make `fs`, in the order looked for, and the Debian
/// package that has them. They take the same arguments.
fn names(fs: FsType) -> (&'static [&'static str], &'static str) {
    match fs {
        FsType::Ext4 => (&["mke2fs", "mkfs.ext4"], "e2fsprogs"),
        FsType::Xfs => (&["mkfs.xfs"], "xfsprogs"),
    }
}

/// The arguments before the device. Both force: the caller has just proven
/// the disk blank and written the LUKS2 header itself, so the mapping can
/// hold nothing to protect, and what the programs would refuse (another
/// signature, a device not a partition) would be noise read through a
/// brand-new key. No discards: a discard through a mapping that allows
/// them tells the host which blocks hold nothing.
///
/// ext4's inode tables and journal are not zeroed (`lazy_*=1`): through
/// dm-crypt, the blank disk reads as noise under the new key, never as an
/// old filesystem's blocks, so there is nothing stale for a replay or a
/// check to take for its own; and zeroing would write 1/64 of the volume
/// plus up to 1 GiB of journal inside the caller's deadline. The kernel
/// zeroes the inode tables after the first mount (ext4lazyinit), as it
/// does on any ext4 made this way. xfs has no such choice.
fn args(fs: FsType) -> &'static [&'static str] {
    match fs {
        FsType::Ext4 => &[
            "-t",
            "ext4",
            "-q",
            "-F",
            "-E",
            "nodiscard,lazy_itable_init=1,lazy_journal_init=1",
        ],
        FsType::Xfs => &["-q", "-f", "-K"],
    }
}

/// Where the programs are, resolved once: [`make`] runs them from there.
#[derive(Clone, Debug)]
pub struct Tools {
    ext4: Option<Program>,
    xfs: Option<Program>,
    /// The directories looked in, for the error that none had the program.
    looked: String,
}

impl Tools {
    /// The initrd's [`PRIVATE_DIR`] for each program it holds with the
    /// interpreter; else the guest's own, from /usr/sbin, /sbin, /usr/bin or /bin.
    pub fn find() -> Tools {
        Tools::search(Path::new(PRIVATE_DIR), &SYSTEM_DIRS)
    }

    /// The programs in `dir` laid out as in [`PRIVATE_DIR`] (tests).
    pub fn at(dir: &Path) -> Tools {
        Tools::search(dir, &[])
    }

    fn search(private: &Path, system: &[&str]) -> Tools {
        let one = |fs| {
            let (names, _) = names(fs);
            let interpreter = private.join(INTERPRETER).is_file();
            let in_private = names
                .iter()
                .find(|n| interpreter && private.join(n).is_file())
                .map(|name| Program::Private {
                    dir: private.to_path_buf(),
                    name,
                });
            in_private.or_else(|| {
                system.iter().find_map(|d| {
                    names
                        .iter()
                        .map(|n| Path::new(d).join(n))
                        .find(|p| p.is_file())
                        .map(Program::System)
                })
            })
        };
        let looked = std::iter::once(shown(private))
            .chain(system.iter().map(|d| d.to_string()))
            .collect::<Vec<_>>()
            .join(", ");
        Tools {
            ext4: one(FsType::Ext4),
            xfs: one(FsType::Xfs),
            looked,
        }
    }

    /// Ok when the program that makes `fs` is there: for callers to check
    /// before they write anything to a disk.
    pub fn check(&self, fs: FsType) -> Result<(), Error> {
        self.program(fs).map(|_| ())
    }

    fn program(&self, fs: FsType) -> Result<&Program, Error> {
        let found = match fs {
            FsType::Ext4 => &self.ext4,
            FsType::Xfs => &self.xfs,
        };
        found.as_ref().ok_or_else(|| {
            let (names, package) = names(fs);
            Error::Missing {
                fs,
                program: names[0],
                package,
                looked: self.looked.clone(),
            }
        })
    }
}

/// Makes an `fs` filesystem on `device`, which the caller has just proven
/// blank and formatted for encryption (so the programs are told to force:
/// see [`args`]). Returns once the program exited 0. When `cancel` fires
/// first, the program is killed and reaped, and the device holds an
/// unfinished filesystem.
pub fn make(fs: FsType, device: &Path, tools: &Tools, cancel: &Cancel) -> Result<(), Error> {
    let program = tools.program(fs)?;
    let path = program.path();
    let doing = || {
        format!(
            "making an {fs} filesystem on {} with {}",
            shown(device),
            shown(&path)
        )
    };
    cancel.check(|| format!("{} (not started)", doing()))?;
    let mut cmd = program.command();
    cmd.args(args(fs))
        .arg(device)
        .env_clear()
        .env("PATH", CHILD_PATH)
        .env("LC_ALL", "C")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so a kill reaches whatever it started too.
        .process_group(0);
    let mut child = Owned::start(|| cmd.spawn()).map_err(|source| Error::Start {
        fs,
        program: path.clone(),
        device: device.to_path_buf(),
        source,
    })?;
    let ended = match watch(&mut child, cancel) {
        Ok(Ok(ended)) => ended,
        Ok(Err(why)) => {
            return Err(Stopped {
                why,
                during: format!(
                    "{}; it was killed, and the device holds an unfinished filesystem",
                    doing()
                ),
            }
            .into())
        }
        Err(source) => {
            kill_group(&child);
            return Err(Error::Wait {
                fs,
                program: path,
                device: device.to_path_buf(),
                source,
            });
        }
    };
    drop(child);
    judge(fs, path, device, &ended)
}

/// How a finished program ended: Ok for exit status 0.
fn judge(fs: FsType, program: PathBuf, device: &Path, ended: &Ended) -> Result<(), Error> {
    let said = || ended.said();
    let device = device.to_path_buf();
    match (ended.status.code(), ended.status.signal()) {
        (Some(0), _) => Ok(()),
        (Some(status), _) => Err(Error::Failed {
            fs,
            program,
            device,
            status,
            said: said(),
        }),
        (None, signal) => Err(Error::Killed {
            fs,
            program,
            device,
            signal: signal.unwrap_or(0),
            said: said(),
        }),
    }
}

/// SIGKILL to the child's process group (the child leads it), while the
/// child is unreaped, so the group's id is still its own.
fn kill_group(child: &Owned) {
    if let Some(pid) = Pid::from_raw(child.pid()) {
        let _ = rustix::process::kill_process_group(pid, Signal::KILL);
    }
}

/// A program that exited: how, and the tails of its outputs.
struct Ended {
    status: ExitStatus,
    stdout: Tail,
    stderr: Tail,
}

impl Ended {
    /// The last lines it wrote (on stderr, else stdout), printable.
    fn said(&self) -> String {
        let tail = if self.stderr.bytes.iter().any(|b| !b.is_ascii_whitespace()) {
            &self.stderr
        } else {
            &self.stdout
        };
        last_lines(&tail.bytes)
    }
}

/// Reads the child's outputs until it exits or `cancel` fires: Ok(Ok) with
/// how it ended, Ok(Err) with why it was stopped (its group killed; dropping
/// the child reaps it).
fn watch(child: &mut Owned, cancel: &Cancel) -> io::Result<Result<Ended, crate::cancel::Why>> {
    let pidfd = Pid::from_raw(child.pid())
        .and_then(|pid| rustix::process::pidfd_open(pid, PidfdFlags::empty()).ok());
    let c = child.child();
    let mut streams = [
        Stream::new(c.stdout.take().map(OwnedFd::from)),
        Stream::new(c.stderr.take().map(OwnedFd::from)),
    ];
    loop {
        if let Some(status) = child.try_wait()? {
            drain(&mut streams, cancel);
            let [stdout, stderr] = streams.map(|s| s.tail);
            return Ok(Ok(Ended {
                status,
                stdout,
                stderr,
            }));
        }
        if let Some(why) = cancel.why() {
            kill_group(child);
            return Ok(Err(why));
        }
        let wait = cancel.slice(if pidfd.is_some() { SLICE } else { POLL });
        read_ready(&mut streams, pidfd.as_ref(), wait)?;
    }
}

/// Reads what is left in the pipes after the program exited, for at most
/// [`DRAIN_GRACE`] (a child of its own may hold them) and never past
/// `cancel`: its exit is known by then, only the tail of what it said is lost.
fn drain(streams: &mut [Stream; 2], cancel: &Cancel) {
    let until = Instant::now() + DRAIN_GRACE;
    while streams.iter().any(|s| s.pipe.is_some()) && cancel.why().is_none() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || read_ready(streams, None, cancel.slice(left)).is_err() {
            return;
        }
    }
}

/// Waits up to `wait` for a pipe to be readable or the pidfd to say the
/// child exited, and reads each readable pipe once.
fn read_ready(
    streams: &mut [Stream; 2],
    pidfd: Option<&OwnedFd>,
    wait: Duration,
) -> io::Result<()> {
    let open: Vec<usize> = (0..streams.len())
        .filter(|&i| streams[i].pipe.is_some())
        .collect();
    let ready: Vec<bool> = {
        let mut fds: Vec<PollFd<'_>> = open
            .iter()
            .filter_map(|&i| streams[i].pipe.as_ref())
            .map(|f| PollFd::new(f, PollFlags::IN))
            .collect();
        if let Some(p) = pidfd {
            fds.push(PollFd::new(p, PollFlags::IN));
        }
        if fds.is_empty() {
            std::thread::sleep(wait);
            return Ok(());
        }
        let timeout = rustix::event::Timespec::try_from(wait).map_err(io::Error::other)?;
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        fds.iter()
            .take(open.len())
            .map(|f| !f.revents().is_empty())
            .collect()
    };
    for (&i, _) in open.iter().zip(ready).filter(|(_, r)| *r) {
        streams[i].read_once();
    }
    Ok(())
}

/// One of the child's outputs: its pipe while open, and what it said.
struct Stream {
    pipe: Option<File>,
    tail: Tail,
}

impl Stream {
    fn new(fd: Option<OwnedFd>) -> Stream {
        Stream {
            pipe: fd.map(File::from),
            tail: Tail::default(),
        }
    }

    /// One read from a readable pipe; closes it at its end or on an error.
    fn read_once(&mut self) {
        let Some(pipe) = self.pipe.as_mut() else {
            return;
        };
        let mut buf = [0u8; 16 * 1024];
        match pipe.read(&mut buf) {
            Ok(0) => self.pipe = None,
            Ok(n) => self.tail.push(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => self.pipe = None,
        }
    }
}

/// The last [`KEEP`] bytes of a stream.
#[derive(Default)]
struct Tail {
    bytes: Vec<u8>,
}

impl Tail {
    fn push(&mut self, data: &[u8]) {
        self.bytes.extend_from_slice(data);
        let over = self.bytes.len().saturating_sub(KEEP);
        self.bytes.drain(..over);
    }
}

/// The last [`SAID_LINES`] non-empty lines of `bytes`, joined by " / ",
/// control characters escaped, at most [`SAID_CHARS`] characters (the end
/// kept); "nothing" when there are none.
fn last_lines(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let last = &lines[lines.len().saturating_sub(SAID_LINES)..];
    if last.is_empty() {
        return "nothing".into();
    }
    let joined: String = last
        .join(" / ")
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect();
    let count = joined.chars().count();
    if count <= SAID_CHARS {
        return joined;
    }
    let kept: String = joined.chars().skip(count - SAID_CHARS).collect();
    format!("…{kept}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cancel::{Token, Why};
    use crate::code::Code;
    use std::os::unix::fs::PermissionsExt;

    /// Writes an executable `name` into `dir` holding `body` after a shebang.
    fn script(dir: &Path, name: &str, body: &str) {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A private layout in a temp dir: an interpreter stand-in that insists
    /// on being called as the real one is, then runs the program; and
    /// `body` as both programs.
    fn layout(body: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        script(
            dir.path(),
            INTERPRETER,
            &format!(
                "[ \"$1\" = --library-path ] && [ \"$2\" = '{d}' ] || {{ echo \"bad call: $*\" >&2; exit 99; }}\nshift 2\nexec \"$@\""
            ),
        );
        script(dir.path(), "mke2fs", body);
        script(dir.path(), "mkfs.xfs", body);
        dir
    }

    /// `make`, again when a concurrent fork of another test held a script
    /// open for writing (ETXTBSY).
    fn run(fs: FsType, dir: &Path, cancel: &Cancel) -> Result<(), Error> {
        let tools = Tools::at(dir);
        for _ in 0..20 {
            match make(fs, Path::new("/dev/null-stand-in"), &tools, cancel) {
                Err(Error::Start { source, .. })
                    if source.raw_os_error() == Some(libc::ETXTBSY) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => return other,
            }
        }
        panic!("the stand-in stayed busy");
    }

    /// A process's state letter (`Z` for a zombie), None once it is gone.
    fn state(pid: i32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(") ")?.1.chars().next()
    }

    fn pid_in(p: &Path) -> i32 {
        std::fs::read_to_string(p).unwrap().trim().parse().unwrap()
    }

    #[test]
    fn the_private_layout_wins_then_the_system_dirs() {
        let private = layout("exit 0");
        let system = tempfile::tempdir().unwrap();
        script(system.path(), "mkfs.ext4", "exit 0");
        let sys = system.path().to_str().unwrap();
        let t = Tools::search(private.path(), &[sys]);
        assert_eq!(
            t.ext4,
            Some(Program::Private {
                dir: private.path().to_path_buf(),
                name: "mke2fs"
            })
        );
        // Without the interpreter the private programs are not runnable: the system's.
        std::fs::remove_file(private.path().join(INTERPRETER)).unwrap();
        let t = Tools::search(private.path(), &[sys]);
        assert_eq!(
            t.ext4,
            Some(Program::System(system.path().join("mkfs.ext4")))
        );
        let e = t.check(FsType::Xfs).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        let msg = e.to_string();
        for want in [
            "the guest has no mkfs.xfs",
            "xfsprogs",
            "/usr/lib/crust/mkfs",
            sys,
        ] {
            assert!(msg.contains(want), "{want:?} in {msg}");
        }
        // make says the same, having started nothing.
        let e = make(FsType::Xfs, Path::new("/x"), &t, &Cancel::never()).unwrap_err();
        assert_eq!(e.to_string(), msg);
        // The private programs' command goes through the interpreter.
        let p = Program::Private {
            dir: "/d".into(),
            name: "mke2fs",
        };
        let c = p.command();
        assert_eq!(c.get_program(), "/d/ld-linux-x86-64.so.2");
        let a: Vec<_> = c.get_args().collect();
        assert_eq!(a, ["--library-path", "/d", "/d/mke2fs"]);
    }

    #[test]
    fn runs_with_the_arguments_a_clean_environment_and_no_stdin() {
        let dir = layout("");
        let d = dir.path().display().to_string();
        script(
            dir.path(),
            "mke2fs",
            &format!("printf '%s\\n' \"$@\" > '{d}/args'; env > '{d}/env'; pwd > '{d}/cwd'; cat > '{d}/stdin'"),
        );
        std::fs::copy(dir.path().join("mke2fs"), dir.path().join("mkfs.xfs")).unwrap();
        for (fs, want) in [
            (
                FsType::Ext4,
                "-t\next4\n-q\n-F\n-E\nnodiscard,lazy_itable_init=1,lazy_journal_init=1\n/dev/null-stand-in\n",
            ),
            (FsType::Xfs, "-q\n-f\n-K\n/dev/null-stand-in\n"),
        ] {
            run(fs, dir.path(), &Cancel::never()).unwrap();
            let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
            assert_eq!(read("args"), want);
            assert_eq!(read("cwd"), "/\n");
            assert_eq!(read("stdin"), "");
            let env = read("env");
            let vars: Vec<&str> = env.lines().filter_map(|l| l.split_once('=')).map(|(k, _)| k).collect();
            assert!(env.contains(&format!("PATH={CHILD_PATH}\n")), "{env}");
            assert!(env.contains("LC_ALL=C\n"), "{env}");
            // The shell adds its own (PWD, SHLVL); nothing of the caller's passes.
            for v in vars {
                assert!(["PATH", "LC_ALL", "PWD", "SHLVL", "OLDPWD", "_"].contains(&v), "{v} leaked: {env}");
            }
        }
    }

    #[test]
    fn a_failure_says_its_status_and_last_lines_printably() {
        let dir = layout(
            "i=1; while [ $i -le 20 ]; do echo \"line $i\" >&2; i=$((i+1)); done; printf 'esc \\033[31mred\\n' >&2; echo out; exit 3",
        );
        let e = run(FsType::Ext4, dir.path(), &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::Internal);
        let Error::Failed { status, said, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(*status, 3);
        assert!(said.starts_with("line 14 / "), "{said}");
        assert!(said.ends_with("line 20 / esc \\u{1b}[31mred"), "{said}");
        assert!(!said.contains("line 13") && !said.contains("out"), "{said}");
        let msg = e.to_string();
        assert!(
            msg.contains(
                "mke2fs failed to make an ext4 filesystem on /dev/null-stand-in (exit status 3)"
            ),
            "{msg}"
        );
        // A program killed by a signal that is not ours says so.
        let dir = layout("echo dying >&2; kill -SEGV $$");
        let e = run(FsType::Xfs, dir.path(), &Cancel::never()).unwrap_err();
        assert!(
            matches!(&e, Error::Killed { signal: 11, said, .. } if said == "dying"),
            "{e:?}"
        );
        // Silent on stderr: stdout is quoted; silent on both: "nothing".
        let dir = layout("echo only-out; exit 1");
        let e = run(FsType::Xfs, dir.path(), &Cancel::never()).unwrap_err();
        assert!(e.to_string().ends_with("it said: only-out"), "{e}");
        let dir = layout("exit 1");
        let e = run(FsType::Xfs, dir.path(), &Cancel::never()).unwrap_err();
        assert!(e.to_string().ends_with("it said: nothing"), "{e}");
    }

    #[test]
    fn a_program_that_never_ends_is_killed_at_the_deadline_and_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let dir = layout(&format!(
            "echo $$ > '{d}/pid'; sleep 600 & echo $! > '{d}/grandchild'; wait"
        ));
        let start = Instant::now();
        let cancel = Cancel::never().with_timeout(Duration::from_millis(300));
        let e = run(FsType::Ext4, dir.path(), &cancel).unwrap_err();
        let took = start.elapsed();
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert_eq!(e.code(), Code::DeadlineExceeded);
        assert!(
            matches!(&e, Error::Stopped(s) if s.why == Why::Deadline),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(msg.starts_with("the caller's deadline passed while making an ext4 filesystem on /dev/null-stand-in with "), "{msg}");
        assert!(
            msg.ends_with("it was killed, and the device holds an unfinished filesystem"),
            "{msg}"
        );
        // Reaped: no zombie left behind.
        let pid = pid_in(&Path::new(&d).join("pid"));
        assert_eq!(state(pid), None, "the program is gone");
        // What it started was in its group and killed with it (reparented, so
        // it may linger as someone else's zombie for a moment).
        let grand = pid_in(&Path::new(&d).join("grandchild"));
        let until = Instant::now() + Duration::from_secs(5);
        while matches!(state(grand), Some(s) if s != 'Z') && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            matches!(state(grand), None | Some('Z')),
            "{:?}",
            state(grand)
        );
    }

    #[test]
    fn a_fired_token_stops_it_and_a_fired_cancel_starts_nothing() {
        let dir = layout("while :; do :; done");
        let t = Token::new(Why::Shutdown);
        let t2 = t.clone();
        let firer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            t2.fire();
        });
        let start = Instant::now();
        let e = run(FsType::Xfs, dir.path(), &Cancel::never().with_token(&t)).unwrap_err();
        firer.join().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.to_string()
                .starts_with("the agent is shutting down while making an xfs"),
            "{e}"
        );

        let marker = dir.path().join("ran");
        script(
            dir.path(),
            "mkfs.xfs",
            &format!("touch '{}'", marker.display()),
        );
        let e = run(FsType::Xfs, dir.path(), &Cancel::never().with_token(&t)).unwrap_err();
        assert!(e.to_string().ends_with("(not started)"), "{e}");
        assert!(!marker.exists());
    }

    #[test]
    fn pipes_held_open_after_the_exit_do_not_hold_the_answer() {
        let dir = tempfile::tempdir().unwrap();
        let grand = dir.path().join("grandchild");
        let dir = layout(&format!(
            "echo said >&2; sleep 600 & echo $! > '{}'; exit 4",
            grand.display()
        ));
        let start = Instant::now();
        let e = run(FsType::Ext4, dir.path(), &Cancel::never()).unwrap_err();
        let took = start.elapsed();
        let _ = rustix::process::kill_process(Pid::from_raw(pid_in(&grand)).unwrap(), Signal::KILL);
        assert!(
            matches!(&e, Error::Failed { status: 4, said, .. } if said == "said"),
            "{e:?}"
        );
        assert!(
            took >= DRAIN_GRACE && took < DRAIN_GRACE + Duration::from_secs(1),
            "{took:?}"
        );
        // The caller's cancel cuts the grace short.
        let start = Instant::now();
        let cancel = Cancel::never().with_timeout(Duration::from_millis(300));
        let e = run(FsType::Ext4, dir.path(), &cancel).unwrap_err();
        let _ = rustix::process::kill_process(Pid::from_raw(pid_in(&grand)).unwrap(), Signal::KILL);
        assert!(matches!(&e, Error::Failed { status: 4, .. }), "{e:?}");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn huge_output_is_read_to_its_end_and_kept_bounded() {
        // 64 MiB on stdout and 2 MiB of lines on stderr: the program never
        // blocks on a full pipe, and only the ends are kept.
        let dir = layout(
            "head -c 67108864 /dev/zero; i=0; yes 'a line of noise' | head -c 2097152 >&2; echo the-last-line >&2; exit 2",
        );
        let start = Instant::now();
        let cancel = Cancel::never().with_timeout(Duration::from_secs(60));
        let e = run(FsType::Ext4, dir.path(), &cancel).unwrap_err();
        let Error::Failed {
            status: 2, said, ..
        } = &e
        else {
            panic!("{e:?}")
        };
        assert!(said.ends_with("a line of noise / the-last-line"), "{said}");
        assert!(said.chars().count() <= SAID_CHARS + 1, "{said}");
        assert!(start.elapsed() < Duration::from_secs(60));

        let mut t = Tail::default();
        for i in 0..100u8 {
            t.push(&[i; 4096]);
        }
        assert_eq!(t.bytes.len(), KEEP);
        assert_eq!(t.bytes[KEEP - 1], 99);
        // The last 16 blocks of 4 KiB: from block 84 on.
        assert_eq!(t.bytes[0], 84);
    }

    #[test]
    fn last_lines_are_few_short_and_printable() {
        let long = "x".repeat(3000);
        let cases: &[(&[u8], &str)] = &[
            (b"", "nothing"),
            (b" \n\n  \n", "nothing"),
            (b"one\ntwo\n", "one / two"),
            (b"a\tb\x07\n", "a\\tb\\u{7}"),
            (b"bad \xff utf8", "bad \u{fffd} utf8"),
        ];
        for (input, want) in cases {
            assert_eq!(last_lines(input), *want, "{input:?}");
        }
        let said = last_lines(long.as_bytes());
        assert_eq!(said.chars().count(), SAID_CHARS + 1);
        assert!(said.starts_with('…'));
    }

    /// Root: a loop device, as the agent would see the mapping.
    #[test]
    #[ignore = "needs root: make test runs it"]
    fn the_real_programs_make_filesystems_their_checkers_accept() {
        crust_testkit::needs::loop_devices_and_mkfs();
        crust_testkit::needs::tools(
            &["e2fsck", "xfs_repair", "blkid"],
            "apt-get install e2fsprogs xfsprogs util-linux",
        );
        let tools = Tools::find();
        for (fs, check) in [
            (FsType::Ext4, &["e2fsck", "-f", "-n"][..]),
            (FsType::Xfs, &["xfs_repair", "-n"][..]),
        ] {
            let disk = crust_testkit::LoopDisk::new(320, None);
            let dev = disk.path();
            let cancel = Cancel::never().with_timeout(Duration::from_secs(120));
            make(fs, Path::new(&dev), &tools, &cancel).unwrap();
            let mut args = check.to_vec();
            args.push(&dev);
            crust_testkit::disks::run(args[0], &args[1..]);
            let kind = crust_testkit::disks::run("blkid", &["-o", "value", "-s", "TYPE", &dev]);
            assert_eq!(kind.trim(), fs.name());
        }
    }
}

//! The crustd process under test: started from the binary cargo built,
//! killed with SIGKILL and started again on the same socket and registry;
//! the requests kubelet sends, and what crustd answers and records.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crust_kubelet::{pb, Kubelet};

use crate::disks::succeeded;

/// A crustd process serving `socket` for the registry `reg`.
pub struct Crustd {
    child: Child,
    pub socket: PathBuf,
    reg: PathBuf,
    extra: Vec<String>,
    /// Where its stderr (one JSON line per call) goes, when kept.
    log: Option<PathBuf>,
}

impl Crustd {
    pub fn start(reg: &Path, extra: &[&str]) -> Crustd {
        Crustd::start_with_umask(reg, extra, None)
    }

    /// As `start`, the process under `umask` (e.g. "0000") when given.
    pub fn start_with_umask(reg: &Path, extra: &[&str], umask: Option<&str>) -> Crustd {
        let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if let Some(u) = umask {
            extra.push(format!("--umask={u}"));
        }
        Crustd::launch(reg, extra, None)
    }

    /// As `start`, its stderr appended to `reg/../crustd.log` (see [`Crustd::log`]).
    pub fn start_logged(reg: &Path, extra: &[&str]) -> Crustd {
        let log = reg.parent().unwrap().join("crustd.log");
        let extra = extra.iter().map(|s| s.to_string()).collect();
        Crustd::launch(reg, extra, Some(log))
    }

    /// Starts crustd on `reg/../crustd.sock` and waits until it answers.
    fn launch(reg: &Path, extra: Vec<String>, log: Option<PathBuf>) -> Crustd {
        let socket = reg.parent().unwrap().join("crustd.sock");
        let child = spawn(&socket, reg, &extra, log.as_deref());
        wait_for(&socket);
        Crustd {
            child,
            socket,
            reg: reg.to_path_buf(),
            extra,
            log,
        }
    }

    /// What it logged so far (started with `start_logged`).
    pub fn log(&self) -> String {
        self.log
            .as_ref()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .unwrap_or_default()
    }

    /// The process id (crustd's old temporary file names had it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How many files crustd has open now.
    pub fn open_files(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// crustd's (soft, hard) limits on open files, from /proc.
    pub fn nofile(&self) -> (String, String) {
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", self.pid())).unwrap();
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap()
            .to_string();
        let f: Vec<&str> = line.split_whitespace().collect();
        (f[3].to_string(), f[4].to_string())
    }

    pub fn client(&self) -> Kubelet {
        Kubelet::connect(&self.socket, Duration::from_secs(60)).unwrap()
    }

    /// SIGKILL (no chance to tidy up), then a fresh crustd on the same socket and registry.
    pub fn kill_and_restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.child = spawn(&self.socket, &self.reg, &self.extra, self.log.as_deref());
        wait_for(&self.socket);
    }
}

/// crustd's command line; `--umask=U` in `extra` runs it under that umask,
/// `--soft-nofile=N` with that soft limit on open files (through sh, so
/// the test process's own are left alone).
fn command(socket: &Path, reg: &Path, extra: &[String]) -> Command {
    let mut shell = Vec::new();
    for a in extra {
        if let Some(u) = a.strip_prefix("--umask=") {
            shell.push(format!("umask {u}"));
        }
        if let Some(n) = a.strip_prefix("--soft-nofile=") {
            shell.push(format!("ulimit -Sn {n}"));
        }
    }
    let mut c = if shell.is_empty() {
        Command::new(crustd_bin())
    } else {
        let mut c = Command::new("sh");
        c.args([
            "-c",
            &format!("{} && exec \"$0\" \"$@\"", shell.join(" && ")),
        ])
        .arg(crustd_bin());
        c
    };
    c.arg("--socket")
        .arg(socket)
        .arg("--sandboxes")
        .arg(reg)
        .args(
            extra
                .iter()
                .filter(|a| !a.starts_with("--umask=") && !a.starts_with("--soft-nofile=")),
        )
        .stdin(Stdio::null());
    c
}

fn spawn(socket: &Path, reg: &Path, extra: &[String], log: Option<&Path>) -> Child {
    let mut c = command(socket, reg, extra);
    if let Some(log) = log {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        c.stderr(f);
    }
    c.spawn().unwrap()
}

/// The Go writer of direct-volume records (crustd/tests/kata_writer), built
/// once per test process; fails the test when Go is missing (scripts/deps.sh
/// installs it).
#[track_caller]
pub fn kata_writer() -> PathBuf {
    built_kata_writer().unwrap_or_else(|| {
        crate::needs::missing(
            "it needs go to build crustd/tests/kata_writer (apt-get install golang-go; scripts/deps.sh does)",
        )
    })
}

fn built_kata_writer() -> Option<PathBuf> {
    static BUILT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let work =
                std::env::temp_dir().join(format!("crustd-kata-writer-{}", std::process::id()));
            let pkg = work.join("src/katawriter");
            std::fs::create_dir_all(&pkg).ok()?;
            std::fs::copy(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../crustd/tests/kata_writer/main.go"),
                pkg.join("main.go"),
            )
            .ok()?;
            let bin = work.join("kata_writer");
            let out = Command::new("go")
                .args(["build", "-o"])
                .arg(&bin)
                .arg(".")
                .current_dir(&pkg)
                .env("GO111MODULE", "off")
                .env("GOPATH", &work)
                .env("GOCACHE", work.join("cache"))
                .output()
                .ok()?;
            succeeded(&out, format_args!("go build tests/kata_writer"));
            Some(bin)
        })
        .clone()
}

/// Runs the Go writer; panics with its stderr if it fails. Answers its stdout.
pub fn kata(writer: &Path, args: &[&str]) -> String {
    let out = Command::new(writer).args(args).output().unwrap();
    succeeded(&out, format_args!("kata_writer {args:?}"));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs a crustd that must refuse to start: its exit status and stderr.
/// One still running after 20 s is killed and reported as such.
pub fn refused(socket: &Path, reg: &Path) -> (bool, String) {
    let mut child = command(socket, reg, &[])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            return (status.success(), err);
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            return (true, "crustd kept running".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until crustd answers a call. A connect alone is not enough: the
/// socket listens from the start, and crustd claims and holds its recorded
/// devices again before it answers anything (a test that looks at those
/// holds right after a restart must wait for that).
fn wait_for(socket: &Path) {
    let t = Instant::now();
    loop {
        let answered = std::os::unix::net::UnixStream::connect(socket).is_ok()
            && Kubelet::connect(socket, Duration::from_secs(5))
                .is_ok_and(|k| k.capabilities().is_ok());
        if answered {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "crustd did not answer"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Crustd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The code name and message of a call that must have failed; a success
/// panics, showing the first 200 characters of what came back.
pub fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (String, String) {
    match r {
        Err(s) => (crust_kubelet::code_name(s.code()), s.message().to_string()),
        Ok(v) => {
            let v: String = format!("{v:?}").chars().take(200).collect();
            panic!("expected an error, got {v}")
        }
    }
}

/// A publish of `dev` as `fs` for `sandbox`, with a pod's fsGroup (2000).
pub fn req(sandbox: &str, dev: &str, fs: &str) -> pb::RuntimePublishVolumeRequest {
    pb::RuntimePublishVolumeRequest {
        sandbox_id: sandbox.into(),
        host_volume_id: dev.into(),
        host_target_path: "/var/lib/kubelet/pods/p/volumes/x".into(),
        file_system: fs.into(),
        fsgroup_gid: Some(2000),
        ..Default::default()
    }
}

/// What crustd records for the sandbox whose directory is `dir`
/// (`crustd.json`): no volumes when there is no record.
pub fn state(dir: &Path) -> serde_json::Value {
    match std::fs::read_to_string(dir.join("crustd.json")) {
        Ok(t) => serde_json::from_str(&t).unwrap(),
        Err(_) => serde_json::json!({"volumes": {}}),
    }
}

/// crustd's binary. See [`bin`].
pub fn crustd_bin() -> PathBuf {
    bin("crustd")
}

/// Runs crustd-ctl's command line with `args`; answers (exit code, stdout,
/// stderr), trimmed.
pub fn ctl(args: &[&str]) -> (u8, String, String) {
    let out = Command::new(bin("crustd-ctl")).args(args).output().unwrap();
    (
        out.status
            .code()
            .and_then(|c| u8::try_from(c).ok())
            .unwrap_or(u8::MAX),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

/// One of the crustd package's binaries (`crustd`, `crustd-ctl`) of this
/// build. Cargo builds them for crustd's own tests; for another package's
/// (the VM tests) they are built here, once per test process, with the same
/// profile, so they are never an older build. The nested cargo finds the
/// target directory as the outer one did (CARGO_TARGET_DIR, the
/// workspace's config). A test binary run by hand, outside cargo, uses those
/// it finds beside it as they are. `CRUST_TEST_CRUSTD_DIR` names another
/// directory holding them.
pub fn bin(name: &str) -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("CRUST_TEST_CRUSTD_DIR") {
            return PathBuf::from(d);
        }
        let dir = crate::build::profile_dir();
        // Cargo tells the tests it runs which package they belong to.
        let package = std::env::var("CARGO_PKG_NAME").ok();
        let by_hand = package.is_none() && dir.join("crustd").is_file();
        if package.as_deref() != Some("crustd") && !by_hand {
            crate::build::cargo_build("crustd", &["--bins"]);
        }
        dir
    });
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "no {name} at {} (cargo build -p crustd, or set CRUST_TEST_CRUSTD_DIR)",
        bin.display()
    );
    bin
}

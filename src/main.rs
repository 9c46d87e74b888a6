//! crust-agent's entry point: settings from flags (or, as PID 1, from the
//! kernel command line) → PID 1 duties → the volume table → one ttrpc
//! server per listen address → wait for Shutdown or SIGTERM → unmount all,
//! then exit (or power off, as PID 1).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crust_agent::notify::Target;
use crust_agent::rpc::limits::Limits;
use crust_agent::rpc::listen::{listen, Address, Peers};
use crust_agent::rpc::transport::Server;
use crust_agent::server::methods::table;
use crust_agent::server::service::Service;
use crust_agent::sys::sysfs::Sysfs;
use crust_agent::system::{self, Gate, Timeline};
use crust_agent::volumes::table::Volumes;
use crust_agent::{init, instance, keys, logging, notify};
use crust_protocols::sync::LockExt;
use slog::{error, info, warn};

/// Loaded before listening: PCI virtio and the vsock transport. Everything
/// else the initrd lists loads in the background once the agent listens.
const EARLY_MODULES: [&str; 2] = ["virtio_pci", "vmw_vsock_virtio_transport"];

/// How long answers in flight may take to leave once the agent stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// How long one readiness announcement may take (connect, then write).
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// Announcements tried before giving up (about 30 s with the pauses).
const NOTIFY_ATTEMPTS: u32 = 8;

const USAGE: &str = "\
usage: crust-agent [--listen ADDR]... [--root DIR] [--log-level LEVEL] [--log-format text|json]
                   [--vsock-peers PEERS] [--notify NOTIFY] [--on-sigterm unpublish|exit]
                   [--cdh-socket PATH] [--key-dir DIR]
  ADDR    vsock://-1:2857 (the default) | vsock://CID:PORT | unix:///path/to.sock (mode 0600)
  DIR     where volumes and binds live: DIR/volumes/<id>, DIR/state; default /run/crust
          (created 0700; one agent per DIR: a second one is refused)
  LEVEL   error | warn | info (the default) | debug
  PEERS   who may connect over vsock: host (CID 2, the default) | any | a list such as host,5
  NOTIFY  where to send READY=1 once listening (sd_notify): vsock-stream:CID:PORT | /path | @name;
          default $NOTIFY_SOCKET
  --on-sigterm  unpublish (the default): unmount every volume, then exit; exit: thaw what is
          frozen, flush, and exit leaving volumes and binds mounted for the next start to adopt
          (under a service manager: a restart keeps the pods' volumes; the guest's shutdown
          unmounts them)
  --cdh-socket  the Confidential Data Hub's ttrpc socket, which resolves an encrypted
          volume's key_uri kbs:///repository/type/tag (docs/encryption.md); default
          /run/confidential-containers/cdh.sock
  --key-dir  the only directory an encrypted volume's key_uri file:///path is read from;
          default /run/crust/keys
As PID 1 the same settings come from the kernel command line: crust.listen=,
crust.root=, crust.log=, crust.log_format=, crust.vsock_peers=, crust.notify=
(or systemd.set_credential=vmm.notify_socket:ADDR), crust.cdh_socket=, crust.key_dir=,
crust.modules=mod1,mod2.";

/// The agent's settings, from flags or the kernel command line.
#[derive(Debug, PartialEq, Eq)]
struct Config {
    listen: Vec<String>,
    root: PathBuf,
    level: slog::Level,
    format: logging::Format,
    modules: Vec<String>,
    vsock_peers: Peers,
    notify: Option<Target>,
    /// On SIGTERM, unpublish everything (true) or leave it for the next start.
    unpublish_on_sigterm: bool,
    /// Where encrypted volumes' keys are resolved from: the CDH's socket.
    keys: keys::resolve::Config,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: Vec::new(),
            root: PathBuf::from("/run/crust"),
            level: slog::Level::Info,
            format: logging::Format::Text,
            modules: Vec::new(),
            vsock_peers: Peers::default(),
            notify: None,
            unpublish_on_sigterm: true,
            keys: keys::resolve::Config::default(),
        }
    }
}

fn apply(cfg: &mut Config, key: &str, value: &str) -> Result<(), String> {
    match key {
        "listen" => {
            Address::parse(value)?;
            cfg.listen.push(value.to_string());
        }
        "root" => {
            if !Path::new(value).is_absolute() {
                return Err(format!("root {value:?} must be an absolute path"));
            }
            cfg.root = PathBuf::from(value);
        }
        "log-level" | "log" => {
            cfg.level = logging::parse_level(value).ok_or(format!(
                "log level {value:?} is not error, warn, info or debug"
            ))?
        }
        "log-format" | "log_format" => {
            cfg.format = logging::Format::parse(value)
                .ok_or(format!("log format {value:?} is not text or json"))?
        }
        "vsock-peers" | "vsock_peers" => cfg.vsock_peers = Peers::parse(value)?,
        "notify" => cfg.notify = Some(Target::parse(value)?),
        "on-sigterm" | "on_sigterm" => {
            cfg.unpublish_on_sigterm = match value {
                "unpublish" => true,
                "exit" => false,
                _ => return Err(format!("on-sigterm {value:?} is not unpublish or exit")),
            }
        }
        "cdh-socket" | "cdh_socket" => cfg.keys.cdh_socket = keys::resolve::cdh_socket(value)?,
        "key-dir" | "key_dir" => cfg.keys.key_dir = keys::resolve::key_dir(value)?,
        _ => return Err(format!("unknown setting {key:?}")),
    }
    Ok(())
}

/// Parses the flags of api.md §3. `Ok(None)` means help was printed.
fn parse_flags(args: &[String], cfg: &mut Config) -> Result<Option<()>, String> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (key, inline) = match a.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (a.as_str(), None),
        };
        match key {
            "-h" | "--help" => return Ok(None),
            "-V" | "--version" => {
                println!("crust-agent {}", env!("CARGO_PKG_VERSION"));
                return Ok(None);
            }
            "--listen" | "--root" | "--log-level" | "--log-format" | "--vsock-peers"
            | "--notify" | "--on-sigterm" | "--cdh-socket" | "--key-dir" => {
                let v = match inline {
                    Some(v) => v,
                    None => it.next().cloned().ok_or(format!("{key} needs a value"))?,
                };
                apply(cfg, &key[2..], &v)?;
            }
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    Ok(Some(()))
}

fn unix_path(addr: &str) -> Option<&Path> {
    addr.strip_prefix("unix://").map(Path::new)
}

/// Removes a socket an earlier run left at `p`, so bind can succeed. A
/// socket something still listens on is not stale (another agent serves
/// there) and anything that is not a socket is not ours: both are refused.
fn clear_stale_socket(p: &Path) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(p) {
        Err(_) => Ok(()),
        Ok(m) if !m.file_type().is_socket() => Err(format!(
            "{} exists and is not a socket: remove it or listen elsewhere",
            p.display()
        )),
        Ok(_) => match std::os::unix::net::UnixStream::connect(p) {
            Ok(_) => Err(format!(
                "something already listens on {}: stop it or listen elsewhere",
                p.display()
            )),
            // Nothing listens: what an earlier run left.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => std::fs::remove_file(p)
                .map_err(|e| format!("cannot remove the stale socket {}: {e}", p.display())),
            Err(e) => Err(format!(
                "cannot tell whether something listens on {} ({e}): not replacing it",
                p.display()
            )),
        },
    }
}

/// Tells whoever waits for the agent that it listens (`READY=1`, sd_notify
/// style, notify.rs), from a thread of its own so that serving never waits
/// for it; bounded attempts, the outcome logged.
fn announce_ready(target: Target, cfg: &Config, log: slog::Logger) {
    let message = format!(
        "READY=1\nSTATUS=crust-agent {} listening on {}\n",
        env!("CARGO_PKG_VERSION"),
        cfg.listen.join(",")
    );
    let spawned = std::thread::Builder::new()
        .name("notify".into())
        .spawn(move || {
            match notify::announce(&target, &message, NOTIFY_ATTEMPTS, NOTIFY_TIMEOUT) {
                Ok(n) => info!(log, "readiness announced"; "notify" => %target, "attempts" => n),
                Err(e) => warn!(log, "cannot announce readiness"; "notify" => %target,
                                "attempts" => NOTIFY_ATTEMPTS, "error" => %e),
            }
        });
    if spawned.is_err() {
        eprintln!("crust-agent: cannot start the readiness thread");
    }
}

/// As PID 1: the early mounts, then the kernel command line's `crust.*`
/// settings into `cfg`. Answers what could not be taken, for the log.
fn pid1_settings(cfg: &mut Config, timeline: &mut Timeline) -> Vec<String> {
    let mut warnings = init::early_mounts();
    timeline.mounts_done_ms = system::boottime_ms();
    // Bytes: one word that is not UTF-8 (another program's argument, say)
    // must not cost the agent every crust.* setting.
    let raw = std::fs::read("/proc/cmdline").unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&raw);
    if std::str::from_utf8(&raw).is_err() {
        warnings.push(
            "the kernel command line holds bytes that are not UTF-8; they were read as U+FFFD"
                .to_string(),
        );
    }
    let s = init::kernel_settings(&cmdline);
    let pairs = s
        .listen
        .iter()
        .map(|v| ("listen", v.clone()))
        .map(|(k, v): (&str, String)| (k, v))
        .chain(s.root.map(|v| ("root", v)))
        .chain(s.log.map(|v| ("log", v)))
        .chain(s.log_format.map(|v| ("log_format", v)))
        .chain(s.vsock_peers.map(|v| ("vsock_peers", v)))
        .chain(s.cdh_socket.map(|v| ("cdh_socket", v)))
        .chain(s.key_dir.map(|v| ("key_dir", v)))
        // crust.notify= wins over systemd's credential spelling of the same.
        .chain(s.notify.or(s.vmm_notify_socket).map(|v| ("notify", v)));
    for (k, v) in pairs {
        if let Err(e) = apply(cfg, k, &v) {
            warnings.push(format!("kernel command line: {e}; ignored"));
        }
    }
    cfg.modules = s.modules;
    warnings
}

/// The service manager's socket, as sd_notify(3) finds it; for PID 1 the
/// kernel passes NOTIFY_SOCKET= from its command line the same way.
fn notify_from_env(cfg: &mut Config, warnings: &mut Vec<String>) {
    if cfg.notify.is_some() {
        return;
    }
    if let Some(v) = std::env::var_os("NOTIFY_SOCKET") {
        match Target::parse(&v.to_string_lossy()) {
            Ok(t) => cfg.notify = Some(t),
            Err(e) => warnings.push(format!("NOTIFY_SOCKET: {e}; ignored")),
        }
    }
}

/// As PID 1: the vsock stack's modules now, so the agent listens as early
/// as it can; the rest (virtio_blk, xfs: the slow one) in a thread once it
/// listens, which opens `modules` when done.
fn load_modules(
    cfg: &Config,
    log: &slog::Logger,
    timeline: &Arc<Mutex<Timeline>>,
    modules: &Arc<Gate>,
) -> Box<dyn FnOnce() + Send> {
    let dir = Path::new("/lib/modules").join(system::kernel_release());
    let early: Vec<String> = EARLY_MODULES.iter().map(|m| m.to_string()).collect();
    let report = init::load_named(&dir, &early);
    for (m, why) in &report.failed {
        warn!(log, "module not loaded"; "module" => m, "error" => why);
    }
    let (log, timeline, modules, extra) = (
        log.clone(),
        timeline.clone(),
        modules.clone(),
        cfg.modules.clone(),
    );
    Box::new(move || {
        let spawned = std::thread::Builder::new()
            .name("modules".into())
            .spawn(move || {
                let report = init::load_modules(&dir, &extra);
                for (m, why) in &report.failed {
                    warn!(log, "module not loaded"; "module" => m, "error" => why);
                }
                let now = system::boottime_ms();
                timeline.locked().modules_loaded_ms = now;
                info!(log, "modules loaded"; "count" => report.loaded.len(), "boot_ms" => now);
                modules.open();
            });
        if spawned.is_err() {
            // Without the thread nothing would open the gate: requests then wait their bound and go on.
            eprintln!("crust-agent: cannot start the module loader thread");
        }
    })
}

fn main() -> ExitCode {
    // Whatever the agent creates (its root, state, sockets, mount points) is
    // for root alone, whatever umask it was started with; the modes it asks
    // for are narrower still where that matters (sockets 0600, the root 0700).
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    let agent_start_ms = system::boottime_ms();
    let started = Instant::now();
    let pid1 = rustix::process::getpid().is_init();
    let mut timeline = Timeline {
        agent_start_ms,
        ..Default::default()
    };
    // Signals are blocked before any thread exists, so only the signal thread receives them.
    init::block_signals();
    let mut cfg = Config::default();
    let mut early_warnings = Vec::new();
    if pid1 {
        init::install_panic_hook();
        early_warnings = pid1_settings(&mut cfg, &mut timeline);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse_flags(&args, &mut cfg) {
        Ok(Some(())) => {}
        Ok(None) => {
            if !args.iter().any(|a| a == "-V" || a == "--version") {
                println!("{USAGE}");
            }
            return ExitCode::SUCCESS;
        }
        Err(e) if !pid1 => {
            eprintln!("crust-agent: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
        Err(e) => early_warnings.push(format!("arguments: {e}; ignored")),
    }
    if cfg.listen.is_empty() {
        cfg.listen
            .push(format!("vsock://-1:{}", crust_protocols::DEFAULT_PORT));
    }
    notify_from_env(&mut cfg, &mut early_warnings);
    let log = logging::logger(cfg.format, cfg.level);
    info!(log, "crust-agent starting"; "version" => env!("CARGO_PKG_VERSION"), "pid1" => pid1,
          "root" => %cfg.root.display(), "listen" => cfg.listen.join(","),
          "vsock_peers" => %cfg.vsock_peers, "cdh_socket" => %cfg.keys.cdh_socket.display(),
          "notify" => cfg.notify.as_ref().map(|t| t.to_string()).unwrap_or_default());
    for w in &early_warnings {
        warn!(log, "{}", w);
    }
    let timeline = Arc::new(Mutex::new(timeline));
    let modules = Arc::new(Gate::new(!pid1));
    let after_listening = pid1.then(|| load_modules(&cfg, &log, &timeline, &modules));

    // As PID 1, exiting (or unwinding out of main) would panic the kernel:
    // whatever happens, the guest ends in an orderly power-off.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(&cfg, &log, started, timeline, modules, after_listening)
    }));
    let code = outcome.unwrap_or_else(|_| {
        error!(log, "the agent failed unexpectedly (see the panic above)");
        ExitCode::FAILURE
    });
    if pid1 {
        info!(log, "powering off");
        init::power_off();
    }
    code
}

fn run(
    cfg: &Config,
    log: &slog::Logger,
    started: Instant,
    timeline: Arc<Mutex<Timeline>>,
    modules: Arc<Gate>,
    after_listening: Option<Box<dyn FnOnce() + Send>>,
) -> ExitCode {
    // One agent per root, held for the life of the process: taken before the
    // table is opened, so a refused agent has touched nothing.
    let _root_lock = match instance::lock_root(&cfg.root) {
        Ok(l) => l,
        Err(e) => {
            error!(log, "cannot take the root"; "root" => %cfg.root.display(), "error" => %e);
            return ExitCode::FAILURE;
        }
    };
    let volumes = match Volumes::open_with_keys(
        &cfg.root,
        Sysfs::system(),
        log.clone(),
        cfg.keys.clone(),
    ) {
        Ok(v) => v,
        Err(e) => {
            error!(log, "cannot open the volume table"; "root" => %cfg.root.display(), "error" => %e);
            return ExitCode::FAILURE;
        }
    };
    let (tx, rx) = mpsc::channel::<()>();
    let service = Arc::new(Service::new(
        volumes.clone(),
        log.clone(),
        started,
        timeline.clone(),
        tx.clone(),
        modules,
    ));
    let (listeners, made) = open_listeners(cfg, log);
    if listeners.is_empty() {
        error!(
            log,
            "no listener could be started; the agent cannot be reached"
        );
        volumes.shutdown();
        return ExitCode::FAILURE;
    }
    let Some(server) = serve(cfg, log, listeners, service) else {
        volumes.shutdown();
        return ExitCode::FAILURE;
    };
    note_listening(&timeline, log);
    if let Some(f) = after_listening {
        f();
    }
    if let Some(target) = cfg.notify.clone() {
        announce_ready(target, cfg, log.clone());
    }
    let by_signal = wait_for_the_end(&tx, &rx);
    wind_down(cfg, log, &volumes, server, &made, by_signal)
}

/// A listening socket for each address of `--listen` that can have one
/// (the others are logged), and the unix sockets made, which the agent
/// removes when it stops.
fn open_listeners(cfg: &Config, log: &slog::Logger) -> (Vec<(String, OwnedFd)>, Vec<PathBuf>) {
    let mut listeners = Vec::new();
    let mut made: Vec<PathBuf> = Vec::new();
    for addr in &cfg.listen {
        if let Some(p) = unix_path(addr) {
            if let Err(e) = clear_stale_socket(p) {
                error!(log, "cannot listen"; "listen" => addr, "error" => e);
                continue;
            }
        }
        match Address::parse(addr).and_then(|a| listen(&a).map_err(|e| e.to_string())) {
            Ok(fd) => {
                made.extend(unix_path(addr).map(Path::to_path_buf));
                listeners.push((addr.clone(), fd))
            }
            Err(e) => error!(log, "cannot listen"; "listen" => addr, "error" => %e),
        }
    }
    (listeners, made)
}

/// Serves the method table on `listeners` within the default limits; None
/// (logged) if the server cannot start.
fn serve(
    cfg: &Config,
    log: &slog::Logger,
    listeners: Vec<(String, OwnedFd)>,
    service: Arc<Service>,
) -> Option<Server> {
    let limits = Limits::default();
    info!(log, "serving"; "max_connections" => limits.max_connections, "workers" => limits.workers,
          "quick_workers" => limits.quick_workers, "queue" => limits.queue,
          "in_flight_per_connection" => limits.in_flight_per_connection,
          "max_request_bytes" => limits.max_request);
    match Server::start(
        listeners,
        table(service),
        limits,
        cfg.vsock_peers.clone(),
        log.clone(),
        SHUTDOWN_GRACE,
    ) {
        Ok(s) => Some(s),
        Err(e) => {
            error!(log, "cannot serve"; "error" => %e);
            None
        }
    }
}

/// Records and logs when the agent began to listen, since boot and since it started.
fn note_listening(timeline: &Mutex<Timeline>, log: &slog::Logger) {
    let listening_ms = system::boottime_ms();
    let mut t = timeline.locked();
    t.listening_ms = listening_ms;
    info!(log, "listening"; "agent_ms" => listening_ms.saturating_sub(t.agent_start_ms),
              "boot_ms" => listening_ms);
}

/// Waits for a Shutdown request (on `rx`) or a signal: whether it was a signal.
fn wait_for_the_end(tx: &mpsc::Sender<()>, rx: &mpsc::Receiver<()>) -> bool {
    let signal_tx = tx.clone();
    let signalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let by_signal = signalled.clone();
    init::start_reaper_and_signals(move || {
        by_signal.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = signal_tx.send(());
    });
    let _ = rx.recv();
    signalled.load(std::sync::atomic::Ordering::SeqCst)
}

/// After a Shutdown request or a signal: every volume unpublished (nothing
/// left after a Shutdown request), or, on SIGTERM with `--on-sigterm exit`,
/// everything left mounted for the next start; then the server stopped,
/// its sockets removed, the disks flushed.
fn wind_down(
    cfg: &Config,
    log: &slog::Logger,
    volumes: &Volumes,
    server: Server,
    made: &[PathBuf],
    by_signal: bool,
) -> ExitCode {
    if by_signal && !cfg.unpublish_on_sigterm {
        // Nothing is left frozen (no timer would end it), no freeze or
        // scheduled trim starts in the server's grace, and what is written
        // is on the disks.
        let n = volumes.close_freezes();
        info!(log, "exiting, volumes left mounted for the next start"; "thawed" => n);
    } else {
        let n = volumes.shutdown();
        info!(log, "shutting down"; "volumes_unmounted_now" => n);
    }
    // Answers in flight (the Shutdown response among them) leave within the grace.
    server.shutdown();
    for p in made {
        let _ = std::fs::remove_file(p);
    }
    rustix::fs::sync();
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn flags() {
        let mut c = Config::default();
        parse_flags(
            &args(&[
                "--listen",
                "unix:///tmp/a.sock",
                "--listen=vsock://-1:1024",
                "--root",
                "/tmp/r",
                "--log-level",
                "debug",
                "--log-format=json",
                "--vsock-peers",
                "host,7",
                "--notify=vsock-stream:2:1025",
                "--cdh-socket",
                "/run/cdh.sock",
            ]),
            &mut c,
        )
        .unwrap();
        assert!(c.vsock_peers.allows(2) && c.vsock_peers.allows(7) && !c.vsock_peers.allows(1));
        assert_eq!(
            c.notify,
            Some(Target::parse("vsock-stream:2:1025").unwrap())
        );
        // The default: the host alone.
        let d = Config::default();
        assert!(d
            .vsock_peers
            .allows(crust_agent::rpc::listen::VMADDR_CID_HOST));
        for cid in [0, 1, 3, 4, u32::MAX] {
            assert!(!d.vsock_peers.allows(cid), "{cid}");
        }
        assert_eq!(c.listen, vec!["unix:///tmp/a.sock", "vsock://-1:1024"]);
        assert_eq!(c.root, PathBuf::from("/tmp/r"));
        assert_eq!(c.level, slog::Level::Debug);
        assert_eq!(c.format, logging::Format::Json);
        assert_eq!(c.keys.cdh_socket, PathBuf::from("/run/cdh.sock"));
        assert_eq!(
            Config::default().keys.cdh_socket,
            PathBuf::from("/run/confidential-containers/cdh.sock")
        );
        for bad in [
            &["--listen"][..],
            &["--listen", "tcp://x:1"],
            &["--listen", "unix://rel"],
            &["--listen", "vsock://x:1"],
            &["--root", "rel"],
            &["--log-level", "loud"],
            &["--log-format", "xml"],
            &["--vsock-peers", "nobody"],
            &["--vsock-peers", "host,"],
            &["--notify", "vsock-dgram:2:1"],
            &["--on-sigterm", "stay"],
            &["--cdh-socket", "cdh.sock"],
            &["--cdh-socket"],
            &["--frob"],
        ] {
            assert!(
                parse_flags(&args(bad), &mut Config::default()).is_err(),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_flags(&args(&["--help"]), &mut Config::default()),
            Ok(None)
        );
        let mut c = Config::default();
        assert!(c.unpublish_on_sigterm);
        parse_flags(&args(&["--on-sigterm=exit"]), &mut c).unwrap();
        assert!(!c.unpublish_on_sigterm);
    }
}

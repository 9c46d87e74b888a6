//! crust-agent's entry point: settings from flags (or, as PID 1, from the
//! kernel command line) → PID 1 duties → the volume table → one ttrpc
//! server per listen address → wait for Shutdown or SIGTERM → unmount all,
//! then exit (or power off, as PID 1).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crust_agent::device::Sysfs;
use crust_agent::server::Service;
use crust_agent::system::{self, Gate, Timeline};
use crust_agent::volumes::Volumes;
use crust_agent::{init, logging, rpc};
use crust_protocols::crust_ttrpc;
use slog::{error, info, warn};

/// Loaded before listening: PCI virtio and the vsock transport. Everything
/// else the initrd lists loads in the background once the agent listens.
const EARLY_MODULES: [&str; 2] = ["virtio_pci", "vmw_vsock_virtio_transport"];

/// How long answers in flight may take to leave once the agent stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

const USAGE: &str = "\
usage: crust-agent [--listen ADDR]... [--root DIR] [--log-level LEVEL] [--log-format text|json]
  ADDR   vsock://-1:1024 (the default) | vsock://CID:PORT | unix:///path/to.sock
  DIR    where volumes and binds live: DIR/volumes/<id>, DIR/state; default /run/crust
  LEVEL  error | warn | info (the default) | debug
As PID 1 the same settings come from the kernel command line: crust.listen=,
crust.root=, crust.log=, crust.log_format=, crust.modules=mod1,mod2.";

/// The agent's settings, from flags or the kernel command line.
#[derive(Debug, PartialEq, Eq)]
struct Config {
    listen: Vec<String>,
    root: PathBuf,
    level: slog::Level,
    format: logging::Format,
    modules: Vec<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: Vec::new(),
            root: PathBuf::from("/run/crust"),
            level: slog::Level::Info,
            format: logging::Format::Text,
            modules: Vec::new(),
        }
    }
}

fn apply(cfg: &mut Config, key: &str, value: &str) -> Result<(), String> {
    match key {
        "listen" => {
            rpc::Address::parse(value)?;
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
            "--listen" | "--root" | "--log-level" | "--log-format" => {
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

fn main() -> ExitCode {
    let agent_start_ms = system::boottime_ms();
    let started = Instant::now();
    let pid1 = rustix::process::getpid().is_init();
    let mut timeline = Timeline {
        agent_start_ms,
        ..Default::default()
    };
    // Signals are blocked before any thread exists, so only the signal thread receives them.
    init::block_signals();
    let mut early_warnings = Vec::new();
    let mut cfg = Config::default();
    if pid1 {
        init::install_panic_hook();
        early_warnings = init::early_mounts();
        timeline.mounts_done_ms = system::boottime_ms();
        let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
        let s = init::kernel_settings(&cmdline);
        let pairs = s
            .listen
            .iter()
            .map(|v| ("listen", v.clone()))
            .map(|(k, v): (&str, String)| (k, v))
            .chain(s.root.map(|v| ("root", v)))
            .chain(s.log.map(|v| ("log", v)))
            .chain(s.log_format.map(|v| ("log_format", v)));
        for (k, v) in pairs {
            if let Err(e) = apply(&mut cfg, k, &v) {
                early_warnings.push(format!("kernel command line: {e}; ignored"));
            }
        }
        cfg.modules = s.modules;
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
        cfg.listen.push("vsock://-1:1024".to_string());
    }
    let log = logging::logger(cfg.format, cfg.level);
    info!(log, "crust-agent starting"; "version" => env!("CARGO_PKG_VERSION"), "pid1" => pid1,
          "root" => %cfg.root.display(), "listen" => cfg.listen.join(","));
    for w in &early_warnings {
        warn!(log, "{}", w);
    }
    let timeline = Arc::new(Mutex::new(timeline));
    let modules = Arc::new(Gate::new(!pid1));
    let mut after_listening: Option<Box<dyn FnOnce() + Send>> = None;
    if pid1 {
        let dir = Path::new("/lib/modules").join(system::kernel_release());
        // The vsock stack first, so the agent listens as early as it can;
        // disks and filesystems (virtio_blk, xfs: the slow one) load after.
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
        after_listening =
            Some(Box::new(move || {
                let spawned = std::thread::Builder::new().name("modules".into()).spawn(move || {
                let report = init::load_modules(&dir, &extra);
                for (m, why) in &report.failed {
                    warn!(log, "module not loaded"; "module" => m, "error" => why);
                }
                let now = system::boottime_ms();
                timeline.lock().unwrap_or_else(|p| p.into_inner()).modules_loaded_ms = now;
                info!(log, "modules loaded"; "count" => report.loaded.len(), "boot_ms" => now);
                modules.open();
            });
                if spawned.is_err() {
                    // Without the thread nothing would open the gate: requests then wait their bound and go on.
                    eprintln!("crust-agent: cannot start the module loader thread");
                }
            }));
    }

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
    let volumes = match Volumes::open(&cfg.root, Sysfs::system(), log.clone()) {
        Ok(v) => Arc::new(v),
        Err(e) => {
            error!(log, "cannot open the volume table"; "root" => %cfg.root.display(), "error" => %e);
            return ExitCode::FAILURE;
        }
    };
    let (tx, rx) = mpsc::channel::<()>();
    let service: Arc<dyn crust_ttrpc::Agent + Send + Sync> = Arc::new(Service::new(
        volumes.clone(),
        log.clone(),
        started,
        timeline.clone(),
        tx.clone(),
        modules,
    ));
    let mut listeners = Vec::new();
    for addr in &cfg.listen {
        if let Some(p) = unix_path(addr) {
            use std::os::unix::fs::FileTypeExt;
            // A socket left by an earlier run would make bind fail; anything else is not ours to remove.
            if std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket()) {
                let _ = std::fs::remove_file(p);
            }
        }
        match rpc::Address::parse(addr).and_then(|a| rpc::listen(&a).map_err(|e| e.to_string())) {
            Ok(fd) => listeners.push((addr.clone(), fd)),
            Err(e) => error!(log, "cannot listen"; "listen" => addr, "error" => %e),
        }
    }
    if listeners.is_empty() {
        error!(
            log,
            "no listener could be started; the agent cannot be reached"
        );
        volumes.shutdown();
        return ExitCode::FAILURE;
    }
    let limits = rpc::Limits::default();
    info!(log, "serving"; "max_connections" => limits.max_connections, "workers" => limits.workers,
          "quick_workers" => limits.quick_workers, "queue" => limits.queue,
          "in_flight_per_connection" => limits.in_flight_per_connection,
          "max_request_bytes" => limits.max_request);
    let server = match rpc::Server::start(
        listeners,
        crust_ttrpc::create_agent(service),
        limits,
        log.clone(),
        SHUTDOWN_GRACE,
    ) {
        Ok(s) => s,
        Err(e) => {
            error!(log, "cannot serve"; "error" => %e);
            volumes.shutdown();
            return ExitCode::FAILURE;
        }
    };
    let listening_ms = system::boottime_ms();
    {
        let mut t = timeline.lock().unwrap_or_else(|p| p.into_inner());
        t.listening_ms = listening_ms;
        info!(log, "listening"; "agent_ms" => listening_ms.saturating_sub(t.agent_start_ms),
              "boot_ms" => listening_ms);
    }
    if let Some(f) = after_listening {
        f();
    }
    let signal_tx = tx.clone();
    init::start_reaper_and_signals(move || {
        let _ = signal_tx.send(());
    });
    let _ = rx.recv();
    // After a Shutdown request this finds nothing left; after a signal it does the work.
    let n = volumes.shutdown();
    info!(log, "shutting down"; "volumes_unmounted_now" => n);
    // Answers in flight (the Shutdown response among them) leave within the grace.
    server.shutdown();
    for addr in &cfg.listen {
        if let Some(p) = unix_path(addr) {
            let _ = std::fs::remove_file(p);
        }
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
            ]),
            &mut c,
        )
        .unwrap();
        assert_eq!(c.listen, vec!["unix:///tmp/a.sock", "vsock://-1:1024"]);
        assert_eq!(c.root, PathBuf::from("/tmp/r"));
        assert_eq!(c.level, slog::Level::Debug);
        assert_eq!(c.format, logging::Format::Json);
        for bad in [
            &["--listen"][..],
            &["--listen", "tcp://x:1"],
            &["--listen", "unix://rel"],
            &["--listen", "vsock://x:1"],
            &["--root", "rel"],
            &["--log-level", "loud"],
            &["--log-format", "xml"],
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
    }
}

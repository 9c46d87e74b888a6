//! `crustd`: serves KEP-2857's RuntimeAssistedStorageManagement on a unix
//! socket for every sandbox in `--sandboxes DIR`. Ends on SIGTERM or SIGINT
//! after the calls in flight have finished.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener as StdListener, UnixStream as StdStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use crustd::pb::runtime_assisted_storage_management_server::RuntimeAssistedStorageManagementServer;
use crustd::service::Service;
use crustd::volumes::{Config, Crustd};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

#[derive(Parser)]
#[command(
    name = "crustd",
    version,
    about = "KEP-2857 CRUST for microVM sandboxes: kubelet's RuntimeAssistedStorageManagement over gRPC, done with QMP and crust-agent"
)]
struct Cli {
    /// The unix socket to serve (the one a RuntimeClass names).
    #[arg(long, env = "CRUSTD_SOCKET", default_value = "/run/crust/crustd.sock")]
    socket: PathBuf,
    /// The sandbox registry: DIR/<sandbox>/sandbox.json.
    #[arg(long, env = "CRUSTD_SANDBOXES", default_value = "/run/crust/sandboxes")]
    sandboxes: PathBuf,
    /// Seconds an agent call may take (a publish: when the caller sent no
    /// grpc-timeout; with one, the caller's deadline less a margin).
    #[arg(long, default_value_t = 30)]
    agent_timeout: u64,
    /// Seconds the agent may wait for a hot-plugged disk to appear or grow.
    #[arg(long, default_value_t = 30)]
    device_wait: u64,
    /// Seconds one QMP reply may take.
    #[arg(long, default_value_t = 10)]
    qmp_timeout: u64,
    /// Seconds the guest may take to release a disk after device_del.
    #[arg(long, default_value_t = 60)]
    unplug_timeout: u64,
    /// Where CSI drivers file Kata's direct-volume records (ROOT/<base64 of the volume path>/mountInfo.json).
    #[arg(long, env = "CRUSTD_DIRECT_VOLUMES", default_value = crustd::direct::DEFAULT_ROOT)]
    direct_volumes: PathBuf,
    /// Seconds blkid or mkfs may take for createFilesystem.
    #[arg(long, default_value_t = 300)]
    mkfs_timeout: u64,
    /// Also find Kata Containers' sandboxes, with no sandbox.json, from
    /// Kata's files under this directory (its runtime's /run/vc):
    /// sbs/<id>/persist.json for the agent's vsock address, and QEMU's
    /// extra monitor vm/<id>/extra-monitor.sock (Kata's QEMU configuration
    /// needs enable_debug = true and extra_monitor_socket = "qmp").
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = crustd::kata::DEFAULT_RUN)]
    kata_runtime_dir: Option<PathBuf>,
    /// The port crust-agent listens on in Kata's guests (beside kata-agent's 1024).
    #[arg(long, default_value_t = crust_protocols::DEFAULT_PORT)]
    kata_agent_port: u32,
}

/// Binds `path`, mode 0600 whatever the umask, replacing only a stale
/// socket: a live crustd's socket, and anything that is not a socket (a
/// file, a directory, a symlink), are refused and left as they are.
/// Runs before the runtime's threads exist, as the umask is process-wide.
fn bind(path: &Path) -> Result<StdListener, String> {
    if let Some(dir) = path.parent() {
        // 0755 at most (the umask can only take bits away).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot look at {}: {e}", path.display())),
        Ok(md) if md.file_type().is_socket() => match StdStream::connect(path) {
            Ok(_) => {
                return Err(format!(
                    "{} is in use: another crustd serves it; stop it or choose another --socket",
                    path.display()
                ))
            }
            // Nobody listens: a socket left by a crustd that was killed.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(|e| {
                    format!("cannot remove the stale socket {}: {e}", path.display())
                })?
            }
            Err(e) => {
                return Err(format!(
                    "{} is a socket crustd cannot test ({e}); remove it yourself if it is stale, or choose another --socket",
                    path.display()
                ))
            }
        },
        Ok(md) => {
            let ft = md.file_type();
            let kind = if ft.is_symlink() {
                "a symbolic link"
            } else if ft.is_dir() {
                "a directory"
            } else if ft.is_file() {
                "a regular file"
            } else {
                "not a socket"
            };
            return Err(format!(
                "{} exists and is {kind}: crustd replaces only a stale socket there; remove it yourself or choose another --socket",
                path.display()
            ));
        }
    }
    // The socket is created 0600: only root (kubelet) may drive crustd.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = StdListener::bind(path);
    rustix::process::umask(old);
    let l = bound.map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    l.set_nonblocking(true)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    Ok(l)
}

/// The socket file's identity, so that only our own is removed at exit.
fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| (m.dev(), m.ino()))
}

fn log_line(v: serde_json::Value) {
    let mut text = v.to_string();
    text.push('\n');
    let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
}

async fn serve(cli: Cli, listener: StdListener) -> Result<(), String> {
    let mut cfg = Config::new(&cli.sandboxes);
    cfg.agent_timeout = Duration::from_secs(cli.agent_timeout);
    cfg.device_wait = Duration::from_secs(cli.device_wait);
    cfg.qmp_timeout = Duration::from_secs(cli.qmp_timeout);
    cfg.unplug_timeout = Duration::from_secs(cli.unplug_timeout);
    cfg.direct_volumes = cli.direct_volumes.clone();
    cfg.mkfs_timeout = Duration::from_secs(cli.mkfs_timeout);
    cfg.kata = cli
        .kata_runtime_dir
        .clone()
        .map(|run| crustd::registry::Kata {
            run,
            port: cli.kata_agent_port,
        });
    let ours = identity(&cli.socket);
    let listener = UnixListener::from_std(listener)
        .map_err(|e| format!("cannot listen on {}: {e}", cli.socket.display()))?;
    let crustd = Arc::new(Crustd::new(cfg));
    // Every recorded volume's device claimed and held again before any call.
    let c = crustd.clone();
    let failed = tokio::task::spawn_blocking(move || c.recover())
        .await
        .map_err(|e| format!("recovering the sandboxes' records: {e}"))?;
    for (key, e) in failed {
        log_line(serde_json::json!({
            "msg": "a recorded volume's device is not claimed and held",
            "sandbox": key.sandbox,
            "host_volume": key.host_volume,
            "code": e.code().name(),
            "error": e.to_string(),
        }));
    }
    // The groups the crustd before left: each live one's timer re-armed.
    let c = crustd.clone();
    let refused = tokio::task::spawn_blocking(move || c.recover_freezes())
        .await
        .map_err(|e| format!("recovering the freeze records: {e}"))?;
    for why in refused {
        log_line(serde_json::json!({
            "msg": "a freeze record is not used",
            "error": why.to_string(),
        }));
    }
    // Reported, not forgotten: an Unpublish frees each of their volumes.
    let c = crustd.clone();
    let dead = match tokio::task::spawn_blocking(move || c.dead_sandboxes()).await {
        Ok(d) => d,
        Err(e) => {
            // Only a report: crustd serves without it, and says so.
            log_line(serde_json::json!({
                "msg": "looking for sandboxes whose VM is gone failed; none are reported",
                "error": e.to_string(),
            }));
            Vec::new()
        }
    };
    for (sandbox, why, volumes) in dead {
        log_line(serde_json::json!({
            "msg": "a sandbox's VM is gone; its volumes stay recorded until unpublished",
            "sandbox": sandbox,
            "why": why,
            "host_volumes": volumes,
        }));
    }
    let service = Service::new(crustd);
    log_line(serde_json::json!({
        "msg": "crustd serving",
        "socket": cli.socket,
        "sandboxes": cli.sandboxes,
        "direct_volumes": cli.direct_volumes,
        "version": env!("CARGO_PKG_VERSION"),
    }));
    let stop = async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    let served = tonic::transport::Server::builder()
        .add_service(RuntimeAssistedStorageManagementServer::new(service))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
        .await;
    // Only the socket this crustd made: another may have replaced it since.
    if ours.is_some() && identity(&cli.socket) == ours {
        let _ = std::fs::remove_file(&cli.socket);
    }
    served.map_err(|e| format!("serving {}: {e}", cli.socket.display()))
}

/// Raises the soft limit on open files to the hard one (systemd's default
/// soft limit is 1,024, the hard 524,288): every sandbox's calls use a few,
/// and what one sandbox can hold is bounded far below either (`calls`).
/// Answers (soft before, soft now).
fn raise_open_files() -> std::io::Result<(Option<u64>, Option<u64>)> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    let before = l.current;
    if l.current < l.maximum {
        l.current = l.maximum;
        setrlimit(Resource::Nofile, l)?;
    }
    Ok((before, getrlimit(Resource::Nofile).current))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match raise_open_files() {
        Ok((before, now)) if before != now => log_line(serde_json::json!({
            "msg": "raised the soft limit on open files to the hard limit",
            "from": before,
            "to": now,
        })),
        Ok(_) => {}
        Err(e) => log_line(serde_json::json!({
            "msg": "cannot raise the soft limit on open files",
            "error": e.to_string(),
        })),
    }
    let listener = match bind(&cli.socket) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("crustd: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A thread for every call at work, up to the node's bound (`calls`).
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(crustd::calls::IN_FLIGHT + 64)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("crustd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(cli, listener)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crustd: {e}");
            ExitCode::FAILURE
        }
    }
}

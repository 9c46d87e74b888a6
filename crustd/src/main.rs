//! `crustd`: serves KEP-2857's RuntimeAssistedStorageManagement on a unix
//! socket for every sandbox in `--sandboxes DIR`. Ends on SIGTERM or SIGINT
//! after the calls in flight have finished.

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
    /// Seconds an agent call may take.
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
}

/// Binds `path`, replacing a stale socket but never a live crustd's.
fn bind(path: &Path) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!(
                "{} is in use: another crustd serves it; stop it or choose another --socket",
                path.display()
            ));
        }
        std::fs::remove_file(path)
            .map_err(|e| format!("cannot remove the stale socket {}: {e}", path.display()))?;
    }
    UnixListener::bind(path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))
}

async fn serve(cli: Cli) -> Result<(), String> {
    let mut cfg = Config::new(&cli.sandboxes);
    cfg.agent_timeout = Duration::from_secs(cli.agent_timeout);
    cfg.device_wait = Duration::from_secs(cli.device_wait);
    cfg.qmp_timeout = Duration::from_secs(cli.qmp_timeout);
    cfg.unplug_timeout = Duration::from_secs(cli.unplug_timeout);
    let listener = bind(&cli.socket)?;
    let service = Service::new(Arc::new(Crustd::new(cfg)));
    eprintln!(
        "{}",
        serde_json::json!({
            "msg": "crustd serving",
            "socket": cli.socket,
            "sandboxes": cli.sandboxes,
            "version": env!("CARGO_PKG_VERSION"),
        })
    );
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
    let _ = std::fs::remove_file(&cli.socket);
    served.map_err(|e| format!("serving {}: {e}", cli.socket.display()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("crustd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crustd: {e}");
            ExitCode::FAILURE
        }
    }
}

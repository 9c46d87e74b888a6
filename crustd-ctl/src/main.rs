//! `crustd-ctl`: what kubelet sends crustd, from a shell. One command per
//! CRUST call; answers are printed as JSON. Exit status: 0 success, 1 crustd
//! answered with an error (`error: CODE: message` on stderr), 2 usage, 3 no
//! connection.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use crustd_ctl::{code_name, pb, Kubelet};
use serde_json::{json, Value};

#[derive(Parser)]
#[command(
    name = "crustd-ctl",
    about = "Call crustd's CRUST service as kubelet would"
)]
struct Cli {
    /// crustd's unix socket.
    #[arg(long, env = "CRUSTD_SOCKET", default_value = "/run/crust/crustd.sock")]
    socket: PathBuf,
    /// Seconds a call may take.
    #[arg(long, default_value_t = 180)]
    timeout: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// RuntimeGetCapabilities.
    Capabilities,
    /// RuntimeGetSupportedFileSystems.
    Filesystems,
    /// RuntimePublishVolume: hot-plug the host device into the sandbox and mount it there.
    Publish {
        sandbox: String,
        /// The host block device, e.g. /dev/loop3.
        volume: String,
        /// ext4 or xfs (empty with --block).
        #[arg(long, default_value = "")]
        fs: String,
        /// Mount option (repeatable).
        #[arg(short = 'o', long = "option")]
        options: Vec<String>,
        #[arg(long)]
        fs_group: Option<i64>,
        /// Always or OnRootMismatch.
        #[arg(long, default_value = "")]
        fs_group_policy: String,
        #[arg(long)]
        read_only: bool,
        #[arg(long)]
        block: bool,
        /// Where kubelet would have mounted it on the host (recorded only).
        #[arg(long, default_value = "")]
        target: String,
    },
    /// RuntimeUnpublishVolume.
    Unpublish { sandbox: String, volume: String },
    /// RuntimeGetVolumeStats.
    Stats { sandbox: String, volume: String },
    /// RuntimeExpandVolume.
    Expand {
        sandbox: String,
        volume: String,
        /// Bytes the filesystem must hold (0: whatever the device has).
        #[arg(long, default_value_t = 0)]
        bytes: i64,
    },
}

fn run(k: &Kubelet, cmd: Cmd) -> Result<Value, tonic::Status> {
    Ok(match cmd {
        Cmd::Capabilities => {
            let caps: Vec<String> = k
                .capabilities()?
                .capabilities
                .iter()
                .filter_map(|c| {
                    let pb::runtime_capability::Type::Rpc(r) = c.r#type.as_ref()?;
                    Some(r.r#type().as_str_name().to_string())
                })
                .collect();
            json!({ "capabilities": caps })
        }
        Cmd::Filesystems => json!({ "file_systems": k.file_systems()?.file_systems }),
        Cmd::Publish {
            sandbox,
            volume,
            fs,
            options,
            fs_group,
            fs_group_policy,
            read_only,
            block,
            target,
        } => {
            let r = k.publish(pb::RuntimePublishVolumeRequest {
                sandbox_id: sandbox,
                host_volume_id: volume,
                host_target_path: target,
                file_system: fs,
                mount_options: options,
                fsgroup_gid: fs_group,
                fsgroup_policy: fs_group_policy,
                read_only,
                block,
            })?;
            json!({ "guest_path": r.guest_path })
        }
        Cmd::Unpublish { sandbox, volume } => {
            k.unpublish(&sandbox, &volume)?;
            json!({})
        }
        Cmd::Stats { sandbox, volume } => {
            let s = k.stats(&sandbox, &volume)?;
            let usage: Vec<Value> = s
                .usage
                .iter()
                .map(|u| {
                    json!({"unit": u.unit().as_str_name(), "available": u.available,
                           "total": u.total, "used": u.used})
                })
                .collect();
            let c = s.volume_condition.unwrap_or_default();
            json!({ "usage": usage, "volume_condition": {"abnormal": c.abnormal, "message": c.message} })
        }
        Cmd::Expand {
            sandbox,
            volume,
            bytes,
        } => json!({ "capacity_bytes": k.expand(&sandbox, &volume, bytes)? }),
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let k = match Kubelet::connect(&cli.socket, Duration::from_secs(cli.timeout)) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(3);
        }
    };
    match run(&k, cli.cmd) {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(s) => {
            eprintln!("error: {}: {}", code_name(s.code()), s.message());
            ExitCode::from(1)
        }
    }
}

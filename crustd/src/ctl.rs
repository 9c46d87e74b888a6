//! The `crustd-ctl` command line: what kubelet sends crustd, from a shell. One command per
//! CRUST call; answers are printed as JSON. And `direct-volume
//! add|remove|stats|resize --volume-path P`, the verbs and flags of
//! `kata-runtime direct-volume`, on the records CSI drivers write for Kata,
//! with `publish-direct`, the runtime's call. Exit status: 0 success, 1
//! crustd answered with an error, or a record is refused or in no sandbox
//! (`error: CODE: message` on stderr), 2 usage, 3 no connection.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use crust_kubelet::{code_name, pb, Kubelet};

use crate::devices::Key;
use crate::direct::{Records, SandboxOf};
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
    /// Seconds a call may take: sent to crustd as the call's deadline
    /// (grpc-timeout), as kubelet sends one.
    #[arg(long, default_value_t = 180)]
    timeout: u64,
    /// Where direct-volume records are filed (crustd's --direct-volumes).
    #[arg(long, env = "CRUSTD_DIRECT_VOLUMES", default_value = crate::direct::DEFAULT_ROOT)]
    direct_volumes: PathBuf,
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
        /// Format the device first if it is provably blank (never anything else).
        #[arg(long)]
        create_file_system: bool,
    },
    /// RuntimePublishDirectVolume: publish the volume whose direct-volume record is filed under the path.
    PublishDirect {
        sandbox: String,
        /// The volume path the record is filed under (the CSI target path).
        #[arg(long)]
        volume_path: String,
        #[arg(long)]
        read_only: bool,
    },
    /// Kata's direct-assigned volume records, as `kata-runtime direct-volume`.
    #[command(subcommand)]
    DirectVolume(Direct),
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
    /// RuntimeFreezeVolumes: freeze volumes across sandboxes, all or none;
    /// prints the group's freeze_id, which thaws it, and when it ends by itself.
    Freeze {
        /// SANDBOX:HOST_VOLUME, e.g. pod-a:/dev/loop3 (1 to 64).
        #[arg(required = true, value_parser = volume_ref)]
        volumes: Vec<Key>,
        /// Seconds after which the guests and crustd thaw by themselves (default 60, at most 600).
        #[arg(long, default_value_t = 0)]
        thaw_after: u32,
        /// The group's id, chosen by the caller (new each time: a retry of
        /// the same freeze answers it again); crustd makes one otherwise.
        #[arg(long)]
        freeze_id: Option<String>,
    },
    /// RuntimeThawVolumes: end a group by its freeze_id (ABORTED, exit 1,
    /// when a part of it ended first: the snapshot may be torn).
    Thaw {
        /// The freeze_id `crustd-ctl freeze` printed.
        #[arg(required_unless_present = "force", conflicts_with = "force")]
        freeze_id: Option<String>,
        /// Instead, end whatever freeze holds these volumes (an operator's
        /// way out; each group it ends hears of it at its own thaw).
        #[arg(long, num_args = 1.., value_parser = volume_ref, value_name = "SANDBOX:HOST_VOLUME")]
        force: Vec<Key>,
    },
    /// RuntimeTrimVolume: give the volume's free space back to the host's device.
    Trim {
        sandbox: String,
        volume: String,
        #[arg(long, default_value_t = 0)]
        min_extent: u64,
    },
    /// RuntimeGetVolumeHealth: CSI 1.13's list, empty when healthy.
    Health { sandbox: String, volume: String },
}

/// `SANDBOX:HOST_VOLUME` (a sandbox id holds no colon).
fn volume_ref(s: &str) -> Result<Key, String> {
    match s.split_once(':') {
        Some((sb, v)) if !sb.is_empty() && !v.is_empty() => Ok(Key::new(sb, v)),
        _ => Err(format!("'{s}' is not SANDBOX:HOST_VOLUME")),
    }
}

/// Volumes as crustd-ctl's client names them: (sandbox, host volume).
fn pairs(volumes: &[Key]) -> Vec<(String, String)> {
    volumes
        .iter()
        .map(|k| (k.sandbox.clone(), k.host_volume.clone()))
        .collect()
}

#[derive(Subcommand)]
enum Direct {
    /// Write a record as Kata's Add does (checks the JSON, 0700 directory, 0600 file).
    Add {
        #[arg(long)]
        volume_path: OsString,
        /// The record, e.g. {"volume-type":"directvol","device":"/dev/sdx","fstype":"ext4"}.
        #[arg(long)]
        mount_info: OsString,
    },
    /// Delete the record directory.
    Remove {
        #[arg(long)]
        volume_path: OsString,
    },
    /// Usage and condition of the volume, in the sandbox its sandbox-id file names, as JSON.
    Stats {
        #[arg(long)]
        volume_path: OsString,
    },
    /// RuntimeExpandVolume to the given number of bytes, in the sandbox its sandbox-id file names.
    Resize {
        #[arg(long)]
        volume_path: OsString,
        #[arg(long)]
        size: u64,
    },
}

/// How a command failed: crustd's or the record's error (exit 1), or no connection (exit 3).
enum Failed {
    Status(tonic::Status),
    Connect(String),
}

impl From<tonic::Status> for Failed {
    fn from(s: tonic::Status) -> Failed {
        Failed::Status(s)
    }
}

impl From<crate::direct::Error> for Failed {
    fn from(e: crate::direct::Error) -> Failed {
        Failed::Status(crate::service::to_status(e.into()))
    }
}

/// The stats answer as JSON.
fn stats_json(s: pb::RuntimeGetVolumeStatsResponse) -> Value {
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

/// The sandbox and device of the record filed under `volume_path`, for stats and resize.
fn placed(records: &Records, volume_path: &OsString) -> Result<Key, Failed> {
    let p = volume_path.as_bytes();
    let shown = volume_path.to_string_lossy();
    let sandbox = match records.sandbox_of(p)? {
        SandboxOf::One(s) => s,
        SandboxOf::NoRecord => {
            // Says where it looked.
            records.read(p)?;
            unreachable_record(&shown)?
        }
        SandboxOf::None => {
            return Err(Failed::Status(tonic::Status::failed_precondition(format!(
                "the direct volume at {shown:?} is in no sandbox: {} has no sandbox-id file beside mountInfo.json (publish it first: crustd-ctl publish-direct SANDBOX --volume-path {shown})",
                records.dir_of(p)?.display()
            ))))
        }
    };
    let found = records.read(p)?;
    Ok(Key::new(&sandbox, &found.record.device))
}

/// A record directory that vanished between two looks.
fn unreachable_record<T>(shown: &str) -> Result<T, Failed> {
    Err(Failed::Status(tonic::Status::not_found(format!(
        "the direct-volume record for {shown:?} went away while crustd-ctl read it"
    ))))
}

/// `direct-volume add|remove|stats|resize`: Kata's records, and the calls
/// on the volume a record names.
fn direct_volume(
    records: &Records,
    connect: impl Fn() -> Result<Kubelet, Failed>,
    d: Direct,
) -> Result<Value, Failed> {
    Ok(match d {
        Direct::Add {
            volume_path,
            mount_info,
        } => {
            let file = records.add(volume_path.as_bytes(), mount_info.as_bytes())?;
            json!({ "record": file })
        }
        Direct::Remove { volume_path } => {
            records.remove(volume_path.as_bytes())?;
            json!({})
        }
        Direct::Stats { volume_path } => {
            let v = placed(records, &volume_path)?;
            stats_json(connect()?.stats(&v.sandbox, &v.host_volume)?)
        }
        Direct::Resize { volume_path, size } => {
            let v = placed(records, &volume_path)?;
            let bytes = i64::try_from(size).map_err(|_| {
                Failed::Status(tonic::Status::invalid_argument(format!(
                    "--size {size} is more than a volume can have"
                )))
            })?;
            json!({ "capacity_bytes": connect()?.expand(&v.sandbox, &v.host_volume, bytes)? })
        }
    })
}

/// RuntimeGetVolumeHealth's list as JSON.
fn health_json(list: Vec<pb::VolumeHealth>) -> Value {
    let list: Vec<Value> = list
        .into_iter()
        .map(|h| json!({ "status": h.status().as_str_name(), "reason": h.reason, "message": h.message }))
        .collect();
    json!({ "health": list })
}

fn run(cli: &Cli, cmd: Cmd) -> Result<Value, Failed> {
    let records = Records::new(&cli.direct_volumes);
    let connect =
        || Kubelet::connect(&cli.socket, Duration::from_secs(cli.timeout)).map_err(Failed::Connect);
    if let Cmd::DirectVolume(d) = cmd {
        return direct_volume(&records, connect, d);
    }
    let k = connect()?;
    let k = &k;
    Ok(match cmd {
        Cmd::DirectVolume(_) => unreachable!("handled above"),
        Cmd::PublishDirect {
            sandbox,
            volume_path,
            read_only,
        } => {
            let r = k.publish_direct(&sandbox, &volume_path, read_only)?;
            json!({ "guest_path": r.guest_path, "host_volume_id": r.host_volume_id })
        }
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
            create_file_system,
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
                create_file_system,
            })?;
            json!({ "guest_path": r.guest_path })
        }
        Cmd::Unpublish { sandbox, volume } => {
            k.unpublish(&sandbox, &volume)?;
            json!({})
        }
        Cmd::Stats { sandbox, volume } => stats_json(k.stats(&sandbox, &volume)?),
        Cmd::Expand {
            sandbox,
            volume,
            bytes,
        } => json!({ "capacity_bytes": k.expand(&sandbox, &volume, bytes)? }),
        Cmd::Freeze {
            volumes,
            thaw_after,
            freeze_id,
        } => {
            let ms = thaw_after.saturating_mul(1000);
            let r = k.freeze(&pairs(&volumes), ms, freeze_id.as_deref())?;
            json!({ "freeze_id": r.freeze_id, "thaw_at_unix_ms": r.thaw_at_unix_ms })
        }
        Cmd::Thaw { freeze_id, force } => {
            match freeze_id {
                Some(id) => k.thaw(&id)?,
                None => k.thaw_force(&pairs(&force))?,
            }
            json!({})
        }
        Cmd::Trim {
            sandbox,
            volume,
            min_extent,
        } => json!({ "trimmed_bytes": k.trim(&sandbox, &volume, min_extent)? }),
        Cmd::Health { sandbox, volume } => health_json(k.health(&sandbox, &volume)?),
    })
}

/// What a run of crustd-ctl ends with: its exit status, stdout and stderr.
#[derive(Debug)]
pub struct Outcome {
    pub code: u8,
    pub stdout: String,
    pub stderr: String,
}

/// Runs crustd-ctl with `args` (the program name first) and answers what it
/// would print and exit with: the binary prints this, tests look at it.
pub fn run_cli<I, T>(args: I) -> Outcome
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            return Outcome {
                code: if e.use_stderr() { 2 } else { 0 },
                stdout: if e.use_stderr() {
                    String::new()
                } else {
                    e.to_string()
                },
                stderr: if e.use_stderr() {
                    e.to_string()
                } else {
                    String::new()
                },
            }
        }
    };
    let cmd = std::mem::replace(&mut cli.cmd, Cmd::Capabilities);
    let (code, stdout, stderr) = match run(&cli, cmd) {
        Ok(v) => (0, format!("{v}\n"), String::new()),
        Err(Failed::Connect(e)) => (3, String::new(), format!("error: {e}\n")),
        Err(Failed::Status(s)) => (
            1,
            String::new(),
            format!("error: {}: {}\n", code_name(s.code()), s.message()),
        ),
    };
    Outcome {
        code,
        stdout,
        stderr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_refs_are_sandbox_colon_host_volume() {
        assert_eq!(
            volume_ref("pod-a:/dev/loop3"),
            Ok(Key::new("pod-a", "/dev/loop3"))
        );
        // A colon in the volume stays in the volume.
        assert_eq!(
            volume_ref("pod-a:/dev/disk/by-path/pci-0000:00:1f.2"),
            Ok(Key::new("pod-a", "/dev/disk/by-path/pci-0000:00:1f.2"))
        );
        for bad in ["pod-a", ":/dev/x", "pod-a:", ""] {
            assert!(volume_ref(bad).is_err(), "{bad}");
        }
        // The verbs parse as the docs write them.
        let out = run_cli([
            "crustd-ctl",
            "--socket",
            "/nonexistent",
            "freeze",
            "nocolon",
        ]);
        assert_eq!(out.code, 2, "{out:?}");
        let ctl = |args: &[&str]| {
            run_cli(
                ["crustd-ctl", "--socket", "/nonexistent"]
                    .iter()
                    .chain(args),
            )
        };
        for usage in [
            &["thaw"][..],
            &["thaw", "group-1", "--force", "pod-a:/dev/x"],
            &["thaw", "--force", "nocolon"],
            &["thaw", "--force"],
        ] {
            let out = ctl(usage);
            assert_eq!(out.code, 2, "{usage:?}: {out:?}");
        }
        for called in [
            &["thaw", "group-1"][..],
            &["thaw", "--force", "pod-a:/dev/x", "pod-b:/dev/y"],
            &[
                "freeze",
                "pod-a:/dev/x",
                "--freeze-id",
                "backup-7",
                "--thaw-after",
                "30",
            ],
        ] {
            let out = ctl(called);
            assert_eq!(out.code, 3, "no crustd there: {called:?}: {out:?}");
        }
    }
}

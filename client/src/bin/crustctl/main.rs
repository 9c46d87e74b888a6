//! crustctl: talk to a crust-agent from the host (api.md §4). Flags become one
//! request, the response is printed for people or as canonical JSON, and the
//! exit status says who failed: 1 the agent, 2 the command line, 3 the connection.

mod human;
mod json;

use std::{io::Write, process::ExitCode, time::Duration};

use clap::{error::ErrorKind, Args, CommandFactory, Parser, Subcommand, ValueEnum};
use crust_client::{
    proto::{self, publish_volume_request::Source},
    protobuf::MessageDyn,
    Address, CallError, ConnectError, CrustClient,
};

/// How long crustctl, having given up on a hybrid vsock `CONNECT`, waits
/// before exiting for the backend to answer it: exiting closes the stream,
/// and vhost-device-vsock 0.3.0 loses the VM's vsock when the guest answers
/// a closed one. A guest that never answers is not harmed by the close.
const SETTLE: Duration = Duration::from_secs(30);

/// Talk to a crust-agent: publish, inspect, grow and bind volumes in a microVM.
#[derive(Debug, Parser)]
#[command(name = "crustctl", version)]
struct Cli {
    /// The agent: unix:///PATH | vsock://CID:PORT | hvsock://PATH:PORT (the VMM's
    /// hybrid vsock socket; "CONNECT PORT" is sent first).
    #[arg(long, env = "CRUST_ADDR", value_name = "ADDR", global = true, value_parser = parse_addr)]
    addr: Option<Address>,
    /// Seconds to wait for the connection and for each answer. Publish and
    /// expand wait at least their --wait plus 10 s.
    #[arg(long, value_name = "SECS", default_value = "10", global = true, value_parser = parse_seconds)]
    timeout: Duration,
    /// Print the response as protobuf canonical JSON, all fields included.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The optional features this agent has (stats, resize, RRO…).
    Capabilities,
    /// The filesystems the agent can publish.
    Filesystems,
    /// Version, kernel, memory and the boot timeline.
    Info,
    /// The published volumes and their bind targets.
    List,
    /// Mount a disk (found by serial or path) at <root>/volumes/VOLUME_ID.
    Publish(PublishArgs),
    /// Unmount a volume and its binds.
    Unpublish { volume_id: String },
    /// Bytes and inodes used, and the filesystem's condition.
    Stats { volume_id: String },
    /// Grow a volume's filesystem online to the device's (or a given) size.
    Expand {
        volume_id: String,
        /// Size to reach, in bytes or with a binary suffix (512M, 20G, 1Ti);
        /// default: the whole device.
        #[arg(long, value_name = "N", value_parser = parse_size)]
        bytes: Option<i64>,
        /// Seconds the agent waits for the guest to see the grown disk.
        #[arg(long, value_name = "SECS", value_parser = parse_wait)]
        wait: Option<u32>,
    },
    /// Bind a volume, or a subpath of it, at TARGET.
    Bind(BindArgs),
    /// Unmount a bind target.
    Unmount { target: String },
    /// Unmount everything and power the VM off (when the agent is PID 1).
    Shutdown,
    /// Freeze volumes' filesystems for a consistent snapshot, all or none;
    /// prints the freeze's id, which `thaw` takes.
    Freeze {
        #[arg(required = true)]
        volume_ids: Vec<String>,
        /// Seconds after which the agent thaws them by itself (default 60,
        /// at most 600) if nobody thaws them first.
        #[arg(long, value_name = "SECS", value_parser = parse_wait)]
        thaw_after: Option<u32>,
        /// Your own id for this freeze (letters, digits, . _ : -): a retry
        /// with it answers the same freeze; it is never used again.
        #[arg(long, value_name = "ID")]
        freeze_id: Option<String>,
    },
    /// End a freeze by its id: exit 0 when it held until now (the snapshot
    /// is consistent), 1 with ABORTED when part of it ended first.
    Thaw {
        /// The freeze's id (with --force: the volume ids).
        #[arg(required = true)]
        ids: Vec<String>,
        /// End whatever freeze holds the volumes named, another caller's
        /// too (that caller's thaw then answers ABORTED).
        #[arg(long)]
        force: bool,
    },
    /// Give a volume's free space back to its disk (FITRIM).
    Trim {
        volume_id: String,
        /// Skip free extents shorter than this (bytes or 64K, 1M...).
        #[arg(long, value_name = "N", value_parser = parse_size)]
        min_extent: Option<i64>,
    },
    /// The volume's health in CSI 1.13's shape (empty when healthy).
    Health { volume_id: String },
}

#[derive(Debug, Args)]
struct PublishArgs {
    /// The host's name for the volume: [A-Za-z0-9][A-Za-z0-9._-]{0,127}.
    volume_id: String,
    /// The virtio-blk serial the host gave the disk.
    #[arg(
        long,
        value_name = "S",
        required_unless_present = "device",
        conflicts_with = "device"
    )]
    serial: Option<String>,
    /// The disk's block device, e.g. /dev/vdb.
    #[arg(long, value_name = "PATH")]
    device: Option<String>,
    /// The filesystem on the disk (ext4 or xfs); it is never formatted.
    #[arg(long, value_name = "T", required_unless_present = "block")]
    fs_type: Option<String>,
    /// Publish the disk itself as a raw block volume (volumeMode: Block):
    /// its node appears at the guest path. A block volume takes no
    /// filesystem, options or fsGroup: given anyway, they are sent, and the
    /// agent refuses them (INVALID_ARGUMENT).
    #[arg(long)]
    block: bool,
    /// Mount options; repeat or separate with commas (-o noatime,discard).
    #[arg(short = 'o', long = "option", value_name = "OPT")]
    options: Vec<String>,
    /// Mount the filesystem read-only.
    #[arg(long)]
    read_only: bool,
    /// Make the volume's files belong to this group (the pod's fsGroup).
    #[arg(long, value_name = "GID")]
    fs_group: Option<u32>,
    #[arg(
        long,
        value_name = "POLICY",
        requires = "fs_group",
        default_value = "always"
    )]
    fs_group_policy: FsGroupPolicy,
    /// Seconds the agent waits for the disk to appear (default 10).
    #[arg(long, value_name = "SECS", value_parser = parse_wait)]
    wait: Option<u32>,
    /// The disk is encrypted (luks2): the agent unlocks it in the guest and
    /// publishes its dm-crypt mapping.
    #[arg(long, value_name = "KIND")]
    encryption: Option<EncryptionKind>,
    /// The passphrase: the bytes of this host file, as they are (cryptsetup's
    /// --key-file), sent in the request. For a host trusted with the key.
    #[arg(
        long,
        value_name = "HOSTPATH",
        requires = "encryption",
        conflicts_with = "key_uri"
    )]
    key_file: Option<std::path::PathBuf>,
    /// Where the guest finds the passphrase itself (file:///PATH, or
    /// kbs:///REPO/TYPE/TAG through the Confidential Data Hub): the host never sees it.
    #[arg(long, value_name = "URI", requires = "encryption")]
    key_uri: Option<String>,
    /// A disk blank at every offset the agent checks is made a LUKS2 volume
    /// (and the filesystem inside); any other disk is left as it is.
    #[arg(long, requires = "encryption")]
    format_if_blank: bool,
    /// Let discards (trim) through the encryption: they tell the host which
    /// blocks are free.
    #[arg(long, requires = "encryption")]
    allow_discards: bool,
    /// Trim the volume in the background this often (30s, 10m, 1h, 1d,
    /// 1h30m), with jitter: freed blocks go back to the host without a call.
    #[arg(long, value_name = "DURATION", value_parser = parse_every)]
    trim_every: Option<u32>,
    /// With --format-if-blank: make the volume with integrity (dm-integrity
    /// under dm-crypt, as cryptsetup luksFormat --integrity makes it); the
    /// whole disk is written once before the filesystem is made.
    #[arg(long, value_name = "MAC", requires = "format_if_blank")]
    integrity: Option<IntegrityMac>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum EncryptionKind {
    Luks2,
}

/// The MACs the agent makes a volume's integrity with.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum IntegrityMac {
    #[value(name = "hmac-sha256")]
    HmacSha256,
}

/// The most bytes a key file may hold (cryptsetup's own bound for --key-file).
const KEY_FILE_MAX: u64 = 8 << 20;

/// The bytes of `path`, as they are, for a passphrase.
fn read_key_file(path: &std::path::Path) -> Result<Vec<u8>, Failure> {
    use std::io::Read;
    let bad = |why: String| Failure::Usage(format!("--key-file {}: {why}", path.display()));
    let f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut key = Vec::new();
    f.take(KEY_FILE_MAX + 1)
        .read_to_end(&mut key)
        .map_err(|e| bad(e.to_string()))?;
    if key.len() as u64 > KEY_FILE_MAX {
        return Err(bad(format!("it holds more than {KEY_FILE_MAX} bytes")));
    }
    if key.is_empty() {
        return Err(bad("it is empty".into()));
    }
    Ok(key)
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum FsGroupPolicy {
    Always,
    OnRootMismatch,
}

#[derive(Debug, Args)]
struct BindArgs {
    volume_id: String,
    /// Absolute path beneath the agent's root.
    target: String,
    /// A directory inside the volume, relative to its root.
    #[arg(long, value_name = "P", default_value = "")]
    subpath: String,
    /// Make the bind read-only.
    #[arg(long)]
    read_only: bool,
    /// Make submounts read-only too (needs --read-only).
    #[arg(long, value_name = "MODE", default_value = "disabled")]
    recursive_read_only: Rro,
    /// Idmap the bind (a user-namespace pod's uids): CONTAINER:HOST:LEN,
    /// repeatable; needs --gid-map too.
    #[arg(long = "uid-map", value_name = "CONTAINER:HOST:LEN", value_parser = parse_id_map)]
    uid_map: Vec<proto::IDMapping>,
    /// The pod's gids, as --uid-map.
    #[arg(long = "gid-map", value_name = "CONTAINER:HOST:LEN", value_parser = parse_id_map)]
    gid_map: Vec<proto::IDMapping>,
}

/// `CONTAINER:HOST:LEN`, as CRI's IDMapping; the agent checks the rest.
fn parse_id_map(s: &str) -> Result<proto::IDMapping, String> {
    let n: Vec<Result<u32, _>> = s.split(':').map(str::parse).collect();
    match n.as_slice() {
        [Ok(container_id), Ok(host_id), Ok(length)] => Ok(proto::IDMapping {
            container_id: *container_id,
            host_id: *host_id,
            length: *length,
            ..Default::default()
        }),
        _ => Err(format!(
            "{s:?} is not CONTAINER:HOST:LEN (three ids, e.g. 0:100000:65536)"
        )),
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Rro {
    Disabled,
    IfPossible,
    Enabled,
}

fn parse_addr(s: &str) -> Result<Address, String> {
    let addr: Address = s
        .parse()
        .map_err(|e: crust_client::AddressError| e.to_string())?;
    addr.check_connectable().map_err(|e| e.to_string())?;
    Ok(addr)
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() && v <= 86_400.0 => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!(
            "'{s}' is not a number of seconds between 0 and 86400"
        )),
    }
}

/// A --wait in seconds, as the request's timeout_ms.
fn parse_wait(s: &str) -> Result<u32, String> {
    match s.parse::<f64>() {
        // Below 1 ms would read as 0, which the agent takes as "its default".
        Ok(v) if v >= 0.001 && v <= f64::from(u32::MAX) / 1000.0 => {
            // In range by the guard: the product is within 1..=u32::MAX.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let ms = (v * 1000.0).round() as u32;
            Ok(ms)
        }
        _ => Err(format!(
            "'{s}' is not a number of seconds between 0.001 and 4294967"
        )),
    }
}

/// A duration in whole seconds, as numbers each with its unit (s, m, h,
/// d): `30s`, `10m`, `1h30m`. The agent judges the range.
fn parse_every(s: &str) -> Result<u32, String> {
    let bad = || format!("'{s}' is not a duration: write e.g. 30s, 10m, 1h or 1h30m");
    let (mut total, mut n, mut digits) = (0u64, 0u64, false);
    for c in s.chars() {
        if let Some(d) = c.to_digit(10) {
            n = n
                .checked_mul(10)
                .and_then(|n| n.checked_add(d.into()))
                .ok_or_else(bad)?;
            digits = true;
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86400,
            _ => return Err(bad()),
        };
        if !digits {
            return Err(bad());
        }
        total = n
            .checked_mul(unit)
            .and_then(|x| total.checked_add(x))
            .ok_or_else(bad)?;
        (n, digits) = (0, false);
    }
    if digits || s.is_empty() {
        return Err(bad());
    }
    u32::try_from(total).map_err(|_| bad())
}

/// Bytes: a plain integer, or one with a binary suffix K/M/G/T/P (KiB…; 1G = 2^30).
fn parse_size(s: &str) -> Result<i64, String> {
    let bad = || {
        format!("'{s}' is not a size: write bytes (1073741824) or use K, M, G, T, P (binary: 1G = 1024M)")
    };
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(digits_end);
    if digits.is_empty() {
        return Err(bad());
    }
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KI" | "KIB" => 10,
        "M" | "MI" | "MIB" => 20,
        "G" | "GI" | "GIB" => 30,
        "T" | "TI" | "TIB" => 40,
        "P" | "PI" | "PIB" => 50,
        "KB" | "MB" | "GB" | "TB" | "PB" => {
            return Err(format!(
                "'{s}' is ambiguous (1000 or 1024?): write {}{} for binary units, or plain bytes",
                digits,
                &suffix[..1]
            ))
        }
        _ => return Err(bad()),
    };
    let n: i64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1i64 << shift)
        .ok_or_else(|| format!("'{s}' is larger than the largest size, 8 EiB"))
}

/// Why crustctl failed after parsing its arguments.
enum Failure {
    Connect(ConnectError),
    Call(CallError),
    /// An argument that parsed but cannot be used (a key file unreadable).
    Usage(String),
}

impl Failure {
    /// The exit status of api.md §4.
    fn exit_code(&self) -> u8 {
        match self {
            Failure::Call(CallError::Status { .. }) => 1,
            Failure::Usage(_) => 2,
            Failure::Call(_) | Failure::Connect(_) => 3,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(addr) = cli.addr.clone() else {
        Cli::command()
            .error(
                ErrorKind::MissingRequiredArgument,
                "no agent address: give --addr ADDR or set CRUST_ADDR",
            )
            .exit();
    };
    if let Command::Thaw { ids, force: false } = &cli.command {
        if ids.len() > 1 {
            Cli::command()
                .error(
                    ErrorKind::TooManyValues,
                    "thaw takes one freeze id (what freeze printed); to end whatever holds volumes, give --force and their ids",
                )
                .exit();
        }
    }
    match run(&cli, &addr) {
        Ok(out) => {
            print(&out);
            ExitCode::SUCCESS
        }
        Err(failure) => {
            match &failure {
                Failure::Call(CallError::Status { code, message }) => {
                    eprintln!("error: {code}: {message}");
                    if cli.json {
                        print(&format!("{}\n", json::error(code.name(), message)));
                    }
                }
                Failure::Call(e) => eprintln!("error: {e}"),
                Failure::Connect(e) => eprintln!("error: {e}"),
                Failure::Usage(e) => eprintln!("error: {e}"),
            }
            if crust_client::unanswered() > 0 {
                eprintln!(
                    "crustctl: waiting up to {} s for the VM's vsock backend to answer the CONNECT before exiting (a CONNECT closed unanswered can take the VM's vsock down)",
                    SETTLE.as_secs()
                );
                crust_client::settle(SETTLE);
            }
            ExitCode::from(failure.exit_code())
        }
    }
}

/// Writes to stdout; a closed pipe (`crustctl list | head -0`) is not worth a panic.
fn print(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|_| stdout.flush());
}

/// The response as JSON or as text for people.
fn render<M: MessageDyn>(as_json: bool, resp: &M, human: impl FnOnce(&M) -> String) -> String {
    if as_json {
        format!("{}\n", json::message(resp))
    } else {
        human(resp)
    }
}

fn run(cli: &Cli, addr: &Address) -> Result<String, Failure> {
    let agent = CrustClient::connect(addr, cli.timeout).map_err(Failure::Connect)?;
    let j = cli.json;
    match &cli.command {
        Command::Capabilities => ask(j, agent.get_capabilities(), human::capabilities),
        Command::Filesystems => ask(j, agent.get_supported_file_systems(), human::filesystems),
        Command::Info => ask(j, agent.get_agent_info(), human::info),
        Command::List => ask(j, agent.list_volumes(), human::list),
        Command::Shutdown => ask(j, agent.shutdown(), human::shutdown),
        Command::Publish(a) => publish(&agent, j, a),
        Command::Unpublish { volume_id } => unpublish(&agent, j, volume_id),
        Command::Stats { volume_id } => stats(&agent, j, volume_id),
        Command::Expand {
            volume_id,
            bytes,
            wait,
        } => expand(&agent, j, volume_id, *bytes, *wait),
        Command::Bind(a) => bind(&agent, j, a),
        Command::Unmount { target } => unmount(&agent, j, target),
        Command::Freeze {
            volume_ids,
            thaw_after,
            freeze_id,
        } => freeze(&agent, j, volume_ids, *thaw_after, freeze_id.as_deref()),
        Command::Thaw { ids, force } => thaw(&agent, j, ids, *force),
        Command::Trim {
            volume_id,
            min_extent,
        } => trim(&agent, j, volume_id, *min_extent),
        Command::Health { volume_id } => health(&agent, j, volume_id),
    }
}

/// A call's answer, rendered.
fn ask<M: MessageDyn>(
    j: bool,
    answer: Result<M, CallError>,
    human: impl FnOnce(&M) -> String,
) -> Result<String, Failure> {
    Ok(render(j, &answer.map_err(Failure::Call)?, human))
}

/// `publish VOLUME_ID --serial|--device ...`.
fn publish(agent: &CrustClient, j: bool, a: &PublishArgs) -> Result<String, Failure> {
    let mut req = publish_request(a);
    if let (Some(e), Some(path)) = (req.encryption.as_mut(), &a.key_file) {
        e.set_passphrase(read_key_file(path)?);
    }
    ask(j, agent.publish_volume(&req), |r| {
        human::publish(&a.volume_id, mounted_read_only(&req), r)
    })
}

/// `unpublish VOLUME_ID`.
fn unpublish(agent: &CrustClient, j: bool, volume_id: &str) -> Result<String, Failure> {
    let req = proto::UnpublishVolumeRequest {
        volume_id: volume_id.to_string(),
        ..Default::default()
    };
    ask(j, agent.unpublish_volume(&req), |r| {
        human::unpublish(volume_id, r)
    })
}

/// `stats VOLUME_ID`.
fn stats(agent: &CrustClient, j: bool, volume_id: &str) -> Result<String, Failure> {
    let req = proto::GetVolumeStatsRequest {
        volume_id: volume_id.to_string(),
        ..Default::default()
    };
    ask(j, agent.get_volume_stats(&req), |r| {
        human::stats(volume_id, r)
    })
}

/// `expand VOLUME_ID [--bytes N] [--wait MS]`.
fn expand(
    agent: &CrustClient,
    j: bool,
    volume_id: &str,
    bytes: Option<i64>,
    wait: Option<u32>,
) -> Result<String, Failure> {
    let req = proto::ExpandVolumeRequest {
        volume_id: volume_id.to_string(),
        required_bytes: bytes.unwrap_or(0),
        timeout_ms: wait.unwrap_or(0),
        ..Default::default()
    };
    ask(j, agent.expand_volume(&req), |r| {
        human::expand(volume_id, r)
    })
}

/// `bind VOLUME_ID TARGET ...`.
fn bind(agent: &CrustClient, j: bool, a: &BindArgs) -> Result<String, Failure> {
    let req = bind_request(a);
    ask(j, agent.bind_mount(&req), |r| human::bind(&req, r))
}

fn unmount(agent: &CrustClient, j: bool, target: &str) -> Result<String, Failure> {
    let req = proto::UnmountRequest {
        target: target.to_string(),
        ..Default::default()
    };
    ask(j, agent.unmount(&req), |r| human::unmount(target, r))
}

/// `freeze ID... [--thaw-after SECS] [--freeze-id ID]`: the id on stdout,
/// alone (`ID=$(crustctl freeze ...)`), what it means on stderr.
fn freeze(
    agent: &CrustClient,
    j: bool,
    volume_ids: &[String],
    thaw_after: Option<u32>,
    freeze_id: Option<&str>,
) -> Result<String, Failure> {
    let req = proto::FreezeVolumesRequest {
        volume_ids: volume_ids.to_vec(),
        timeout_ms: thaw_after.unwrap_or(0),
        freeze_id: freeze_id.unwrap_or_default().to_string(),
        ..Default::default()
    };
    let resp = agent.freeze_volumes(&req).map_err(Failure::Call)?;
    if !j {
        eprint!("{}", human::frozen(volume_ids, &resp));
    }
    Ok(render(j, &resp, |r| format!("{}\n", r.freeze_id)))
}

/// `thaw FREEZE_ID` or `thaw --force VOLUME_ID...`.
fn thaw(agent: &CrustClient, j: bool, ids: &[String], force: bool) -> Result<String, Failure> {
    // main refused more than one id without --force before connecting.
    let req = if force {
        proto::ThawVolumesRequest {
            volume_ids: ids.to_vec(),
            force: true,
            ..Default::default()
        }
    } else {
        proto::ThawVolumesRequest {
            freeze_id: ids.concat(),
            ..Default::default()
        }
    };
    ask(j, agent.thaw_volumes(&req), |r| {
        human::thawed(force.then_some(ids), r)
    })
}

/// `trim ID [--min-extent N]`.
fn trim(
    agent: &CrustClient,
    j: bool,
    volume_id: &str,
    min_extent: Option<i64>,
) -> Result<String, Failure> {
    let req = proto::TrimVolumeRequest {
        volume_id: volume_id.to_string(),
        min_extent_bytes: u64::try_from(min_extent.unwrap_or(0)).unwrap_or(0),
        ..Default::default()
    };
    ask(j, agent.trim_volume(&req), |r| human::trimmed(volume_id, r))
}

fn health(agent: &CrustClient, j: bool, volume_id: &str) -> Result<String, Failure> {
    let req = proto::GetVolumeHealthRequest {
        volume_id: volume_id.to_string(),
        ..Default::default()
    };
    ask(j, agent.get_volume_health(&req), |r| {
        human::health(volume_id, r)
    })
}

fn publish_request(a: &PublishArgs) -> proto::PublishVolumeRequest {
    let source = match (&a.serial, &a.device) {
        (Some(s), _) => Some(Source::Serial(s.clone())),
        (None, Some(d)) => Some(Source::DevicePath(d.clone())),
        // clap requires one of them; sending none lets the agent say so.
        (None, None) => None,
    };
    let fs_group = a.fs_group.map(|gid| proto::FsGroup {
        gid,
        change_policy: match a.fs_group_policy {
            FsGroupPolicy::Always => proto::FsGroupChangePolicy::ALWAYS,
            FsGroupPolicy::OnRootMismatch => proto::FsGroupChangePolicy::ON_ROOT_MISMATCH,
        }
        .into(),
        ..Default::default()
    });
    proto::PublishVolumeRequest {
        volume_id: a.volume_id.clone(),
        source,
        fs_type: a.fs_type.clone().unwrap_or_default(),
        volume_mode: if a.block {
            proto::VolumeMode::BLOCK
        } else {
            proto::VolumeMode::FILESYSTEM
        }
        .into(),
        mount_options: a
            .options
            .iter()
            .flat_map(|o| o.split(','))
            .filter(|o| !o.is_empty())
            .map(String::from)
            .collect(),
        read_only: a.read_only,
        fs_group: fs_group.into(),
        timeout_ms: a.wait.unwrap_or(0),
        trim_interval_s: a.trim_every.unwrap_or(0),
        encryption: a
            .encryption
            .map(|EncryptionKind::Luks2| {
                let mut e = proto::Encryption {
                    kind: proto::encryption::Kind::LUKS2.into(),
                    format_if_blank: a.format_if_blank,
                    allow_discards: a.allow_discards,
                    integrity: a
                        .integrity
                        .map_or(String::new(), |IntegrityMac::HmacSha256| {
                            "hmac-sha256".into()
                        }),
                    ..Default::default()
                };
                if let Some(u) = &a.key_uri {
                    e.set_key_uri(u.clone());
                }
                e
            })
            .into(),
        ..Default::default()
    }
}

/// Whether the agent mounts what `req` asks for read-only: its flag, or an
/// `ro` that no later `rw` undoes (the agent's own rule).
fn mounted_read_only(req: &proto::PublishVolumeRequest) -> bool {
    let by_options = req
        .mount_options
        .iter()
        .fold(false, |ro, o| match o.as_str() {
            "ro" => true,
            "rw" => false,
            _ => ro,
        });
    req.read_only || by_options
}

fn bind_request(a: &BindArgs) -> proto::BindMountRequest {
    proto::BindMountRequest {
        volume_id: a.volume_id.clone(),
        subpath: a.subpath.clone(),
        target: a.target.clone(),
        read_only: a.read_only,
        recursive_read_only: match a.recursive_read_only {
            Rro::Disabled => proto::RecursiveReadOnly::DISABLED,
            Rro::IfPossible => proto::RecursiveReadOnly::IF_POSSIBLE,
            Rro::Enabled => proto::RecursiveReadOnly::ENABLED,
        }
        .into(),
        uid_mappings: a.uid_map.clone(),
        gid_mappings: a.gid_map.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("crustctl").chain(args.iter().copied()))
    }

    #[test]
    fn sizes_accept_bytes_and_binary_suffixes() {
        let table: &[(&str, Result<i64, &str>)] = &[
            ("0", Ok(0)),
            ("1073741824", Ok(1 << 30)),
            ("512M", Ok(512 << 20)),
            ("1g", Ok(1 << 30)),
            ("1GiB", Ok(1 << 30)),
            ("2Ti", Ok(2 << 40)),
            ("7B", Ok(7)),
            ("1GB", Err("ambiguous")),
            ("", Err("not a size")),
            ("G", Err("not a size")),
            ("-1", Err("not a size")),
            ("1.5G", Err("not a size")),
            ("1X", Err("not a size")),
            ("9223372036854775808", Err("not a size")),
            ("8192P", Err("larger than")),
        ];
        for (s, want) in table {
            match (parse_size(s), want) {
                (Ok(n), Ok(w)) => assert_eq!(n, *w, "{s}"),
                (Err(e), Err(w)) => assert!(e.contains(w), "{s}: {e}"),
                (got, _) => panic!("{s}: {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn trim_intervals_are_durations_with_units() {
        for (s, want) in [
            ("30s", 30),
            ("10m", 600),
            ("1h", 3600),
            ("1d", 86400),
            ("1h30m", 5400),
        ] {
            assert_eq!(parse_every(s), Ok(want), "{s}");
        }
        for bad in [
            "",
            "30",
            "m",
            "1x",
            "1.5h",
            "-1m",
            "99999999999999999999s",
            "50000d",
        ] {
            assert!(
                parse_every(bad).unwrap_err().contains("not a duration"),
                "{bad}"
            );
        }
    }

    #[test]
    fn waits_become_milliseconds() {
        assert_eq!(parse_wait("30"), Ok(30_000));
        assert_eq!(parse_wait("0.25"), Ok(250));
        assert!(parse_wait("0").is_err(), "0 would mean the agent's default");
        assert!(parse_wait("-1").is_err());
        assert!(parse_wait("1e10").is_err());
        assert!(parse_seconds("0").is_err());
        assert_eq!(parse_seconds("1.5"), Ok(Duration::from_millis(1500)));
    }

    #[test]
    fn read_only_is_the_flag_or_the_last_of_ro_and_rw() {
        let req = |opts: &[&str], flag: bool| proto::PublishVolumeRequest {
            mount_options: opts.iter().map(|o| o.to_string()).collect(),
            read_only: flag,
            ..Default::default()
        };
        assert!(!mounted_read_only(&req(&["noatime"], false)));
        assert!(mounted_read_only(&req(&["noatime"], true)));
        assert!(mounted_read_only(&req(&["noatime", "ro"], false)));
        assert!(!mounted_read_only(&req(&["ro", "rw"], false)));
        assert!(mounted_read_only(&req(&["rw", "ro"], false)));
        assert!(mounted_read_only(&req(&["ro", "rw"], true)));
    }

    /// The publish request the command line `args` makes.
    fn publish_request_of(args: &[&str]) -> proto::PublishVolumeRequest {
        let cli = parse(args).unwrap();
        let Command::Publish(a) = &cli.command else {
            panic!("{cli:?}")
        };
        publish_request(a)
    }

    #[test]
    fn publish_flags_become_the_request() {
        let req = publish_request_of(&[
            "--addr",
            "unix:///x",
            "publish",
            "vol-1",
            "--serial",
            "s1",
            "--fs-type",
            "xfs",
            "-o",
            "noatime,discard",
            "-o",
            "nouuid",
            "--read-only",
            "--fs-group",
            "2000",
            "--fs-group-policy",
            "on-root-mismatch",
            "--wait",
            "30",
            "--trim-every",
            "1h30m",
        ]);
        assert_eq!(req.trim_interval_s, 5400);
        assert_eq!(req.volume_id, "vol-1");
        assert_eq!(req.serial(), "s1");
        assert!(!req.has_device_path());
        assert_eq!(req.fs_type, "xfs");
        assert_eq!(req.mount_options, ["noatime", "discard", "nouuid"]);
        assert!(req.read_only);
        assert_eq!(req.fs_group.gid, 2000);
        assert_eq!(
            req.fs_group.change_policy,
            proto::FsGroupChangePolicy::ON_ROOT_MISMATCH.into()
        );
        assert_eq!(req.timeout_ms, 30_000);

        let req = publish_request_of(&[
            "--addr",
            "unix:///x",
            "publish",
            "v",
            "--device",
            "/dev/vdb",
            "--fs-type",
            "ext4",
        ]);
        assert_eq!(req.device_path(), "/dev/vdb");
        assert!(
            req.fs_group.is_none(),
            "no --fs-group leaves ownership alone"
        );
        assert_eq!(req.timeout_ms, 0);
        assert_eq!(req.volume_mode, proto::VolumeMode::FILESYSTEM.into());
    }

    #[test]
    fn block_publishes_name_no_filesystem() {
        let req =
            publish_request_of(&["publish", "raw", "--serial", "s1", "--block", "--read-only"]);
        assert_eq!(req.volume_mode, proto::VolumeMode::BLOCK.into());
        assert_eq!(req.fs_type, "");
        assert!(req.mount_options.is_empty() && req.fs_group.is_none() && req.read_only);
        // What a block volume cannot take is the agent's to refuse, with its code.
        let req = publish_request_of(&[
            "publish",
            "raw",
            "--serial",
            "s1",
            "--block",
            "--fs-type",
            "ext4",
            "-o",
            "noatime",
        ]);
        assert_eq!((req.fs_type.as_str(), req.mount_options.len()), ("ext4", 1));
        assert_eq!(req.volume_mode, proto::VolumeMode::BLOCK.into());
    }

    #[test]
    fn integrity_is_asked_with_format_if_blank() {
        let base = [
            "publish",
            "v",
            "--serial",
            "s1",
            "--fs-type",
            "ext4",
            "--encryption",
            "luks2",
            "--key-uri",
            "file:///k",
        ];
        let asked = ["--format-if-blank", "--integrity", "hmac-sha256"];
        let req = publish_request_of(&[&base[..], &asked[..]].concat());
        let e = req.encryption.as_ref().unwrap();
        assert_eq!(
            (e.format_if_blank, e.integrity.as_str()),
            (true, "hmac-sha256")
        );
        let without = publish_request_of(&base);
        assert_eq!(without.encryption.as_ref().unwrap().integrity, "");
        for extra in [
            &["--integrity", "hmac-sha256"][..],
            &["--format-if-blank", "--integrity", "crc32c"],
        ] {
            let err = parse(&[&base[..], extra].concat()).expect_err("parsed");
            assert_eq!(err.exit_code(), 2, "{extra:?}: {err}");
        }
    }

    #[test]
    fn bind_flags_become_the_request() {
        let cli = parse(&[
            "bind",
            "v",
            "/run/crust/binds/t",
            "--subpath",
            "a/b",
            "--read-only",
            "--recursive-read-only",
            "if-possible",
            "--json",
            "--addr",
            "vsock://3:1024",
        ])
        .unwrap();
        assert!(cli.json);
        assert_eq!(cli.addr, Some(Address::Vsock { cid: 3, port: 1024 }));
        let Command::Bind(a) = &cli.command else {
            panic!()
        };
        let req = bind_request(a);
        assert_eq!(
            (req.subpath.as_str(), req.target.as_str(), req.read_only),
            ("a/b", "/run/crust/binds/t", true)
        );
        assert_eq!(
            req.recursive_read_only,
            proto::RecursiveReadOnly::IF_POSSIBLE.into()
        );
        assert!(req.uid_mappings.is_empty() && req.gid_mappings.is_empty());
    }

    #[test]
    fn id_maps_become_the_request() {
        let cli = parse(&[
            "bind",
            "v",
            "/run/crust/binds/t",
            "--uid-map",
            "0:100000:65536",
            "--uid-map",
            "65536:5:1",
            "--gid-map",
            "0:200000:65536",
        ])
        .unwrap();
        let Command::Bind(a) = &cli.command else {
            panic!()
        };
        let req = bind_request(a);
        let ids = |m: &[proto::IDMapping]| -> Vec<(u32, u32, u32)> {
            m.iter()
                .map(|r| (r.container_id, r.host_id, r.length))
                .collect()
        };
        assert_eq!(ids(&req.uid_mappings), [(0, 100000, 65536), (65536, 5, 1)]);
        assert_eq!(ids(&req.gid_mappings), [(0, 200000, 65536)]);
        for bad in ["0:1", "0:1:2:3", "a:1:1", "0:1:-1", "0:4294967296:1"] {
            assert!(
                parse(&["bind", "v", "/t", "--uid-map", bad]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn usage_errors_are_refused_by_the_parser() {
        let table: &[&[&str]] = &[
            &["publish", "v", "--fs-type", "ext4"], // no source
            &[
                "publish",
                "v",
                "--serial",
                "s",
                "--device",
                "/dev/vdb",
                "--fs-type",
                "ext4",
            ], // two sources
            &["publish", "v", "--serial", "s"],     // no fs type
            &[
                "publish",
                "v",
                "--serial",
                "s",
                "--fs-type",
                "ext4",
                "--fs-group-policy",
                "always",
            ],
            &["bind", "v", "/t", "--recursive-read-only", "sometimes"],
            &["expand", "v", "--bytes", "1GB"],
            &["--addr", "tcp://x:1", "info"],
            &["--addr", "vsock://-1:1024", "info"],
            &["--timeout", "0", "info"],
            &["frobnicate"],
            &[],
        ];
        for args in table {
            let err = parse(args).expect_err(&format!("{args:?} parsed"));
            assert_eq!(err.exit_code(), 2, "{args:?}: {err}");
        }
    }

    #[test]
    fn exit_codes_say_who_failed() {
        let status = Failure::Call(CallError::Status {
            code: crust_client::Code::NotFound,
            message: "m".into(),
        });
        assert_eq!(status.exit_code(), 1);
        let timed_out = Failure::Call(CallError::TimedOut {
            method: "Info",
            timeout: Duration::from_secs(1),
        });
        assert_eq!(timed_out.exit_code(), 3);
        let broken = Failure::Call(CallError::Connection {
            method: "Info",
            detail: "eof".into(),
        });
        assert_eq!(broken.exit_code(), 3);
        let refused = Failure::Connect(ConnectError::Unreachable {
            addr: "unix:///x".into(),
            source: std::io::Error::from_raw_os_error(libc::ECONNREFUSED),
        });
        assert_eq!(refused.exit_code(), 3);
    }
}

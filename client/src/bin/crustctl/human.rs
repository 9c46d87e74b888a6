//! crustctl's default output: what happened, in a sentence or an aligned
//! table. Pure functions from responses to text, so they are tested here.

use crust_client::proto::{self, volume_usage::Unit};
use crust_client::protobuf::{Enum, EnumOrUnknown};

/// The name of an enum value, or its number when this build does not know it.
fn enum_name<E: Enum + std::fmt::Debug>(v: EnumOrUnknown<E>) -> String {
    match v.enum_value() {
        Ok(e) => format!("{e:?}"),
        Err(n) => format!("UNKNOWN({n})"),
    }
}

/// Bytes in binary units, one decimal: `512 B`, `1.5 KiB`, `10.0 GiB`.
pub fn size(bytes: i64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes.unsigned_abs() < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v.abs() >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Milliseconds as seconds with millisecond precision: `1.234s`.
fn seconds(ms: u64) -> String {
    format!("{}.{:03}s", ms / 1000, ms % 1000)
}

/// Rows of cells as left-aligned columns two spaces apart.
fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

pub fn capabilities(r: &proto::GetCapabilitiesResponse) -> String {
    if r.capabilities.is_empty() {
        return "the agent reports no optional capabilities\n".into();
    }
    r.capabilities
        .iter()
        .map(|c| format!("{}\n", enum_name(*c).trim_start_matches("CAPABILITY_")))
        .collect()
}

pub fn filesystems(r: &proto::GetSupportedFileSystemsResponse) -> String {
    r.file_systems.iter().map(|f| format!("{f}\n")).collect()
}

pub fn info(r: &proto::GetAgentInfoResponse) -> String {
    let mut rows = vec![
        vec!["version".into(), r.version.clone()],
        vec!["kernel".into(), r.kernel_release.clone()],
        vec![
            "init mode".into(),
            if r.init_mode {
                "yes (PID 1)".into()
            } else {
                "no".into()
            },
        ],
        vec!["uptime".into(), seconds(r.uptime_ms)],
        vec![
            "memory (RSS)".into(),
            size(r.rss_bytes.min(i64::MAX as u64) as i64),
        ],
    ];
    match r.boot.as_ref() {
        Some(b) => {
            rows.push(vec![
                "boot timeline".into(),
                "(since the kernel started)".into(),
            ]);
            for (name, ms) in [
                ("agent start", b.agent_start_ms),
                ("mounts done", b.mounts_done_ms),
                ("modules loaded", b.modules_loaded_ms),
                ("listening", b.listening_ms),
            ] {
                rows.push(vec![format!("  {name}"), seconds(ms)]);
            }
        }
        None => rows.push(vec!["boot timeline".into(), "not reported".into()]),
    }
    // Only when there is one: the agent could not write its state (a full or
    // read-only state filesystem), so publish and bind are refused.
    if !r.state_problem.is_empty() {
        rows.push(vec!["state".into(), r.state_problem.clone()]);
    }
    table(&rows)
}

pub fn list(r: &proto::ListVolumesResponse) -> String {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    list_at(r, now_ms)
}

/// `list`, with the trim schedules' times said relative to `now_ms`.
fn list_at(r: &proto::ListVolumesResponse, now_ms: i64) -> String {
    if r.volumes.is_empty() {
        return "no volumes published\n".into();
    }
    let mut rows = vec![[
        "VOLUME", "DEVICE", "SERIAL", "MODE", "FS", "ACCESS", "SIZE", "STATE", "PATH", "BINDS",
    ]
    .map(String::from)
    .to_vec()];
    for v in &r.volumes {
        let binds = if v.bind_targets.is_empty() {
            "-".to_string()
        } else if v.binds.is_empty() {
            // An agent that lists targets only.
            v.bind_targets.join(",")
        } else {
            let each: Vec<String> = v.binds.iter().map(bind_info).collect();
            each.join(",")
        };
        let serial = if v.serial.is_empty() {
            "-".to_string()
        } else {
            v.serial.clone()
        };
        rows.push(vec![
            v.volume_id.clone(),
            v.device.clone(),
            serial,
            match v.volume_mode.enum_value() {
                Ok(proto::VolumeMode::BLOCK) => "block".to_string(),
                Ok(proto::VolumeMode::FILESYSTEM) => "filesystem".to_string(),
                Err(_) => enum_name(v.volume_mode).to_lowercase(),
            } + &encryption(v),
            if v.fs_type.is_empty() {
                "-".into()
            } else {
                v.fs_type.clone()
            },
            if v.read_only { "ro" } else { "rw" }.into(),
            if v.device_bytes > 0 {
                size(i64::try_from(v.device_bytes).unwrap_or(i64::MAX))
            } else {
                "-".into()
            },
            state(v),
            v.guest_path.clone(),
            binds,
        ]);
    }
    let trims: String = r.volumes.iter().filter_map(|v| trim(v, now_ms)).collect();
    table(&rows) + &trims
}

/// A volume's trim schedule, one line, if it has one:
/// `vol-1: trimmed every 1h; last 5m ago, 12.0 MiB in 3.2 ms; next in 55m`.
fn trim(v: &proto::VolumeInfo, now_ms: i64) -> Option<String> {
    let t = v.trim.as_ref()?;
    let last = if t.last_unix_ms == 0 {
        "none yet".to_string()
    } else {
        format!(
            "{} ago, {} in {:.1} ms",
            span(now_ms.saturating_sub(t.last_unix_ms)),
            size(i64::try_from(t.last_bytes).unwrap_or(i64::MAX)),
            t.last_duration_us as f64 / 1000.0
        )
    };
    let failed = if t.last_error.is_empty() {
        String::new()
    } else {
        format!("; the last try failed: {}", t.last_error)
    };
    Some(format!(
        "{}: trimmed every {}; last {last}{failed}; next in {}\n",
        v.volume_id,
        span(i64::from(t.interval_s) * 1000),
        span(t.next_unix_ms.saturating_sub(now_ms).max(0))
    ))
}

/// Milliseconds as the largest units that say them: `1h30m`, `45s`, `0s`.
fn span(ms: i64) -> String {
    let mut s = ms.max(0) / 1000;
    let mut out = String::new();
    for (unit, secs) in [("d", 86400), ("h", 3600), ("m", 60)] {
        if s >= secs {
            out += &format!("{}{unit}", s / secs);
            s %= secs;
        }
    }
    if s > 0 || out.is_empty() {
        out += &format!("{s}s");
    }
    out
}

/// A bind's target, and its mappings when it is idmapped:
/// `/run/crust/b(uid 0:100000:65536 gid 0:100000:65536)`.
fn bind_info(b: &proto::BindInfo) -> String {
    if b.uid_mappings.is_empty() && b.gid_mappings.is_empty() {
        return b.target.clone();
    }
    format!(
        "{}(uid {} gid {})",
        b.target,
        id_maps(&b.uid_mappings),
        id_maps(&b.gid_mappings)
    )
}

/// Mappings as crustctl takes them: `CONTAINER:HOST:LEN`, joined by `+`.
fn id_maps(m: &[proto::IDMapping]) -> String {
    let each: Vec<String> = m
        .iter()
        .map(|r| format!("{}:{}:{}", r.container_id, r.host_id, r.length))
        .collect();
    each.join("+")
}

/// `+luks2(aes-xts-plain64/512)` after the mode of an encrypted volume,
/// `+integrity` and `+discards` where they apply; nothing for one in the clear.
fn encryption(v: &proto::VolumeInfo) -> String {
    let Some(e) = v.encryption.as_ref() else {
        return String::new();
    };
    let mut s = format!("+{}({}/{})", e.kind, e.cipher, e.key_bits);
    if !e.integrity.is_empty() {
        s += &format!("+integrity({})", e.integrity);
    }
    if e.allow_discards {
        s += "+discards";
    }
    s
}

/// `ready`, or `publishing (123,456 entries)` while the fsGroup walk runs.
fn state(v: &proto::VolumeInfo) -> String {
    if !v.freeze_id.is_empty() {
        return format!("frozen ({} s left)", v.frozen_ms_left.div_ceil(1000));
    }
    match v.state.enum_value() {
        Ok(proto::VolumeState::VOLUME_STATE_READY) => "ready".into(),
        Ok(proto::VolumeState::VOLUME_STATE_PUBLISHING) => {
            format!("publishing ({} entries)", thousands(v.ownership_done))
        }
        Err(_) => enum_name(v.state).to_lowercase(),
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let groups: Vec<&str> = digits
        .as_bytes()
        .rchunks(3)
        .rev()
        .map(|g| std::str::from_utf8(g).unwrap_or(""))
        .collect();
    groups.join(",")
}

/// `read_only` is whether the request asked for a read-only mount (its flag
/// or an `ro` option): the agent leaves such a volume's ownership alone, as
/// kubelet does, and reports it as skipped.
pub fn publish(volume_id: &str, read_only: bool, r: &proto::PublishVolumeResponse) -> String {
    let mut out = if r.already_published {
        format!(
            "{volume_id} was already published at {} (device {})\n",
            r.guest_path, r.device
        )
    } else {
        format!(
            "published {volume_id} at {} (device {})\n",
            r.guest_path, r.device
        )
    };
    if let Some(o) = r.ownership.as_ref() {
        if o.skipped && read_only {
            out.push_str(
                "ownership: not applied: the volume is mounted read-only (kubelet does not apply fsGroup to a read-only volume either)\n",
            );
        } else if o.skipped {
            out.push_str(
                "ownership: the root already had the right group; walk skipped (OnRootMismatch)\n",
            );
        } else {
            out.push_str(&format!(
                "ownership: visited {} entries, changed {}, {} errors, in {}\n",
                o.visited,
                o.changed,
                o.errors,
                seconds(o.duration_us / 1000)
            ));
        }
        if o.mounts_skipped > 0 {
            out.push_str(&not_entered(o));
        }
    }
    if !r.options_not_applied.is_empty() {
        out.push_str(&format!(
            "left out of the mount (this guest has no SELinux, so no label applies): {}\n",
            r.options_not_applied.join(",")
        ));
    }
    out
}

/// The mount points a walk did not enter: why their files kept their group.
fn not_entered(o: &proto::OwnershipReport) -> String {
    let n = o.mounts_skipped;
    let mut names = o.skipped_mount_points.join(", ");
    let more = n.saturating_sub(o.skipped_mount_points.len() as u64);
    if more > 0 {
        names.push_str(&format!(", and {more} more"));
    }
    let what = if n == 1 {
        "mount point"
    } else {
        "mount points"
    };
    format!(
        "ownership: {n} {what} not entered (what is at and below them kept its group): {names}\n"
    )
}

pub fn frozen(ids: &[String], r: &proto::FreezeVolumesResponse) -> String {
    format!(
        "frozen {} as {}; thawed by the agent in {} s unless `crustctl thaw {}` comes first\n",
        ids.join(" "),
        r.freeze_id,
        r.timeout_ms.div_ceil(1000),
        r.freeze_id
    )
}

/// A thaw's answer; `forced`: the volumes a forced thaw named.
pub fn thawed(forced: Option<&[String]>, r: &proto::ThawVolumesResponse) -> String {
    let mut out = String::new();
    if !r.thawed.is_empty() {
        out += &format!("thawed {}\n", r.thawed.join(" "));
    }
    let not: Vec<&str> = forced
        .unwrap_or_default()
        .iter()
        .filter(|id| !r.thawed.contains(id))
        .map(String::as_str)
        .collect();
    match forced {
        Some(_) if !not.is_empty() => {
            out += &format!("{} not frozen; nothing to do\n", not.join(" "))
        }
        None if r.thawed.is_empty() => {
            out += "the freeze held until its thaw; nothing was left frozen\n"
        }
        _ => {}
    }
    out
}

pub fn trimmed(volume_id: &str, r: &proto::TrimVolumeResponse) -> String {
    format!(
        "{volume_id}: {} ({} bytes) given back to the disk, over {} of filesystem, in {} ms\n",
        size(i64::try_from(r.trimmed_bytes).unwrap_or(i64::MAX)),
        r.trimmed_bytes,
        size(i64::try_from(r.covered_bytes).unwrap_or(i64::MAX)),
        r.duration_us / 1000
    )
}

pub fn health(volume_id: &str, r: &proto::GetVolumeHealthResponse) -> String {
    if r.health.is_empty() {
        return format!("{volume_id}: healthy\n");
    }
    let mut out = String::new();
    for h in &r.health {
        out += &format!(
            "{volume_id}: {} {}: {}\n",
            enum_name(h.status),
            h.reason,
            h.message
        );
    }
    out
}

pub fn unpublish(volume_id: &str, r: &proto::UnpublishVolumeResponse) -> String {
    if r.was_published {
        format!("unpublished {volume_id}\n")
    } else {
        format!("{volume_id} was not published; nothing to do\n")
    }
}

pub fn stats(volume_id: &str, r: &proto::GetVolumeStatsResponse) -> String {
    let mut rows = vec![["", "USED", "TOTAL", "AVAILABLE", "USE%"]
        .map(String::from)
        .to_vec()];
    for u in &r.usage {
        let (name, fmt): (String, fn(i64) -> String) = match u.unit.enum_value() {
            Ok(Unit::BYTES) => ("bytes".into(), size),
            Ok(Unit::INODES) => ("inodes".into(), |n| n.to_string()),
            _ => (enum_name(u.unit).to_lowercase(), |n| n.to_string()),
        };
        let pct = if u.total > 0 {
            format!("{}%", (u.used as f64 * 100.0 / u.total as f64).round())
        } else {
            "-".into()
        };
        rows.push(vec![name, fmt(u.used), fmt(u.total), fmt(u.available), pct]);
    }
    let condition = match r.condition.as_ref() {
        None => "not reported".to_string(),
        Some(c) if c.abnormal => format!("ABNORMAL: {}", c.message),
        Some(c) if c.message.is_empty() => "normal".to_string(),
        Some(c) => format!("normal ({})", c.message),
    };
    let mut out = format!("volume {volume_id}\n");
    if r.usage.is_empty() {
        out.push_str("usage: not reported\n");
    } else {
        out.push_str(&table(&rows));
    }
    out.push_str(&format!("condition: {condition}\n"));
    out
}

pub fn expand(volume_id: &str, r: &proto::ExpandVolumeResponse) -> String {
    if r.capacity_bytes == r.device_bytes {
        return format!(
            "{volume_id}: {} ({} bytes), the size of its device\n",
            size(r.capacity_bytes),
            r.capacity_bytes
        );
    }
    format!(
        "{volume_id}: filesystem is {} ({} bytes) on a device of {} ({} bytes)\n",
        size(r.capacity_bytes),
        r.capacity_bytes,
        size(r.device_bytes),
        r.device_bytes
    )
}

pub fn bind(req: &proto::BindMountRequest, r: &proto::BindMountResponse) -> String {
    let source = if req.subpath.is_empty() {
        req.volume_id.clone()
    } else {
        format!("{}/{}", req.volume_id, req.subpath)
    };
    let mut mode = match (req.read_only, r.recursive_read_only_applied) {
        (false, _) => "read-write",
        (true, false) => "read-only",
        (true, true) => "recursively read-only",
    }
    .to_string();
    if !req.uid_mappings.is_empty() {
        mode += &format!(
            ", idmapped uid {} gid {}",
            id_maps(&req.uid_mappings),
            id_maps(&req.gid_mappings)
        );
    }
    if r.already_mounted {
        format!("{source} was already bound at {} ({mode})\n", req.target)
    } else {
        format!("bound {source} at {} ({mode})\n", req.target)
    }
}

pub fn unmount(target: &str, r: &proto::UnmountResponse) -> String {
    if r.was_mounted {
        format!("unmounted {target}\n")
    } else {
        format!("{target} was not mounted; nothing to do\n")
    }
}

pub fn shutdown(r: &proto::ShutdownResponse) -> String {
    format!(
        "the agent is shutting down; {} volumes unmounted\n",
        r.volumes_unmounted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_use_binary_units() {
        let table = [
            (0, "0 B"),
            (1023, "1023 B"),
            (1024, "1.0 KiB"),
            (1536, "1.5 KiB"),
            (10 << 30, "10.0 GiB"),
            ((1 << 40) - 1, "1024.0 GiB"),
            (1 << 40, "1.0 TiB"),
            (i64::MAX, "8.0 EiB"),
            (-2048, "-2.0 KiB"),
        ];
        for (n, want) in table {
            assert_eq!(size(n), want, "{n}");
        }
    }

    #[test]
    fn stats_table_is_aligned_and_names_the_condition() {
        let r = proto::GetVolumeStatsResponse {
            usage: vec![
                proto::VolumeUsage {
                    available: 3 << 30,
                    total: 4 << 30,
                    used: 1 << 30,
                    unit: Unit::BYTES.into(),
                    ..Default::default()
                },
                proto::VolumeUsage {
                    available: 262_133,
                    total: 262_144,
                    used: 11,
                    unit: Unit::INODES.into(),
                    ..Default::default()
                },
            ],
            condition: Some(proto::VolumeCondition {
                abnormal: true,
                message: "ext4 recorded 2 errors".into(),
                ..Default::default()
            })
            .into(),
            ..Default::default()
        };
        assert_eq!(
            stats("vol-1", &r),
            "volume vol-1\n\
             \x20       USED     TOTAL    AVAILABLE  USE%\n\
             bytes   1.0 GiB  4.0 GiB  3.0 GiB    25%\n\
             inodes  11       262144   262133     0%\n\
             condition: ABNORMAL: ext4 recorded 2 errors\n"
        );
        let empty = proto::GetVolumeStatsResponse::new();
        assert_eq!(
            stats("v", &empty),
            "volume v\nusage: not reported\ncondition: not reported\n"
        );
    }

    #[test]
    fn publish_says_where_and_reports_ownership() {
        let mut r = proto::PublishVolumeResponse {
            guest_path: "/run/crust/volumes/vol-1".into(),
            device: "/dev/vdb".into(),
            ..Default::default()
        };
        assert_eq!(
            publish("vol-1", false, &r),
            "published vol-1 at /run/crust/volumes/vol-1 (device /dev/vdb)\n"
        );
        r.already_published = true;
        r.ownership = Some(proto::OwnershipReport {
            skipped: true,
            ..Default::default()
        })
        .into();
        assert_eq!(
            publish("vol-1", false, &r),
            "vol-1 was already published at /run/crust/volumes/vol-1 (device /dev/vdb)\n\
             ownership: the root already had the right group; walk skipped (OnRootMismatch)\n"
        );
        // A read-only volume: not walked, and said why.
        assert!(
            publish("vol-1", true, &r).ends_with(
                "ownership: not applied: the volume is mounted read-only (kubelet does not apply fsGroup to a read-only volume either)\n"
            ),
            "{}",
            publish("vol-1", true, &r)
        );
        r.ownership = Some(proto::OwnershipReport {
            visited: 102_400,
            changed: 102_399,
            errors: 1,
            duration_us: 1_234_567,
            ..Default::default()
        })
        .into();
        assert!(publish("vol-1", false, &r)
            .ends_with("ownership: visited 102400 entries, changed 102399, 1 errors, in 1.234s\n"));
        // Mount points not entered: counted, the first named, the rest said.
        let report = |count: u64, names: &[&str]| {
            Some(proto::OwnershipReport {
                visited: 3,
                mounts_skipped: count,
                skipped_mount_points: names.iter().map(|n| n.to_string()).collect(),
                ..Default::default()
            })
            .into()
        };
        r.ownership = report(1, &["cache"]);
        assert!(
            publish("vol-1", false, &r).ends_with(
                "in 0.000s\nownership: 1 mount point not entered \
             (what is at and below them kept its group): cache\n"
            ),
            "{}",
            publish("vol-1", false, &r)
        );
        r.ownership = report(20, &["a/m", "b\\xffc"]);
        assert!(publish("vol-1", false, &r).ends_with(
            "ownership: 20 mount points not entered \
             (what is at and below them kept its group): a/m, b\\xffc, and 18 more\n"
        ));
        r.options_not_applied = vec!["context=system_u:object_r:container_file_t:s0".into()];
        assert!(publish("vol-1", false, &r).ends_with(
            "left out of the mount (this guest has no SELinux, so no label applies): \
             context=system_u:object_r:container_file_t:s0\n"
        ));
    }

    #[test]
    fn bind_names_the_mode_actually_obtained() {
        let mut req = proto::BindMountRequest {
            volume_id: "v".into(),
            target: "/run/crust/binds/t".into(),
            ..Default::default()
        };
        let mut r = proto::BindMountResponse::new();
        assert_eq!(
            bind(&req, &r),
            "bound v at /run/crust/binds/t (read-write)\n"
        );
        req.read_only = true;
        req.subpath = "data/logs".into();
        assert_eq!(
            bind(&req, &r),
            "bound v/data/logs at /run/crust/binds/t (read-only)\n"
        );
        r.recursive_read_only_applied = true;
        r.already_mounted = true;
        assert_eq!(
            bind(&req, &r),
            "v/data/logs was already bound at /run/crust/binds/t (recursively read-only)\n"
        );
    }

    /// An idmapped bind says its mappings, in the bind's answer and in the list.
    #[test]
    fn idmapped_binds_show_their_mappings() {
        let m = |container_id, host_id, length| proto::IDMapping {
            container_id,
            host_id,
            length,
            ..Default::default()
        };
        let req = proto::BindMountRequest {
            volume_id: "v".into(),
            target: "/run/crust/b/t".into(),
            uid_mappings: vec![m(0, 100000, 65536), m(65536, 5, 1)],
            gid_mappings: vec![m(0, 100000, 65536)],
            ..Default::default()
        };
        assert_eq!(
            bind(&req, &proto::BindMountResponse::new()),
            "bound v at /run/crust/b/t (read-write, idmapped uid 0:100000:65536+65536:5:1 gid 0:100000:65536)\n"
        );
        let plain = proto::BindInfo {
            target: "/run/crust/b/p".into(),
            ..Default::default()
        };
        let mapped = proto::BindInfo {
            target: "/run/crust/b/t".into(),
            uid_mappings: req.uid_mappings.clone(),
            gid_mappings: req.gid_mappings.clone(),
            ..Default::default()
        };
        assert_eq!(bind_info(&plain), "/run/crust/b/p");
        let r = proto::ListVolumesResponse {
            volumes: vec![proto::VolumeInfo {
                volume_id: "v".into(),
                bind_targets: vec![plain.target.clone(), mapped.target.clone()],
                binds: vec![plain, mapped],
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = list(&r);
        assert!(
            text.contains(
                "/run/crust/b/p,/run/crust/b/t(uid 0:100000:65536+65536:5:1 gid 0:100000:65536)"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_trim_schedule_is_a_line_below_the_table() {
        let mut v = proto::VolumeInfo {
            volume_id: "vol-1".into(),
            ..Default::default()
        };
        v.trim = crust_client::protobuf::MessageField::some(proto::TrimSchedule {
            interval_s: 5400,
            next_unix_ms: 1_000_000 + 61_000,
            ..Default::default()
        });
        let r = proto::ListVolumesResponse {
            volumes: vec![v.clone()],
            ..Default::default()
        };
        assert!(list_at(&r, 1_000_000)
            .ends_with("vol-1: trimmed every 1h30m; last none yet; next in 1m1s\n"));
        let t = v.trim.as_mut().unwrap();
        t.last_unix_ms = 1_000_000 - 300_000;
        t.last_bytes = 12 << 20;
        t.last_duration_us = 3_250;
        t.last_error = "FITRIM failed".into();
        let r = proto::ListVolumesResponse {
            volumes: vec![v],
            ..Default::default()
        };
        assert!(list_at(&r, 1_000_000).ends_with(
            "vol-1: trimmed every 1h30m; last 5m ago, 12.0 MiB in 3.2 ms; the last try failed: FITRIM failed; next in 1m1s\n"
        ), "{}", list_at(&r, 1_000_000));
    }

    #[test]
    fn list_is_a_table_or_says_none() {
        assert_eq!(
            list(&proto::ListVolumesResponse::new()),
            "no volumes published\n"
        );
        let r = proto::ListVolumesResponse {
            volumes: vec![
                proto::VolumeInfo {
                    volume_id: "vol-1".into(),
                    device: "/dev/vdb".into(),
                    serial: "s1".into(),
                    fs_type: "ext4".into(),
                    guest_path: "/run/crust/volumes/vol-1".into(),
                    bind_targets: vec!["/run/crust/b/1".into(), "/run/crust/b/2".into()],
                    ..Default::default()
                },
                proto::VolumeInfo {
                    volume_id: "data".into(),
                    device: "/dev/vdc".into(),
                    fs_type: "xfs".into(),
                    guest_path: "/run/crust/volumes/data".into(),
                    read_only: true,
                    device_bytes: 1 << 30,
                    ..Default::default()
                },
                proto::VolumeInfo {
                    volume_id: "raw".into(),
                    device: "/dev/vdd".into(),
                    guest_path: "/run/crust/volumes/raw".into(),
                    volume_mode: proto::VolumeMode::BLOCK.into(),
                    device_bytes: 64 << 20,
                    ..Default::default()
                },
                proto::VolumeInfo {
                    volume_id: "big".into(),
                    device: "/dev/vde".into(),
                    fs_type: "ext4".into(),
                    guest_path: "/run/crust/volumes/big".into(),
                    device_bytes: 2 << 40,
                    state: proto::VolumeState::VOLUME_STATE_PUBLISHING.into(),
                    ownership_done: 123_456,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        assert_eq!(
            list(&r),
"VOLUME  DEVICE    SERIAL  MODE        FS    ACCESS  SIZE      STATE                         PATH                      BINDS\n\
             vol-1   /dev/vdb  s1      filesystem  ext4  rw      -         ready                         /run/crust/volumes/vol-1  /run/crust/b/1,/run/crust/b/2\n\
             data    /dev/vdc  -       filesystem  xfs   ro      1.0 GiB   ready                         /run/crust/volumes/data   -\n\
             raw     /dev/vdd  -       block       -     rw      64.0 MiB  ready                         /run/crust/volumes/raw    -\n\
             big     /dev/vde  -       filesystem  ext4  rw      2.0 TiB   publishing (123,456 entries)  /run/crust/volumes/big    -\n"
        );
    }

    #[test]
    fn thousands_are_grouped() {
        for (n, want) in [
            (0, "0"),
            (999, "999"),
            (1_000, "1,000"),
            (123_456, "123,456"),
            (1_000_000, "1,000,000"),
            (u64::MAX, "18,446,744,073,709,551,615"),
        ] {
            assert_eq!(thousands(n), want);
        }
    }

    #[test]
    fn info_shows_a_state_problem_only_when_there_is_one() {
        let mut r = proto::GetAgentInfoResponse::default();
        assert!(!info(&r).contains("state"));
        r.state_problem = "the state directory is full".into();
        let text = info(&r);
        let last = text.lines().last().unwrap();
        assert!(
            last.starts_with("state ") && last.ends_with(" the state directory is full"),
            "{text}"
        );
    }

    #[test]
    fn info_shows_the_boot_timeline() {
        let r = proto::GetAgentInfoResponse {
            version: "0.1.0".into(),
            kernel_release: "6.12.0".into(),
            init_mode: true,
            uptime_ms: 61_002,
            rss_bytes: 1_572_864,
            boot: Some(proto::BootTimeline {
                agent_start_ms: 312,
                mounts_done_ms: 314,
                modules_loaded_ms: 350,
                listening_ms: 351,
                ..Default::default()
            })
            .into(),
            ..Default::default()
        };
        assert_eq!(
            info(&r),
            "version           0.1.0\n\
             kernel            6.12.0\n\
             init mode         yes (PID 1)\n\
             uptime            61.002s\n\
             memory (RSS)      1.5 MiB\n\
             boot timeline     (since the kernel started)\n\
             \x20 agent start     0.312s\n\
             \x20 mounts done     0.314s\n\
             \x20 modules loaded  0.350s\n\
             \x20 listening       0.351s\n"
        );
    }

    #[test]
    fn capabilities_drop_the_prefix() {
        let r = proto::GetCapabilitiesResponse {
            capabilities: vec![
                proto::Capability::CAPABILITY_VOLUME_STATS.into(),
                EnumOrUnknown::from_i32(42),
            ],
            ..Default::default()
        };
        assert_eq!(capabilities(&r), "VOLUME_STATS\nUNKNOWN(42)\n");
    }
}

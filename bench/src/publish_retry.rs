//! A publish whose fsGroup walk outlives its caller's deadline:
//! the 1M-entry volume of `fsgroup_scale`, published by the release agent on
//! the host, once by a caller whose deadline is 2 s and who retries every
//! 2 s until the agent answers OK (kubelet's way with slow node operations;
//! each retry joins the walk the first one started), beside once by a caller
//! who waits for the walk uninterrupted. Each publish asks for an fsGroup
//! the tree does not have yet, so both walk a fresh tree (every entry
//! changes), and each is verified by the walk's report (every entry
//! visited and changed).

use std::path::Path;
use std::time::{Duration, Instant};

use crust_client::proto::{
    FsGroup, FsGroupChangePolicy, PublishVolumeRequest, UnpublishVolumeRequest,
};
use crust_client::{protobuf::MessageField, unary, Address, CallError, CrustClient};
use serde_json::json;

use crate::host_agent::spawn_agent;
use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{secs, R};

/// The caller's deadline, which is also how often it retries.
const DEADLINE: Duration = Duration::from_secs(2);
/// The uninterrupted caller's deadline: longer than any walk here.
const FOREVER: Duration = Duration::from_secs(3600);

/// The figure's key, title and target, for main.rs.
pub fn key() -> (&'static str, &'static str, &'static str) {
    (
        "publish_1m_retry",
        "Publish of a fresh 1M-entry volume (fsGroup walk), caller deadline 2 s retrying every 2 s, beside one uninterrupted publish",
        "within 10% of the uninterrupted publish",
    )
}

fn request(dev: &str, gid: u32) -> PublishVolumeRequest {
    let mut r = PublishVolumeRequest::new();
    r.volume_id = "big".into();
    r.set_device_path(dev.into());
    r.fs_type = "ext4".into();
    let mut g = FsGroup::new();
    g.gid = gid;
    g.change_policy = FsGroupChangePolicy::ALWAYS.into();
    r.fs_group = MessageField::some(g);
    r
}

/// One publish until OK, each call with `deadline`, retried at once when it
/// answers DEADLINE_EXCEEDED: (time to OK, calls made).
fn publish(
    addr: &Address,
    req: &PublishVolumeRequest,
    deadline: Duration,
    entries: u64,
) -> R<(Duration, u32)> {
    let t = Instant::now();
    let mut calls = 0;
    loop {
        calls += 1;
        let wait = deadline + Duration::from_secs(1);
        match unary::publish_volume(addr, Duration::from_secs(10), req, deadline, wait) {
            Ok(r) => {
                let took = t.elapsed();
                let o = r
                    .ownership
                    .as_ref()
                    .ok_or("the publish reported no fsGroup walk")?;
                if (o.visited, o.changed, o.errors) != (entries, entries, 0) {
                    return Err(format!(
                        "the walk visited {} and changed {} of {entries} entries, {} errors",
                        o.visited, o.changed, o.errors
                    ));
                }
                return Ok((took, calls));
            }
            Err(CallError::Status { code, .. }) if code == "DEADLINE_EXCEEDED" => {}
            Err(e) => return Err(format!("publish (call {calls}): {e}")),
        }
        if t.elapsed() > FOREVER {
            return Err(format!("no OK after {calls} calls"));
        }
    }
}

fn unpublish(c: &CrustClient) -> R<()> {
    let mut r = UnpublishVolumeRequest::new();
    r.volume_id = "big".into();
    c.unpublish_volume(&r)
        .map(|_| ())
        .map_err(|e| format!("unpublish: {e}"))
}

/// The figure, on `dev` (the 1M-entry ext4, not mounted on the host).
pub fn figure(dev: &str, work: &Path, entries: u64) -> Figure {
    let (k, title, target) = key();
    match measure(dev, work, entries) {
        Ok((once, (retried, calls))) => {
            let ratio = secs(retried) / secs(once);
            Figure {
                key: k.into(),
                title: title.into(),
                ours: format!("{} ({calls} calls of 2 s)", fmt_secs(secs(retried))),
                baseline: format!("one uninterrupted publish {}", fmt_secs(secs(once))),
                ratio: format!("{ratio:.3}x"),
                target: target.into(),
                verdict: Verdict::from(ratio <= 1.10),
                data: json!({
                    "retried_s": secs(retried), "calls": calls,
                    "uninterrupted_s": secs(once), "entries": entries,
                    "deadline_s": secs(DEADLINE),
                    "note": "release agent on the host; each publish walks a fresh tree (a new fsGroup)",
                }),
            }
        }
        Err(e) => Figure::not_measured(k, title, target, e),
    }
}

fn measure(dev: &str, work: &Path, entries: u64) -> R<(Duration, (Duration, u32))> {
    let (agent, _) = spawn_agent(work, "retry")?;
    let addr = Address::Unix(agent.sock.clone());
    let mut c = CrustClient::connect(&addr, Duration::from_secs(10))
        .map_err(|e| format!("cannot connect to the agent: {e}"))?;
    // An unpublish flushes a million changed inodes.
    c.set_timeout(Duration::from_secs(600));
    let (once, _) = publish(&addr, &request(dev, 7101), FOREVER, entries)?;
    unpublish(&c)?;
    let retried = publish(&addr, &request(dev, 7102), DEADLINE, entries)?;
    unpublish(&c)?;
    if retried.1 < 2 {
        return Err(format!(
            "the walk took {} and so fit one 2 s deadline: nothing was retried",
            fmt_secs(secs(retried.0))
        ));
    }
    Ok((once, retried))
}

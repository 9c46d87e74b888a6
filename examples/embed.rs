//! A guest agent that embeds crust-agent's volume table and serves nothing:
//! it publishes the ext4 or xfs disk it is given with the pod's fsGroup,
//! binds it read-only (recursively, where the kernel can) for a container,
//! reads its usage and health, and takes it all down again. What a Rust
//! guest agent (kata-agent is one) would do from its own RPC handlers.
//!
//!     cargo run -p crust-agent --example embed -- ROOT DEVICE FS_TYPE
//!
//! `make test` runs it on a loop device (scripts/embed-example.sh).

use std::process::ExitCode;
use std::time::Duration;

use crust_agent::embed::{pb, Table};

fn run(root: &str, device: &str, fs: &str) -> Result<(), String> {
    let table = Table::open(root.as_ref()).map_err(|e| format!("open: {e}"))?;
    let deadline = Some(Duration::from_secs(60));

    let mut p = pb::PublishVolumeRequest::new();
    p.volume_id = "example".into();
    p.set_device_path(device.into());
    p.fs_type = fs.into();
    let mut g = pb::FsGroup::new();
    g.gid = 2000;
    p.fs_group = Some(g).into();
    let published = table
        .publish(&p, deadline)
        .map_err(|e| format!("publish: {e}"))?;
    println!(
        "published at {} ({})",
        published.guest_path, published.device
    );

    // The same request again is idempotent; another filesystem is refused
    // with the code a ttrpc client would get.
    let again = table
        .publish(&p, deadline)
        .map_err(|e| format!("publish again: {e}"))?;
    assert!(again.already_published);
    let mut other = p.clone();
    other.fs_type = if fs == "ext4" { "xfs" } else { "ext4" }.into();
    match table.publish(&other, deadline) {
        Err(e) => println!("a conflicting publish is refused: {}", e.code.name()),
        Ok(_) => return Err("a conflicting publish was accepted".into()),
    }

    let mut b = pb::BindMountRequest::new();
    b.volume_id = "example".into();
    b.target = format!("{root}/pods/example/data");
    b.read_only = true;
    b.recursive_read_only = pb::RecursiveReadOnly::IF_POSSIBLE.into();
    let bound = table.bind(&b, deadline).map_err(|e| format!("bind: {e}"))?;
    println!(
        "bound read-only at {} (recursively: {})",
        b.target, bound.recursive_read_only_applied
    );

    let mut s = pb::GetVolumeStatsRequest::new();
    s.volume_id = "example".into();
    let st = table
        .stats(&s, deadline)
        .map_err(|e| format!("stats: {e}"))?;
    for u in &st.usage {
        println!("usage: {} of {} {:?}", u.used, u.total, u.unit);
    }
    let mut h = pb::GetVolumeHealthRequest::new();
    h.volume_id = "example".into();
    let health = table
        .health(&h, deadline)
        .map_err(|e| format!("health: {e}"))?;
    println!("health: {} problem(s)", health.health.len());
    if !health.health.is_empty() {
        return Err(format!("a fresh volume is unhealthy: {:?}", health.health));
    }
    println!("listed: {} volume(s)", table.list().volumes.len());

    let mut u = pb::UnmountRequest::new();
    u.target = b.target.clone();
    table
        .unmount(&u, deadline)
        .map_err(|e| format!("unmount: {e}"))?;
    let mut up = pb::UnpublishVolumeRequest::new();
    up.volume_id = "example".into();
    let out = table
        .unpublish(&up, deadline)
        .map_err(|e| format!("unpublish: {e}"))?;
    println!("unpublished: {}", out.was_published);
    if table.shutdown() != 0 {
        return Err("a volume was left published".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [root, device, fs] = args.as_slice() else {
        eprintln!("usage: embed ROOT DEVICE FS_TYPE");
        return ExitCode::from(2);
    };
    match run(root, device, fs) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("embed: {e}");
            ExitCode::FAILURE
        }
    }
}

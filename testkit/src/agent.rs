//! The crust.v1 side of a test: request builders and readers of answers,
//! for tests that talk to the agent over a unix socket or in a guest.

use std::path::Path;

pub use crust_protocols::crust as pb;
use crust_protocols::protobuf::MessageField;
use crust_protocols::ttrpc;

/// A call context with a generous timeout.
pub fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_timeout(60_000_000_000)
}

/// A call's result in one line: `OK {fields}`, `CODE: message`, or `no
/// answer: why` when no status came back (the connection or the guest went).
pub fn said<M: crust_protocols::protobuf::MessageFull>(r: &ttrpc::Result<M>) -> String {
    match r {
        Ok(m) => format!(
            "OK {{{}}}",
            crust_protocols::protobuf::text_format::print_to_string(m).trim()
        ),
        Err(ttrpc::Error::RpcStatus(s)) => format!("{:?}: {}", s.code(), s.message()),
        Err(e) => format!("no answer: {e}"),
    }
}

/// The gRPC code name of a failed call.
pub fn code<T: std::fmt::Debug>(r: ttrpc::Result<T>) -> String {
    match r {
        Err(ttrpc::Error::RpcStatus(s)) => format!("{:?}", s.code()),
        other => panic!("expected an error status, got {other:?}"),
    }
}

/// The message of a failed call.
pub fn message<T: std::fmt::Debug>(r: ttrpc::Result<T>) -> String {
    match r {
        Err(ttrpc::Error::RpcStatus(s)) => s.message().to_string(),
        other => panic!("expected an error status, got {other:?}"),
    }
}

/// A publish by device path; `fs` "block" asks for a block volume.
pub fn publish_req(id: &str, device: &str, fs: &str) -> pb::PublishVolumeRequest {
    let mut r = pb::PublishVolumeRequest::new();
    r.volume_id = id.into();
    r.set_device_path(device.into());
    if fs == "block" {
        r.volume_mode = pb::VolumeMode::BLOCK.into();
    } else {
        r.fs_type = fs.into();
    }
    r
}

/// A publish by disk serial (a hot-plugged disk in a guest) with a minute
/// for the disk to show, and `gid` as the fsGroup when given.
pub fn serial_publish_req(
    id: &str,
    serial: &str,
    fs: &str,
    gid: Option<u32>,
) -> pb::PublishVolumeRequest {
    let mut r = pb::PublishVolumeRequest::new();
    r.volume_id = id.into();
    r.set_serial(serial.into());
    r.fs_type = fs.into();
    r.timeout_ms = 60_000;
    if let Some(g) = gid {
        let mut f = pb::FsGroup::new();
        f.gid = g;
        r.fs_group = MessageField::some(f);
    }
    r
}

pub fn unpublish_req(id: impl Into<String>) -> pb::UnpublishVolumeRequest {
    let mut r = pb::UnpublishVolumeRequest::new();
    r.volume_id = id.into();
    r
}

pub fn stats_req(id: impl Into<String>) -> pb::GetVolumeStatsRequest {
    let mut r = pb::GetVolumeStatsRequest::new();
    r.volume_id = id.into();
    r
}

pub fn unmount_req(target: impl Into<String>) -> pb::UnmountRequest {
    let mut r = pb::UnmountRequest::new();
    r.target = target.into();
    r
}

pub fn fs_group(gid: u32, policy: pb::FsGroupChangePolicy) -> MessageField<pb::FsGroup> {
    let mut g = pb::FsGroup::new();
    g.gid = gid;
    g.change_policy = policy.into();
    MessageField::some(g)
}

pub fn bind_req(
    id: &str,
    target: &Path,
    subpath: &str,
    ro: bool,
    rro: pb::RecursiveReadOnly,
) -> pb::BindMountRequest {
    let mut r = pb::BindMountRequest::new();
    r.volume_id = id.into();
    r.target = target.display().to_string();
    r.subpath = subpath.into();
    r.read_only = ro;
    r.recursive_read_only = rro.into();
    r
}

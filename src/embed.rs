//! The volume table as a library, for a guest agent written in Rust that
//! serves its own protocol (kata-agent is one) and wants the agent's
//! volumes without running a second server.
//!
//! ```no_run
//! use std::time::Duration;
//! use crust_agent::embed::{pb, Table};
//!
//! let table = Table::open("/run/crust".as_ref())?;
//! let mut r = pb::PublishVolumeRequest::new();
//! r.volume_id = "pvc-1".into();
//! r.set_serial("vol-0001".into());
//! r.fs_type = "ext4".into();
//! r.trim_interval_s = 3600; // freed blocks go back to the host hourly, with jitter
//! let published = table.publish(&r, Some(Duration::from_secs(60)))?;
//! println!("mounted at {}", published.guest_path);
//! # Ok::<(), crust_agent::embed::Error>(())
//! ```
//!
//! Each call takes and answers crust.proto's messages (the wire contract,
//! docs/api.md) and fails with the code and sentence a ttrpc client of the
//! agent gets for the same request: one set of rules, whichever way in.
//! `timeout` is the caller's deadline (None: none, as a ttrpc request
//! without one). Calls on different volumes run at once from different
//! threads; a `Table` is `Send + Sync`.
//!
//! **Stable** (kept across minor versions, as the wire contract is):
//! [`Table`] and its methods, [`Error`], and the messages of [`pb`]
//! (fields are added, never renumbered or removed). Every other public
//! module of this crate is the agent's own inside, public for its tests
//! and tools, and changes without notice.
//!
//! What the table does not do for an embedder: listen anywhere, load
//! kernel modules, or act as PID 1. One table per root: a second `open` of
//! the same root (in this process or another agent) is refused, as a
//! second agent is.

use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::code::Code;
use crate::instance::{self, RootLock};
use crate::server::methods::{self, Method};
use crate::server::service::Service;
use crate::server::translate::Caller;
use crate::sys::sysfs::Sysfs;
use crate::system::{Gate, Timeline};
use crate::volumes::table::Volumes;

/// The wire contract's messages, the table's requests and answers.
pub use crust_protocols::crust as pb;

/// A refused or failed call: the code a ttrpc client would get (gRPC's
/// numbers and names), and its sentence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.name())]
pub struct Error {
    /// INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, ...
    pub code: Code,
    /// The same sentence the agent answers a client.
    pub message: String,
}

impl From<crate::error::Error> for Error {
    fn from(e: crate::error::Error) -> Error {
        Error {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

/// The agent's volume table on one root.
pub struct Table {
    service: Service,
    volumes: Arc<Volumes>,
    _root: RootLock,
}

impl Table {
    /// Opens the table at `root` (created if missing), takes back the
    /// volumes a previous run left (as a restarted agent does), and logs
    /// nothing.
    pub fn open(root: &Path) -> Result<Table, Error> {
        Table::open_logged(root, crate::logging::discard())
    }

    /// [`Table::open`], saying what happens on `log` (slog).
    pub fn open_logged(root: &Path, log: slog::Logger) -> Result<Table, Error> {
        let lock = instance::lock_root(root).map_err(|e| Error {
            code: Code::FailedPrecondition,
            message: e.to_string(),
        })?;
        let volumes = Volumes::open(root, Sysfs::system(), log.clone())?;
        // Nobody waits on this sender: Shutdown here only unpublishes.
        let (tx, _rx) = mpsc::channel();
        let service = Service::new(
            volumes.clone(),
            log,
            Instant::now(),
            Arc::new(Mutex::new(Timeline::default())),
            tx,
            Arc::new(Gate::new(true)),
        );
        Ok(Table {
            service,
            volumes,
            _root: lock,
        })
    }

    /// One call of the method `req` names, run as a ttrpc client's request
    /// runs (the service's method table), with `timeout` from now as its
    /// deadline (none past the clock's end).
    fn call<M: Method>(&self, req: &M, timeout: Option<Duration>) -> Result<M::Response, Error> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        Ok(methods::call(
            &self.service,
            req,
            &Caller::Deadline(deadline),
        )?)
    }

    /// A call whose handler never fails: a panic in it, logged by the call,
    /// goes on as a panic.
    fn infallible<M: Method>(&self, req: &M) -> M::Response {
        self.call(req, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// PublishVolume: finds the disk, checks its filesystem, mounts it at
    /// `<root>/volumes/<id>`, applies fsGroup.
    pub fn publish(
        &self,
        req: &pb::PublishVolumeRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::PublishVolumeResponse, Error> {
        self.call(req, timeout)
    }

    /// UnpublishVolume: its binds, a flush, its mount.
    pub fn unpublish(
        &self,
        req: &pb::UnpublishVolumeRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::UnpublishVolumeResponse, Error> {
        self.call(req, timeout)
    }

    /// GetVolumeStats: usage and condition.
    pub fn stats(
        &self,
        req: &pb::GetVolumeStatsRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::GetVolumeStatsResponse, Error> {
        self.call(req, timeout)
    }

    /// ExpandVolume: grows the filesystem online to its disk.
    pub fn expand(
        &self,
        req: &pb::ExpandVolumeRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::ExpandVolumeResponse, Error> {
        self.call(req, timeout)
    }

    /// BindMount: the volume or a subpath at a target beneath the root;
    /// idmapped with `uid_mappings` and `gid_mappings` (docs/semantics.md §7).
    pub fn bind(
        &self,
        req: &pb::BindMountRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::BindMountResponse, Error> {
        self.call(req, timeout)
    }

    /// Unmount: a bind the table made.
    pub fn unmount(
        &self,
        req: &pb::UnmountRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::UnmountResponse, Error> {
        self.call(req, timeout)
    }

    /// ListVolumes: never waits for a call in flight.
    pub fn list(&self) -> pb::ListVolumesResponse {
        self.infallible(&pb::ListVolumesRequest::new())
    }

    /// FreezeVolumes: a lease; only its id (`thaw`), its timeout, an
    /// unpublish, closing the table or a forced thaw ends it.
    pub fn freeze(
        &self,
        req: &pb::FreezeVolumesRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::FreezeVolumesResponse, Error> {
        self.call(req, timeout)
    }

    /// ThawVolumes: ends the freeze its id names, or (force) whatever
    /// holds the volumes named.
    pub fn thaw(&self, req: &pb::ThawVolumesRequest) -> Result<pb::ThawVolumesResponse, Error> {
        self.call(req, None)
    }

    /// TrimVolume: the filesystem's free space given back to its disk.
    pub fn trim(
        &self,
        req: &pb::TrimVolumeRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::TrimVolumeResponse, Error> {
        self.call(req, timeout)
    }

    /// GetVolumeHealth: CSI's list of what is wrong, empty when healthy.
    pub fn health(
        &self,
        req: &pb::GetVolumeHealthRequest,
        timeout: Option<Duration>,
    ) -> Result<pb::GetVolumeHealthResponse, Error> {
        self.call(req, timeout)
    }

    /// Unpublishes every volume and lets go of the root; answers how many
    /// were unpublished. Dropping a table without it leaves the volumes
    /// mounted for the next `open` to take back (and thaws them).
    pub fn shutdown(self) -> u32 {
        let n = self
            .infallible(&pb::ShutdownRequest::new())
            .volumes_unmounted;
        drop(self);
        n
    }
}

impl Drop for Table {
    /// Ends every freeze and stops the freeze timer before the root's lock
    /// is let go (the fields drop after this): a timer of this table must
    /// never thaw what a table opened next on the same root froze.
    fn drop(&mut self) {
        self.volumes.close_freezes();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_requests_answer_the_clients_codes_and_a_root_is_held_once() {
        let dir = tempfile::tempdir().unwrap();
        let t = Table::open(dir.path()).unwrap();
        let e = Table::open(dir.path()).err().unwrap();
        assert_eq!(e.code, Code::FailedPrecondition, "{e}");
        let mut r = pb::PublishVolumeRequest::new();
        r.volume_id = "../x".into();
        let e = t.publish(&r, None).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument, "{e}");
        r.volume_id = "x".into();
        r.set_serial("vol-x".into());
        r.fs_type = "ext4".into();
        r.trim_interval_s = 5;
        let e = t.publish(&r, None).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument, "{e}");
        assert!(e.message.contains("trim_interval_s 5"), "{e}");
        let mut s = pb::GetVolumeStatsRequest::new();
        s.volume_id = "nope".into();
        assert_eq!(t.stats(&s, None).unwrap_err().code, Code::NotFound);
        assert!(t.list().volumes.is_empty());
        assert_eq!(t.shutdown(), 0);
        // Let go: the root can be opened again.
        drop(Table::open(dir.path()).unwrap());
    }
}

//! What the service asks of the volume table, as a trait: the agent's
//! table (`Volumes`) answers it, and so does any stand-in that should be
//! reached only after the service's own translation and validation (the
//! fuzz targets' table that refuses everything).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cancel::Cancel;
use crate::error::Result;
use crate::stats::{Condition, Measured};
use crate::validate::Invalid;
use crate::volumes::freeze::{Frozen, Thaw};
use crate::volumes::health::Said;
use crate::volumes::request::{
    BindOutcome, BindRequest, Expanded, PublishRequest, Published, VolumeInfo,
};
use crate::volumes::table::Volumes;
use crate::volumes::trim::Trimmed;

/// The volume table's operations, as `Volumes` has them (its docs say what
/// each does). A bind's or an unmount's target is one [`VolumeTable::target`]
/// answered.
pub trait VolumeTable: Send + Sync + 'static {
    /// A bind or unmount target as the request gave it, validated beneath
    /// the table's root and made canonical.
    fn target(&self, given: &str) -> std::result::Result<PathBuf, Invalid>;
    fn publish(&self, req: &PublishRequest, cancel: &Cancel) -> Result<Published>;
    fn unpublish(&self, id: &str, cancel: &Cancel) -> Result<bool>;
    fn stats(&self, id: &str, cancel: &Cancel) -> Result<(Option<Measured>, Condition)>;
    fn expand(
        &self,
        id: &str,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Expanded>;
    fn bind(&self, req: &BindRequest, cancel: &Cancel) -> Result<BindOutcome>;
    fn unmount(&self, target: &Path, cancel: &Cancel) -> Result<bool>;
    fn list(&self) -> Vec<VolumeInfo>;
    fn freeze(
        &self,
        ids: &[String],
        timeout: Duration,
        asked: Option<&str>,
        cancel: &Cancel,
    ) -> Result<Frozen>;
    fn thaw(&self, what: &Thaw) -> Result<Vec<String>>;
    fn trim(&self, id: &str, min_extent: u64, cancel: &Cancel) -> Result<Trimmed>;
    fn health(&self, id: &str, cancel: &Cancel) -> Result<Vec<Said>>;
    /// Every volume unpublished; how many were.
    fn shutdown(&self) -> u32;
    /// Why the state directory cannot be written, while it cannot.
    fn state_problem(&self) -> Option<String>;
}

impl VolumeTable for Volumes {
    fn target(&self, given: &str) -> std::result::Result<PathBuf, Invalid> {
        Volumes::target(self, given)
    }
    fn publish(&self, req: &PublishRequest, cancel: &Cancel) -> Result<Published> {
        Volumes::publish(self, req, cancel)
    }
    fn unpublish(&self, id: &str, cancel: &Cancel) -> Result<bool> {
        Volumes::unpublish(self, id, cancel)
    }
    fn stats(&self, id: &str, cancel: &Cancel) -> Result<(Option<Measured>, Condition)> {
        Volumes::stats(self, id, cancel)
    }
    fn expand(
        &self,
        id: &str,
        required_bytes: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Expanded> {
        Volumes::expand(self, id, required_bytes, timeout, cancel)
    }
    fn bind(&self, req: &BindRequest, cancel: &Cancel) -> Result<BindOutcome> {
        Volumes::bind_checked(self, req, cancel)
    }
    fn unmount(&self, target: &Path, cancel: &Cancel) -> Result<bool> {
        Volumes::unmount_checked(self, target, cancel)
    }
    fn list(&self) -> Vec<VolumeInfo> {
        Volumes::list(self)
    }
    fn freeze(
        &self,
        ids: &[String],
        timeout: Duration,
        asked: Option<&str>,
        cancel: &Cancel,
    ) -> Result<Frozen> {
        Volumes::freeze(self, ids, timeout, asked, cancel)
    }
    fn thaw(&self, what: &Thaw) -> Result<Vec<String>> {
        Volumes::thaw(self, what)
    }
    fn trim(&self, id: &str, min_extent: u64, cancel: &Cancel) -> Result<Trimmed> {
        Volumes::trim(self, id, min_extent, cancel)
    }
    fn health(&self, id: &str, cancel: &Cancel) -> Result<Vec<Said>> {
        Volumes::health(self, id, cancel)
    }
    fn shutdown(&self) -> u32 {
        Volumes::shutdown(self)
    }
    fn state_problem(&self) -> Option<String> {
        Volumes::state_problem(self)
    }
}

//! RuntimeGetVolumeStats and RuntimeExpandVolume: what the agent says of a
//! published volume, and its growth (QEMU's view first, then the
//! filesystem, by the agent).

use crate::deadline::Deadline;
use crate::error::{Code, Error, Result};
use crate::hostdev;
use crate::hotplug;
use crate::registry::Sandbox;
use crate::state::{Phase, Volume};

use super::error::Error as Refused;
use super::{Crustd, Stats};
use crate::devices::Key;

impl Crustd {
    /// The record of a published volume, else NOT_FOUND; one still
    /// publishing (its fsGroup walk runs in the guest) only if `publishing`
    /// may be, else FAILED_PRECONDITION.
    pub(super) fn published(
        sandbox: &str,
        host_volume_id: &str,
        record: Option<Volume>,
        publishing: bool,
    ) -> Result<Volume> {
        match record {
            Some(v) if v.phase == Phase::Published => Ok(v),
            Some(v) if v.phase == Phase::Publishing && publishing => Ok(v),
            Some(v) if v.phase == Phase::Publishing => {
                Err(Refused::StillPublishing(Key::new(sandbox, host_volume_id)).into())
            }
            _ => Err(Refused::NotPublished(Key::new(sandbox, host_volume_id)).into()),
        }
    }

    /// FAILED_PRECONDITION for a call that needs the VM of `sb`, gone (`why`).
    fn dead(sb: &Sandbox, why: &str) -> Error {
        Refused::Dead {
            sandbox: sb.id().to_string(),
            why: why.to_string(),
        }
        .into()
    }

    /// `err` from a call that could not reach `sb`'s VM, or FAILED_PRECONDITION
    /// when the VM is gone.
    pub(super) fn unless_dead(&self, sb: &Sandbox, err: impl Into<Error>) -> Error {
        let err = err.into();
        if err.code() != Code::Unavailable {
            return err;
        }
        match sb.qmp.gone(self.cfg.qmp_timeout) {
            Some(why) => Crustd::dead(sb, &why),
            None => err,
        }
    }

    /// RuntimeGetVolumeStats: the agent's usage and condition, as they are.
    pub fn stats(
        &self,
        sandbox_id: &str,
        host_volume_id: &str,
        deadline: &Deadline,
    ) -> Result<Stats> {
        let o = self.open_volume(sandbox_id, host_volume_id, deadline)?;
        let sb = o.home.vm()?;
        // Still publishing: the agent says how it stands (FAILED_PRECONDITION
        // while its walk runs, the usage once it is done).
        let v = Crustd::published(sandbox_id, host_volume_id, o.record, true)?;
        self.agent(&sb, deadline)
            .stats(&v.volume_id)
            .map_err(|e| self.unless_dead(&sb, e))
    }

    /// RuntimeExpandVolume: QEMU grown to the host device's size, then the
    /// filesystem by the agent; answers the capacity.
    pub fn expand(
        &self,
        sandbox_id: &str,
        host_volume_id: &str,
        required_bytes: i64,
        deadline: &Deadline,
    ) -> Result<i64> {
        hostdev::check_path(host_volume_id)?;
        if required_bytes < 0 {
            return Err(Refused::NegativeBytes(required_bytes).into());
        }
        let o = self.open_volume(sandbox_id, host_volume_id, deadline)?;
        let sb = o.home.vm()?;
        let v = Crustd::published(sandbox_id, host_volume_id, o.record, false)?;
        if let Some(why) = sb.qmp.gone(self.cfg.qmp_timeout) {
            return Err(Crustd::dead(&sb, &why));
        }
        let dev = hostdev::resolve(host_volume_id)?;
        if dev.rdev != v.rdev {
            return Err(Refused::DeviceChanged {
                key: Key::new(sandbox_id, host_volume_id),
                now: dev.rdev,
                was: v.rdev,
                growing: true,
            }
            .into());
        }
        let size = dev.size()?;
        if size < required_bytes.unsigned_abs() {
            return Err(Refused::TooSmall {
                host_volume: host_volume_id.to_string(),
                size,
                required: required_bytes,
            }
            .into());
        }
        self.with_qmp(&sb, deadline, |q| hotplug::grow(q, &v.node, size))
            .map_err(|e| self.unless_dead(&sb, e))?;
        self.agent(&sb, deadline)
            .expand(&v.volume_id, required_bytes)
            .map_err(|e| self.unless_dead(&sb, e))
    }
}

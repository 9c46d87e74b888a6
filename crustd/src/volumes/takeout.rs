//! RuntimeUnpublishVolume, and taking a disk out of a sandbox: the agent's
//! unpublish, QEMU's device_del (the wait for the guest to let go runs
//! without the sandbox's QMP lock, so its other volumes go on), blockdev-del,
//! and only then the device freed, by the device table's one rule. A
//! sandbox whose VM is gone, or whose entry is missing, has nothing to
//! unplug: its volumes are forgotten, and their devices freed if no process
//! still has them open.

use std::time::Duration;

use crust_client::qmp::{self, Patience, UnplugError};
use crust_protocols::sync::LockExt;

use crate::hotplug::Added;

use crate::deadline::Deadline;
use crate::devices::Key;
use crate::error::{Code, Error, Result};
use crate::freezes::How;
use crate::hostdev::Names;
use crate::hotplug::{self, Doing};
use crate::registry::{Home, Sandbox};
use crate::state::{Phase, Volume};

use super::Crustd;

impl Crustd {
    /// RuntimeUnpublishVolume: OK when the volume is not (or no longer) published.
    pub fn unpublish(
        &self,
        sandbox_id: &str,
        host_volume_id: &str,
        deadline: &Deadline,
    ) -> Result<()> {
        // A volume that stays (its unpublish fails) is judged again from
        // its record's mark at the next look.
        self.shrinks.forget(&Key::new(sandbox_id, host_volume_id));
        let o = match self.open_volume(sandbox_id, host_volume_id, deadline) {
            Ok(o) => o,
            Err(e) if e.code() == Code::NotFound => {
                // No directory, so no record; a claim may be left (the
                // directory was removed under a VM): freed by the rule.
                let key = Key::new(sandbox_id, host_volume_id);
                if self.devices.held(&key).is_none() {
                    return Err(e);
                }
                let _lock = self.lock_volume(&key, deadline)?;
                let why = format!("sandbox {sandbox_id}'s directory is gone");
                self.devices.release(&key, &why, deadline.at())?;
                self.freezes
                    .end_volume(sandbox_id, host_volume_id, How::Unpublished);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let Some(v) = o.record else {
            if self.devices.held(&o.key).is_some() {
                // A claim without its record (the state file was edited behind crustd's back).
                return Ok(self.devices.release(
                    &o.key,
                    "crustd has no record of it",
                    deadline.at(),
                )?);
            }
            // An unknown sandbox is NOT_FOUND, as for every call.
            return Ok(o.home.vm().map(|_| ())?);
        };
        let sb = match o.home.vm() {
            Ok(sb) => sb,
            // No usable entry: the VM is gone or being rewritten, and crustd
            // cannot ask it. Freed only if no process has the device open.
            Err(e) if matches!(e.code(), Code::NotFound | Code::FailedPrecondition) => {
                let why = if e.code() == Code::NotFound {
                    "its sandbox.json is missing".to_string()
                } else {
                    format!("its sandbox.json is unusable: {e}")
                };
                return self.forget_dead(&o.home, &o.key, &v, &why, deadline);
            }
            Err(e) => return Err(e.into()),
        };
        // A dead VM has nothing to unplug: asking its agent would only wait.
        if let Some(why) = sb.qmp.gone(self.cfg.qmp_timeout) {
            return self.forget_dead(&o.home, &o.key, &v, &why, deadline);
        }
        // The monitor proved this sandbox's VM's before the guest is asked to
        // let go: one crustd refuses (another VM's, behind a link) leaves
        // the volume as it was.
        drop(self.session(&sb, deadline)?);
        self.take_out(&sb, &o.key, &v, false, deadline)
    }

    /// Agent unpublish, device_del and the guest's release, blockdev-del,
    /// then the device freed and the record forgotten. The record stays (as
    /// `unplugging`) until every step has succeeded. `undoing`: the volume
    /// was never reported published, so an agent that cannot be reached
    /// does not keep the disk in (nothing uses it yet); an agent that
    /// answers no (e.g. busy) always does.
    pub(super) fn take_out(
        &self,
        sb: &Sandbox,
        key: &Key,
        v: &Volume,
        undoing: bool,
        deadline: &Deadline,
    ) -> Result<()> {
        let names = names_of(v);
        self.take_out_of_vm(sb, key, &names, undoing, deadline)?;
        self.forget(
            &sb.home,
            key,
            "its disk left the VM",
            v.direct.as_deref(),
            deadline,
        )
    }

    /// The undo of a hot-plug kubelet was never told of: out of the VM, as
    /// [`Crustd::take_out`] takes it (the record and claim are the undo
    /// list's next entry).
    pub(super) fn undo_plug(
        &self,
        sb: &Sandbox,
        key: &Key,
        names: &Names,
        deadline: &Deadline,
    ) -> Result<()> {
        self.take_out_of_vm(sb, key, names, true, deadline)
    }

    /// Marks the record `unplugging`, has the agent let go, and unplugs.
    fn take_out_of_vm(
        &self,
        sb: &Sandbox,
        key: &Key,
        names: &Names,
        undoing: bool,
        deadline: &Deadline,
    ) -> Result<()> {
        self.change(&sb.home, &key.host_volume, deadline, |v| {
            v.phase = Phase::Unplugging
        })?;
        match self.agent(sb, deadline).unpublish(&names.volume_id) {
            Err(e) if !(undoing && e.code() == Code::Unavailable) => return Err(e.into()),
            _ => {}
        }
        // The agent thawed it before it unpublished: a group holding it
        // did not hold any more.
        self.freezes
            .end_volume(&key.sandbox, &key.host_volume, How::Unpublished);
        self.unplug(sb, names, deadline)
    }

    /// device_del, the wait for the guest to let go (the device gone from
    /// QEMU's list), then blockdev-del, asked again while QEMU says the node
    /// is in use (crust-client's unplug). The sandbox's QMP lock is held for
    /// each short session only, never across a wait; each wait ends at
    /// `--unplug-timeout` or the caller's deadline.
    fn unplug(&self, sb: &Sandbox, names: &Names, deadline: &Deadline) -> Result<()> {
        let patience = Patience {
            each: self.cfg.unplug_timeout,
            deadline: deadline.at(),
        };
        qmp::unplug(
            || self.session(sb, deadline),
            &names.device,
            &names.node,
            patience,
        )
        .map_err(|e| unplug_error(e, names, self.cfg.unplug_timeout))
    }

    /// Takes back what one publish added in QEMU and nothing else (a volume
    /// kubelet knows as published, whose disk had left QEMU).
    pub(super) fn remove_added(
        &self,
        sb: &Sandbox,
        names: &Names,
        added: Added,
        deadline: &Deadline,
    ) -> Result<()> {
        if added.device {
            return self.unplug(sb, names, deadline);
        }
        if added.node {
            self.with_qmp(sb, deadline, |q| hotplug::remove_node(q, names))?;
        }
        Ok(())
    }

    /// Unpublish in a sandbox whose VM is gone (`why`): nothing to unplug,
    /// so the volume is forgotten and its device freed, unless a process
    /// still has the device open (a VMM whose monitor socket or entry was
    /// removed under it would): then FAILED_PRECONDITION, and nothing changes.
    fn forget_dead(
        &self,
        home: &Home,
        key: &Key,
        v: &Volume,
        why: &str,
        deadline: &Deadline,
    ) -> Result<()> {
        let why = format!("sandbox {}'s VM looks gone ({why})", home.id);
        self.forget(home, key, &why, v.direct.as_deref(), deadline)?;
        self.freezes
            .end_volume(&key.sandbox, &key.host_volume, How::Unpublished);
        self.connections.locked().remove(&home.id);
        Ok(())
    }

    /// The end of every volume: its device freed by the device table's rule
    /// (`why` crustd thinks nothing uses it, for the refusal's message), the
    /// direct-volume record's sandbox-id file removed, the record forgotten.
    /// A refusal changes nothing.
    pub(super) fn forget(
        &self,
        home: &Home,
        key: &Key,
        why: &str,
        direct: Option<&str>,
        deadline: &Deadline,
    ) -> Result<()> {
        self.devices.release(key, why, deadline.at())?;
        if let Some(path) = direct {
            self.records.forget_sandbox(path.as_bytes(), &home.id)?;
        }
        self.update(home, deadline, |st| {
            st.volumes.remove(&key.host_volume);
            Ok(())
        })
    }
}

/// An unplug's failure (each step on a session from crustd's factory) as
/// crustd's error: the factory's own, QEMU's for the step that failed, or
/// the guest's keeping the device past `timeout` or the caller's deadline.
fn unplug_error(e: UnplugError<Error>, names: &Names, timeout: Duration) -> Error {
    match e {
        UnplugError::Session(e) => e,
        UnplugError::Qmp { step, error } => Doing::of_step(step, names).failed(error).into(),
        UnplugError::NotReleased => hotplug::Error::NotReleased {
            device: names.device.clone(),
            timeout,
        }
        .into(),
    }
}

/// The QEMU and agent names a record carries.
pub(super) fn names_of(v: &Volume) -> Names {
    Names {
        volume_id: v.volume_id.clone(),
        serial: v.serial.clone(),
        node: v.node.clone(),
        device: v.device.clone(),
    }
}

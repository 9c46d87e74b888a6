//! RuntimePublishVolume as a list of steps with one undo list (`rollback`):
//! open the sandbox and the device, lock the volume, claim (and hold) the
//! device, format it (createFilesystem), record it, plug it into QEMU, have
//! the agent publish it, record the answer. Each step that changes
//! something pushes what takes it back; a failure runs the list newest
//! first, so a reader sees at each step the one undo that applies after it.
//!
//! A volume kubelet was told is published (or whose publish goes on in the
//! guest) is never taken out by a failed retry: only what the retry itself
//! added in QEMU is.

use crate::deadline::Deadline;
use crate::devices::{Key, Refusal};
use crate::error::{Code, Error, Result};
use crate::hostdev::{self, HostDevice, Named, Names, Unusable};
use crate::hotplug;
use crate::mkfs;
use crate::registry::{self, Sandbox};
use crate::state::{Phase, Volume, MAX_VOLUMES};

use super::error::Error as Refused;
use super::request::fs_group;
use super::rollback::{Rollback, Undo};
use super::{validate, Crustd, PublishRequest};
use crate::agent;

/// One publish in progress.
struct Steps<'a> {
    c: &'a Crustd,
    r: &'a PublishRequest,
    sb: &'a Sandbox,
    key: &'a Key,
    names: &'a Names,
    deadline: &'a Deadline,
    /// What undoes the steps done so far.
    rollback: Rollback<'a>,
}

impl Crustd {
    /// RuntimePublishVolume: answers the guest path.
    pub fn publish(&self, r: &PublishRequest, deadline: &Deadline) -> Result<String> {
        validate(r)?;
        let sb = registry::open_with(&self.cfg.sandboxes, &r.sandbox_id, self.cfg.kata.as_ref())?;
        let dev = hostdev::open_block(&r.host_volume_id).map_err(|e| match e {
            Unusable::NotBlock(n) => r.origin.refuse(&r.host_volume_id, n),
            Unusable::Failed(e) => e.into(),
        })?;
        let key = Key::new(&r.sandbox_id, &r.host_volume_id);
        let _lock = self.lock_volume(&key, deadline)?;
        let names = Names::derive(&r.host_volume_id);
        let mut steps = Steps {
            c: self,
            r,
            sb: &sb,
            key: &key,
            names: &names,
            deadline,
            rollback: Rollback::new(self, &sb, &key, &names, deadline),
        };
        match steps.run(&dev) {
            Ok(guest_path) => Ok(guest_path),
            Err(e) => Err(steps.rollback.fail(e)),
        }
    }
}

impl Steps<'_> {
    fn run(&mut self, dev: &HostDevice) -> Result<String> {
        let (c, r) = (self.c, self.r);
        let fs_group = fs_group(r)?;
        let mut prior = c
            .load(&self.sb.home, self.deadline)?
            .volumes
            .remove(&r.host_volume_id);
        if let Some(p) = prior.as_ref().filter(|p| p.phase == Phase::Unplugging) {
            // A previous unpublish or undo did not finish: finish it first.
            c.take_out(self.sb, self.key, p, false, self.deadline)?;
            prior = None;
        }
        // Whether kubelet was ever told this volume is published, or that its
        // publish goes on: if neither, a failure below leaves nothing behind,
        // whichever call plugged it.
        let published_before = prior
            .as_ref()
            .is_some_and(|p| matches!(p.phase, Phase::Published | Phase::Publishing));
        match &prior {
            None => {
                self.claim(dev)?;
                self.create_file_system(dev)?;
                self.record(dev)?;
            }
            Some(p) => {
                if p.rdev != dev.rdev {
                    return Err(Refused::DeviceChanged {
                        key: self.key.clone(),
                        now: dev.rdev.clone(),
                        was: p.rdev.clone(),
                        growing: false,
                    }
                    .into());
                }
                // Recorded before (a restart, a hold the kernel refused then): held again now.
                c.devices
                    .adopt(self.key, &p.rdev)
                    .map_err(|e| Error::from(e.error(self.key, &dev.path)))?;
                if !published_before {
                    self.rollback.push(Undo::Forget);
                }
            }
        }
        if self.deadline.passed() {
            return Err(Refused::LateToPlug(self.key.clone()).into());
        }
        self.plug(published_before)?;
        if !published_before {
            c.change(&self.sb.home, &r.host_volume_id, self.deadline, |v| {
                v.phase = Phase::Plugged
            })?;
        }
        let published = c
            .agent(self.sb, self.deadline)
            .publish(&agent_publish(r, self.names, fs_group));
        match published {
            Ok(guest_path) => {
                // Published in the guest: whatever happens now, nothing is undone.
                self.rollback.done();
                c.change(&self.sb.home, &r.host_volume_id, self.deadline, |v| {
                    v.phase = Phase::Published;
                    v.guest_path = guest_path.clone();
                    v.host_target_path = r.host_target_path.clone();
                    if let Some(d) = r.origin.direct() {
                        v.direct = Some(d.to_string());
                    }
                })?;
                Ok(guest_path)
            }
            Err(e) if matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled) => {
                self.outlived(e)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Claims the device for this new volume. A conflict with a volume of a
    /// sandbox whose VM is gone (no sandbox.json) frees that volume the way
    /// Unpublish there would, which the device table allows only when no
    /// process has the device open; then the claim is tried again.
    fn claim(&mut self, dev: &HostDevice) -> Result<()> {
        let c = self.c;
        let home = &self.sb.home;
        if c.load(home, self.deadline)?.volumes.len() >= MAX_VOLUMES {
            return Err(Refused::Full(home.id.clone()).into());
        }
        for _ in 0..4 {
            match c.devices.claim(self.key, dev) {
                Ok(()) => {
                    self.rollback.push(Undo::Claim);
                    return Ok(());
                }
                Err(Refusal::Conflict(k))
                    if k.holder.sandbox != self.key.sandbox
                        && !registry::alive_with(
                            &c.cfg.sandboxes,
                            &k.holder.sandbox,
                            c.cfg.kata.as_ref(),
                        ) =>
                {
                    c.forget_gone(&k.holder, self.deadline)
                        .map_err(|e| Error::Unfreed {
                            claim: k.refuse(self.key, &dev.path),
                            forget: Box::new(e),
                        })?;
                }
                Err(e) => return Err(e.error(self.key, &dev.path).into()),
            }
        }
        Err(Refused::Unsettled(Named::new(&self.key.host_volume, &dev.path)).into())
    }

    /// createFilesystem for a volume this call has just claimed and holds:
    /// a device that already holds `file_system` is left as it is; a
    /// provably blank one is formatted, held all the while; anything else
    /// is FAILED_PRECONDITION and not a byte of it is written. An encrypted
    /// volume is never written on the host (its filesystem would be in the
    /// clear): the guest formats it inside LUKS2, and only a disk it finds
    /// blank itself. crustd's look, deeper than the guest's, refuses first
    /// a disk that is neither blank nor LUKS.
    fn create_file_system(&mut self, dev: &HostDevice) -> Result<()> {
        let timeout = self.c.cfg.mkfs_timeout;
        if let Some(e) = &self.r.encryption {
            if e.format_if_blank {
                mkfs::inspect(dev, mkfs::LUKS, timeout)?;
            }
            return Ok(());
        }
        if !self.r.create_file_system {
            return Ok(());
        }
        let fs = &self.r.file_system;
        if mkfs::inspect(dev, fs, timeout)? == mkfs::Content::Same {
            return Ok(());
        }
        Ok(mkfs::format(dev, fs, timeout)?)
    }

    /// Records the new volume as `plugging`, before anything is plugged.
    fn record(&mut self, dev: &HostDevice) -> Result<()> {
        let (r, names) = (self.r, &self.names);
        self.c.update(&self.sb.home, self.deadline, |st| {
            st.volumes
                .entry(r.host_volume_id.clone())
                .or_insert_with(|| Volume {
                    volume_id: names.volume_id.clone(),
                    serial: names.serial.clone(),
                    node: names.node.clone(),
                    device: names.device.clone(),
                    rdev: dev.rdev.clone(),
                    host_target_path: r.host_target_path.clone(),
                    guest_path: String::new(),
                    file_system: r.file_system.clone(),
                    read_only: r.read_only,
                    block: r.block,
                    phase: Phase::Plugging,
                    direct: r.origin.direct().map(str::to_string),
                    host_bytes: dev.capacity().ok(),
                });
            Ok(())
        })?;
        // The claim is now the record's: both go together.
        self.rollback.supersede(Undo::Claim, Undo::Forget);
        Ok(())
    }

    /// blockdev-add and device_add, each only if QEMU lacks it. Once QEMU
    /// has been reached, a volume never reported published is taken out on
    /// failure, whatever this call added; one kubelet knows keeps its disk,
    /// less what this call added.
    fn plug(&mut self, published_before: bool) -> Result<()> {
        let (c, r) = (self.c, self.r);
        let dev = std::path::PathBuf::from(&r.host_volume_id);
        let mut reached = false;
        let added = c.with_qmp(self.sb, self.deadline, |q| {
            reached = true;
            hotplug::plug(q, self.names, &dev, r.read_only)
        });
        match added {
            Ok(a) if published_before => self.rollback.push(Undo::Added(a)),
            Ok(_) => self.rollback.push(Undo::TakeOut),
            Err(e) => {
                if reached && !published_before {
                    self.rollback.push(Undo::TakeOut);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// The agent's publish ended with DEADLINE_EXCEEDED or CANCELLED. If the
    /// agent lists the volume, it is mounted and its fsGroup walk goes on in
    /// the guest: the disk stays plugged, the volume is recorded as
    /// `publishing` (a retry joins the walk, Unpublish takes it out), and the
    /// caller gets DEADLINE_EXCEEDED with the agent's message. If the agent
    /// does not list it (no disk appeared in time), it is undone as any
    /// failure is. If the agent cannot say, the disk stays: unplugging it
    /// under a running walk would be worse than a record the next call settles.
    fn outlived(&mut self, e: agent::Error) -> Result<String> {
        let (c, r) = (self.c, self.r);
        if matches!(
            c.agent(self.sb, self.deadline).lists(&self.names.volume_id),
            Ok(false)
        ) {
            return Err(e.into());
        }
        self.rollback.done();
        c.change(&self.sb.home, &r.host_volume_id, self.deadline, |v| {
            if v.phase != Phase::Published {
                v.phase = Phase::Publishing;
            }
            v.host_target_path = r.host_target_path.clone();
            if let Some(d) = r.origin.direct() {
                v.direct = Some(d.to_string());
            }
        })?;
        Err(Error::Outlived(e))
    }
}

/// What the agent is asked to publish for `r`, plugged under `names`.
pub(super) fn agent_publish<'a>(
    r: &'a PublishRequest,
    names: &'a Names,
    fs_group: Option<(u32, bool)>,
) -> agent::Publish<'a> {
    agent::Publish {
        volume_id: &names.volume_id,
        serial: &names.serial,
        fs_type: &r.file_system,
        mount_options: &r.mount_options,
        read_only: r.read_only,
        // fsGroup does not apply to a raw device (kubelet does not chown one either).
        fs_group: if r.block { None } else { fs_group },
        block: r.block,
        encryption: r.encryption.as_ref(),
    }
}

impl Crustd {
    /// Frees `holder`, a volume of a sandbox whose VM is gone, as Unpublish
    /// there would: its device only if no process has it open.
    fn forget_gone(&self, holder: &Key, deadline: &Deadline) -> Result<()> {
        let home =
            registry::home_with(&self.cfg.sandboxes, &holder.sandbox, self.cfg.kata.as_ref());
        let _lock = self.lock_volume(holder, deadline)?;
        let why = format!(
            "sandbox {}'s VM looks gone (its sandbox.json is missing)",
            holder.sandbox
        );
        match home {
            Ok(home) => {
                let v = self
                    .load(&home, deadline)?
                    .volumes
                    .remove(&holder.host_volume);
                let direct = v.and_then(|v| v.direct);
                self.forget(&home, holder, &why, direct.as_deref(), deadline)
            }
            // Its directory went too: only the claim is left.
            Err(e) if e.code() == Code::NotFound => {
                Ok(self.devices.release(holder, &why, deadline.at())?)
            }
            Err(e) => Err(e.into()),
        }
    }
}

//! What each CRUST call does, as steps over the sandbox registry
//! (`registry`), crustd's records (`state`), the node's devices (`devices`),
//! QEMU (`hotplug`) and the agent (`agent`). A file per call:
//! `publish` (the steps and their one undo list), `direct` (a Kata record's
//! publish), `takeout` (Unpublish, and the undo of a hot-plug), `usage`
//! (Stats and Expand), `freeze` and `thaw` (a group across sandboxes, a
//! lease ended only by its id, and the host's timer), `snapshot` (what
//! they share, Trim, Health), `recover` (crustd's start).
//!
//! Locks, each wait ending at the caller's deadline: one per (sandbox, host
//! volume), so two calls for one volume run one after the other while other
//! volumes and sandboxes go on; one per sandbox around one QMP session
//! (QEMU serves one client at a time; never held across a wait on the
//! guest) and one around its state file; and the node-wide device table,
//! locked only for a lookup and an insert. Order: volume, then sandbox state
//! or QMP (never both), then the device table.

use std::borrow::{Borrow, BorrowMut};
use std::path::PathBuf;
use std::time::Duration;

use crate::agent::{self, Agent};
use crate::deadline::Deadline;
use crate::devices::{Devices, Key};
use crate::direct::{self, Records};
use crate::error::{Error, Result};
use crate::freezes::{Freezes, Store};
use crate::hostdev;
use crate::locks::{Guard, KeyedLocks};
use crate::registry::{self, Home, Sandbox};
use crate::state::{self, State, Volume};
use crust_client::qmp::Qmp;
use error::{Error as Refused, Shared};

mod direct_volume;
pub(crate) mod error;
mod freeze;
mod limits;
mod publish;
mod recover;
mod request;
mod rollback;
pub mod shrink;
pub mod snapshot;
mod takeout;
mod thaw;
mod usage;

pub use crate::agent::{Stats, Usage};
pub use request::{
    validate, DirectRequest, FsGroupPolicy, Origin, PublishRequest, BLOCK_VOLUMES, FILE_SYSTEMS,
};

/// Deadlines and places.
#[derive(Debug, Clone)]
pub struct Config {
    /// The sandbox registry, `DIR/<sandbox>/sandbox.json`.
    pub sandboxes: PathBuf,
    /// Deadline of one agent call (and of connecting to it).
    pub agent_timeout: Duration,
    /// How long the agent may wait for a hot-plugged disk to appear or grow.
    pub device_wait: Duration,
    /// Deadline of one QMP reply.
    pub qmp_timeout: Duration,
    /// How long the guest may take to release a device after device_del.
    pub unplug_timeout: Duration,
    /// Where CSI drivers file Kata's direct-volume records.
    pub direct_volumes: PathBuf,
    /// How long blkid or mkfs may take for createFilesystem.
    pub mkfs_timeout: Duration,
    /// How long a call whose caller set no deadline waits for a lock or a
    /// free slot (kubelet always sets one).
    pub wait_timeout: Duration,
    /// Kata's sandboxes, found from Kata's files too (`--kata-runtime-dir`).
    pub kata: Option<registry::Kata>,
}

impl Config {
    pub fn new(sandboxes: impl Into<PathBuf>) -> Config {
        Config {
            direct_volumes: PathBuf::from(direct::DEFAULT_ROOT),
            mkfs_timeout: Duration::from_secs(300),
            sandboxes: sandboxes.into(),
            agent_timeout: Duration::from_secs(30),
            device_wait: Duration::from_secs(30),
            qmp_timeout: Duration::from_secs(10),
            unplug_timeout: Duration::from_secs(60),
            wait_timeout: Duration::from_secs(120),
            kata: None,
        }
    }
}

/// The daemon's shared state: configuration, locks and the device table.
pub struct Crustd {
    cfg: Config,
    /// Per (sandbox, host_volume_id).
    volume_locks: KeyedLocks<Key>,
    /// Per sandbox: one QMP session at a time.
    qmp_locks: KeyedLocks<String>,
    /// Per sandbox: read-modify-write of crustd.json.
    state_locks: KeyedLocks<String>,
    /// Node-wide: every claimed device, where its bytes lie, and its hold.
    devices: Devices,
    /// Agent connections kept per sandbox.
    connections: agent::Connections,
    /// Kata's direct-volume records.
    records: Records,
    /// The groups frozen across sandboxes, with the host's timer; their
    /// records in the registry (`freezes::store`).
    freezes: Freezes,
    /// The host devices' sizes, and which shrank (`shrink`).
    shrinks: shrink::Shrinks,
}

/// One QMP session of a sandbox, with the sandbox's QMP lock, let go together.
struct Session<'a> {
    qmp: Qmp,
    _lock: Guard<'a, String>,
}

impl Borrow<Qmp> for Session<'_> {
    fn borrow(&self) -> &Qmp {
        &self.qmp
    }
}

impl BorrowMut<Qmp> for Session<'_> {
    fn borrow_mut(&mut self) -> &mut Qmp {
        &mut self.qmp
    }
}

/// A volume's call after its prologue: the sandbox's directory, the
/// volume's lock, and its record as it was.
struct Opened<'a> {
    home: Home,
    key: Key,
    _lock: Guard<'a, Key>,
    record: Option<Volume>,
}

impl Crustd {
    pub fn new(cfg: Config) -> Crustd {
        Crustd {
            volume_locks: KeyedLocks::default(),
            qmp_locks: KeyedLocks::default(),
            state_locks: KeyedLocks::default(),
            devices: Devices::default(),
            connections: agent::Connections::default(),
            records: Records::new(&cfg.direct_volumes),
            freezes: Freezes::new(Some(Store::new(&cfg.sandboxes))),
            shrinks: shrink::Shrinks::default(),
            cfg,
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// How many volume locks are held or waited for (a bound tests check).
    pub fn locks_in_use(&self) -> usize {
        self.volume_locks.len() + self.qmp_locks.len() + self.state_locks.len()
    }

    fn agent<'a>(&'a self, sb: &'a Sandbox, deadline: &Deadline) -> Agent<'a> {
        Agent {
            connections: &self.connections,
            addr: &sb.agent,
            sandbox: &sb.home.id,
            timeout: self.cfg.agent_timeout,
            device_wait: self.cfg.device_wait,
            deadline: deadline.at(),
        }
    }

    /// A fresh QMP session of `sb`, holding the sandbox's QMP lock while it
    /// lives: one session per sandbox at a time. Whoever holds it must not
    /// wait on the guest: the lock stalls every other volume of the sandbox.
    fn session(&self, sb: &Sandbox, deadline: &Deadline) -> Result<Session<'_>> {
        let lock = self
            .qmp_locks
            .lock_until(&sb.home.id, deadline.until(self.cfg.wait_timeout))
            .ok_or_else(|| busy(&sb.home.id, Shared::Monitor))?;
        let qmp = sb
            .qmp
            .connect(self.cfg.qmp_timeout)
            .map_err(|error| Error::Session {
                sandbox: sb.home.id.clone(),
                error,
            })?;
        Ok(Session { qmp, _lock: lock })
    }

    /// Runs `f` on a fresh QMP session of `sb` ([`Crustd::session`]).
    fn with_qmp<T, E: Into<Error>>(
        &self,
        sb: &Sandbox,
        deadline: &Deadline,
        f: impl FnOnce(&mut Qmp) -> std::result::Result<T, E>,
    ) -> Result<T> {
        f(&mut self.session(sb, deadline)?.qmp).map_err(Into::into)
    }

    /// Reads, changes and writes the state of `home` under its lock; answers what `f` answers.
    fn update<T>(
        &self,
        home: &Home,
        deadline: &Deadline,
        f: impl FnOnce(&mut State) -> Result<T>,
    ) -> Result<T> {
        let _g = self
            .state_locks
            .lock_until(&home.id, deadline.until(self.cfg.wait_timeout))
            .ok_or_else(|| busy(&home.id, Shared::StateFile))?;
        let mut st = state::load(home.fd(), &home.dir)?;
        let out = f(&mut st)?;
        state::save(home.fd(), &home.dir, &st)?;
        Ok(out)
    }

    /// The state of `home` as it is now.
    fn load(&self, home: &Home, deadline: &Deadline) -> Result<State> {
        let _g = self
            .state_locks
            .lock_until(&home.id, deadline.until(self.cfg.wait_timeout))
            .ok_or_else(|| busy(&home.id, Shared::StateFile))?;
        Ok(state::load(home.fd(), &home.dir)?)
    }

    /// Takes `key`'s volume lock, waiting until the caller's deadline.
    fn lock_volume(&self, key: &Key, deadline: &Deadline) -> Result<Guard<'_, Key>> {
        self.volume_locks
            .lock_until(key, deadline.until(self.cfg.wait_timeout))
            .ok_or_else(|| Refused::VolumeBusy(key.clone()).into())
    }

    /// The prologue of Unpublish, Stats and Expand: the path checked, the
    /// sandbox's directory opened, the volume locked, its record read.
    fn open_volume(
        &self,
        sandbox_id: &str,
        host_volume_id: &str,
        deadline: &Deadline,
    ) -> Result<Opened<'_>> {
        hostdev::check_path(host_volume_id)?;
        let home = registry::home_with(&self.cfg.sandboxes, sandbox_id, self.cfg.kata.as_ref())?;
        let key = Key::new(sandbox_id, host_volume_id);
        let lock = self.lock_volume(&key, deadline)?;
        let record = self.load(&home, deadline)?.volumes.remove(host_volume_id);
        Ok(Opened {
            home,
            key,
            _lock: lock,
            record,
        })
    }

    /// Changes the record of `host_volume_id` in `home`, if there is one.
    fn change(
        &self,
        home: &Home,
        host_volume_id: &str,
        deadline: &Deadline,
        f: impl FnOnce(&mut Volume),
    ) -> Result<()> {
        self.update(home, deadline, |st| {
            if let Some(v) = st.volumes.get_mut(host_volume_id) {
                f(v);
            }
            Ok(())
        })
    }
}

/// One JSON line on stderr, in one write.
fn log_line(v: serde_json::Value) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{v}\n").as_bytes());
}

/// DEADLINE_EXCEEDED: `what` of `sandbox` stayed busy until the caller gave up.
fn busy(sandbox: &str, what: Shared) -> Error {
    Refused::Busy {
        sandbox: sandbox.to_string(),
        what,
    }
    .into()
}

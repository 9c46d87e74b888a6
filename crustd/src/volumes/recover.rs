//! crustd's start: the device of every recorded volume claimed and held
//! again before any call is served, whether or not its sandbox still has
//! its entry (a VM whose sandbox.json is missing may still be writing its
//! disks), and the sandboxes whose VM is gone reported.

use crate::deadline::Deadline;
use std::path::Path;

use crate::devices::Key;
use crate::error::{Code, Error};
use crate::registry;

use super::Crustd;

impl Crustd {
    /// At start, before serving: claims and holds the device of every
    /// volume recorded in every sandbox directory. Answers what failed, for
    /// the log: a device gone, another volume's bytes, the host using it, a
    /// state file crustd cannot read (its key's host volume then empty).
    /// Each is tried again at that volume's next call.
    pub fn recover(&self) -> Vec<(Key, Error)> {
        let deadline = Deadline::new(None);
        let mut failed = Vec::new();
        for id in registry::all_ids(&self.cfg.sandboxes) {
            let home = match registry::home_with(&self.cfg.sandboxes, &id, self.cfg.kata.as_ref()) {
                Ok(h) => h,
                Err(e) if e.code() == Code::NotFound => continue,
                Err(e) => {
                    failed.push((Key::new(&id, ""), e.into()));
                    continue;
                }
            };
            let st = match self.load(&home, &deadline) {
                Ok(st) => st,
                Err(e) => {
                    failed.push((Key::new(&id, ""), e));
                    continue;
                }
            };
            for (hv, v) in &st.volumes {
                let key = Key::new(&id, hv);
                match self.devices.adopt(&key, &v.rdev) {
                    Ok(()) => {}
                    Err(r) => {
                        let e = r.error(&key, Path::new(&v.rdev)).into();
                        failed.push((key, e))
                    }
                }
            }
        }
        failed
    }

    /// At start, after [`Crustd::recover`]: every sandbox with volumes
    /// recorded whose VM is gone (no sandbox.json, or nobody on its QMP
    /// socket), as (sandbox, why, host volumes), for the log. They stay
    /// recorded, and their devices held, until unpublished.
    pub fn dead_sandboxes(&self) -> Vec<(String, String, Vec<String>)> {
        let deadline = Deadline::new(None);
        let mut out = Vec::new();
        for id in registry::all_ids(&self.cfg.sandboxes) {
            let Ok(home) = registry::home_with(&self.cfg.sandboxes, &id, self.cfg.kata.as_ref())
            else {
                continue;
            };
            let Ok(st) = self.load(&home, &deadline) else {
                continue;
            };
            if st.volumes.is_empty() {
                continue;
            }
            let why = match home.vm() {
                Ok(sb) => sb.qmp.gone(self.cfg.qmp_timeout),
                Err(e) if e.code() == Code::NotFound => Some("its sandbox.json is missing".into()),
                Err(_) => None,
            };
            if let Some(why) = why {
                out.push((id, why, st.volumes.keys().cloned().collect()));
            }
        }
        out
    }
}

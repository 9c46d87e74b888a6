//! The listing room: what ListVolumes answers, so that a list never waits
//! behind an operation in flight (a long walk holds its volume's slot for
//! minutes). The table shows each volume here as an operation leaves it,
//! when it lets go of the slot, and nowhere else; a volume whose fsGroup
//! walk runs is listed with the walk, whose progress is read live. Its
//! mutex is a leaf (lock 3 of table.rs).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crust_protocols::sync::LockExt;

use super::request::{VolumeInfo, VolumeState};
use super::volume::Volume;
use super::walking::job::WalkJob;
use crate::model::Device;

/// One volume as ListVolumes shows it.
#[derive(Clone, Debug)]
struct Listed {
    info: VolumeInfo,
    device: Device,
    /// Its publish's walk, while one runs.
    walk: Option<Arc<WalkJob>>,
}

/// What ListVolumes answers (the module doc).
#[derive(Debug, Default)]
pub(crate) struct Listing {
    map: Mutex<BTreeMap<String, Listed>>,
}

impl Listing {
    /// Shows volume `id` as its slot holds it now: `vol`, or nothing.
    pub(crate) fn show(&self, id: &str, vol: Option<&Volume>) {
        let Some(vol) = vol else {
            self.map.locked().remove(id);
            return;
        };
        let listed = Listed {
            info: vol.info(),
            device: vol.device.clone(),
            walk: vol.phase.job().cloned(),
        };
        self.map.locked().insert(id.to_string(), listed);
    }

    /// Every volume listed, with its device; one still publishing shows
    /// how far its walk is now.
    pub(crate) fn all(&self) -> Vec<(VolumeInfo, Device)> {
        let listed: Vec<Listed> = self.map.locked().values().cloned().collect();
        listed
            .into_iter()
            .map(|mut l| {
                if let Some(job) = l.walk.as_ref().filter(|j| !j.finished()) {
                    l.info.state = VolumeState::Publishing;
                    l.info.ownership_done = job.visited();
                }
                (l.info, l.device)
            })
            .collect()
    }
}

//! RuntimePublishDirectVolume: a Kata direct-volume record, read and
//! checked, published as RuntimePublishVolume publishes its device, then
//! the record's sandbox-id file written.

use crate::deadline::Deadline;
use crate::error::Result;
use crate::registry;

use super::{Crustd, DirectRequest, FsGroupPolicy, Origin, PublishRequest};

impl Crustd {
    /// Answers (guest path, device).
    pub fn publish_direct(
        &self,
        r: &DirectRequest,
        deadline: &Deadline,
    ) -> Result<(String, String)> {
        registry::check_id(&r.sandbox_id)?;
        let found = self.records.read(r.volume_path.as_bytes())?;
        self.records
            .check_sandbox_slot(r.volume_path.as_bytes(), &r.sandbox_id)?;
        let rec = found.record;
        let p = PublishRequest {
            sandbox_id: r.sandbox_id.clone(),
            host_volume_id: rec.device.clone(),
            host_target_path: r.volume_path.clone(),
            file_system: rec.fstype,
            mount_options: rec.options,
            fsgroup_gid: rec.fs_group.map(i64::from),
            fsgroup_policy: if rec.on_root_mismatch {
                FsGroupPolicy::OnRootMismatch
            } else {
                FsGroupPolicy::Always
            },
            read_only: r.read_only,
            block: false,
            create_file_system: rec.create_filesystem,
            origin: Origin::Direct {
                volume_path: r.volume_path.clone(),
                file: found.file,
            },
        };
        let guest_path = self.publish(&p, deadline)?;
        self.records
            .record_sandbox(r.volume_path.as_bytes(), &r.sandbox_id)?;
        Ok((guest_path, rec.device))
    }
}

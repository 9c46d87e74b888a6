//! RuntimePublishDirectVolume: a Kata direct-volume record, read and
//! checked, published as RuntimePublishVolume publishes its device, then
//! the record's sandbox-id file written.

use crate::agent;
use crate::deadline::Deadline;
use crate::direct::Found;
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
        let p = publish_request(r, found);
        let guest_path = self.publish(&p, deadline)?;
        self.records
            .record_sandbox(r.volume_path.as_bytes(), &r.sandbox_id)?;
        Ok((guest_path, p.host_volume_id))
    }
}

/// The publish a record asks for. An encrypted record's key goes to the
/// guest by reference, and its createFilesystem is the guest's to do,
/// inside LUKS2: the host never formats it.
fn publish_request(r: &DirectRequest, found: Found) -> PublishRequest {
    let rec = found.record;
    let encryption = rec.key_uri.map(|key_uri| agent::Encryption {
        key_uri,
        format_if_blank: rec.create_filesystem,
    });
    PublishRequest {
        sandbox_id: r.sandbox_id.clone(),
        host_volume_id: rec.device,
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
        create_file_system: rec.create_filesystem && encryption.is_none(),
        encryption,
        origin: Origin::Direct {
            volume_path: r.volume_path.clone(),
            file: found.file,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::direct::parse_record;
    use crate::hostdev::Names;
    use crate::volumes::publish::agent_publish;
    use crate::volumes::request::{fs_group, validate};

    /// The PublishVolume request the guest gets for `json`, filed for /v.
    fn guest_gets(json: &str) -> (PublishRequest, crust_client::proto::PublishVolumeRequest) {
        let found = Found {
            file: "/root/E/mountInfo.json".into(),
            record: parse_record(json.as_bytes()).unwrap(),
        };
        let d = DirectRequest {
            sandbox_id: "pod".into(),
            volume_path: "/v".into(),
            read_only: false,
        };
        let p = publish_request(&d, found);
        validate(&p).unwrap();
        let names = Names::derive(&p.host_volume_id);
        let pb = agent::publish_request(&agent_publish(&p, &names, fs_group(&p).unwrap()), 10);
        (p, pb)
    }

    #[test]
    fn an_encrypted_record_reaches_the_guest_as_a_key_reference() {
        for (create, key) in [
            ("true", "kbs:///default/key/1"),
            ("false", "file:///run/keys/vol"),
        ] {
            let (p, r) = guest_gets(&format!(
                r#"{{"volume-type":"directvol","device":"/dev/sdx","fstype":"ext4","metadata":{{"encryptionKey":"{key}","createFilesystem":"{create}","fsGroup":"9"}}}}"#
            ));
            // Never formatted on the host: the guest does it, inside LUKS2.
            assert!(!p.create_file_system, "{create}");
            let e = r.encryption.as_ref().unwrap();
            assert_eq!(
                e.kind.enum_value(),
                Ok(crust_client::proto::encryption::Kind::LUKS2)
            );
            assert_eq!(e.key_uri(), key);
            assert!(!e.has_passphrase(), "{key}");
            assert_eq!(e.format_if_blank, create == "true");
            assert!(!e.allow_discards);
            assert_eq!((r.fs_type.as_str(), r.fs_group.gid), ("ext4", 9));
        }
    }

    #[test]
    fn a_record_in_the_clear_is_formatted_on_the_host_as_before() {
        let (p, r) = guest_gets(
            r#"{"volume-type":"block","device":"/dev/sdx","fstype":"xfs","metadata":{"createFilesystem":"true"}}"#,
        );
        assert!(p.create_file_system && p.encryption.is_none());
        assert!(r.encryption.is_none());
    }
}

//! An encrypted volume's part of its record (state.rs): how it was asked
//! to be opened, the disk under it, and the mapping over it, by name and
//! uuid. Never a key, a passphrase or where one came from. A record makes
//! recovery and Unpublish act on the mapping it names, so a mapping name is
//! accepted only as an agent names the volume's mapping (`mapping::is_name_of`
//! its id: tagged with an owner, or untagged as agents before owners named
//! it), with a cryptsetup uuid for that name; the store then refuses one
//! tagged with another agent's owner: a record cannot point the agent at a
//! mapping of anyone else's.
//!
//! Lines (values escaped as the rest of the record):
//! `encryption=luks2\t<allow_discards>\t<format_if_blank>`,
//! `format_integrity=<hmac-sha256>` (only when asked: records without it ask none),
//! `disk=<path>\t<name>\t<major>:<minor>\t<serial or empty>`,
//! `mapping=<name>\t<dm uuid>\t<LUKS2 uuid>\t<cipher>\t<key bits>\t<integrity or empty>\t<allow_discards>`.

use super::request::Encryption;
use super::volume::Encrypted;
use crate::luks2::format::Mac;
use crate::luks2::mapping::{is_name_of, Mapping};
use crate::model::Device;
use crate::sys::dm;

/// What a record holds of an encrypted volume, before it is checked
/// against the rest.
#[derive(Default)]
pub(crate) struct Fields {
    pub(crate) encryption: Option<Encryption>,
    integrity: Option<Mac>,
    disk: Option<Device>,
    mapping: Option<(String, String, String, String, u32, String, bool)>,
}

/// A field of the encryption lines that is not as the agent writes it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Bad {
    #[error("{0} {1:?}")]
    Value(&'static str, String),
    #[error("mapping {found:?} is not the one an agent names volume {id}'s")]
    OtherMapping { id: String, found: String },
    #[error("an encrypted volume with no {0}")]
    Missing(&'static str),
}

/// The encryption lines of a record of `spec` and `enc`.
pub(crate) fn encode(asked: &Encryption, enc: &Encrypted, esc: impl Fn(&str) -> String) -> String {
    let d = &enc.disk;
    let m = &enc.mapping;
    let integrity = asked.integrity.map_or(String::new(), |i| {
        format!("format_integrity={}\n", i.flag())
    });
    format!(
        "encryption=luks2\t{}\t{}\n{integrity}disk={}\t{}\t{}:{}\t{}\nmapping={}\t{}\t{}\t{}\t{}\t{}\t{}\n",
        asked.allow_discards,
        asked.format_if_blank,
        esc(&d.path.to_string_lossy()),
        esc(&d.name),
        d.major,
        d.minor,
        esc(d.serial.as_deref().unwrap_or("")),
        esc(&m.name),
        esc(&m.dm_uuid),
        esc(&m.luks_uuid),
        esc(&m.cipher),
        m.key_bits,
        esc(m.integrity.as_deref().unwrap_or("")),
        m.allow_discards,
    )
}

fn boolean(key: &'static str, v: &str) -> Result<bool, Bad> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(Bad::Value(key, v.to_string())),
    }
}

impl Fields {
    /// Takes a line of the encryption part; false for a key that is not one.
    /// `unesc` unescapes a value (the record's escapes).
    pub(crate) fn take(
        &mut self,
        k: &str,
        v: &str,
        unesc: impl Fn(&str) -> Option<String>,
    ) -> Result<bool, Bad> {
        let f: Vec<&str> = v.split('\t').collect();
        let text = |key, s: &str| unesc(s).ok_or_else(|| Bad::Value(key, s.to_string()));
        match (k, f.as_slice()) {
            ("encryption", ["luks2", discards, format]) => {
                self.encryption = Some(Encryption {
                    allow_discards: boolean("encryption allow_discards", discards)?,
                    format_if_blank: boolean("encryption format_if_blank", format)?,
                    integrity: None,
                });
            }
            ("format_integrity", [flag]) => {
                self.integrity = Some(
                    Mac::from_flag(flag)
                        .ok_or_else(|| Bad::Value("format_integrity", v.to_string()))?,
                );
            }
            ("format_integrity", _) => return Err(Bad::Value("format_integrity", v.to_string())),
            ("encryption", _) => return Err(Bad::Value("encryption", v.to_string())),
            ("disk", [path, name, num, serial]) => {
                let (major, minor) = num
                    .split_once(':')
                    .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
                    .ok_or_else(|| Bad::Value("disk devnum", num.to_string()))?;
                let serial = text("disk serial", serial)?;
                self.disk = Some(Device {
                    path: text("disk path", path)?.into(),
                    name: text("disk name", name)?,
                    major,
                    minor,
                    serial: (!serial.is_empty()).then_some(serial),
                });
            }
            ("disk", _) => return Err(Bad::Value("disk", v.to_string())),
            ("mapping", [name, uuid, luks, cipher, bits, integrity, discards]) => {
                self.mapping = Some((
                    text("mapping name", name)?,
                    text("mapping uuid", uuid)?,
                    text("LUKS2 uuid", luks)?,
                    text("cipher", cipher)?,
                    bits.parse()
                        .map_err(|_| Bad::Value("key bits", bits.to_string()))?,
                    text("integrity", integrity)?,
                    boolean("mapping allow_discards", discards)?,
                ));
            }
            ("mapping", _) => return Err(Bad::Value("mapping", v.to_string())),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The encrypted part of volume `id` whose mapping is `device`, checked;
    /// None for a volume in the clear (a record with none of the lines).
    pub(crate) fn finish(
        self,
        id: &str,
        device: &Device,
    ) -> Result<Option<(Encryption, Encrypted)>, Bad> {
        let Some(mut asked) = self.encryption else {
            if self.disk.is_some() || self.mapping.is_some() || self.integrity.is_some() {
                return Err(Bad::Missing("encryption line"));
            }
            return Ok(None);
        };
        asked.integrity = self.integrity;
        let disk = self.disk.ok_or(Bad::Missing("disk"))?;
        let (name, dm_uuid, luks_uuid, cipher, key_bits, integrity, allow_discards) =
            self.mapping.ok_or(Bad::Missing("mapping"))?;
        let named = dm::parse_crypt_uuid(&dm_uuid).map(|(_, _, n)| n);
        if !is_name_of(&name, id) || named != Some(name.as_str()) {
            return Err(Bad::OtherMapping {
                id: id.to_string(),
                found: format!("{name} ({dm_uuid})"),
            });
        }
        let mapping = Mapping {
            name,
            dm_uuid,
            dev: (device.major, device.minor),
            luks_uuid,
            cipher,
            key_bits,
            integrity: (!integrity.is_empty()).then_some(integrity),
            allow_discards,
            log_from: 0,
        };
        Ok(Some((asked, Encrypted { disk, mapping })))
    }
}

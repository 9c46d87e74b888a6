//! A Kata direct-volume record as bytes: parsed and judged without looking
//! at the host (the pure half, the entry point a fuzz target calls), and
//! the name of a volume path's record directory. `store` reads and writes
//! the records on disk.
//!
//! The JSON is read as Go's `encoding/json` reads it into Kata's struct,
//! except where that would be ambiguous: a key that Go would match to a
//! field case-insensitively but that is not spelled exactly so, and a key
//! given twice, are refused rather than guessed. serde_json reads it
//! straight into [`MountInfo`] through a visitor that sees every key in
//! order, so those can be told (a map type would keep one key silently).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use crust_protocols::key_uri;
use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
use serde_json::Value;

/// The largest fsGroup a record may give (Kubernetes' int64 limited to a
/// non-negative 32-bit signed value, as Kata's runtime parses it).
pub const MAX_FS_GROUP: u32 = 2_147_483_647;

/// The fields of Kata's `MountInfo`, as its JSON tags spell them.
const FIELDS: [&str; 5] = ["volume-type", "device", "fstype", "metadata", "options"];

crust_protocols::coded_errors! {
/// Why a record's bytes are refused. Pure: says nothing of the file's place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[code(InvalidArgument)]
    #[error("it is not JSON: {0}")]
    NotJson(String),
    #[code(InvalidArgument)]
    #[error("it is not a JSON object")]
    NotObject,
    #[code(InvalidArgument)]
    #[error("key {0:?} is given twice (Go's reader would keep one silently)")]
    Duplicate(String),
    #[code(InvalidArgument)]
    #[error("key {key:?} is not spelled as Kata writes it ({field:?}), yet Go's reader would take it for that field")]
    Misspelled { key: String, field: &'static str },
    #[code(InvalidArgument)]
    #[error("{field} must be {want}")]
    Type {
        field: &'static str,
        want: &'static str,
    },
    #[code(InvalidArgument)]
    #[error("volume-type {0:?} is not a direct volume's: Kata writes \"directvol\" or \"block\"")]
    VolumeType(String),
    #[code(InvalidArgument)]
    #[error("it names no device")]
    NoDevice,
    #[code(InvalidArgument)]
    #[error("device {0:?} is not an absolute path to a block device")]
    DeviceNotAbsolute(String),
    #[code(InvalidArgument)]
    #[error("fstype {0:?} is not supported: use ext4 or xfs")]
    FsType(String),
    #[code(InvalidArgument)]
    #[error("metadata fsGroup {0:?} is not a decimal group id from 0 to 2147483647")]
    FsGroup(String),
    #[code(InvalidArgument)]
    #[error(
        "metadata fsGroupChangePolicy {0:?} is not a policy: use \"Always\" or \"OnRootMismatch\""
    )]
    Policy(String),
    #[code(InvalidArgument)]
    #[error("metadata createFilesystem {0:?} must be \"true\" or \"false\"")]
    CreateFilesystem(String),
    #[code(InvalidArgument)]
    #[error("{0}")]
    Option(String),
    #[code(InvalidArgument)]
    #[error("metadata encryptionKey is empty, which Kata reads as no encryption and crustd will not guess: leave encryptionKey out for a volume in the clear, or name its key (kbs:///repository/type/tag, or file:///path in the guest)")]
    EmptyKey,
    #[code(Unimplemented)]
    #[error("metadata encryptionKey \"ephemeral\" asks for a key made for this pod alone (Kata's encrypted emptyDir), and the guest agent makes none: crustd would have to make the key and hand it over, and crustd never holds key bytes; name a key the guest fetches instead (kbs:///repository/type/tag, or file:///path in the guest)")]
    Ephemeral,
    #[code(Unimplemented)]
    #[error("metadata encryptionKey is a sealed secret (sealed.…), which the guest agent does not unseal: put the key in the KBS and name it kbs:///repository/type/tag")]
    Sealed,
    #[code(InvalidArgument)]
    #[error("metadata encryptionKey is not a reference to a key but, it seems, the key itself ({0} bytes, not shown): crustd never holds key bytes nor hands them to the guest; put the key in the KBS and name it kbs:///repository/type/tag, or in a file in the guest and name it file:///path")]
    KeyBytes(usize),
    #[code(InvalidArgument)]
    #[error("metadata encryptionKey names the scheme {0:?}, which the guest does not resolve: name the key kbs:///repository/type/tag (a KBS resource, through the Confidential Data Hub) or file:///path (a file in the guest)")]
    KeyScheme(String),
    #[code(InvalidArgument)]
    #[error("metadata encryptionKey {} {why}", key_uri::shown(.uri))]
    KeyUri { uri: String, why: key_uri::Refused },
}
}

/// A record's JSON as Go's `encoding/json` takes it into Kata's struct
/// (types only; values are judged by [`MountInfo::validate`]). Absent and
/// `null` fields are empty, as in Go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountInfo {
    pub volume_type: String,
    pub device: String,
    pub fstype: String,
    pub metadata: BTreeMap<String, String>,
    pub options: Vec<String>,
}

/// A record that passed every check that needs no host: what to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// "directvol" or "block": both a filesystem on a block device.
    pub volume_type: String,
    /// The host block device (an absolute path; a symlink to one is fine).
    pub device: String,
    /// "ext4" or "xfs".
    pub fstype: String,
    /// Mount options, each accepted by the agent's option table.
    pub options: Vec<String>,
    /// fsGroup, if the record gives one.
    pub fs_group: Option<u32>,
    /// fsGroupChangePolicy OnRootMismatch (else Always).
    pub on_root_mismatch: bool,
    /// createFilesystem "true": format the device first if it is provably
    /// blank (on the host; in the guest, inside LUKS2, when encrypted).
    pub create_filesystem: bool,
    /// encryptionKey: the key's reference (`kbs:///repository/type/tag` or
    /// `file:///path`), which the guest resolves; never key bytes. None:
    /// the volume is in the clear.
    pub key_uri: Option<String>,
}

/// Parses and validates a record's bytes: the entry point for a fuzz target.
pub fn parse_record(bytes: &[u8]) -> std::result::Result<Record, RecordError> {
    MountInfo::from_json(bytes)?.validate()
}

/// A key as Go's `encoding/json` compares it with a field's name (Unicode
/// simple case folding: "DEVICE", and "ſ" for "s", match).
fn fold(s: &str) -> String {
    s.chars()
        .flat_map(char::to_lowercase)
        .flat_map(char::to_uppercase)
        .collect()
}

/// A record's refusal found while reading, kept beside serde's own error
/// (which carries only text) so the caller gets it typed.
#[derive(Default)]
struct Refusal(RefCell<Option<RecordError>>);

impl Refusal {
    /// Keeps `e` and answers serde's error for it.
    fn refuse<E: de::Error>(&self, e: RecordError) -> E {
        let text = e.to_string();
        self.0.borrow_mut().get_or_insert(e);
        E::custom(text)
    }
}

/// Reads the top-level object into a [`MountInfo`].
struct Top<'a>(&'a Refusal);

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = MountInfo;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<MountInfo, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = MountInfo;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<MountInfo, A::Error> {
        let mut seen: Vec<&'static str> = Vec::new();
        let mut mi = MountInfo::default();
        while let Some(key) = a.next_key::<String>()? {
            let folded = fold(&key);
            // Go ignores keys that match no field, and so does crustd (Azure
            // and others may add their own); their values are still read,
            // within serde_json's nesting limit, as Go's reader reads them.
            let Some(field) = FIELDS.iter().copied().find(|f| fold(f) == folded) else {
                a.next_value::<Value>()?;
                continue;
            };
            if key != field {
                return Err(self.0.refuse(RecordError::Misspelled { key, field }));
            }
            if seen.contains(&field) {
                return Err(self.0.refuse(RecordError::Duplicate(key)));
            }
            seen.push(field);
            match field {
                "metadata" => mi.metadata = a.next_value_seed(Metadata(self.0))?,
                "options" => {
                    let want = RecordError::Type {
                        field: "options",
                        want: "an array of strings",
                    };
                    mi.options = match a.next_value::<Value>()? {
                        Value::Null => Vec::new(),
                        Value::Array(items) => {
                            let mut out = Vec::with_capacity(items.len());
                            for i in items {
                                let Value::String(o) = i else {
                                    return Err(self.0.refuse(want));
                                };
                                out.push(o);
                            }
                            out
                        }
                        _ => return Err(self.0.refuse(want)),
                    };
                }
                _ => {
                    let s = match a.next_value::<Value>()? {
                        Value::Null => String::new(),
                        Value::String(s) => s,
                        _ => {
                            return Err(self.0.refuse(RecordError::Type {
                                field,
                                want: "a string",
                            }))
                        }
                    };
                    match field {
                        "volume-type" => mi.volume_type = s,
                        "device" => mi.device = s,
                        _ => mi.fstype = s,
                    }
                }
            }
        }
        Ok(mi)
    }
}

/// Reads `metadata`: null, or an object of strings, each key once.
struct Metadata<'a>(&'a Refusal);

impl Metadata<'_> {
    fn wrong<E: de::Error>(&self) -> E {
        self.0.refuse(RecordError::Type {
            field: "metadata",
            want: "an object of strings",
        })
    }
}

impl<'de> DeserializeSeed<'de> for Metadata<'_> {
    type Value = BTreeMap<String, String>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Metadata<'_> {
    type Value = BTreeMap<String, String>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of strings")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(BTreeMap::new())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(k) = a.next_key::<String>()? {
            let Value::String(v) = a.next_value::<Value>()? else {
                return Err(self.wrong());
            };
            if out.contains_key(&k) {
                return Err(self
                    .0
                    .refuse(RecordError::Duplicate(format!("metadata.{k}"))));
            }
            out.insert(k, v);
        }
        Ok(out)
    }
    // Any other JSON value is the wrong type.
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Err(self.wrong())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Err(self.wrong())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Err(self.wrong())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Err(self.wrong())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Err(self.wrong())
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(self.wrong())
    }
}

impl MountInfo {
    /// Reads a record's JSON the way Kata's reader unmarshals it, refusing
    /// what Go would read ambiguously (duplicate or case-variant keys).
    pub fn from_json(bytes: &[u8]) -> std::result::Result<MountInfo, RecordError> {
        let refusal = Refusal::default();
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let read = Top(&refusal)
            .deserialize(&mut de)
            .and_then(|mi| de.end().map(|()| mi));
        read.map_err(|e| match refusal.0.into_inner() {
            Some(r) => r,
            // serde_json's own refusal of the shape: a value, but not an object.
            None if e.classify() == serde_json::error::Category::Data => RecordError::NotObject,
            None => RecordError::NotJson(e.to_string()),
        })
    }

    /// Judges the values: everything that can be decided without the host.
    pub fn validate(self) -> std::result::Result<Record, RecordError> {
        // Said first and plainly: an encrypted volume is never published in the clear.
        let key_uri = match self.metadata.get("encryptionKey") {
            None => None,
            Some(k) => Some(key_reference(k)?),
        };
        if !matches!(self.volume_type.as_str(), "directvol" | "block") {
            return Err(RecordError::VolumeType(self.volume_type));
        }
        if self.device.is_empty() {
            return Err(RecordError::NoDevice);
        }
        if !self.device.starts_with('/') || self.device.contains('\0') || self.device.len() > 4096 {
            return Err(RecordError::DeviceNotAbsolute(self.device));
        }
        if !matches!(self.fstype.as_str(), "ext4" | "xfs") {
            return Err(RecordError::FsType(self.fstype));
        }
        let fs_group = match self.metadata.get("fsGroup") {
            None => None,
            Some(g) => Some(parse_gid(g).ok_or_else(|| RecordError::FsGroup(g.clone()))?),
        };
        let on_root_mismatch = match self.metadata.get("fsGroupChangePolicy").map(String::as_str) {
            None | Some("Always") => false,
            Some("OnRootMismatch") => true,
            Some(p) => return Err(RecordError::Policy(p.to_string())),
        };
        let create_filesystem = match self.metadata.get("createFilesystem").map(String::as_str) {
            None | Some("false") => false,
            Some("true") => true,
            Some(c) => return Err(RecordError::CreateFilesystem(c.to_string())),
        };
        // The agent's own option table, so that a refused option plugs nothing.
        crust_protocols::options::parse_options(&self.options, false)
            .map_err(|e| RecordError::Option(e.to_string()))?;
        Ok(Record {
            volume_type: self.volume_type,
            device: self.device,
            fstype: self.fstype,
            options: self.options,
            fs_group,
            on_root_mismatch,
            create_filesystem,
            key_uri,
        })
    }
}

/// metadata encryptionKey: a reference the guest resolves, or why crustd
/// cannot publish the volume with it. The value is shown only where it
/// names a key (a scheme, a `kbs:///` or `file:///` URI), never where it may
/// be one.
fn key_reference(key: &str) -> std::result::Result<String, RecordError> {
    if key.is_empty() {
        return Err(RecordError::EmptyKey);
    }
    if key.eq_ignore_ascii_case("ephemeral") {
        return Err(RecordError::Ephemeral);
    }
    if key.starts_with("sealed.") {
        return Err(RecordError::Sealed);
    }
    let Some(scheme) = scheme(key) else {
        return Err(RecordError::KeyBytes(key.len()));
    };
    if !matches!(scheme, "kbs" | "file") && !scheme.starts_with("kbs+") {
        return Err(RecordError::KeyScheme(scheme.to_string()));
    }
    match key_uri::parse(key) {
        Ok(_) => Ok(key.to_string()),
        Err(why) => Err(RecordError::KeyUri {
            uri: key.to_string(),
            why,
        }),
    }
}

/// The scheme `s` starts with, as RFC 3986 spells one (a letter, then
/// letters, digits, `+`, `-` or `.`, then `:`), at most 32 bytes; None if
/// it starts with none.
fn scheme(s: &str) -> Option<&str> {
    let (scheme, _) = s.split_once(':')?;
    let b = scheme.as_bytes();
    let part = |c: &u8| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'-' | b'.');
    (b.len() <= 32 && b.first().is_some_and(u8::is_ascii_alphabetic) && b.iter().all(part))
        .then_some(scheme)
}

/// A decimal group id from 0 to [`MAX_FS_GROUP`], digits only.
fn parse_gid(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u64>()
        .ok()
        .and_then(|g| u32::try_from(g).ok())
        .filter(|g| *g <= MAX_FS_GROUP)
}

/// Go's `base64.URLEncoding` (the URL-safe alphabet, `=` padding kept): the
/// name of a volume path's record directory.
pub fn encode(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::code::Code;

    #[test]
    fn encodes_as_gos_url_encoding() {
        // Go: base64.URLEncoding.EncodeToString.
        for (input, want) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"/a?b>", "L2E_Yj4="),
            (
                b"/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount",
                "L3Zhci9saWIva3ViZWxldC9wb2RzL3Uvdm9sdW1lcy9rdWJlcm5ldGVzLmlvfmNzaS9wdi9tb3VudA==",
            ),
            (&[0xfb, 0xff, 0xfe][..], "-__-"),
        ] {
            assert_eq!(encode(input), want, "{input:?}");
        }
    }

    #[test]
    fn kata_records_parse() {
        let r = parse_record(
            br#"{"volume-type":"directvol","device":"/dev/sdx","fstype":"ext4","metadata":{"fsGroup":"2000","fsGroupChangePolicy":"OnRootMismatch","azure.csi.disk/volume-id":"x"},"options":["noatime"]}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            Record {
                volume_type: "directvol".into(),
                device: "/dev/sdx".into(),
                fstype: "ext4".into(),
                options: vec!["noatime".into()],
                fs_group: Some(2000),
                on_root_mismatch: true,
                create_filesystem: false,
                key_uri: None,
            }
        );
        // Go's runtime spelling, no metadata or options, nulls, unknown keys.
        let r = parse_record(
            br#"{"volume-type":"block","device":"/dev/disk/by-id/x","fstype":"xfs","metadata":null,"options":null,"extra":{"a":[1]}}"#,
        )
        .unwrap();
        assert_eq!((r.fs_group, r.on_root_mismatch), (None, false));
        assert!(r.options.is_empty());
        let r = parse_record(
            br#"{"volume-type":"block","device":"/dev/x","fstype":"ext4","metadata":{"createFilesystem":"true","fsGroup":"0"}}"#,
        )
        .unwrap();
        assert!(r.create_filesystem);
        assert_eq!(r.fs_group, Some(0));
    }

    /// A directvol record with `meta` inside its metadata and `opts` inside its options.
    fn directvol(meta: &str, opts: &str) -> String {
        format!(
            r#"{{"volume-type":"directvol","device":"/dev/sdx","fstype":"ext4","metadata":{{{meta}}},"options":[{opts}]}}"#
        )
    }

    /// Records not in the shape of one: not JSON, not an object, a key
    /// twice or misspelled, a value of the wrong type.
    fn misshapen() -> Vec<(String, RecordError)> {
        vec![
            ("".into(), RecordError::NotJson(String::new())),
            ("{".into(), RecordError::NotJson(String::new())),
            ("[]".into(), RecordError::NotObject),
            ("null".into(), RecordError::NotObject),
            (
                format!("{} x", directvol("", "")),
                RecordError::NotJson(String::new()),
            ),
            (
                r#"{"device":"/dev/a","device":"/dev/b"}"#.into(),
                RecordError::Duplicate("device".into()),
            ),
            (
                r#"{"volume-type":"block","device":"/dev/a","DEVICE":"/dev/b","fstype":"ext4"}"#
                    .into(),
                RecordError::Misspelled {
                    key: "DEVICE".into(),
                    field: "device",
                },
            ),
            (
                // U+017F folds to "s" in Go's matching.
                "{\"volume-type\":\"block\",\"device\":\"/dev/a\",\"f\u{17f}type\":\"ext4\"}"
                    .into(),
                RecordError::Misspelled {
                    key: "f\u{17f}type".into(),
                    field: "fstype",
                },
            ),
            (
                r#"{"volume-type":"block","device":7,"fstype":"ext4"}"#.into(),
                RecordError::Type {
                    field: "device",
                    want: "a string",
                },
            ),
            (
                directvol(r#""fsGroup":5"#, ""),
                RecordError::Type {
                    field: "metadata",
                    want: "an object of strings",
                },
            ),
            (
                directvol(r#""fsGroup":"1","fsGroup":"2""#, ""),
                RecordError::Duplicate("metadata.fsGroup".into()),
            ),
            (
                directvol("", "1"),
                RecordError::Type {
                    field: "options",
                    want: "an array of strings",
                },
            ),
        ]
    }

    /// Records in the right shape whose values are refused.
    fn refused_values() -> Vec<(String, RecordError)> {
        vec![
            (
                r#"{"volume-type":"nfs","device":"/dev/a","fstype":"ext4"}"#.into(),
                RecordError::VolumeType("nfs".into()),
            ),
            (
                r#"{"volume-type":"block","fstype":"ext4"}"#.into(),
                RecordError::NoDevice,
            ),
            (
                r#"{"volume-type":"block","device":"dev/sdx","fstype":"ext4"}"#.into(),
                RecordError::DeviceNotAbsolute("dev/sdx".into()),
            ),
            (
                r#"{"volume-type":"block","device":"/dev/a\u0000b","fstype":"ext4"}"#.into(),
                RecordError::DeviceNotAbsolute("/dev/a\0b".into()),
            ),
            (
                r#"{"volume-type":"block","device":"/dev/a","fstype":"btrfs"}"#.into(),
                RecordError::FsType("btrfs".into()),
            ),
            (
                directvol(r#""fsGroup":"-1""#, ""),
                RecordError::FsGroup("-1".into()),
            ),
            (
                directvol(r#""fsGroup":"+5""#, ""),
                RecordError::FsGroup("+5".into()),
            ),
            (
                directvol(r#""fsGroup":"""#, ""),
                RecordError::FsGroup("".into()),
            ),
            (
                directvol(r#""fsGroup":"2147483648""#, ""),
                RecordError::FsGroup("2147483648".into()),
            ),
            (
                directvol(r#""fsGroup":"99999999999999999999""#, ""),
                RecordError::FsGroup("99999999999999999999".into()),
            ),
            (
                directvol(r#""fsGroupChangePolicy":"always""#, ""),
                RecordError::Policy("always".into()),
            ),
            (
                directvol(r#""createFilesystem":"yes""#, ""),
                RecordError::CreateFilesystem("yes".into()),
            ),
            (
                // Said even when something else is wrong too.
                r#"{"volume-type":"x","metadata":{"encryptionKey":"k"}}"#.into(),
                RecordError::KeyBytes(1),
            ),
            (
                // Kata's encrypted emptyDir, as its runtime files it.
                r#"{"volume-type":"blk","device":"/x/disk.img","fstype":"ext4","metadata":{"createFilesystem":"true","encryptionKey":"ephemeral"}}"#.into(),
                RecordError::Ephemeral,
            ),
        ]
    }

    /// A directvol record whose encryptionKey is `key`.
    fn keyed(key: &str) -> String {
        directvol(&format!(r#""encryptionKey":{key:?}"#), "")
    }

    #[test]
    fn a_key_reference_is_kept_for_the_guest_to_resolve() {
        for key in [
            "kbs:///default/key/1",
            "kbs:///alice/luks-key/vol_7",
            "kbs:///1.ok/2ok./3...",
            "file:///run/keys/vol-1",
            "file:///etc/keys/a b.bin",
        ] {
            let r = parse_record(keyed(key).as_bytes()).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(r.key_uri.as_deref(), Some(key));
            assert!(!r.create_filesystem);
        }
        let r = parse_record(
            directvol(
                r#""encryptionKey":"kbs:///a/b/c","createFilesystem":"true","fsGroup":"7""#,
                r#""noatime""#,
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(r.key_uri.as_deref(), Some("kbs:///a/b/c"));
        assert!(r.create_filesystem);
        assert_eq!(
            (r.fs_group, r.options),
            (Some(7), vec!["noatime".to_string()])
        );
        assert_eq!(
            parse_record(directvol("", "").as_bytes()).unwrap().key_uri,
            None
        );
    }

    /// encryptionKey values that are no key URI: the error, and words its
    /// sentence holds.
    fn refused_keys() -> Vec<(&'static str, RecordError, Vec<&'static str>)> {
        use RecordError::{EmptyKey, Ephemeral, KeyBytes, KeyScheme, Sealed};
        vec![
            (
                "",
                EmptyKey,
                vec!["is empty", "Kata reads as no encryption"],
            ),
            (
                "ephemeral",
                Ephemeral,
                vec!["never holds key bytes", "kbs:///"],
            ),
            ("EPHEMERAL", Ephemeral, vec!["emptyDir"]),
            (
                "sealed.eyJhbGciOiJub25lIn0.eyJ4IjoxfQ.c2ln",
                Sealed,
                vec!["sealed secret"],
            ),
            // A passphrase, base64, hex and a path: key bytes, never echoed.
            (
                "correct horse battery",
                KeyBytes(21),
                vec!["21 bytes, not shown"],
            ),
            (
                "c2VjcmV0LWtleS1ieXRlcw==",
                KeyBytes(24),
                vec!["file:///path"],
            ),
            (
                "00112233445566778899aabbccddeeff",
                KeyBytes(32),
                vec!["never holds key bytes"],
            ),
            ("/etc/keys/k", KeyBytes(11), vec!["not shown"]),
            (
                "https://vault.example/k",
                KeyScheme("https".into()),
                vec!["scheme \"https\""],
            ),
            (
                "vault:secret/data/k",
                KeyScheme("vault".into()),
                vec!["\"vault\""],
            ),
            (
                "KBS:///a/b/c",
                KeyScheme("KBS".into()),
                vec!["\"KBS\"", "kbs:///"],
            ),
        ]
    }

    /// Key URIs that break crust_protocols::key_uri's rule, and words the
    /// sentence holds.
    fn refused_uris() -> Vec<(&'static str, key_uri::Refused, &'static str)> {
        use key_uri::Refused::*;
        vec![
            (
                "kbs://kbs.example:8080/a/b/c",
                KbsHost,
                "write kbs:///repository/type/tag",
            ),
            ("kbs:///a/b", Segments(2), "2 path segments"),
            ("kbs:///a/b/c/d", Segments(4), "4 path segments"),
            (
                "kbs:///a/../c",
                SegmentStart("type", '.'),
                "starting with '.'",
            ),
            ("kbs:///a/b/c?v=1", KbsQuery('?'), "no query"),
            ("kbs+pkcs11:///a/b/c", KbsPlugin, "KBS plugin"),
            ("file://host/k", FileHost, "names a host"),
            ("file:///etc/../k", DotComponent, ". or .."),
            ("file:/etc/k", NotKeyUri, "not a key URI"),
        ]
    }

    #[test]
    fn a_key_crustd_would_have_to_hold_is_refused_saying_what_to_use() {
        let uris = refused_uris().into_iter().map(|(u, why, says)| {
            let e = RecordError::KeyUri { uri: u.into(), why };
            (u, e, vec![says, u])
        });
        for (key, want, says) in refused_keys().into_iter().chain(uris) {
            let e = parse_record(keyed(key).as_bytes()).unwrap_err();
            assert_eq!(e, want, "{key:?}");
            let code = match want {
                RecordError::Ephemeral | RecordError::Sealed => Code::Unimplemented,
                _ => Code::InvalidArgument,
            };
            assert_eq!(e.code(), code, "{key:?}");
            let m = e.to_string();
            assert!(m.starts_with("metadata encryptionKey"), "{m}");
            for w in says {
                assert!(m.contains(w), "{key:?}: {m:?} lacks {w:?}");
            }
            if matches!(want, RecordError::KeyBytes(_) | RecordError::Sealed) {
                assert!(!m.contains(&key[..8]), "{m} shows the key");
            }
        }
        // A long reference is cut in the sentence, never echoed whole.
        let long = format!("kbs:///a/b/{}", "t".repeat(300));
        let m = parse_record(keyed(&long).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(m.contains("tag of 300 bytes") && m.len() < 300, "{m}");
    }

    #[test]
    fn hostile_records_are_refused_with_their_reason() {
        for (bytes, want) in misshapen().into_iter().chain(refused_values()) {
            let got = parse_record(bytes.as_bytes()).unwrap_err();
            match (&got, &want) {
                (RecordError::NotJson(_), RecordError::NotJson(_)) => {}
                _ => assert_eq!(got, want, "{bytes}"),
            }
            let code = if want == RecordError::Ephemeral {
                Code::Unimplemented
            } else {
                Code::InvalidArgument
            };
            assert_eq!(got.code(), code, "{bytes}");
        }
    }

    #[test]
    fn options_the_agent_refuses_are_refused_before_anything_is_plugged() {
        for opt in [r#""errors=panic""#, r#""bind""#, r#""""#] {
            let e = parse_record(directvol("", opt).as_bytes()).unwrap_err();
            assert!(matches!(e, RecordError::Option(_)), "{opt}: {e:?}");
        }
    }

    #[test]
    fn deep_nesting_ends_at_the_recursion_limit_not_the_stack() {
        let deep = format!(r#"{{"x":{}1{}}}"#, "[".repeat(100_000), "]".repeat(100_000));
        assert!(matches!(
            parse_record(deep.as_bytes()),
            Err(RecordError::NotJson(_))
        ));
    }
}

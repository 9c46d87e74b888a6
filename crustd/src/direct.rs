//! Kata Containers' direct-assigned volume records, the ones CSI drivers
//! write today (Azure Disk, Alibaba Cloud, Kata's csi-kata-directvolume):
//! instead of mounting a block volume on the host, the driver files a
//! record for the runtime, `ROOT/E/mountInfo.json`, where `E` is the volume
//! path (the CSI target path) in base64 with the URL-safe alphabet and `=`
//! padding kept (Go's `base64.URLEncoding`):
//!
//! ```json
//! {"volume-type": "directvol", "device": "/dev/sdx", "fstype": "ext4",
//!  "metadata": {"fsGroup": "2000", "fsGroupChangePolicy": "OnRootMismatch"},
//!  "options": ["noatime"]}
//! ```
//!
//! Once the volume is in sandbox `S`, an empty file `ROOT/E/S` sits beside
//! it (Kata's `RecordSandboxID`); `crustd-ctl direct-volume stats|resize`
//! find the sandbox through it. The driver owns the record; crustd writes
//! and removes only the sandbox-id file.
//!
//! A record is untrusted input: it names a host block device, so a driver
//! made to surface a hostile record could reach any device on the host.
//! `ROOT/E` and `mountInfo.json` must be a real directory and a regular
//! file (no symlink is followed), owned by root, not writable by group or
//! others; the file is read through the directory's fd, bounded
//! ([`MAX_RECORD`]), and parsed by [`parse_record`], a pure function from
//! bytes to a validated [`Record`] or a [`RecordError`] (the entry point a
//! fuzz target calls). The JSON is read as Go's `encoding/json` reads it
//! into Kata's struct, except where that would be ambiguous: a key that Go
//! would match to a field case-insensitively but that is not spelled
//! exactly so, and a key given twice, are refused rather than guessed.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::error::{Code, Error, Result};
use crate::files::{self, ReadError};
use crate::registry;

/// Where Kata's Go package and runtime-rs look for records.
pub const DEFAULT_ROOT: &str = "/run/kata-containers/shared/direct-volumes";
/// The record's file name inside its directory.
pub const MOUNT_INFO: &str = "mountInfo.json";
/// The largest record read: a device, a few options and keys need far less.
pub const MAX_RECORD: u64 = 64 << 10;
/// The longest file name (the encoded volume path is one).
const NAME_MAX: usize = 255;
/// The largest fsGroup a record may give (Kubernetes' int64 limited to a
/// non-negative 32-bit signed value, as Kata's runtime parses it).
pub const MAX_FS_GROUP: u32 = 2_147_483_647;

/// The fields of Kata's `MountInfo`, as its JSON tags spell them.
const FIELDS: [&str; 5] = ["volume-type", "device", "fstype", "metadata", "options"];

/// Why a record's bytes are refused. Pure: says nothing of the file's place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("it is not JSON: {0}")]
    NotJson(String),
    #[error("it is not a JSON object")]
    NotObject,
    #[error("key {0:?} is given twice (Go's reader would keep one silently)")]
    Duplicate(String),
    #[error("key {key:?} is not spelled as Kata writes it ({field:?}), yet Go's reader would take it for that field")]
    Misspelled { key: String, field: &'static str },
    #[error("{field} must be {want}")]
    Type {
        field: &'static str,
        want: &'static str,
    },
    #[error("volume-type {0:?} is not a direct volume's: Kata writes \"directvol\" or \"block\"")]
    VolumeType(String),
    #[error("it names no device")]
    NoDevice,
    #[error("device {0:?} is not an absolute path to a block device")]
    DeviceNotAbsolute(String),
    #[error("fstype {0:?} is not supported: use ext4 or xfs")]
    FsType(String),
    #[error("metadata fsGroup {0:?} is not a decimal group id from 0 to 2147483647")]
    FsGroup(String),
    #[error(
        "metadata fsGroupChangePolicy {0:?} is not a policy: use \"Always\" or \"OnRootMismatch\""
    )]
    Policy(String),
    #[error("metadata createFilesystem {0:?} must be \"true\" or \"false\"")]
    CreateFilesystem(String),
    #[error("{0}")]
    Option(String),
    #[error("metadata encryptionKey asks for an encrypted volume, which crustd does not support: it would not ignore the key and publish the data in the clear; publish it with a runtime that supports encrypted direct volumes, or without encryptionKey")]
    Encrypted,
}

impl RecordError {
    /// The gRPC code a call refused for this answers with.
    pub fn code(&self) -> Code {
        match self {
            RecordError::Encrypted => Code::Unimplemented,
            _ => Code::InvalidArgument,
        }
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
    /// createFilesystem "true": format the device first if it is provably blank.
    pub create_filesystem: bool,
}

/// Parses and validates a record's bytes: the entry point for a fuzz target.
pub fn parse_record(bytes: &[u8]) -> std::result::Result<Record, RecordError> {
    MountInfo::from_json(bytes)?.validate()
}

/// A JSON value that keeps an object's keys in order, duplicates included
/// (serde_json's own `Value` would keep only the last).
#[derive(Debug)]
enum Json {
    Null,
    Bool,
    Number,
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Json, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<Json, E> {
        Ok(Json::Bool)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<Json, E> {
        Ok(Json::Number)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<Json, E> {
        Ok(Json::Number)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<Json, E> {
        Ok(Json::Number)
    }
    fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<Json, E> {
        Ok(Json::Str(s.to_string()))
    }
    fn visit_string<E: de::Error>(self, s: String) -> std::result::Result<Json, E> {
        Ok(Json::Str(s))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> std::result::Result<Json, A::Error> {
        let mut v = Vec::new();
        while let Some(x) = a.next_element()? {
            v.push(x);
        }
        Ok(Json::Array(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> std::result::Result<Json, A::Error> {
        let mut v = Vec::new();
        while let Some((k, x)) = a.next_entry::<String, Json>()? {
            v.push((k, x));
        }
        Ok(Json::Object(v))
    }
}

/// A key as Go's `encoding/json` compares it with a field's name (Unicode
/// simple case folding: "DEVICE", and "ſ" for "s", match).
fn fold(s: &str) -> String {
    s.chars()
        .flat_map(char::to_lowercase)
        .flat_map(char::to_uppercase)
        .collect()
}

fn string(field: &'static str, v: Json) -> std::result::Result<String, RecordError> {
    match v {
        Json::Null => Ok(String::new()),
        Json::Str(s) => Ok(s),
        _ => Err(RecordError::Type {
            field,
            want: "a string",
        }),
    }
}

impl MountInfo {
    /// Reads a record's JSON the way Kata's reader unmarshals it, refusing
    /// what Go would read ambiguously (duplicate or case-variant keys).
    pub fn from_json(bytes: &[u8]) -> std::result::Result<MountInfo, RecordError> {
        let json: Json =
            serde_json::from_slice(bytes).map_err(|e| RecordError::NotJson(e.to_string()))?;
        let Json::Object(pairs) = json else {
            return Err(RecordError::NotObject);
        };
        let mut seen: Vec<&'static str> = Vec::new();
        let mut mi = MountInfo::default();
        for (key, value) in pairs {
            let folded = fold(&key);
            // Go ignores keys that match no field, and so does crustd (Azure
            // and others may add their own).
            let Some(field) = FIELDS.iter().copied().find(|f| fold(f) == folded) else {
                continue;
            };
            if key != field {
                return Err(RecordError::Misspelled { key, field });
            }
            if seen.contains(&field) {
                return Err(RecordError::Duplicate(key));
            }
            seen.push(field);
            match field {
                "volume-type" => mi.volume_type = string(field, value)?,
                "device" => mi.device = string(field, value)?,
                "fstype" => mi.fstype = string(field, value)?,
                "metadata" => {
                    let want = RecordError::Type {
                        field: "metadata",
                        want: "an object of strings",
                    };
                    match value {
                        Json::Null => {}
                        Json::Object(entries) => {
                            for (k, v) in entries {
                                let Json::Str(v) = v else {
                                    return Err(want);
                                };
                                if mi.metadata.insert(k.clone(), v).is_some() {
                                    return Err(RecordError::Duplicate(format!("metadata.{k}")));
                                }
                            }
                        }
                        _ => return Err(want),
                    }
                }
                _ => match value {
                    Json::Null => {}
                    Json::Array(items) => {
                        for i in items {
                            let Json::Str(o) = i else {
                                return Err(RecordError::Type {
                                    field: "options",
                                    want: "an array of strings",
                                });
                            };
                            mi.options.push(o);
                        }
                    }
                    _ => {
                        return Err(RecordError::Type {
                            field: "options",
                            want: "an array of strings",
                        })
                    }
                },
            }
        }
        Ok(mi)
    }

    /// Judges the values: everything that can be decided without the host.
    pub fn validate(self) -> std::result::Result<Record, RecordError> {
        // Said first and plainly: an encrypted volume is never published in the clear.
        if self.metadata.contains_key("encryptionKey") {
            return Err(RecordError::Encrypted);
        }
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
        })
    }
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

/// Go's `base64.URLEncoding`: the URL-safe alphabet, `=` padding kept.
pub fn encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A record found and checked.
#[derive(Debug)]
pub struct Found {
    /// `ROOT/E/mountInfo.json`, for messages.
    pub file: PathBuf,
    pub record: Record,
}

/// The record directory of one volume path under a root.
pub struct Records {
    root: PathBuf,
}

/// What a sandbox-id file search found.
#[derive(Debug, PartialEq, Eq)]
pub enum SandboxOf {
    /// No record directory at all.
    NoRecord,
    /// A record, in no sandbox.
    None,
    /// In this sandbox.
    One(String),
}

impl Records {
    pub fn new(root: impl Into<PathBuf>) -> Records {
        Records { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `E` for `volume_path`, or INVALID_ARGUMENT when it cannot name a record.
    pub fn name(&self, volume_path: &[u8]) -> Result<String> {
        let shown = String::from_utf8_lossy(volume_path);
        if volume_path.is_empty() {
            return Err(Error::invalid(
                "volume_path is empty: give the path the CSI driver filed its direct-volume record under (its target path)",
            ));
        }
        if volume_path.contains(&0) {
            return Err(Error::invalid(format!(
                "volume_path {shown:?} contains a NUL byte"
            )));
        }
        let e = encode(volume_path);
        if e.len() > NAME_MAX {
            return Err(Error::invalid(format!(
                "volume_path {shown:?} is too long for a direct-volume record: its base64 name has {} bytes, a file name at most {NAME_MAX} (Kata's package cannot file it either)",
                e.len()
            )));
        }
        Ok(e)
    }

    /// `ROOT/E` for messages.
    pub fn dir_of(&self, volume_path: &[u8]) -> Result<PathBuf> {
        Ok(self.root.join(self.name(volume_path)?))
    }

    /// Opens ROOT (given by the operator: a symlink there is followed).
    fn open_root(&self) -> io::Result<OwnedFd> {
        files::open_dir(&self.root)
    }

    /// Opens and checks `ROOT/E`: a real directory owned by root and not
    /// writable by group or others. `Ok(None)`: it does not exist.
    fn open_record_dir(&self, volume_path: &[u8]) -> Result<Option<(PathBuf, OwnedFd)>> {
        let name = self.name(volume_path)?;
        let dir = self.root.join(&name);
        let root = match self.open_root() {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(Error::internal(format!(
                    "cannot open the direct-volume directory {}: {e}",
                    self.root.display()
                )))
            }
        };
        let fd = match files::open_dir_at(root.as_fd(), &name) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) if matches!(e.raw_os_error(), Some(c) if c == Errno::LOOP.raw_os_error() || c == Errno::NOTDIR.raw_os_error()) =>
            {
                let what = rfs::statat(root.as_fd(), name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                    .map(|st| files::kind(FileType::from_raw_mode(st.st_mode)))
                    .unwrap_or("not a directory");
                return Err(Error::invalid(format!(
                    "direct-volume record {} is refused: it is {what}, not a real directory (a symbolic link is not followed)",
                    dir.display()
                )));
            }
            Err(e) => {
                return Err(Error::internal(format!(
                    "cannot open {}: {e}",
                    dir.display()
                )))
            }
        };
        let st = rfs::fstat(&fd)
            .map_err(|e| Error::internal(format!("cannot stat {}: {e}", dir.display())))?;
        safe_owner(&st).map_err(|why| {
            Error::invalid(format!(
                "direct-volume record {} is refused: {why}",
                dir.display()
            ))
        })?;
        Ok(Some((dir, fd)))
    }

    /// Finds, checks and parses the record for `volume_path`. No record:
    /// NOT_FOUND naming the path and where crustd looked; a record refused:
    /// its code (INVALID_ARGUMENT, UNIMPLEMENTED for encryption) and a
    /// sentence naming the file.
    pub fn read(&self, volume_path: &[u8]) -> Result<Found> {
        let shown = String::from_utf8_lossy(volume_path).into_owned();
        let missing = |file: &Path| {
            Error::not_found(format!(
                "no direct-volume record for volume path {shown:?}: {} does not exist (crustd looks in {}, its --direct-volumes; the CSI driver writes the record, e.g. with crustd-ctl direct-volume add)",
                file.display(),
                self.root.display()
            ))
        };
        let file = self.dir_of(volume_path)?.join(MOUNT_INFO);
        let Some((_, dir)) = self.open_record_dir(volume_path)? else {
            return Err(missing(&file));
        };
        let refused = |why: String, code: Code| {
            Error::new(
                code,
                format!(
                    "direct-volume record {} (volume path {shown:?}) is refused: {why}",
                    file.display()
                ),
            )
        };
        let bytes =
            match files::read_bounded_checked(dir.as_fd(), MOUNT_INFO, MAX_RECORD, safe_owner) {
                Ok(b) => b,
                Err(ReadError::Missing) => return Err(missing(&file)),
                Err(ReadError::Io(e)) => {
                    return Err(Error::internal(format!(
                        "cannot read {}: {e}",
                        file.display()
                    )))
                }
                Err(e @ ReadError::TooLarge(_)) => {
                    return Err(refused(
                        format!("{e} (at most {MAX_RECORD} bytes)"),
                        Code::InvalidArgument,
                    ))
                }
                Err(e) => return Err(refused(e.to_string(), Code::InvalidArgument)),
            };
        let record = parse_record(&bytes).map_err(|e| refused(e.to_string(), e.code()))?;
        Ok(Found { file, record })
    }

    /// Writes the empty sandbox-id file `ROOT/E/S` (mode 0600) as Kata's
    /// `RecordSandboxID` does, and removes any other sandbox's (a record is
    /// in one sandbox at a time, and crustd's claims just proved no other
    /// has the device). A record gone meanwhile is left gone.
    pub fn record_sandbox(&self, volume_path: &[u8], sandbox: &str) -> Result<()> {
        registry::check_id(sandbox)?;
        let Some((dir, fd)) = self.open_record_dir(volume_path)? else {
            return Ok(());
        };
        for other in sandbox_files(fd.as_fd()).map_err(|e| io_err(&dir, e))? {
            if other != sandbox {
                remove_at(fd.as_fd(), &other).map_err(|e| io_err(&dir.join(&other), e))?;
            }
        }
        match files::create_exclusive(fd.as_fd(), sandbox) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let st = rfs::statat(fd.as_fd(), sandbox, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|e| io_err(&dir.join(sandbox), e.into()))?;
                let t = FileType::from_raw_mode(st.st_mode);
                if t == FileType::RegularFile {
                    Ok(())
                } else {
                    Err(Error::precondition(format!(
                        "{} is {}, not the empty file crustd writes for the sandbox; remove it",
                        dir.join(sandbox).display(),
                        files::kind(t)
                    )))
                }
            }
            Err(e) => Err(io_err(&dir.join(sandbox), e)),
        }
    }

    /// Refuses, before anything is plugged, a record directory where the
    /// sandbox-id file of `sandbox` could not be written: something other
    /// than a regular file already has its name (FAILED_PRECONDITION).
    pub fn check_sandbox_slot(&self, volume_path: &[u8], sandbox: &str) -> Result<()> {
        registry::check_id(sandbox)?;
        let Some((dir, fd)) = self.open_record_dir(volume_path)? else {
            return Ok(());
        };
        match rfs::statat(fd.as_fd(), sandbox, AtFlags::SYMLINK_NOFOLLOW) {
            Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(io_err(&dir.join(sandbox), e.into())),
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile => Ok(()),
            Ok(st) => Err(Error::precondition(format!(
                "{} is {}, where crustd writes the empty sandbox-id file: remove it, then publish again",
                dir.join(sandbox).display(),
                files::kind(FileType::from_raw_mode(st.st_mode))
            ))),
        }
    }

    /// Removes `ROOT/E/S`, if the record is still there.
    pub fn forget_sandbox(&self, volume_path: &[u8], sandbox: &str) -> Result<()> {
        let name = self.name(volume_path)?;
        let Ok(root) = self.open_root() else {
            return Ok(());
        };
        // Not checked as a record is: crustd only removes its own file here.
        let Ok(fd) = files::open_dir_at(root.as_fd(), &name) else {
            return Ok(());
        };
        remove_at(fd.as_fd(), sandbox).map_err(|e| io_err(&self.root.join(&name).join(sandbox), e))
    }

    /// The sandbox the record of `volume_path` is in, by its sandbox-id file.
    pub fn sandbox_of(&self, volume_path: &[u8]) -> Result<SandboxOf> {
        let Some((dir, fd)) = self.open_record_dir(volume_path)? else {
            return Ok(SandboxOf::NoRecord);
        };
        let mut ids = sandbox_files(fd.as_fd()).map_err(|e| io_err(&dir, e))?;
        match ids.len() {
            0 => Ok(SandboxOf::None),
            1 => Ok(SandboxOf::One(ids.remove(0))),
            _ => Err(Error::precondition(format!(
                "{} names more than one sandbox ({}): a direct volume is in one sandbox at a time; remove the stale files",
                dir.display(),
                ids.join(", ")
            ))),
        }
    }

    /// `direct-volume add`, as Kata's `Add`: checks that `mount_info`
    /// parses as a record, makes `ROOT/E` (mode 0700, ROOT too if missing)
    /// and writes `mount_info` as given to `mountInfo.json` (mode 0600),
    /// replacing it atomically.
    pub fn add(&self, volume_path: &[u8], mount_info: &[u8]) -> Result<PathBuf> {
        MountInfo::from_json(mount_info)
            .map_err(|e| Error::invalid(format!("--mount-info is not a record: {e}")))?;
        let name = self.name(volume_path)?;
        let dir = self.root.join(&name);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .map_err(|e| io_err(&self.root, e))?;
        let root = self.open_root().map_err(|e| io_err(&self.root, e))?;
        match rfs::mkdirat(root.as_fd(), name.as_str(), Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(io_err(&dir, e.into())),
        }
        let fd = files::open_dir_at(root.as_fd(), &name).map_err(|e| {
            Error::precondition(format!(
                "{} should be a directory (a symbolic link is not followed): {e}",
                dir.display()
            ))
        })?;
        files::write_atomic(fd.as_fd(), MOUNT_INFO, mount_info)
            .map_err(|e| io_err(&dir.join(MOUNT_INFO), e))?;
        Ok(dir.join(MOUNT_INFO))
    }

    /// `direct-volume remove`, as Kata's `Remove`: the record directory and
    /// everything in it (no symlink followed); none is fine.
    pub fn remove(&self, volume_path: &[u8]) -> Result<()> {
        let dir = self.dir_of(volume_path)?;
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&dir, e)),
            _ => Ok(()),
        }
    }
}

use std::os::unix::fs::DirBuilderExt;

/// A record's directory and file must be root's and writable by root only.
fn safe_owner(st: &rfs::Stat) -> std::result::Result<(), String> {
    if st.st_uid != 0 {
        return Err(format!(
            "it is owned by uid {}, not root (only root may write a record)",
            st.st_uid
        ));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(format!(
            "it is writable by group or others (mode {:04o}); a record is root's alone",
            st.st_mode & 0o7777
        ));
    }
    Ok(())
}

/// The sandbox-id files in a record directory: regular files whose names
/// are sandbox ids (not `mountInfo.json`, not hidden), sorted.
fn sandbox_files(dir: BorrowedFd<'_>) -> io::Result<Vec<String>> {
    let fd = rfs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut out = Vec::new();
    for entry in rfs::Dir::read_from(&fd)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().to_str() else {
            continue;
        };
        if name == MOUNT_INFO || name.starts_with('.') || registry::check_id(name).is_err() {
            continue;
        }
        let regular = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile);
        if regular {
            out.push(name.to_string());
        }
    }
    out.sort();
    Ok(out)
}

/// Unlinks `name` in `dir` (never a directory, never through a symlink); none is fine.
fn remove_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    match rfs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn io_err(path: &Path, e: io::Error) -> Error {
    Error::internal(format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn hostile_records_are_refused_with_their_reason() {
        let ok = |meta: &str, opts: &str| {
            format!(
                r#"{{"volume-type":"directvol","device":"/dev/sdx","fstype":"ext4","metadata":{{{meta}}},"options":[{opts}]}}"#
            )
        };
        let table: Vec<(String, RecordError)> = vec![
            ("".into(), RecordError::NotJson(String::new())),
            ("{".into(), RecordError::NotJson(String::new())),
            ("[]".into(), RecordError::NotObject),
            ("null".into(), RecordError::NotObject),
            (
                format!("{} x", ok("", "")),
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
                ok(r#""fsGroup":5"#, ""),
                RecordError::Type {
                    field: "metadata",
                    want: "an object of strings",
                },
            ),
            (
                ok(r#""fsGroup":"1","fsGroup":"2""#, ""),
                RecordError::Duplicate("metadata.fsGroup".into()),
            ),
            (
                ok("", "1"),
                RecordError::Type {
                    field: "options",
                    want: "an array of strings",
                },
            ),
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
                ok(r#""fsGroup":"-1""#, ""),
                RecordError::FsGroup("-1".into()),
            ),
            (
                ok(r#""fsGroup":"+5""#, ""),
                RecordError::FsGroup("+5".into()),
            ),
            (ok(r#""fsGroup":"""#, ""), RecordError::FsGroup("".into())),
            (
                ok(r#""fsGroup":"2147483648""#, ""),
                RecordError::FsGroup("2147483648".into()),
            ),
            (
                ok(r#""fsGroup":"99999999999999999999""#, ""),
                RecordError::FsGroup("99999999999999999999".into()),
            ),
            (
                ok(r#""fsGroupChangePolicy":"always""#, ""),
                RecordError::Policy("always".into()),
            ),
            (
                ok(r#""createFilesystem":"yes""#, ""),
                RecordError::CreateFilesystem("yes".into()),
            ),
            (ok(r#""encryptionKey":"""#, ""), RecordError::Encrypted),
            (
                // Said even when something else is wrong too.
                r#"{"volume-type":"x","metadata":{"encryptionKey":"k"}}"#.into(),
                RecordError::Encrypted,
            ),
        ];
        for (bytes, want) in table {
            let got = parse_record(bytes.as_bytes()).unwrap_err();
            match (&got, &want) {
                (RecordError::NotJson(_), RecordError::NotJson(_)) => {}
                _ => assert_eq!(got, want, "{bytes}"),
            }
            let code = if want == RecordError::Encrypted {
                Code::Unimplemented
            } else {
                Code::InvalidArgument
            };
            assert_eq!(got.code(), code, "{bytes}");
        }
        // The agent's option table: refused before anything is plugged.
        for opt in [r#""errors=panic""#, r#""bind""#, r#""""#] {
            let e = parse_record(ok("", opt).as_bytes()).unwrap_err();
            assert!(matches!(e, RecordError::Option(_)), "{opt}: {e:?}");
        }
        // Deep nesting ends at serde_json's recursion limit, not the stack.
        let deep = format!(r#"{{"x":{}1{}}}"#, "[".repeat(100_000), "]".repeat(100_000));
        assert!(matches!(
            parse_record(deep.as_bytes()),
            Err(RecordError::NotJson(_))
        ));
    }
}

//! device-mapper through its ioctls on /dev/mapper/control, typed: the
//! `struct dm_ioctl` header and its payloads (target specs, name lists)
//! encoded and decoded here as the kernel's uapi (`linux/dm-ioctl.h`, 4.x)
//! lays them out, and the calls a dm-crypt mapping needs: create, load,
//! resume, suspend, remove, status, list. No dmsetup, no libdevmapper, no
//! udev: the agent names a mapping by its dm name and uuid and opens it by
//! its device number. What a mapping is for (LUKS2, which key) is not known
//! here; the caller builds the `crypt` line with [`Crypt`].
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rustix::io::Errno;
use zeroize::Zeroizing;

use crate::sys::error::SysError;

/// Where the kernel's device-mapper control node is (made by devtmpfs when
/// dm-mod loads).
pub const CONTROL: &str = "/dev/mapper/control";

/// `sizeof(struct dm_ioctl)`: the header every call starts with.
pub const HEADER_LEN: usize = 312;
/// `DM_NAME_LEN`: a name's bytes, its NUL included.
pub const NAME_LEN: usize = 128;
/// `DM_UUID_LEN`: a uuid's bytes, its NUL included.
pub const UUID_LEN: usize = 129;
/// `sizeof(struct dm_target_spec)`.
pub const SPEC_LEN: usize = 40;
/// `DM_MAX_TYPE_NAME`: a target type's bytes, its NUL included.
const TYPE_LEN: usize = 16;
/// The header's size as the header's own fields hold it.
#[allow(clippy::cast_possible_truncation)] // 312 fits.
const HEADER_U32: u32 = HEADER_LEN as u32;
/// The interface major version the agent speaks (`DM_VERSION_MAJOR`).
const MAJOR: u32 = 4;

/// Field offsets in `struct dm_ioctl` (checked against the uapi in the tests).
mod at {
    pub const VERSION: usize = 0;
    pub const DATA_SIZE: usize = 12;
    pub const DATA_START: usize = 16;
    pub const TARGET_COUNT: usize = 20;
    pub const OPEN_COUNT: usize = 24;
    pub const FLAGS: usize = 28;
    pub const EVENT_NR: usize = 32;
    pub const DEV: usize = 40;
    pub const NAME: usize = 48;
    pub const UUID: usize = 176;
}

/// The `flags` bits the agent sends or reads (`DM_*_FLAG`).
pub mod flag {
    /// The mapping refuses writes.
    pub const READONLY: u32 = 1 << 0;
    /// In a DM_DEV_SUSPEND request: suspend (absent: resume). In a reply: suspended.
    pub const SUSPEND: u32 = 1 << 1;
    /// DM_TABLE_STATUS: the table lines, not the targets' status.
    pub const STATUS_TABLE: u32 = 1 << 4;
    /// Reply: a live table is loaded.
    pub const ACTIVE_PRESENT: u32 = 1 << 5;
    /// Reply: an inactive table waits for a resume.
    pub const INACTIVE_PRESENT: u32 = 1 << 6;
    /// Reply: the answer did not fit; ask again with a larger buffer.
    pub const BUFFER_FULL: u32 = 1 << 8;
    /// DM_LIST_DEVICES: each entry carries its uuid too (since 4.46).
    pub const UUID: u32 = 1 << 14;
    /// Request: the kernel wipes its copy of the buffer (it holds a key).
    pub const SECURE_DATA: u32 = 1 << 15;
}

/// `DM_NAME_LIST_FLAG_HAS_UUID`: a name list entry carries its uuid.
const LIST_HAS_UUID: u32 = 1;

/// The smallest answer buffer (after the header) for calls that answer with
/// data, and the most the agent will grow it to on DM_BUFFER_FULL_FLAG.
const FIRST_DATA: usize = 16 << 10;
const MAX_DATA: usize = 1 << 20;

crate::code::coded_errors! {
/// What can go wrong with device-mapper.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("device-mapper is not available: {why}; the guest kernel needs dm-mod and dm-crypt loaded (the initrd's module list)")]
    Unavailable {
        /// What was found instead of the control node.
        why: String,
    },
    #[code(FailedPrecondition)]
    #[error("the kernel's device-mapper speaks interface {major}.{minor}.{patch}; the agent needs 4.x")]
    Version { major: u32, minor: u32, patch: u32 },
    #[code(InvalidArgument)]
    #[error("{what} {value:?} cannot be a device-mapper {what}: {why}")]
    Invalid {
        /// "name", "uuid", "cipher", "target type", ...
        what: &'static str,
        /// The value refused (never a key: keys are not checked here).
        value: String,
        why: &'static str,
    },
    #[code(AlreadyExists)]
    #[error("a device-mapper device named {name:?} or with uuid {uuid:?} already exists")]
    Exists { name: String, uuid: String },
    #[code(NotFound)]
    #[error("no device-mapper device named {0:?}")]
    NotFound(String),
    #[code(FailedPrecondition)]
    #[error("device-mapper device {0:?} is in use (open, mounted, or under another mapping)")]
    Busy(String),
    #[code(FailedPrecondition)]
    #[error("the kernel refused the table of {name:?} ({source}); its log says why: ENOENT is a cipher it cannot load (is the xts module loaded?), ENOKEY a key not in the keyring, EINVAL a target or a line it does not take")]
    TableRefused {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[code(Internal)]
    #[error("device-mapper answered {call} with {why}")]
    Answer { call: &'static str, why: String },
    #[code(ResourceExhausted)]
    #[error("device-mapper's answer to {call} needs more than {max} bytes")]
    TooLarge { call: &'static str, max: usize },
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

// ----------------------------------------------------------- the commands --

/// The ioctl commands the agent uses (`DM_*_CMD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmd {
    Version = 0,
    ListDevices = 2,
    DevCreate = 3,
    DevRemove = 4,
    DevSuspend = 6,
    DevStatus = 7,
    TableLoad = 9,
    TableStatus = 12,
}

impl Cmd {
    /// `_IOWR(DM_IOCTL, nr, struct dm_ioctl)`.
    pub const fn opcode(self) -> u32 {
        // 312 fits the 14 bits of the size field.
        (3 << 30) | (HEADER_U32 << 16) | (0xfd << 8) | self as u32
    }

    /// The name messages use.
    pub const fn name(self) -> &'static str {
        match self {
            Cmd::Version => "DM_VERSION",
            Cmd::ListDevices => "DM_LIST_DEVICES",
            Cmd::DevCreate => "DM_DEV_CREATE",
            Cmd::DevRemove => "DM_DEV_REMOVE",
            Cmd::DevSuspend => "DM_DEV_SUSPEND",
            Cmd::DevStatus => "DM_DEV_STATUS",
            Cmd::TableLoad => "DM_TABLE_LOAD",
            Cmd::TableStatus => "DM_TABLE_STATUS",
        }
    }
}

// ---------------------------------------------------------------- names --

/// Checks a dm name: what the kernel takes, and what a node path and a
/// table line can hold (no '/', no whitespace or control bytes).
pub fn check_name(name: &str) -> Result<(), Error> {
    let bad = |why| {
        Err(Error::Invalid {
            what: "name",
            value: name.to_string(),
            why,
        })
    };
    if name.is_empty() || name == "." || name == ".." {
        return bad("it is empty, \".\" or \"..\"");
    }
    if name.len() >= NAME_LEN {
        return bad("it is 128 bytes or longer");
    }
    if name.bytes().any(|b| b == b'/' || b <= b' ' || b == 0x7f) {
        return bad("it holds '/', whitespace or a control byte");
    }
    Ok(())
}

/// Checks a dm uuid: nonempty, shorter than 129 bytes, printable ASCII.
pub fn check_uuid(uuid: &str) -> Result<(), Error> {
    if uuid.is_empty() || uuid.len() >= UUID_LEN || !uuid.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::Invalid {
            what: "uuid",
            value: uuid.to_string(),
            why: "it must be 1 to 128 printable ASCII bytes",
        });
    }
    Ok(())
}

/// The dm uuid cryptsetup gives a LUKS2 mapping named `name` of the volume
/// whose LUKS2 uuid is `luks_uuid`: `CRYPT-LUKS2-<uuid without dashes>-<name>`.
/// Where cryptsetup would cut it at 128 bytes, this refuses: a cut uuid
/// could name two mappings.
pub fn crypt_uuid(luks_uuid: &str, name: &str) -> Result<String, Error> {
    check_name(name)?;
    let hex: String = luks_uuid.chars().filter(|&c| c != '-').collect();
    if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(Error::Invalid {
            what: "LUKS2 uuid",
            value: luks_uuid.to_string(),
            why: "it must be letters and digits, with dashes",
        });
    }
    let uuid = format!("CRYPT-LUKS2-{hex}-{name}");
    check_uuid(&uuid)?;
    Ok(uuid)
}

/// The parts of a cryptsetup-named dm uuid: (type, LUKS uuid without
/// dashes, mapping name), e.g. ("LUKS2", "1b4e…", "pvc-1"). None for any
/// other uuid (cryptsetup's "CRYPT-PLAIN-name" and subdevices' "CRYPT-SUBDEV-"
/// have no LUKS uuid).
pub fn parse_crypt_uuid(uuid: &str) -> Option<(&str, &str, &str)> {
    let rest = uuid.strip_prefix("CRYPT-")?;
    let (kind, rest) = rest.split_once('-')?;
    let (hex, name) = rest.split_once('-')?;
    if !kind.starts_with("LUKS") || hex.is_empty() || name.is_empty() {
        return None;
    }
    hex.bytes()
        .all(|b| b.is_ascii_hexdigit())
        .then_some((kind, hex, name))
}

// ------------------------------------------------------------- dm-crypt --

/// How a `crypt` line carries the volume key.
pub enum CryptKey<'a> {
    /// In hex, in the line: a table readback (`dmsetup table --showkeys`)
    /// shows it.
    Hex(&'a [u8]),
    /// A `logon` key in the kernel keyring, by its description: the line
    /// says `:<size>:logon:<description>`, and no readback shows the key.
    Logon {
        /// The key's size in bytes.
        size: usize,
        description: &'a str,
    },
}

/// One dm-crypt target, as `Documentation/admin-guide/device-mapper/dm-crypt.rst`
/// writes it: `<cipher> <key> <iv_offset> <device> <offset> [<#opt> <opt>...]`.
pub struct Crypt<'a> {
    /// e.g. "aes-xts-plain64" (LUKS2's `encryption`).
    pub cipher: &'a str,
    pub key: CryptKey<'a>,
    /// The IV of the first sector (LUKS2's `iv_tweak`), in 512-byte sectors.
    pub iv_offset: u64,
    /// The device under the mapping, by number.
    pub device: (u32, u32),
    /// Where the ciphertext starts on it, in 512-byte sectors.
    pub offset: u64,
    /// The encryption sector size (512 to 4096); 512 adds no option.
    pub sector_size: u32,
    /// Pass discards down (they reveal which blocks are free).
    pub allow_discards: bool,
    /// With integrity: the bytes of tag per sector the device below keeps
    /// for an AEAD cipher (`integrity:<n>:aead`).
    pub aead_tag: Option<u16>,
}

impl Crypt<'_> {
    /// The target's parameter string. It may hold the key: it is zeroed
    /// when dropped.
    pub fn params(&self) -> Result<Zeroizing<String>, Error> {
        use std::fmt::Write;
        let invalid = |what, value: &str, why| Error::Invalid {
            what,
            value: value.to_string(),
            why,
        };
        if self.cipher.is_empty() || !self.cipher.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                "cipher",
                self.cipher,
                "it must be printable ASCII without spaces",
            ));
        }
        if !(512..=4096).contains(&self.sector_size) || !self.sector_size.is_power_of_two() {
            return Err(invalid(
                "sector size",
                &self.sector_size.to_string(),
                "it must be a power of two from 512 to 4096",
            ));
        }
        // Room for the whole line up front: a String that grew would leave
        // a copy of the key in the memory it freed.
        let key_len = match self.key {
            CryptKey::Hex(key) => key.len().saturating_mul(2),
            CryptKey::Logon { description, .. } => description.len().saturating_add(32),
        };
        let cap = self
            .cipher
            .len()
            .saturating_add(key_len)
            .saturating_add(160);
        let mut s = Zeroizing::new(String::with_capacity(cap));
        let room = s.capacity();
        s.push_str(self.cipher);
        s.push(' ');
        match self.key {
            CryptKey::Hex(key) => {
                if key.is_empty() {
                    return Err(invalid("key", "", "it is empty"));
                }
                for b in key {
                    // Writing to a String cannot fail.
                    let _ = write!(s, "{b:02x}");
                }
            }
            CryptKey::Logon { size, description } => {
                if description.is_empty() || !description.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(invalid(
                        "key description",
                        description,
                        "it must be printable ASCII without spaces",
                    ));
                }
                let _ = write!(s, ":{size}:logon:{description}");
            }
        }
        let (maj, min) = self.device;
        let _ = write!(s, " {} {maj}:{min} {}", self.iv_offset, self.offset);
        let mut opts: Vec<String> = Vec::new();
        if self.allow_discards {
            opts.push("allow_discards".into());
        }
        if self.sector_size != 512 {
            opts.push(format!("sector_size:{}", self.sector_size));
        }
        if let Some(tag) = self.aead_tag {
            opts.push(format!("integrity:{tag}:aead"));
        }
        if !opts.is_empty() {
            let _ = write!(s, " {} {}", opts.len(), opts.join(" "));
        }
        debug_assert_eq!(s.capacity(), room, "the line outgrew its room");
        Ok(s)
    }
}

/// One target of a table to load: sectors `start..start+length` of the
/// mapping, mapped by `kind` with `params`.
pub struct Target {
    pub start: u64,
    pub length: u64,
    /// The target type, e.g. "crypt".
    pub kind: &'static str,
    /// Its parameters; may hold a key, so zeroed when dropped.
    pub params: Zeroizing<String>,
}

// ------------------------------------------------------------- encoding --

fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..][..4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..][..8].copy_from_slice(&v.to_ne_bytes());
}

fn get_u32(buf: &[u8], at: usize) -> Option<u32> {
    let b = buf.get(at..at.checked_add(4)?)?;
    Some(u32::from_ne_bytes(b.try_into().ok()?))
}

fn get_u64(buf: &[u8], at: usize) -> Option<u64> {
    let b = buf.get(at..at.checked_add(8)?)?;
    Some(u64::from_ne_bytes(b.try_into().ok()?))
}

/// The NUL-terminated string at the start of `b`, or None without a NUL.
fn c_str(b: &[u8]) -> Option<String> {
    let end = b.iter().position(|&c| c == 0)?;
    Some(String::from_utf8_lossy(&b[..end]).into_owned())
}

/// `x` rounded up to 8 (the kernel's `align_ptr`).
fn align8(x: usize) -> Option<usize> {
    Some(x.checked_add(7)? & !7)
}

/// A request: the header (version 4.0.0, the sizes, `flags`, the name and
/// uuid if given) then `data`, in a buffer of `HEADER_LEN + data.len().max(room)`
/// bytes that is zeroed when dropped.
pub fn request(
    name: Option<&str>,
    uuid: Option<&str>,
    flags: u32,
    target_count: u32,
    data: &[u8],
    room: usize,
) -> Result<Zeroizing<Vec<u8>>, Error> {
    let total = HEADER_LEN
        .checked_add(data.len().max(room))
        .filter(|&t| t <= HEADER_LEN.saturating_add(MAX_DATA))
        .ok_or(Error::TooLarge {
            call: "a request",
            max: MAX_DATA,
        })?;
    let mut buf = Zeroizing::new(vec![0u8; total]);
    put_u32(&mut buf, at::VERSION, MAJOR);
    let size = u32::try_from(total).map_err(|_| Error::TooLarge {
        call: "a request",
        max: MAX_DATA,
    })?;
    put_u32(&mut buf, at::DATA_SIZE, size);
    put_u32(&mut buf, at::DATA_START, HEADER_U32);
    put_u32(&mut buf, at::TARGET_COUNT, target_count);
    put_u32(&mut buf, at::FLAGS, flags);
    if let Some(n) = name {
        check_name(n)?;
        buf[at::NAME..][..n.len()].copy_from_slice(n.as_bytes());
    }
    if let Some(u) = uuid {
        check_uuid(u)?;
        buf[at::UUID..][..u.len()].copy_from_slice(u.as_bytes());
    }
    buf[HEADER_LEN..][..data.len()].copy_from_slice(data);
    Ok(buf)
}

/// DM_TABLE_LOAD's payload: each target a `struct dm_target_spec` then its
/// NUL-terminated parameters, padded to 8, `next` the offset from this spec
/// to the next (the kernel's `populate_table`). Zeroed when dropped.
pub fn encode_targets(targets: &[Target]) -> Result<Zeroizing<Vec<u8>>, Error> {
    let mut out = Zeroizing::new(Vec::new());
    for t in targets {
        if t.kind.is_empty()
            || t.kind.len() >= TYPE_LEN
            || !t.kind.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(Error::Invalid {
                what: "target type",
                value: t.kind.to_string(),
                why: "it must be 1 to 15 printable ASCII bytes",
            });
        }
        if t.params.bytes().any(|b| b == 0) {
            return Err(Error::Invalid {
                what: "target parameters",
                value: format!("({} bytes)", t.params.len()),
                why: "they hold a NUL byte",
            });
        }
        let len = SPEC_LEN
            .checked_add(t.params.len())
            .and_then(|l| l.checked_add(1))
            .and_then(align8)
            .filter(|&l| l <= MAX_DATA)
            .ok_or(Error::TooLarge {
                call: Cmd::TableLoad.name(),
                max: MAX_DATA,
            })?;
        let start = out.len();
        let grown = start.checked_add(len).filter(|&g| g <= MAX_DATA);
        let grown = grown.ok_or(Error::TooLarge {
            call: Cmd::TableLoad.name(),
            max: MAX_DATA,
        })?;
        // Grown in place, never reallocated with a copy of the key left behind.
        reserve_zeroizing(&mut out, grown);
        out.resize(grown, 0);
        let spec = &mut out[start..];
        put_u64(spec, 0, t.start);
        put_u64(spec, 8, t.length);
        // status 0; next: this spec's own length, the last one's too (unused).
        put_u32(spec, 20, u32::try_from(len).unwrap_or(u32::MAX));
        spec[24..][..t.kind.len()].copy_from_slice(t.kind.as_bytes());
        spec[SPEC_LEN..][..t.params.len()].copy_from_slice(t.params.as_bytes());
    }
    Ok(out)
}

/// Makes room for `want` bytes in `v` without leaving a copy of its old
/// contents in freed memory: a larger buffer, the bytes moved, the old one zeroed.
fn reserve_zeroizing(v: &mut Zeroizing<Vec<u8>>, want: usize) {
    if v.capacity() >= want {
        return;
    }
    let mut bigger = Zeroizing::new(Vec::with_capacity(want.max(v.capacity().saturating_mul(2))));
    bigger.extend_from_slice(v);
    std::mem::swap(v, &mut bigger);
}

// ------------------------------------------------------------- decoding --

/// A device as DM_DEV_STATUS (and every call's reply header) describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevInfo {
    pub name: String,
    /// Empty when the device has none.
    pub uuid: String,
    /// Its block device number (major, minor): /dev/dm-<minor>.
    pub dev: (u32, u32),
    /// How many openers it has (a mounted filesystem counts).
    pub open_count: i32,
    pub event_nr: u32,
    pub target_count: u32,
    /// The `flags` word: [`flag::SUSPEND`], [`flag::READONLY`],
    /// [`flag::ACTIVE_PRESENT`], [`flag::INACTIVE_PRESENT`].
    pub flags: u32,
}

impl DevInfo {
    pub fn suspended(&self) -> bool {
        self.flags & flag::SUSPEND != 0
    }
    pub fn has_live_table(&self) -> bool {
        self.flags & flag::ACTIVE_PRESENT != 0
    }
}

/// A device number as dm encodes it (`huge_encode_dev`) → (major, minor).
pub fn decode_dev(dev: u64) -> (u32, u32) {
    let major = (dev >> 8) & 0xfff;
    let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
    (
        u32::try_from(major).unwrap_or(u32::MAX),
        u32::try_from(minor).unwrap_or(u32::MAX),
    )
}

/// The reply header of `buf`, checked: long enough, version 4, sizes inside
/// the buffer.
pub fn decode_header(call: Cmd, buf: &[u8]) -> Result<DevInfo, Error> {
    let bad = |why: &str| Error::Answer {
        call: call.name(),
        why: why.to_string(),
    };
    if buf.len() < HEADER_LEN {
        return Err(bad("a header shorter than 312 bytes"));
    }
    let field = |at| get_u32(buf, at).ok_or_else(|| bad("a short header"));
    if field(at::VERSION)? != MAJOR {
        return Err(bad("an interface major version other than 4"));
    }
    let name =
        c_str(&buf[at::NAME..at::NAME + NAME_LEN]).ok_or_else(|| bad("a name without NUL"))?;
    let uuid =
        c_str(&buf[at::UUID..at::UUID + UUID_LEN]).ok_or_else(|| bad("a uuid without NUL"))?;
    let open_count = i32::from_ne_bytes(field(at::OPEN_COUNT)?.to_ne_bytes());
    Ok(DevInfo {
        name,
        uuid,
        dev: decode_dev(get_u64(buf, at::DEV).ok_or_else(|| bad("a short header"))?),
        open_count,
        event_nr: field(at::EVENT_NR)?,
        target_count: field(at::TARGET_COUNT)?,
        flags: field(at::FLAGS)?,
    })
}

/// The data a reply carries: `buf[data_start..data_size]`, both checked.
fn reply_data(call: Cmd, buf: &[u8]) -> Result<&[u8], Error> {
    let bad = |why: &str| Error::Answer {
        call: call.name(),
        why: why.to_string(),
    };
    let start = get_u32(buf, at::DATA_START).ok_or_else(|| bad("a short header"))?;
    let size = get_u32(buf, at::DATA_SIZE).ok_or_else(|| bad("a short header"))?;
    let (start, size) = (
        usize::try_from(start).map_err(|_| bad("a data start past the buffer"))?,
        usize::try_from(size).map_err(|_| bad("a data size past the buffer"))?,
    );
    if start < HEADER_LEN || start > size || size > buf.len() {
        return Err(bad(&format!(
            "data from {start} to {size} in a buffer of {}",
            buf.len()
        )));
    }
    Ok(&buf[start..size])
}

/// A device DM_LIST_DEVICES names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub dev: (u32, u32),
    /// Its uuid; None when it has none, or the kernel (before 4.46) does not say.
    pub uuid: Option<String>,
}

/// DM_LIST_DEVICES's data: none when there are no devices, else `struct
/// dm_name_list` entries, each `next` bytes from the one before (0 ends the
/// list), the name then, 8-aligned, the event number, flags and (asked with
/// [`flag::UUID`], kernels since 5.14) the uuid. Every offset is
/// checked to stay inside `data` and to move forward.
pub fn decode_list(data: &[u8]) -> Result<Vec<Listed>, Error> {
    let bad = |why: String| Error::Answer {
        call: Cmd::ListDevices.name(),
        why,
    };
    let mut out = Vec::new();
    let mut at = 0usize;
    if data.is_empty() {
        return Ok(out); // No devices: data_size says 0 bytes.
    }
    loop {
        let dev = get_u64(data, at).ok_or_else(|| bad(format!("an entry cut at {at}")))?;
        if dev == 0 && at == 0 {
            return Ok(out); // "Flags no data": no devices.
        }
        let next = get_u32(data, at.saturating_add(8))
            .ok_or_else(|| bad(format!("an entry cut at {at}")))?;
        let next = usize::try_from(next).map_err(|_| bad("a huge next".into()))?;
        // This entry's bytes: up to the next one, or the end of the data.
        let end = if next == 0 {
            data.len()
        } else {
            at.checked_add(next)
                .filter(|&e| e <= data.len() && next >= 16)
                .ok_or_else(|| {
                    bad(format!(
                        "an entry at {at} whose next ({next}) leaves the data"
                    ))
                })?
        };
        let entry = &data[at..end];
        let name = c_str(entry.get(12..).unwrap_or(&[]))
            .ok_or_else(|| bad(format!("a name without NUL at {at}")))?;
        let uuid = align8(12usize.saturating_add(name.len()).saturating_add(1))
            .and_then(|e| Some((e, get_u32(entry, e.checked_add(4)?)?)))
            .filter(|&(_, flags)| flags & LIST_HAS_UUID != 0)
            .and_then(|(e, _)| c_str(entry.get(e.checked_add(8)?..)?));
        out.push(Listed {
            name,
            dev: decode_dev(dev),
            uuid,
        });
        if next == 0 {
            return Ok(out);
        }
        at = end;
    }
}

/// One target of a live table, as DM_TABLE_STATUS answers: its sectors,
/// type, and either its status or (with [`flag::STATUS_TABLE`]) its table line.
#[derive(Clone, PartialEq, Eq)]
pub struct TargetLine {
    pub start: u64,
    pub length: u64,
    pub kind: String,
    /// May hold a key (a `crypt` line read back as a table, loaded with a
    /// hex key): zeroed when dropped, and not printed by Debug.
    pub text: Zeroizing<String>,
}

impl std::fmt::Debug for TargetLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TargetLine({} {} {} ({} bytes))",
            self.start,
            self.length,
            self.kind,
            self.text.len()
        )
    }
}

/// DM_TABLE_STATUS's data: `count` target specs, each followed by its
/// string; here `next` counts from the start of the data, not from the spec
/// (the kernel's `retrieve_status`, unlike `populate_table`).
pub fn decode_targets(data: &[u8], count: u32) -> Result<Vec<TargetLine>, Error> {
    let bad = |why: String| Error::Answer {
        call: Cmd::TableStatus.name(),
        why,
    };
    let mut out = Vec::new();
    let mut at = 0usize;
    for i in 0..count {
        let spec = data
            .get(at..at.saturating_add(SPEC_LEN))
            .ok_or_else(|| bad(format!("target {i} cut at {at}")))?;
        let kind = c_str(&spec[24..SPEC_LEN])
            .ok_or_else(|| bad(format!("target {i}'s type without NUL")))?;
        let last = i.saturating_add(1) == count;
        let next = get_u32(spec, 20)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0);
        // The string ends before the next spec (the last one, at the data's end).
        let text_start = at.saturating_add(SPEC_LEN);
        let end = if last { data.len() } else { next };
        let text = data
            .get(text_start..end)
            .filter(|_| last || next > at)
            .ok_or_else(|| bad(format!("target {i}'s next ({next}) does not move forward")))?;
        let text = Zeroizing::new(
            c_str(text).ok_or_else(|| bad(format!("target {i}'s string without NUL")))?,
        );
        out.push(TargetLine {
            start: get_u64(spec, 0).unwrap_or(0),
            length: get_u64(spec, 8).unwrap_or(0),
            kind,
            text,
        });
        at = next;
    }
    Ok(out)
}

// -------------------------------------------------------------- the node --

/// The kernel's device-mapper interface version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

/// /dev/mapper/control, open, its interface version checked to be 4.x.
pub struct Control {
    file: File,
    path: String,
    pub version: Version,
}

impl Control {
    /// Opens /dev/mapper/control.
    pub fn open() -> Result<Control, Error> {
        Control::open_at(Path::new(CONTROL))
    }

    /// Opens the control node at `path` and asks its version: an absent
    /// node, or one that is not device-mapper's, is [`Error::Unavailable`].
    pub fn open_at(path: &Path) -> Result<Control, Error> {
        let shown = path.display().to_string();
        let file = File::options()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| match e.raw_os_error().map(Errno::from_raw_os_error) {
                Some(Errno::NOENT | Errno::NODEV | Errno::NXIO) => Error::Unavailable {
                    why: format!("{shown} does not exist ({e})"),
                },
                _ => SysError::new("open", &shown, e).into(),
            })?;
        let mut c = Control {
            file,
            path: shown,
            version: Version {
                major: MAJOR,
                minor: 0,
                patch: 0,
            },
        };
        let buf = match c.call(Cmd::Version, request(None, None, 0, 0, &[], 0)?) {
            Err(Error::Sys(e)) if e.errno() == Some(libc::ENOTTY) => {
                return Err(Error::Unavailable {
                    why: format!(
                        "{} is not device-mapper's control node ({})",
                        c.path, e.source
                    ),
                })
            }
            r => r?,
        };
        let v = |i: usize| get_u32(&buf, i.saturating_mul(4)).unwrap_or(0);
        c.version = Version {
            major: v(0),
            minor: v(1),
            patch: v(2),
        };
        if c.version.major != MAJOR {
            let Version {
                major,
                minor,
                patch,
            } = c.version;
            return Err(Error::Version {
                major,
                minor,
                patch,
            });
        }
        Ok(c)
    }

    /// One ioctl with `buf`, which comes back with the kernel's answer.
    fn ioctl(&self, cmd: Cmd, buf: &mut [u8]) -> Result<(), Errno> {
        // What the SAFETY note below stands on, checked rather than assumed.
        if buf.len() < HEADER_LEN || get_u32(buf, at::DATA_SIZE) != u32::try_from(buf.len()).ok() {
            return Err(Errno::INVAL);
        }
        // SAFETY: `buf` is a live, writable buffer of exactly `data_size`
        // bytes (checked above), at least a whole struct dm_ioctl; the kernel reads at most data_size bytes from it and
        // writes back at most data_size bytes (ctl_ioctl copies
        // param->data_size, which it never raises past the size given).
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::Ioctl::from(cmd.opcode()),
                buf.as_mut_ptr(),
            )
        };
        if r < 0 {
            return Err(Errno::from_raw_os_error(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO),
            ));
        }
        Ok(())
    }

    /// `cmd` with `req`; asked again with a buffer twice as large while the
    /// kernel says its answer did not fit, up to [`MAX_DATA`].
    fn call(&self, cmd: Cmd, mut req: Zeroizing<Vec<u8>>) -> Result<Zeroizing<Vec<u8>>, Error> {
        // What a larger request repeats: the name and flags (never a table:
        // DM_TABLE_LOAD answers with no data, so never with a full buffer).
        let name = c_str(&req[at::NAME..][..NAME_LEN]).filter(|n| !n.is_empty());
        let flags = get_u32(&req, at::FLAGS).unwrap_or(0);
        loop {
            let data = req.len().saturating_sub(HEADER_LEN);
            if let Err(e) = self.ioctl(cmd, &mut req) {
                return Err(SysError::new(cmd.name(), &self.path, e).into());
            }
            if get_u32(&req, at::FLAGS).unwrap_or(0) & flag::BUFFER_FULL == 0 {
                return Ok(req);
            }
            if data >= MAX_DATA {
                return Err(Error::TooLarge {
                    call: cmd.name(),
                    max: MAX_DATA,
                });
            }
            let room = data.saturating_mul(2).clamp(FIRST_DATA, MAX_DATA);
            req = request(name.as_deref(), None, flags, 0, &[], room)?;
        }
    }

    /// A call on the device `name`, its errno told as NotFound where the
    /// kernel says there is no such device.
    fn on(
        &self,
        cmd: Cmd,
        name: &str,
        req: Zeroizing<Vec<u8>>,
    ) -> Result<Zeroizing<Vec<u8>>, Error> {
        self.call(cmd, req).map_err(|e| match e {
            Error::Sys(s) if s.errno() == Some(libc::ENXIO) => Error::NotFound(name.to_string()),
            e => e,
        })
    }

    /// DM_DEV_CREATE: a device with no table yet, named and with a uuid
    /// (neither may be in use).
    pub fn create(&self, name: &str, uuid: &str) -> Result<DevInfo, Error> {
        let req = request(Some(name), Some(uuid), 0, 0, &[], 0)?;
        let buf = self.call(Cmd::DevCreate, req).map_err(|e| match e {
            Error::Sys(s) if s.errno() == Some(libc::EBUSY) => Error::Exists {
                name: name.to_string(),
                uuid: uuid.to_string(),
            },
            e => e,
        })?;
        decode_header(Cmd::DevCreate, &buf)
    }

    /// DM_TABLE_LOAD: `targets` as the device's inactive table (a resume
    /// makes it live). Sent with DM_SECURE_DATA_FLAG, so the kernel wipes
    /// its copy; ours is zeroed when this returns.
    pub fn load(&self, name: &str, targets: &[Target], read_only: bool) -> Result<DevInfo, Error> {
        let data = encode_targets(targets)?;
        let count = u32::try_from(targets.len()).unwrap_or(u32::MAX);
        let flags = flag::SECURE_DATA | if read_only { flag::READONLY } else { 0 };
        let req = request(Some(name), None, flags, count, &data, 0)?;
        drop(data);
        let buf = self.on(Cmd::TableLoad, name, req).map_err(|e| match e {
            Error::Sys(s)
                if s.errno()
                    .is_some_and(|n| n != libc::EACCES && n != libc::ENOMEM) =>
            {
                Error::TableRefused {
                    name: name.to_string(),
                    source: s.source,
                }
            }
            e => e,
        })?;
        decode_header(Cmd::TableLoad, &buf)
    }

    /// DM_DEV_SUSPEND without the suspend flag: resumes the device, making
    /// an inactive table live.
    pub fn resume(&self, name: &str) -> Result<DevInfo, Error> {
        let buf = self.on(
            Cmd::DevSuspend,
            name,
            request(Some(name), None, 0, 0, &[], 0)?,
        )?;
        decode_header(Cmd::DevSuspend, &buf)
    }

    /// DM_DEV_SUSPEND: holds new I/O and flushes what is in flight (a
    /// filesystem on it is frozen first by the kernel).
    pub fn suspend(&self, name: &str) -> Result<DevInfo, Error> {
        let req = request(Some(name), None, flag::SUSPEND, 0, &[], 0)?;
        let buf = self.on(Cmd::DevSuspend, name, req)?;
        decode_header(Cmd::DevSuspend, &buf)
    }

    /// DM_DEV_REMOVE: the device and its tables; [`Error::Busy`] while
    /// anything holds it open.
    pub fn remove(&self, name: &str) -> Result<(), Error> {
        let req = request(Some(name), None, 0, 0, &[], 0)?;
        match self.on(Cmd::DevRemove, name, req) {
            Err(Error::Sys(s)) if s.errno() == Some(libc::EBUSY) => {
                Err(Error::Busy(name.to_string()))
            }
            r => r.map(drop),
        }
    }

    /// DM_DEV_STATUS: the device's numbers, openers and flags.
    pub fn status(&self, name: &str) -> Result<DevInfo, Error> {
        let buf = self.on(
            Cmd::DevStatus,
            name,
            request(Some(name), None, 0, 0, &[], 0)?,
        )?;
        decode_header(Cmd::DevStatus, &buf)
    }

    /// DM_TABLE_STATUS: each live target's status, or with `table` its line.
    pub fn targets(&self, name: &str, table: bool) -> Result<(DevInfo, Vec<TargetLine>), Error> {
        let flags = if table {
            flag::STATUS_TABLE | flag::SECURE_DATA
        } else {
            0
        };
        let req = request(Some(name), None, flags, 0, &[], FIRST_DATA)?;
        let buf = self.on(Cmd::TableStatus, name, req)?;
        let info = decode_header(Cmd::TableStatus, &buf)?;
        let lines = decode_targets(reply_data(Cmd::TableStatus, &buf)?, info.target_count)?;
        Ok((info, lines))
    }

    /// DM_LIST_DEVICES: every device, with its uuid where the kernel says it.
    pub fn list(&self) -> Result<Vec<Listed>, Error> {
        let buf = self.call(
            Cmd::ListDevices,
            request(None, None, flag::UUID, 0, &[], FIRST_DATA)?,
        )?;
        decode_list(reply_data(Cmd::ListDevices, &buf)?)
    }

    /// The devices whose uuid starts with `prefix` (e.g. "CRYPT-LUKS2-"),
    /// asked one by one where the list does not carry uuids.
    pub fn find_by_uuid_prefix(&self, prefix: &str) -> Result<Vec<Listed>, Error> {
        let mut out = Vec::new();
        for mut l in self.list()? {
            if l.uuid.is_none() {
                match self.status(&l.name) {
                    Ok(i) => l.uuid = Some(i.uuid).filter(|u| !u.is_empty()),
                    Err(Error::NotFound(_)) => continue, // removed meanwhile
                    Err(e) => return Err(e),
                }
            }
            if l.uuid.as_deref().is_some_and(|u| u.starts_with(prefix)) {
                out.push(l);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
#[path = "dm_tests.rs"]
mod tests;

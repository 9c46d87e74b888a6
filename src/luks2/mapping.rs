//! A LUKS2 volume mapped: the disk's header read, a keyslot unlocked, and
//! a dm-crypt device made over the disk's data segment, named as cryptsetup
//! names its mappings (`CRYPT-LUKS2-<uuid>-<name>`), so that `cryptsetup
//! status`, `lsblk` and `dmsetup` in the guest know it. Then closing it,
//! telling whether it is still live, growing it with its disk, and finding
//! agents' mappings among the guest's. Each name carries its agent's tag
//! ([`Owner`]), so that agents sharing a guest never take each other's.
//!
//! The volume key reaches dm-crypt as a `logon` key (`sys::keyring`),
//! never as hex in a table line. The key stays in the user keyring while
//! the mapping lives, under `crust:<name>`, so that a grow (a new table,
//! which dm-crypt must load with the key) and a restarted agent need no
//! passphrase again: user space cannot read a logon key back, and dm-crypt
//! holds the same key in kernel memory for as long anyway. Closing the
//! mapping unlinks and revokes it. The agent links the user keyring into
//! its process keyring before each load, so that dm-crypt finds the key
//! whether the agent is PID 1 (no session keyring) or a systemd service
//! (a private one).
//!
//! A failed open leaves nothing: neither a device nor a key.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use zeroize::Zeroizing;

use super::error::Error;
use super::header;
use super::integrity;
use super::unlock::{self, Limits};
use crate::sys::dm::{self, Control, CryptKey, Target};
use crate::sys::dm_integrity;
use crate::sys::error::SysError;
use crate::sys::keyring::{self, Keyring};

/// The start of the name of every mapping an agent makes: how recovery
/// tells agents' mappings from the guest's other ones.
pub const NAME_PREFIX: &str = "crust-";

/// The longest volume id used as it is in a mapping's name: longer ones
/// (or ones with bytes device-mapper refuses) are named by a hash, so that
/// with its owner's tag the name stays within the 78 bytes the
/// dm-integrity device's uuid leaves it (`CRYPT-SUBDEV-` + 32 hex + `-` +
/// name + `_dif` within 128).
const PLAIN_ID_MAX: usize = 56;

/// The same, in the untagged names of agents before owners, whose names
/// only had to fit the mapping's own uuid.
const LEGACY_PLAIN_ID_MAX: usize = 64;

/// How many hex digits an owner's tag has: 48 bits of a hash.
const TAG_LEN: usize = 12;

/// Which agent in the guest a mapping is: the tag its name ends with,
/// `crust-<id>@<tag>`. Several agents may run in one guest, each with its
/// own root; each makes, sweeps and closes only the mappings that carry
/// its own tag (and those its own records name), so that no agent closes
/// another's mapping or revokes its key. The tag is a hash of the identity
/// (device and inode) of the agent's state directory, the one its root
/// lock holds: two agents serving at once never share a state directory,
/// and the same root keeps its tag across restarts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    tag: String,
}

impl Owner {
    /// The owner whose state directory is inode `ino` on device `dev`.
    pub fn of_dir(dev: u64, ino: u64) -> Owner {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"crust-agent state directory\0");
        h.update(dev.to_le_bytes());
        h.update(ino.to_le_bytes());
        Owner {
            tag: hex(&h.finalize()[..TAG_LEN / 2]),
        }
    }

    /// The mapping name this owner gives volume `id`: `crust-<id>@<tag>`
    /// when the id is short and made of letters, digits, '.', '_' and '-';
    /// else `crust-#<hash>@<tag>`, a SHA-256 of the id cut to 128 bits.
    pub fn name_for(&self, id: &str) -> String {
        format!("{}@{}", untagged(id, PLAIN_ID_MAX), self.tag)
    }

    /// Whether mapping `name` carries this owner's tag.
    pub fn owns(&self, name: &str) -> bool {
        tag_of(name) == Some(self.tag.as_str())
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.tag)
    }
}

/// The owner's tag an agent's mapping `name` carries; None for a name
/// without one (an agent's from before owners, or no agent's).
pub fn tag_of(name: &str) -> Option<&str> {
    let (_, tag) = name.strip_prefix(NAME_PREFIX)?.rsplit_once('@')?;
    (tag.len() == TAG_LEN && tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then_some(tag)
}

/// Whether `name` is a name an agent gives volume `id`'s mapping: its
/// name under any owner, or the untagged name agents before owners gave
/// it (`crust-<id>`, `crust-#<hash>`; still adopted from their records).
pub fn is_name_of(name: &str, id: &str) -> bool {
    let tagged = name
        .rsplit_once('@')
        .is_some_and(|(base, _)| tag_of(name).is_some() && base == untagged(id, PLAIN_ID_MAX));
    tagged || name == untagged(id, LEGACY_PLAIN_ID_MAX)
}

/// `crust-<id>` when `id` is at most `plain_max` bytes of letters, digits,
/// '.', '_' and '-'; else `crust-#<hash>`.
fn untagged(id: &str, plain_max: usize) -> String {
    let plain = id.len() <= plain_max
        && !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if plain {
        return format!("{NAME_PREFIX}{id}");
    }
    use sha2::Digest;
    let hash = sha2::Sha256::digest(id.as_bytes());
    // '#' is in no plain name: no volume id names another's hashed mapping.
    format!("{NAME_PREFIX}#{}", hex(&hash[..16]))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The logon key's description for mapping `name`.
fn key_description(name: &str) -> String {
    format!("crust:{name}")
}

/// A mapping as opened: what the table and ListVolumes say of it. No key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// Its device-mapper name.
    pub name: String,
    /// Its device-mapper uuid, cryptsetup's form.
    pub dm_uuid: String,
    /// Its block device: /dev/dm-<minor>.
    pub dev: (u32, u32),
    /// The LUKS2 header's uuid.
    pub luks_uuid: String,
    /// e.g. "aes-xts-plain64".
    pub cipher: String,
    /// The volume key's size in bits.
    pub key_bits: u32,
    /// The data segment's integrity, if any (e.g. "hmac(sha256)").
    pub integrity: Option<String>,
    /// Whether discards pass through.
    pub allow_discards: bool,
    /// With integrity: the kernel log's next record when it was opened;
    /// reports of tampering before it are of an earlier device with its
    /// number. 0 when adopted after a restart: the whole log counts.
    pub log_from: u64,
}

/// How a mapping is opened.
#[derive(Clone, Copy, Debug)]
pub struct Open<'a> {
    /// The disk's node, and its device number.
    pub disk: &'a Path,
    pub disk_dev: (u32, u32),
    /// The mapping's name ([`Owner::name_for`]).
    pub name: &'a str,
    /// A read-only mapping.
    pub read_only: bool,
    /// Pass discards down.
    pub allow_discards: bool,
    /// What the unlock may cost.
    pub limits: Limits,
}

/// What unlocking costs at most in a guest with `free_bytes` of free
/// memory: Argon2 may take half of it (and never more than 4 GiB, the most
/// cryptsetup asks), and the time costs are bounded so that a hostile
/// header cannot hold an unlock for hours.
pub fn guest_limits(free_bytes: u64) -> Limits {
    Limits {
        argon2_memory_kib: (free_bytes / 2 / 1024).min(4 << 20),
        argon2_passes: 64,
        pbkdf2_iterations: 20_000_000,
    }
}

/// Opens `o.disk`'s LUKS2 volume with `passphrase` as mapping `o.name`
/// (and, for a segment with integrity, its dm-integrity device first).
/// Nothing is left behind when it fails.
pub fn open(o: &Open<'_>, passphrase: &Zeroizing<Vec<u8>>) -> Result<Mapping, Error> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(o.disk)
        .map_err(|e| SysError::new("open", o.disk.display(), e))?;
    let size = crate::sys::blockdev::size_of(&file, o.disk)?;
    let hdr = header::read(&file, size)?;
    let unlocked = unlock::unlock(&file, &hdr, passphrase, o.limits, None)?;
    let seg = &unlocked.segment;
    let key = unlocked.volume_key.bytes();
    let layer = layer_of(o, &file, size, &hdr, seg, key.len())?;
    drop(file);
    let description = key_description(o.name);
    let dm_uuid = dm::crypt_uuid(&hdr.uuid, o.name)?;
    let control = Control::open()?;
    // A mapping of that name already there is not touched, nor is the
    // logon key it was loaded with (a key added under the same description
    // would replace it, and this open's undo would then revoke it).
    match control.status(o.name) {
        Err(dm::Error::NotFound(_)) => {}
        Ok(info) => {
            return Err(dm::Error::Exists {
                name: o.name.to_string(),
                uuid: info.uuid,
            }
            .into())
        }
        Err(e) => return Err(e.into()),
    }
    // The dm-integrity device, and where the ciphertext then lies.
    let (device, offset, length) = match &layer {
        None => (
            o.disk_dev,
            seg.offset / 512,
            data_sectors(size, seg.offset, seg.size, seg.sector_size)?,
        ),
        Some((_, line)) => {
            let uuid = dm_integrity::subdevice_uuid(&hdr.uuid, o.name)?;
            let info = make_subdevice(&control, o, &uuid, line)?;
            (info.dev, 0, line.superblock.provided_data_sectors)
        }
    };
    let unmake_sub = || {
        if layer.is_some() {
            let _ = control.remove(&dm_integrity::subdevice_name(o.name));
        }
    };
    let params = dm::Crypt {
        cipher: layer.as_ref().map_or(&seg.encryption, |(a, _)| &a.cipher),
        key: CryptKey::Logon {
            size: key.len(),
            description: &description,
        },
        iv_offset: seg.iv_tweak,
        device,
        offset,
        sector_size: seg.sector_size,
        allow_discards: o.allow_discards,
        aead_tag: layer.as_ref().map(|(a, _)| a.tag),
    }
    .params()
    .inspect_err(|_| unmake_sub())?;
    // The user keyring, reachable from every thread of the agent.
    let serial = keyring::link(Keyring::User, Keyring::Process)
        .and_then(|()| keyring::add_logon(&description, key, Keyring::User))
        .inspect_err(|_| unmake_sub())?;
    let key_bits = u32::try_from(key.len() * 8).unwrap_or(u32::MAX);
    let (cipher, kind) = (
        seg.encryption.clone(),
        seg.integrity.as_ref().map(|i| i.kind.clone()),
    );
    drop(unlocked);
    let target = Target {
        start: 0,
        length,
        kind: "crypt",
        params,
    };
    // Read before the mapping exists, so no report of its own is missed.
    let log_from = match layer {
        Some(_) => crate::sys::kmsg::next_seq().unwrap_or(0),
        None => 0,
    };
    let info = match make(&control, o.name, &dm_uuid, target, o.read_only) {
        Ok(info) => info,
        Err(e) => {
            unmake_sub();
            let _ = keyring::unlink(serial, Keyring::User);
            let _ = keyring::revoke(serial);
            return Err(e.into());
        }
    };
    Ok(Mapping {
        name: o.name.to_string(),
        dm_uuid,
        dev: info.dev,
        luks_uuid: hdr.uuid.clone(),
        cipher,
        key_bits,
        integrity: kind,
        allow_discards: o.allow_discards,
        log_from,
    })
}

/// With integrity: what dm-crypt and dm-integrity are given for segment
/// `seg` (its volume key `key_len` bytes), checked against the disk before
/// anything is made. None for a segment without integrity.
fn layer_of(
    o: &Open<'_>,
    file: &File,
    size: u64,
    hdr: &header::Header,
    seg: &super::metadata::Segment,
    key_len: usize,
) -> Result<Option<(integrity::Aead, dm_integrity::Integrity)>, Error> {
    if seg.integrity.is_none() {
        return Ok(None);
    }
    let aead = integrity::aead(seg, key_len)?;
    if o.allow_discards {
        return Err(Error::NotWithIntegrity {
            what: "allow_discards".into(),
            why: "dm-integrity takes discards only with an internal hash, which LUKS2 does not use; publish it without allow_discards",
        });
    }
    let sb = integrity::superblock(file, size, seg, &aead)?;
    // dm-integrity and authenc load at boot with the rest (the initrd's
    // list); where they are missing, the table load below fails with EINVAL
    // ("unknown target type") or ENOENT, which its error explains.
    let line = dm_integrity::Integrity {
        device: o.disk_dev,
        offset: seg.offset / 512,
        superblock: sb,
        mode: integrity::mode(&hdr.metadata.config.flags),
    };
    Ok(Some((aead, line)))
}

/// Makes mapping `o.name`'s dm-integrity device, `line` over the disk.
fn make_subdevice(
    control: &Control,
    o: &Open<'_>,
    uuid: &str,
    line: &dm_integrity::Integrity,
) -> Result<dm::DevInfo, Error> {
    let target = Target {
        start: 0,
        length: line.superblock.provided_data_sectors,
        kind: "integrity",
        params: Zeroizing::new(line.params()?),
    };
    let sub = dm_integrity::subdevice_name(o.name);
    // A device of this very volume left by a close cut short (its mapping
    // gone) is removed and made again; anything else in the way is refused.
    let stale = matches!(control.status(o.name), Err(dm::Error::NotFound(_)))
        && control.status(&sub).is_ok_and(|i| i.uuid == uuid);
    if stale {
        control.remove(&sub)?;
    }
    Ok(make(control, &sub, uuid, target, o.read_only)?)
}

/// Makes device `name` (uuid `uuid`) with the one `target`, live and with
/// its node in /dev; removed again when any step fails (unless it was
/// someone else's: create refuses a name or uuid in use).
fn make(
    control: &Control,
    name: &str,
    uuid: &str,
    target: Target,
    read_only: bool,
) -> Result<dm::DevInfo, dm::Error> {
    let made = control.create(name, uuid).and_then(|_| {
        control.load(name, &[target], read_only)?;
        control.resume(name)
    });
    match made.and_then(|info| wait_for_node(name, info.dev).map(|()| info)) {
        Ok(info) => Ok(info),
        Err(e) => {
            if !matches!(e, dm::Error::Exists { .. }) {
                let _ = control.remove(name);
            }
            Err(e)
        }
    }
}

/// How long a new mapping's node may take to appear in devtmpfs.
const NODE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits until devtmpfs shows mapping `name`'s node, /dev/dm-<minor>, as
/// that device: the kernel makes it right after the device, on a thread of
/// its own.
fn wait_for_node(name: &str, dev: (u32, u32)) -> Result<(), dm::Error> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let node = format!("/dev/dm-{}", dev.1);
    let start = std::time::Instant::now();
    loop {
        if let Ok(m) = std::fs::symlink_metadata(&node) {
            let rdev = m.rdev();
            if m.file_type().is_block_device() && (libc::major(rdev), libc::minor(rdev)) == dev {
                return Ok(());
            }
        }
        if start.elapsed() > NODE_WAIT {
            return Err(dm::Error::Answer {
                call: "DM_DEV_SUSPEND",
                why: format!(
                    "a live mapping {name:?} whose node {node} did not appear in {} s (is devtmpfs mounted on /dev?)",
                    NODE_WAIT.as_secs()
                ),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The mapping's length in 512-byte sectors: the segment's size, or (when
/// "dynamic") the disk from the segment's offset to its end, in whole
/// encryption sectors. Refused when nothing is left.
pub fn data_sectors(
    disk_bytes: u64,
    offset: u64,
    size: Option<u64>,
    sector_size: u32,
) -> Result<u64, Error> {
    let room = disk_bytes.saturating_sub(offset);
    let bytes = size.unwrap_or(room);
    if bytes > room {
        return Err(Error::corrupt(format!(
            "its data segment ends at byte {}, past the disk's end ({disk_bytes})",
            offset.saturating_add(bytes)
        )));
    }
    let unit = u64::from(sector_size.max(512));
    let sectors = bytes / unit * (unit / 512);
    if sectors == 0 {
        return Err(Error::corrupt(format!(
            "its data segment at byte {offset} holds no whole {unit}-byte sector of the {disk_bytes}-byte disk"
        )));
    }
    Ok(sectors)
}

/// Removes mapping `name`, then its dm-integrity device if it has one,
/// and forgets its key; false when there was no such mapping.
/// [`dm::Error::Busy`] while something holds it open (a mount): the caller
/// takes its mounts down first.
pub fn close(name: &str) -> Result<bool, Error> {
    let control = Control::open()?;
    let was = match control.remove(name) {
        Ok(()) => true,
        Err(dm::Error::NotFound(_)) => false,
        Err(e) => return Err(e.into()),
    };
    let sub = dm_integrity::subdevice_name(name);
    match control.status(&sub) {
        Ok(info) if is_subdevice_of(&info.uuid, name) => match control.remove(&sub) {
            Ok(()) | Err(dm::Error::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        },
        Ok(_) | Err(dm::Error::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    forget_key(name);
    Ok(was)
}

/// Whether dm uuid `uuid` is cryptsetup's for the dm-integrity device
/// under mapping `name` (2.7's `CRYPT-SUBDEV-…`, or 2.6's `CRYPT-LUKS2-…`).
fn is_subdevice_of(uuid: &str, name: &str) -> bool {
    let sub = dm_integrity::subdevice_name(name);
    let rest = uuid
        .strip_prefix("CRYPT-SUBDEV-")
        .or_else(|| uuid.strip_prefix("CRYPT-LUKS2-"));
    rest.and_then(|r| r.split_once('-'))
        .is_some_and(|(hex, n)| {
            !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) && n == sub
        })
}

/// Unlinks and revokes mapping `name`'s logon key, if the user keyring
/// holds it.
fn forget_key(name: &str) {
    if let Ok(Some(serial)) = keyring::search_logon(Keyring::User, &key_description(name)) {
        let _ = keyring::unlink(serial, Keyring::User);
        let _ = keyring::revoke(serial);
    }
}

/// Whether a mapping is there and serving.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Live {
    /// Live, with its device number.
    Serving((u32, u32)),
    /// Suspended: I/O to it waits.
    Suspended,
    /// There, with no live table.
    NoTable,
    /// No mapping of that name, or one with another uuid.
    Missing,
}

/// How mapping `name` (whose uuid must be `dm_uuid`) is now.
pub fn live(name: &str, dm_uuid: &str) -> Result<Live, Error> {
    let control = Control::open()?;
    let info = match control.status(name) {
        Ok(i) => i,
        Err(dm::Error::NotFound(_)) => return Ok(Live::Missing),
        Err(e) => return Err(e.into()),
    };
    Ok(if info.uuid != dm_uuid {
        Live::Missing
    } else if info.suspended() {
        Live::Suspended
    } else if !info.has_live_table() {
        Live::NoTable
    } else {
        Live::Serving(info.dev)
    })
}

/// Grows mapping `name` to the end of its disk, now `disk_bytes` long:
/// its live table is read back (it names the key, never holds it), given
/// the new length, loaded and made live. The mapping's size in bytes after.
pub fn grow(name: &str, disk_bytes: u64) -> Result<u64, Error> {
    let control = Control::open()?;
    let (info, lines) = control.targets(name, true)?;
    let [line] = &lines[..] else {
        return Err(Error::corrupt(format!(
            "mapping {name:?} has {} targets where the agent made one",
            lines.len()
        )));
    };
    refuse_integrity_grow(name, &line.text)?;
    let crypt = CryptLine::parse(&line.text).ok_or_else(|| {
        Error::corrupt(format!(
            "mapping {name:?} is not a dm-crypt mapping with its key in the keyring"
        ))
    })?;
    let length = data_sectors(
        disk_bytes,
        crypt.offset.saturating_mul(512),
        None,
        crypt.sector_size,
    )?;
    if length <= line.length {
        return Ok(line.length.saturating_mul(512));
    }
    keyring::link(Keyring::User, Keyring::Process)?;
    let table = [Target {
        start: 0,
        length,
        kind: "crypt",
        params: Zeroizing::new(line.text.to_string()),
    }];
    let read_only = info.flags & dm::flag::READONLY != 0;
    control.load(name, &table, read_only)?;
    control.resume(name)?;
    Ok(length.saturating_mul(512))
}

/// A grow of a mapping whose `crypt` line (`text`) has integrity
/// (`integrity:<n>:aead`) is refused.
fn refuse_integrity_grow(name: &str, text: &str) -> Result<(), Error> {
    if text
        .split_ascii_whitespace()
        .any(|w| w.starts_with("integrity:"))
    {
        return Err(Error::NotWithIntegrity {
            what: format!("growing mapping {name:?}"),
            why: "its dm-integrity device provides the sectors its superblock was formatted with, and the agent does not resize that",
        });
    }
    Ok(())
}

/// What a grow needs of a live `crypt` line: its offset and sector size.
struct CryptLine {
    /// Where the ciphertext starts on the disk, in 512-byte sectors.
    offset: u64,
    sector_size: u32,
}

impl CryptLine {
    /// `<cipher> :<size>:logon:<desc> <iv_offset> <dev> <offset> [<n> <opt>...]`;
    /// None for any other form (a hex key among them: not the agent's).
    fn parse(text: &str) -> Option<CryptLine> {
        let mut words = text.split_ascii_whitespace();
        let _cipher = words.next()?;
        let key = words.next()?;
        if !key.starts_with(':') || !key.contains(":logon:") {
            return None;
        }
        let _iv = words.next()?;
        let _dev = words.next()?;
        let offset = words.next()?.parse().ok()?;
        let mut sector_size = 512;
        for opt in words.skip(1) {
            if let Some(s) = opt.strip_prefix("sector_size:") {
                sector_size = s.parse().ok()?;
            }
        }
        Some(CryptLine {
            offset,
            sector_size,
        })
    }
}

/// The names of agents' mappings among the guest's, this agent's and any
/// other's: a cryptsetup LUKS2 uuid whose name is the mapping's, starting
/// with [`NAME_PREFIX`]; and the mapping a dm-integrity device of an
/// agent's was made under, when that mapping is gone (a close cut short),
/// so that closing it removes the device. Whose each is, its name says
/// ([`Owner::owns`]).
pub fn agents_mappings() -> Result<Vec<String>, Error> {
    let control = match Control::open() {
        Ok(c) => c,
        // No device-mapper: no mapping of anyone's.
        Err(dm::Error::Unavailable { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut names: Vec<String> = control
        .find_by_uuid_prefix("CRYPT-")?
        .into_iter()
        .filter(|l| l.name.starts_with(NAME_PREFIX))
        .filter_map(|l| {
            let uuid = l.uuid.as_deref()?;
            if let Some(top) = l.name.strip_suffix("_dif") {
                if is_subdevice_of(uuid, top) {
                    return Some(top.to_string());
                }
            }
            dm::parse_crypt_uuid(uuid)
                .is_some_and(|(kind, _, n)| kind == "LUKS2" && n == l.name)
                .then_some(l.name)
        })
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// [`integrity::tampered`] for the live mapping `m`: its dm-integrity device's status
/// and the kernel's log, read now. 0 for a mapping without integrity.
pub fn tampered_now(m: &Mapping) -> Result<u64, Error> {
    if m.integrity.is_none() {
        return Ok(0);
    }
    let control = Control::open()?;
    let sub = dm_integrity::subdevice_name(&m.name);
    let mut minors = vec![m.dev.1];
    let mut status = None;
    match control.targets(&sub, false) {
        Ok((info, lines)) => {
            minors.push(info.dev.1);
            status = lines
                .into_iter()
                .find(|l| l.kind == "integrity")
                .map(|l| l.text.to_string());
        }
        Err(dm::Error::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    // A log that cannot be read (no /dev/kmsg) leaves the status count.
    let records = crate::sys::kmsg::records(&mut |r| r.message.contains("INTEGRITY AEAD ERROR"))
        .unwrap_or_default();
    Ok(integrity::tampered(
        &records,
        m.log_from,
        &minors,
        status.as_deref(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_or_hashed_carry_the_owner_and_always_fit_a_dm_uuid() {
        let owner = Owner::of_dir(0x2a, 7);
        let tag = owner.to_string();
        assert_eq!(tag.len(), TAG_LEN, "{tag}");
        assert_eq!(
            owner.name_for("pvc-1.a_b"),
            format!("crust-pvc-1.a_b@{tag}")
        );
        for id in ["a b", "ü", &"x".repeat(PLAIN_ID_MAX + 1), "a/b", "a:b"] {
            let n = owner.name_for(id);
            assert!(
                n.starts_with("crust-#") && n.len() == 7 + 32 + 1 + TAG_LEN,
                "{id:?} → {n}"
            );
            assert!(owner.owns(&n) && is_name_of(&n, id), "{n}");
        }
        assert_ne!(owner.name_for("a b"), owner.name_for("a c"));
        let luks = "0123456789abcdef0123456789abcdef";
        for id in ["y".repeat(PLAIN_ID_MAX), "y".repeat(128)] {
            let n = owner.name_for(&id);
            let uuid = dm::crypt_uuid(luks, &n).unwrap();
            let sub = dm_integrity::subdevice_uuid(luks, &n).unwrap();
            assert!(uuid.len() <= 128 && sub.len() <= 128, "{sub}");
            assert_eq!(dm::parse_crypt_uuid(&uuid).unwrap().2, n);
            assert!(is_subdevice_of(&sub, &n), "{sub}");
        }
        // Names of agents before owners: untagged, up to 64 bytes plain.
        assert!(is_name_of("crust-pvc-1", "pvc-1"));
        let long = "z".repeat(LEGACY_PLAIN_ID_MAX);
        assert!(is_name_of(&format!("crust-{long}"), &long));
        assert!(tag_of("crust-pvc-1").is_none() && tag_of("crust-#00").is_none());
    }

    /// Two roots' agents never name one volume's mapping alike, nor own
    /// each other's (nor an untagged one); the same root keeps its tag.
    #[test]
    fn each_owner_owns_only_its_own_names() {
        let (a, b) = (Owner::of_dir(0x2a, 7), Owner::of_dir(0x2a, 8));
        assert_eq!(a, Owner::of_dir(0x2a, 7));
        assert_ne!(a, Owner::of_dir(0x2b, 7));
        assert_ne!(a.name_for("v"), b.name_for("v"));
        assert!(a.owns(&a.name_for("v")) && !a.owns(&b.name_for("v")));
        assert!(!a.owns("crust-v") && !a.owns("other-v") && !a.owns(&format!("crust-v@{a}x")));
        assert!(is_name_of(&b.name_for("v"), "v") && !is_name_of(&b.name_for("w"), "v"));
        // A tagged name is no volume's untagged name: '@' is in no volume id.
        let plain = a.name_for("v");
        assert!(crate::validate::volume_id(plain.strip_prefix(NAME_PREFIX).unwrap()).is_err());
    }

    #[test]
    fn a_segment_maps_to_whole_encryption_sectors() {
        let mib = 1 << 20;
        assert_eq!(data_sectors(32 * mib, 16 * mib, None, 512).unwrap(), 32768);
        assert_eq!(
            data_sectors(32 * mib + 3072, 16 * mib, None, 4096).unwrap(),
            32768,
            "a part of a 4096-byte sector is not mapped"
        );
        assert_eq!(
            data_sectors(64 * mib, 16 * mib, Some(mib), 512).unwrap(),
            2048
        );
        assert!(data_sectors(17 * mib, 16 * mib, Some(2 * mib), 512).is_err());
        assert!(data_sectors(16 * mib, 16 * mib, None, 512).is_err());
        assert!(data_sectors(mib, 16 * mib, None, 512).is_err());
    }

    #[test]
    fn a_grow_reads_only_the_agents_own_lines() {
        let l = CryptLine::parse("aes-xts-plain64 :64:logon:crust:crust-v 0 254:16 32768 2 allow_discards sector_size:4096").unwrap();
        assert_eq!((l.offset, l.sector_size), (32768, 4096));
        let l = CryptLine::parse("aes-xts-plain64 :64:logon:crust:crust-v 0 254:16 32768").unwrap();
        assert_eq!((l.offset, l.sector_size), (32768, 512));
        assert!(CryptLine::parse("aes-xts-plain64 00112233 0 254:16 32768").is_none());
        assert!(CryptLine::parse("aes-xts-plain64 :64:logon:x 0 254:16").is_none());
    }

    #[test]
    fn a_mapping_with_integrity_is_not_grown() {
        let live = "capi:authenc(hmac(sha256),xts(aes))-plain64 :96:logon:crust:crust-v 0 253:0 0 2 integrity:32:aead sector_size:4096";
        let e = refuse_integrity_grow("crust-v", live).unwrap_err();
        assert!(matches!(e, Error::NotWithIntegrity { .. }), "{e}");
        assert!(
            e.to_string().starts_with(
                "growing mapping \"crust-v\" of a LUKS2 volume with integrity is not supported"
            ),
            "{e}"
        );
        assert!(refuse_integrity_grow(
            "crust-v",
            "aes-xts-plain64 :64:logon:crust:crust-v 0 254:16 32768"
        )
        .is_ok());
    }

    #[test]
    fn a_subdevice_is_told_by_its_uuid() {
        let hex = "1b4e28ba2fa111d2883f0016d3cca427";
        assert!(is_subdevice_of(
            &format!("CRYPT-SUBDEV-{hex}-crust-v_dif"),
            "crust-v"
        ));
        assert!(is_subdevice_of(
            &format!("CRYPT-LUKS2-{hex}-crust-v_dif"),
            "crust-v"
        ));
        assert!(!is_subdevice_of(
            &format!("CRYPT-SUBDEV-{hex}-crust-w_dif"),
            "crust-v"
        ));
        assert!(!is_subdevice_of(
            &format!("CRYPT-LUKS2-{hex}-crust-v"),
            "crust-v"
        ));
        assert!(!is_subdevice_of("CRYPT-SUBDEV--crust-v_dif", "crust-v"));
        assert!(!is_subdevice_of("CRYPT-PLAIN-crust-v_dif", "crust-v"));
    }

    #[test]
    fn limits_follow_the_guests_memory() {
        let l = guest_limits(1 << 30);
        assert_eq!(l.argon2_memory_kib, 512 << 10);
        assert_eq!(guest_limits(u64::MAX).argon2_memory_kib, 4 << 20);
    }

    /// No volume id is named like another's hashed mapping: a hashed
    /// name's part after the prefix is no valid volume id.
    #[test]
    fn no_plain_id_takes_a_hashed_name() {
        let long = "v".repeat(65);
        crate::validate::volume_id(&long).unwrap();
        for hashed in [
            untagged(&long, LEGACY_PLAIN_ID_MAX),
            Owner::of_dir(1, 2).name_for(&long),
        ] {
            let plain = hashed.strip_prefix(NAME_PREFIX).unwrap();
            assert!(crate::validate::volume_id(plain).is_err(), "{plain}");
        }
    }
}

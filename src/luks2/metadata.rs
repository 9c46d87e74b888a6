//! The LUKS2 JSON area as types: keyslots, segments, digests and config,
//! read from the bounded JSON tree and checked as cryptsetup checks them
//! (`LUKS2_hdr_validate`) before anything acts on them: numbered sections
//! within their counts, sizes as decimal strings that fit 64 bits, keyslot
//! areas inside the keyslots area and apart from each other and from the
//! binary headers, segments after the metadata and inside the device,
//! digests naming keyslots and segments that exist. Only what is checked
//! here is trusted by the unlock.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use super::json::{base64, Value};

/// At most this many keyslots, segments, digests and tokens each (LUKS2's own limits).
pub const MAX_NUMBERED: u32 = 32;

/// The largest key (a keyslot's, or its area's) read: a 512-bit XTS key with
/// a 512-bit HMAC key for integrity is 128 bytes; twice that is absurd.
pub const MAX_KEY_BYTES: u32 = 256;

/// The AF stripes cryptsetup writes; more would only make the unlock longer.
pub const MAX_STRIPES: u32 = 4000;

/// The largest keyslots area cryptsetup makes (LUKS2_MAX_KEYSLOTS_SIZE).
pub const MAX_KEYSLOTS_SIZE: u64 = 128 << 20;

/// The longest salt or digest read (cryptsetup writes 32-byte salts and digests).
pub const MAX_SALT_BYTES: usize = 64;

/// The binary header's own size, before the JSON area.
pub const BINARY_HEADER: u64 = 4096;

/// The JSON area of one header, typed.
#[derive(Clone, Debug, PartialEq)]
pub struct Metadata {
    /// By number, ascending.
    pub keyslots: Vec<(u32, Keyslot)>,
    /// By number, ascending.
    pub segments: Vec<(u32, Segment)>,
    /// By number, ascending.
    pub digests: Vec<(u32, Digest)>,
    /// How many tokens there are (their contents are the tools' that wrote them).
    pub tokens: u32,
    pub config: Config,
}

/// A keyslot. Only type `luks2` has its parameters read; others (a
/// re-encryption's `reencrypt` slot) are kept by type, and no passphrase
/// opens them.
#[derive(Clone, Debug, PartialEq)]
pub struct Keyslot {
    /// "luks2", "reencrypt", ….
    pub kind: String,
    /// The size of the key it holds (the volume key), in bytes.
    pub key_size: u32,
    /// 0 ignore (only when named), 1 normal, 2 high (tried first).
    pub priority: u8,
    /// For type `luks2`: how the key is stored.
    pub stored: Option<Stored>,
}

/// How a `luks2` keyslot stores its key.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    /// The anti-forensic splitter's hash ("sha256", …).
    pub af_hash: String,
    /// The splitter's stripes.
    pub stripes: u32,
    /// Where the split key lies: bytes from the device's start.
    pub area_offset: u64,
    /// The area's size in bytes.
    pub area_size: u64,
    /// The area's cipher ("aes-xts-plain64", …).
    pub area_cipher: String,
    /// The area key's size in bytes (what the KDF derives).
    pub area_key_size: u32,
    /// How the area key comes from the passphrase.
    pub kdf: Kdf,
}

impl Stored {
    /// The bytes of the area that hold the split key: key size × stripes,
    /// in whole 512-byte sectors, as cryptsetup's AF_split_sectors.
    pub fn split_bytes(&self, key_size: u32) -> u64 {
        let raw = u64::from(key_size).saturating_mul(u64::from(self.stripes));
        raw.div_ceil(512).saturating_mul(512)
    }
}

/// A keyslot's key derivation.
#[derive(Clone, PartialEq, Debug)]
pub enum Kdf {
    Pbkdf2 {
        hash: String,
        iterations: u32,
        salt: Vec<u8>,
    },
    Argon2 {
        /// Argon2id rather than Argon2i.
        id: bool,
        /// Passes.
        time: u32,
        /// KiB.
        memory_kib: u32,
        /// Lanes.
        cpus: u32,
        salt: Vec<u8>,
    },
}

/// A data segment.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    /// "crypt", "linear", ….
    pub kind: String,
    /// Bytes from the device's start.
    pub offset: u64,
    /// Bytes, or `None` for "dynamic" (to the device's end).
    pub size: Option<u64>,
    /// For type crypt: the first IV's sector.
    pub iv_tweak: u64,
    /// For type crypt: the cipher ("aes-xts-plain64", …).
    pub encryption: String,
    /// For type crypt: 512, 1024, 2048 or 4096.
    pub sector_size: u32,
    /// For type crypt: dm-integrity under the encryption, if any.
    pub integrity: Option<Integrity>,
    /// The segment's flags, as written.
    pub flags: Vec<String>,
}

/// A crypt segment's integrity (authenticated encryption over dm-integrity).
#[derive(Clone, Debug, PartialEq)]
pub struct Integrity {
    /// "hmac(sha256)", "aead", ….
    pub kind: String,
    pub journal_encryption: String,
    pub journal_integrity: String,
}

/// A digest: how a volume key is recognised, and which keyslots and
/// segments share that key.
#[derive(Clone, Debug, PartialEq)]
pub struct Digest {
    /// "pbkdf2".
    pub kind: String,
    pub keyslots: Vec<u32>,
    pub segments: Vec<u32>,
    pub hash: String,
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub digest: Vec<u8>,
}

/// The config section.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The JSON area's size: the header's size less the binary header.
    pub json_size: u64,
    /// The keyslots area's size, after both headers.
    pub keyslots_size: u64,
    /// Activation flags ("allow-discards", …).
    pub flags: Vec<String>,
    /// Mandatory requirements ("online-reencrypt-v2", …): a reader that
    /// does not know one must not open the volume.
    pub requirements: Vec<String>,
}

/// Reads and checks the JSON area of a header of `hdr_size` bytes on a
/// device of `device_bytes`. The error says what is wrong.
pub fn read(root: &Value, hdr_size: u64, device_bytes: u64) -> Result<Metadata, String> {
    let config = config(field(root, "config", "the header")?)?;
    if Some(config.json_size) != hdr_size.checked_sub(BINARY_HEADER) {
        return Err(format!(
            "config says the JSON area is {} bytes, but the binary header makes it {}",
            config.json_size,
            hdr_size.saturating_sub(BINARY_HEADER)
        ));
    }
    let keyslots = numbered(root, "keyslots", keyslot)?;
    let segments = numbered(root, "segments", segment)?;
    let digests = numbered(root, "digests", digest)?;
    let tokens = numbered(root, "tokens", |_, v| object(v, "a token").map(|_| ()))?;
    let m = Metadata {
        keyslots,
        segments,
        digests,
        tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
        config,
    };
    m.check(hdr_size, device_bytes)?;
    Ok(m)
}

impl Metadata {
    /// Where the metadata ends: both headers and the keyslots area.
    pub fn end(&self, hdr_size: u64) -> u64 {
        hdr_size
            .saturating_mul(2)
            .saturating_add(self.config.keyslots_size)
    }

    fn check(&self, hdr_size: u64, device_bytes: u64) -> Result<(), String> {
        let keyslots_size = self.config.keyslots_size;
        if !keyslots_size.is_multiple_of(4096) || keyslots_size > MAX_KEYSLOTS_SIZE {
            return Err(format!(
                "the keyslots area is {keyslots_size} bytes, not a multiple of 4096 up to {MAX_KEYSLOTS_SIZE}"
            ));
        }
        let end = self.end(hdr_size);
        if end > device_bytes {
            return Err(format!(
                "the headers and keyslots end at byte {end}, past the device's {device_bytes} bytes"
            ));
        }
        self.check_areas(hdr_size, end)?;
        for (id, s) in &self.segments {
            check_segment(*id, s, end, device_bytes)?;
        }
        for (id, d) in &self.digests {
            if let Some(k) = d
                .keyslots
                .iter()
                .find(|k| !self.keyslots.iter().any(|(n, _)| n == *k))
            {
                return Err(format!(
                    "digest {id} names keyslot {k}, which does not exist"
                ));
            }
            if let Some(s) = d
                .segments
                .iter()
                .find(|s| !self.segments.iter().any(|(n, _)| n == *s))
            {
                return Err(format!(
                    "digest {id} names segment {s}, which does not exist"
                ));
            }
        }
        Ok(())
    }

    /// Each keyslot's area lies in the keyslots area, is long enough for
    /// its split key and overlaps no other (cryptsetup's validate_intervals).
    fn check_areas(&self, hdr_size: u64, end: u64) -> Result<(), String> {
        let mut areas: Vec<(u32, u64, u64)> = Vec::new();
        for (id, k) in &self.keyslots {
            let Some(st) = &k.stored else { continue };
            let (start, size) = (st.area_offset, st.area_size);
            let stop = start.saturating_add(size);
            if start < hdr_size.saturating_mul(2) || size == 0 || stop > end {
                return Err(format!(
                    "keyslot {id}'s area [{start}, +{size}) is not inside the keyslots area [{}, {end})",
                    hdr_size.saturating_mul(2)
                ));
            }
            if st.split_bytes(k.key_size) > size {
                return Err(format!(
                    "keyslot {id}'s area of {size} bytes cannot hold {} stripes of a {}-byte key",
                    st.stripes, k.key_size
                ));
            }
            if let Some((other, ..)) = areas.iter().find(|(_, s, e)| start < *e && *s < stop) {
                return Err(format!("the areas of keyslots {other} and {id} overlap"));
            }
            areas.push((*id, start, stop));
        }
        Ok(())
    }
}

fn check_segment(id: u32, s: &Segment, metadata_end: u64, device_bytes: u64) -> Result<(), String> {
    if s.offset < metadata_end || !s.offset.is_multiple_of(512) {
        return Err(format!(
            "segment {id} starts at byte {}, inside the metadata (which ends at {metadata_end}) or not on a 512-byte sector",
            s.offset
        ));
    }
    let stop = match s.size {
        Some(size) => s.offset.checked_add(size),
        None => Some(s.offset),
    };
    if stop.is_none_or(|e| e > device_bytes) {
        return Err(format!(
            "segment {id} ({} bytes at byte {}) does not fit the device's {device_bytes} bytes",
            s.size.map_or("dynamic".to_string(), |n| n.to_string()),
            s.offset
        ));
    }
    if s.kind == "crypt" {
        if ![512, 1024, 2048, 4096].contains(&s.sector_size) {
            return Err(format!(
                "segment {id}'s sector size {} is not 512, 1024, 2048 or 4096",
                s.sector_size
            ));
        }
        if s.size
            .is_some_and(|n| !n.is_multiple_of(u64::from(s.sector_size)))
        {
            return Err(format!(
                "segment {id}'s size is not a whole number of its sectors"
            ));
        }
    }
    Ok(())
}

// ------------------------------------------------------------- sections --

/// A section whose members are numbered "0".."31", each read by `each`,
/// sorted by number.
fn numbered<T>(
    root: &Value,
    name: &str,
    each: impl Fn(&str, &Value) -> Result<T, String>,
) -> Result<Vec<(u32, T)>, String> {
    let members = object(field(root, name, "the header")?, name)?;
    if members.len() > MAX_NUMBERED as usize {
        return Err(format!(
            "{} {name}, more than {MAX_NUMBERED}",
            members.len()
        ));
    }
    let mut out = Vec::with_capacity(members.len());
    for (key, v) in members {
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|n| *n < MAX_NUMBERED && n.to_string() == *key)
            .ok_or_else(|| {
                format!("{name} has a member {key:?}, not a number below {MAX_NUMBERED}")
            })?;
        let what = format!("{} {id}", name.trim_end_matches('s'));
        // In order as they come: at most 32, and no sort's code built
        // once per section (the standard sorts are large).
        let at = out.partition_point(|(n, _)| *n < id);
        out.insert(at, (id, each(&what, v)?));
    }
    Ok(out)
}

fn keyslot(what: &str, v: &Value) -> Result<Keyslot, String> {
    let kind = string(v, "type", what)?;
    let key_size = int(v, "key_size", what, 1, MAX_KEY_BYTES.into())?;
    let priority = match v.get("priority") {
        None => 1,
        Some(_) => int(v, "priority", what, 0, 2)?,
    };
    let stored = if kind == "luks2" {
        Some(stored(what, v)?)
    } else {
        None
    };
    Ok(Keyslot {
        kind,
        key_size: u32::try_from(key_size).unwrap_or(0),
        priority: u8::try_from(priority).unwrap_or(0),
        stored,
    })
}

fn stored(what: &str, v: &Value) -> Result<Stored, String> {
    let af = field(v, "af", what)?;
    let af_what = format!("{what}'s af");
    let af_type = string(af, "type", &af_what)?;
    if af_type != "luks1" {
        return Err(format!("{af_what} is of type {af_type:?}, not \"luks1\""));
    }
    let area = field(v, "area", what)?;
    let area_what = format!("{what}'s area");
    let area_type = string(area, "type", &area_what)?;
    if area_type != "raw" {
        return Err(format!("{area_what} is of type {area_type:?}, not \"raw\""));
    }
    Ok(Stored {
        af_hash: string(af, "hash", &af_what)?,
        stripes: u32::try_from(int(af, "stripes", &af_what, 1, MAX_STRIPES.into())?).unwrap_or(0),
        area_offset: decimal(area, "offset", &area_what)?,
        area_size: decimal(area, "size", &area_what)?,
        area_cipher: string(area, "encryption", &area_what)?,
        area_key_size: u32::try_from(int(area, "key_size", &area_what, 1, MAX_KEY_BYTES.into())?)
            .unwrap_or(0),
        kdf: kdf(field(v, "kdf", what)?, &format!("{what}'s kdf"))?,
    })
}

fn kdf(v: &Value, what: &str) -> Result<Kdf, String> {
    let kind = string(v, "type", what)?;
    let salt = bytes(v, "salt", what)?;
    let u32_of = |key: &str, min: u64| {
        int(v, key, what, min, u32::MAX.into()).map(|n| u32::try_from(n).unwrap_or(0))
    };
    match kind.as_str() {
        "pbkdf2" => Ok(Kdf::Pbkdf2 {
            hash: string(v, "hash", what)?,
            iterations: u32_of("iterations", 1)?,
            salt,
        }),
        "argon2i" | "argon2id" => Ok(Kdf::Argon2 {
            id: kind == "argon2id",
            time: u32_of("time", 1)?,
            memory_kib: u32_of("memory", 1)?,
            cpus: u32_of("cpus", 1)?,
            salt,
        }),
        // Named for the unlock to refuse; nothing else of it is read.
        _ => Err(format!(
            "{what} is of type {kind:?}, which LUKS2 does not define"
        )),
    }
}

fn segment(what: &str, v: &Value) -> Result<Segment, String> {
    let kind = string(v, "type", what)?;
    let size = match v.get("size") {
        Some(Value::Str(s)) if s == "dynamic" => None,
        _ => Some(decimal(v, "size", what)?),
    };
    let flags = match v.get("flags") {
        None => Vec::new(),
        Some(f) => strings(f, &format!("{what}'s flags"))?,
    };
    let mut s = Segment {
        offset: decimal(v, "offset", what)?,
        size,
        iv_tweak: 0,
        encryption: String::new(),
        sector_size: 0,
        integrity: None,
        flags,
        kind,
    };
    if s.kind == "crypt" {
        s.iv_tweak = decimal(v, "iv_tweak", what)?;
        s.encryption = string(v, "encryption", what)?;
        s.sector_size = u32::try_from(int(v, "sector_size", what, 512, 4096)?).unwrap_or(0);
        if let Some(i) = v.get("integrity") {
            let iw = format!("{what}'s integrity");
            s.integrity = Some(Integrity {
                kind: string(i, "type", &iw)?,
                journal_encryption: string(i, "journal_encryption", &iw)?,
                journal_integrity: string(i, "journal_integrity", &iw)?,
            });
        }
    }
    Ok(s)
}

fn digest(what: &str, v: &Value) -> Result<Digest, String> {
    let kind = string(v, "type", what)?;
    if kind != "pbkdf2" {
        return Err(format!("{what} is of type {kind:?}, not \"pbkdf2\""));
    }
    let digest = bytes(v, "digest", what)?;
    if digest.is_empty() {
        return Err(format!("{what} is empty"));
    }
    Ok(Digest {
        keyslots: ids(field(v, "keyslots", what)?, &format!("{what}'s keyslots"))?,
        segments: ids(field(v, "segments", what)?, &format!("{what}'s segments"))?,
        hash: string(v, "hash", what)?,
        iterations: u32::try_from(int(v, "iterations", what, 1, u32::MAX.into())?).unwrap_or(0),
        salt: bytes(v, "salt", what)?,
        digest,
        kind,
    })
}

fn config(v: &Value) -> Result<Config, String> {
    let what = "config";
    let flags = match v.get("flags") {
        None => Vec::new(),
        Some(f) => strings(f, "config's flags")?,
    };
    let requirements = match v.get("requirements") {
        None => Vec::new(),
        Some(r) => match r.get("mandatory") {
            None => Vec::new(),
            Some(m) => strings(m, "config's mandatory requirements")?,
        },
    };
    Ok(Config {
        json_size: decimal(v, "json_size", what)?,
        keyslots_size: decimal(v, "keyslots_size", what)?,
        flags,
        requirements,
    })
}

// -------------------------------------------------------------- fields --

fn object<'a>(v: &'a Value, what: &str) -> Result<&'a [(String, Value)], String> {
    match v {
        Value::Object(m) => Ok(m),
        other => Err(format!("{what} is {}, not an object", other.kind())),
    }
}

fn field<'a>(v: &'a Value, key: &str, what: &str) -> Result<&'a Value, String> {
    object(v, what)?;
    v.get(key).ok_or_else(|| format!("{what} has no {key:?}"))
}

fn string(v: &Value, key: &str, what: &str) -> Result<String, String> {
    match field(v, key, what)? {
        Value::Str(s) => Ok(s.clone()),
        other => Err(format!(
            "{what}'s {key:?} is {}, not a string",
            other.kind()
        )),
    }
}

/// A JSON integer within `[min, max]`.
fn int(v: &Value, key: &str, what: &str, min: u64, max: u64) -> Result<u64, String> {
    match field(v, key, what)? {
        Value::Int(n) => u64::try_from(*n)
            .ok()
            .filter(|n| (min..=max).contains(n))
            .ok_or_else(|| format!("{what}'s {key:?} is {n}, outside [{min}, {max}]")),
        other => Err(format!(
            "{what}'s {key:?} is {}, not an integer",
            other.kind()
        )),
    }
}

/// A size or offset: a string of decimal digits that fits 64 bits.
fn decimal(v: &Value, key: &str, what: &str) -> Result<u64, String> {
    let s = string(v, key, what)?;
    s.bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| s.parse::<u64>().ok())
        .flatten()
        .ok_or_else(|| format!("{what}'s {key:?} is {s:?}, not a decimal number of 64 bits"))
}

/// Base64 bytes, at most [`MAX_SALT_BYTES`].
fn bytes(v: &Value, key: &str, what: &str) -> Result<Vec<u8>, String> {
    let s = string(v, key, what)?;
    base64(&s)
        .filter(|b| b.len() <= MAX_SALT_BYTES)
        .ok_or_else(|| format!("{what}'s {key:?} is not base64 of at most {MAX_SALT_BYTES} bytes"))
}

fn strings(v: &Value, what: &str) -> Result<Vec<String>, String> {
    match v {
        Value::Array(items) if items.len() <= MAX_NUMBERED as usize => items
            .iter()
            .map(|i| match i {
                Value::Str(s) => Ok(s.clone()),
                other => Err(format!("{what} holds {}, not a string", other.kind())),
            })
            .collect(),
        other => Err(format!(
            "{what} is {}, not an array of at most {MAX_NUMBERED} strings",
            other.kind()
        )),
    }
}

/// An array of numbers written as strings ("0", "1"), as digests name keyslots and segments.
fn ids(v: &Value, what: &str) -> Result<Vec<u32>, String> {
    strings(v, what)?
        .iter()
        .map(|s| {
            s.parse::<u32>()
                .ok()
                .filter(|n| *n < MAX_NUMBERED && n.to_string() == *s)
                .ok_or_else(|| format!("{what} holds {s:?}, not a number below {MAX_NUMBERED}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::luks2::fixture::{json, DEVICE};
    use crate::luks2::json::parse;

    fn read_edited(edit: impl Fn(String) -> String) -> Result<Metadata, String> {
        let text = json(edit);
        read(&parse(&text).unwrap(), 16384, DEVICE)
    }

    fn refused(edit: impl Fn(String) -> String) -> String {
        read_edited(edit).expect_err("accepted")
    }

    #[test]
    fn cryptsetups_json_reads_typed() {
        let m = read_edited(|s| s).unwrap();
        let (id, k) = &m.keyslots[0];
        let st = k.stored.as_ref().unwrap();
        assert_eq!((*id, k.key_size, k.priority), (0, 64, 1));
        assert_eq!(
            (st.area_offset, st.area_size, st.stripes),
            (32768, 258048, 4000)
        );
        assert_eq!(st.split_bytes(64), 256000);
        assert!(
            matches!(st.kdf, Kdf::Pbkdf2 { iterations: 1000, ref salt, .. } if salt.len() == 32)
        );
        let s = &m.segments[0].1;
        assert_eq!((s.offset, s.size, s.sector_size), (16 << 20, None, 4096));
        assert_eq!(m.digests[0].1.keyslots, [0]);
        assert_eq!((m.config.json_size, m.tokens), (12288, 0));
    }

    /// As cryptsetup writes a segment formatted with --integrity
    /// hmac-sha256 (luksFormat cannot make one without device-mapper, so
    /// the JSON is edited by hand), and a 768-bit volume key.
    #[test]
    fn an_integrity_segment_reads() {
        let m = read_edited(|s| {
            s.replace(
                "\"sector_size\":4096}",
                "\"sector_size\":4096,\"integrity\":{\"type\":\"hmac(sha256)\",\"journal_encryption\":\"none\",\"journal_integrity\":\"none\"}}",
            )
            .replace("\"key_size\":64,\"af\"", "\"key_size\":96,\"af\"")
            .replace("\"size\":\"258048\"", "\"size\":\"385024\"")
        })
        .unwrap();
        let i = m.segments[0].1.integrity.as_ref().unwrap();
        assert_eq!(
            (
                i.kind.as_str(),
                i.journal_encryption.as_str(),
                i.journal_integrity.as_str()
            ),
            ("hmac(sha256)", "none", "none")
        );
        assert_eq!(m.keyslots[0].1.key_size, 96);
    }

    /// Edits of cryptsetup's JSON (the first match of .0.0 becomes .0.1),
    /// each with what its refusal must say.
    const ABSURD: &[((&str, &str), &str)] = &[
        (
            ("\"key_size\":64,\"af\"", "\"key_size\":100000,\"af\""),
            "outside [1, 256]",
        ),
        (
            ("\"stripes\":4000", "\"stripes\":4001"),
            "outside [1, 4000]",
        ),
        (("\"stripes\":4000", "\"stripes\":-1"), "outside [1, 4000]"),
        (
            ("\"size\":\"258048\"", "\"size\":\"1000\""),
            "cannot hold 4000 stripes",
        ),
        (
            ("\"offset\":\"32768\"", "\"offset\":\"16384\""),
            "not inside the keyslots area",
        ),
        (
            (
                "\"offset\":\"32768\"",
                "\"offset\":\"18446744073709551615\"",
            ),
            "not inside",
        ),
        (
            (
                "\"offset\":\"32768\"",
                "\"offset\":\"18446744073709551616\"",
            ),
            "not a decimal number of 64 bits",
        ),
        (
            ("\"offset\":\"32768\"", "\"offset\":\"+32768\""),
            "not a decimal number",
        ),
        (
            ("\"offset\":\"16777216\"", "\"offset\":\"4096\""),
            "inside the metadata",
        ),
        (
            ("\"offset\":\"16777216\"", "\"offset\":\"16777217\""),
            "not on a 512-byte sector",
        ),
        (
            ("\"size\":\"dynamic\"", "\"size\":\"1073741824\""),
            "does not fit the device",
        ),
        (
            ("\"sector_size\":4096", "\"sector_size\":3000"),
            "not 512, 1024, 2048 or 4096",
        ),
        (
            (
                "\"keyslots_size\":\"16744448\"",
                "\"keyslots_size\":\"16744449\"",
            ),
            "not a multiple of 4096",
        ),
        (
            (
                "\"keyslots_size\":\"16744448\"",
                "\"keyslots_size\":\"1073741824\"",
            ),
            "up to 134217728",
        ),
        (
            ("\"json_size\":\"12288\"", "\"json_size\":\"61440\""),
            "the binary header makes it 12288",
        ),
        (
            ("\"iterations\":1000,\"salt\"", "\"iterations\":0,\"salt\""),
            "outside [1, 4294967295]",
        ),
        (
            (
                "\"iterations\":1000,\"salt\"",
                "\"iterations\":1e9,\"salt\"",
            ),
            "not an integer",
        ),
        (
            ("\"keyslots\":[\"0\"]", "\"keyslots\":[\"5\"]"),
            "names keyslot 5, which does not exist",
        ),
        (
            ("\"segments\":[\"0\"]", "\"segments\":[\"01\"]"),
            "not a number below 32",
        ),
        (
            ("\"keyslots\":{\"0\"", "\"keyslots\":{\"32\""),
            "not a number below 32",
        ),
        (("\"tokens\":{}", "\"tokens\":[]"), "not an object"),
        (
            ("\"af\":{\"type\":\"luks1\"", "\"af\":{\"type\":\"luks3\""),
            "not \"luks1\"",
        ),
        (
            (
                "\"type\":\"pbkdf2\",\"hash\"",
                "\"type\":\"scrypt\",\"hash\"",
            ),
            "\"scrypt\"",
        ),
    ];

    #[test]
    fn absurd_sizes_and_counts_are_refused() {
        for &(edit, says) in ABSURD {
            let what = refused(|s| {
                assert!(s.contains(edit.0), "{}", edit.0);
                s.replacen(edit.0, edit.1, 1)
            });
            assert!(what.contains(says), "{edit:?}: {what}");
        }
    }

    #[test]
    fn more_than_32_of_a_section_is_refused() {
        let tokens: Vec<String> = (0..33).map(|i| format!("\"{i}\":{{}}")).collect();
        let what = refused(|s| {
            s.replace(
                "\"tokens\":{}",
                &format!("\"tokens\":{{{}}}", tokens.join(",")),
            )
        });
        assert!(what.contains("33 tokens, more than 32"), "{what}");
    }

    #[test]
    fn overlapping_keyslot_areas_are_refused() {
        let what = refused(|s| {
            let slot = s
                .split_once("\"0\":")
                .unwrap()
                .1
                .split_once(",\"tokens\"")
                .unwrap()
                .0
                .strip_suffix('}')
                .unwrap()
                .to_string();
            let other = slot.replace("\"offset\":\"32768\"", "\"offset\":\"36864\"");
            s.replacen(
                "\"keyslots\":{",
                &format!("\"keyslots\":{{\"1\":{other},"),
                1,
            )
        });
        assert!(what.contains("the areas of keyslots"), "{what}");
    }

    #[test]
    fn the_device_must_hold_the_metadata() {
        let text = json(|s| s);
        let e = read(&parse(&text).unwrap(), 16384, 1 << 20).unwrap_err();
        assert!(e.contains("past the device's 1048576 bytes"), "{e}");
    }
}

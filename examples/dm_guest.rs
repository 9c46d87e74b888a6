//! `sys::dm` and `sys::keyring` against a real guest kernel, until the RPC
//! wiring lets a VM test in vm/tests/ do it through the agent. This program
//! is PID 1 of a guest of its own: it mounts /dev, loads the initrd's
//! modules, then on a `zero` device makes dm-crypt mappings, one with a
//! logon key and one with a hex key, and checks what the kernel says and
//! decrypts; it prints `DM_GUEST OK` (or `DM_GUEST FAILED <why>`) and
//! powers off. docs/encryption.md ("device-mapper") says how to run it.

use std::fmt::Display;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use aes::cipher::KeyInit;
use aes::Aes256;
use crust_agent::sys::dm::{self, Control, Crypt, CryptKey, DevInfo, Error, Target};
use crust_agent::sys::keyring::{self, Keyring};
use xts_mode::{get_tweak_default, Xts128};
use zeroize::Zeroizing;

const LUKS_UUID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";
const KEY: [u8; 64] = [7; 64];

fn say(s: &str) {
    println!("DM_GUEST {s}");
}

fn s(e: impl Display) -> String {
    e.to_string()
}

fn target(length: u64, kind: &'static str, params: Zeroizing<String>) -> Target {
    Target {
        start: 0,
        length,
        kind,
        params,
    }
}

/// A crypt mapping `name` over `under`, from its 9th sector on.
fn crypt(
    c: &Control,
    name: &str,
    under: (u32, u32),
    key: CryptKey<'_>,
    sector_size: u32,
) -> Result<DevInfo, String> {
    let uuid = dm::crypt_uuid(LUKS_UUID, name).map_err(s)?;
    c.create(name, &uuid).map_err(s)?;
    let params = Crypt {
        cipher: "aes-xts-plain64",
        key,
        iv_offset: 0,
        device: under,
        offset: 8,
        sector_size,
        allow_discards: sector_size != 512,
        aead_tag: None,
    }
    .params()
    .map_err(s)?;
    let loaded = c.load(
        name,
        &[target(
            4088 - 8 * u64::from(sector_size != 512),
            "crypt",
            params,
        )],
        sector_size != 512,
    );
    let loaded = loaded.map_err(s)?;
    if loaded.flags & dm::flag::INACTIVE_PRESENT == 0 {
        return Err(format!("{name}: no inactive table after the load"));
    }
    Ok(loaded)
}

/// The logon-key mapping: the key revoked once loaded, the table readback
/// without it, and sector 1 decrypted by dm-crypt as AES-XTS decrypts it here.
fn with_logon_key(c: &Control, under: (u32, u32)) -> Result<(), String> {
    let desc = "crust:dm-guest-d0";
    // Before the key is in the keyring: refused, and said so.
    match crypt(
        c,
        "crypt0",
        under,
        CryptKey::Logon {
            size: 64,
            description: desc,
        },
        512,
    ) {
        Err(e) if e.contains("refused the table") && e.contains("os error 126") => {
            say(&format!("without the key: {e}"))
        }
        other => {
            return Err(format!(
                "a table whose key is not in the keyring: {other:?}"
            ))
        }
    }
    c.remove("crypt0").map_err(s)?;
    let serial = keyring::add_logon(desc, &KEY, Keyring::Thread).map_err(s)?;
    crypt(
        c,
        "crypt0",
        under,
        CryptKey::Logon {
            size: 64,
            description: desc,
        },
        512,
    )?;
    keyring::revoke(serial).map_err(s)?;
    let info = c.resume("crypt0").map_err(s)?;
    let (_, lines) = c.targets("crypt0", true).map_err(s)?;
    let line = lines
        .first()
        .map(|l| l.text.to_string())
        .unwrap_or_default();
    say(&format!("crypt0 {:?}, table {line:?}", info.dev));
    if line
        != format!(
            "aes-xts-plain64 :64:logon:{desc} 0 {}:{} 8",
            under.0, under.1
        )
    {
        return Err(format!("crypt0's table reads back as {line:?}"));
    }
    let node = format!("/dev/dm-{}", info.dev.1);
    let mut got = [0u8; 512];
    let mut f = std::fs::File::open(&node).map_err(|e| format!("{node}: {e}"))?;
    f.seek(SeekFrom::Start(512)).map_err(s)?;
    f.read_exact(&mut got)
        .map_err(|e| format!("read {node}: {e}"))?;
    let xts = Xts128::new(
        Aes256::new_from_slice(&KEY[..32]).map_err(s)?,
        Aes256::new_from_slice(&KEY[32..]).map_err(s)?,
    );
    let mut want = [0u8; 512];
    xts.decrypt_area(&mut want, 512, 1, get_tweak_default);
    if got != want {
        return Err("crypt0's sector 1 is not AES-XTS of zeros with the key".into());
    }
    say("crypt0 decrypts as AES-XTS with the key does");
    Ok(())
}

/// The hex-key mapping: read-only, 4096-byte sectors, discards; its
/// table readback shows the key, which is why the agent will not use it.
fn with_hex_key(c: &Control, under: (u32, u32)) -> Result<(), String> {
    crypt(c, "crypt1", under, CryptKey::Hex(&KEY), 4096)?;
    c.resume("crypt1").map_err(s)?;
    let (info, lines) = c.targets("crypt1", true).map_err(s)?;
    let line = lines
        .first()
        .map(|l| l.text.to_string())
        .unwrap_or_default();
    let shows_key = line.contains(&"07".repeat(64));
    let opts = line.split(' ').skip(5).collect::<Vec<_>>().join(" ");
    say(&format!(
        "crypt1 table shows the key: {shows_key}; options {opts:?}"
    ));
    if !shows_key
        || opts != "2 allow_discards sector_size:4096"
        || info.flags & dm::flag::READONLY == 0
    {
        return Err(format!(
            "crypt1 reads back as {} bytes, options {opts:?}, flags {:#x}",
            line.len(),
            info.flags
        ));
    }
    Ok(())
}

/// If the guest has a disk (/dev/vda): a LUKS2 image cryptsetup made,
/// unlocked with `luks2`, mapped from the segment it answers, and its first
/// two data sectors read back as the plaintext written into them.
fn cryptsetup_disk(c: &Control) -> Result<(), String> {
    use crust_agent::luks2::{header, unlock};
    use std::os::unix::fs::MetadataExt;
    let Ok(disk) = std::fs::File::open("/dev/vda") else {
        say("no /dev/vda: the cryptsetup image is skipped");
        return Ok(());
    };
    let rdev = disk.metadata().map_err(s)?.rdev();
    let under = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let bytes = crust_agent::sys::blockdev::size_of(&disk, Path::new("/dev/vda")).map_err(s)?;
    let hdr = header::read(&disk, bytes).map_err(s)?;
    let limits = unlock::Limits {
        argon2_memory_kib: 64 << 10,
        argon2_passes: 10,
        pbkdf2_iterations: 10_000_000,
    };
    let pass = Zeroizing::new(b"crust-test-pass".to_vec());
    let open = unlock::unlock(&disk, &hdr, &pass, limits, None).map_err(s)?;
    let seg = &open.segment;
    let desc = format!("cryptsetup:{}-d0", hdr.uuid);
    let serial = keyring::add_logon(&desc, open.volume_key.bytes(), Keyring::Thread).map_err(s)?;
    let size = open.volume_key.bytes().len();
    let sector = u64::from(seg.sector_size);
    let length = (seg.size.unwrap_or(bytes - seg.offset) / sector * sector) / 512;
    let params = Crypt {
        cipher: &seg.encryption,
        key: CryptKey::Logon {
            size,
            description: &desc,
        },
        iv_offset: seg.iv_tweak,
        device: under,
        offset: seg.offset / 512,
        sector_size: seg.sector_size,
        allow_discards: false,
        aead_tag: None,
    }
    .params()
    .map_err(s)?;
    let name = "luks0";
    c.create(name, &dm::crypt_uuid(&hdr.uuid, name).map_err(s)?)
        .map_err(s)?;
    c.load(name, &[target(length, "crypt", params)], true)
        .map_err(s)?;
    keyring::revoke(serial).map_err(s)?;
    let info = c.resume(name).map_err(s)?;
    let (_, lines) = c.targets(name, true).map_err(s)?;
    say(&format!(
        "{name}: {:?}",
        lines.first().map(|l| l.text.to_string())
    ));
    let mut got = vec![0u8; 8192];
    let node = format!("/dev/dm-{}", info.dev.1);
    std::fs::File::open(&node)
        .and_then(|mut f| f.read_exact(&mut got))
        .map_err(|e| format!("{node}: {e}"))?;
    let want: Vec<u8> = [
        &b"CRUST-PLAINTEXT-SECTOR-0 "[..],
        &b"crust-plaintext-sector-1 "[..],
    ]
    .iter()
    .flat_map(|p| p.iter().copied().cycle().take(4096))
    .collect();
    c.remove(name).map_err(s)?;
    if got != want {
        return Err(format!(
            "{name} reads {:?}…, not the plaintext",
            String::from_utf8_lossy(&got[..32])
        ));
    }
    say(&format!(
        "{name}: cryptsetup's image, keyslot {}, reads back its plaintext",
        open.keyslot
    ));
    Ok(())
}

/// Listing by uuid, suspend and resume, the typed refusals, and removal.
fn lifecycle(c: &Control) -> Result<(), String> {
    let found = c.find_by_uuid_prefix("CRYPT-LUKS2-").map_err(s)?;
    let names: Vec<&str> = found.iter().map(|l| l.name.as_str()).collect();
    say(&format!("found by uuid: {names:?}"));
    if names != ["crypt0", "crypt1"] {
        return Err(format!("the LUKS2 mappings listed are {names:?}"));
    }
    if !c.suspend("crypt0").map_err(s)?.suspended() || !c.status("crypt0").map_err(s)?.suspended() {
        return Err("crypt0 is not suspended".into());
    }
    if c.resume("crypt0").map_err(s)?.suspended() {
        return Err("crypt0 is still suspended".into());
    }
    let uuid = dm::crypt_uuid(LUKS_UUID, "crypt0").map_err(s)?;
    match (
        c.create("crypt0", &uuid),
        c.status("nope"),
        c.remove("zero0"),
    ) {
        (Err(Error::Exists { .. }), Err(Error::NotFound(_)), Err(e @ Error::Busy(_))) => {
            say(&format!("refusals typed: {e}"))
        }
        other => return Err(format!("refusals: {other:?}")),
    }
    for n in ["crypt0", "crypt1", "zero0"] {
        c.remove(n).map_err(|e| format!("remove {n}: {e}"))?;
    }
    let left = c.list().map_err(s)?;
    if !left.is_empty() {
        return Err(format!("left behind: {left:?}"));
    }
    Ok(())
}

fn run() -> Result<(), String> {
    for w in crust_agent::init::early_mounts() {
        say(&format!("mount warning: {w}"));
    }
    let modules = Path::new("/lib/modules").join(crust_agent::system::kernel_release());
    let report = crust_agent::init::load_modules(&modules, &[]);
    say(&format!(
        "modules {:?}, failed {:?}",
        report.loaded, report.failed
    ));
    let c = Control::open().map_err(s)?;
    say(&format!("device-mapper {:?}", c.version));
    c.create("zero0", "CRUST-TEST-zero0").map_err(s)?;
    c.load(
        "zero0",
        &[target(4096, "zero", Zeroizing::default())],
        false,
    )
    .map_err(s)?;
    let zero = c.resume("zero0").map_err(s)?;
    with_logon_key(&c, zero.dev)?;
    with_hex_key(&c, zero.dev)?;
    cryptsetup_disk(&c)?;
    lifecycle(&c)
}

fn main() {
    match run() {
        Ok(()) => say("OK"),
        Err(e) => say(&format!("FAILED {e}")),
    }
    crust_agent::init::power_off();
}

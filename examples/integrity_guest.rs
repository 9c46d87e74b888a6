//! LUKS2 with integrity against a real guest kernel and cryptsetup's own
//! format: this program is PID 1 of a guest whose initrd also holds the
//! host's cryptsetup (scripts/integrity-guest.sh). cryptsetup formats
//! /dev/vda with `--integrity hmac-sha256` and writes known plaintext
//! through its own mapping; then the agent's `luks2::mapping` opens it,
//! reads the plaintext back, closes it; then one byte of ciphertext is
//! flipped on the raw disk, and the agent's mapping must refuse that block
//! (an I/O error, never other bytes) and count it as tampered. It prints
//! `INTEGRITY_GUEST OK` (or `INTEGRITY_GUEST FAILED <why>`) and powers off.
//!
//! With `crust.make` on the kernel command line it only makes an image for
//! the VM test: the disk formatted so, an ext4 inside holding
//! `data/marker`, and where the ciphertext of the mapping's first block
//! lies on the raw disk (`INTEGRITY_GUEST BLOCK0 <byte>`).

use std::fmt::Display;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::process::Command;

use crust_agent::luks2::mapping;
use crust_agent::sys::dm::Control;
use zeroize::Zeroizing;

const DISK: &str = "/dev/vda";
const PASS: &[u8] = b"crust-integrity-pass";
const BLOCKS: usize = 4;

fn say(s: &str) {
    println!("INTEGRITY_GUEST {s}");
}

fn s(e: impl Display) -> String {
    e.to_string()
}

fn plaintext() -> Vec<u8> {
    (0..BLOCKS)
        .flat_map(|i| {
            format!("CRUST-INTEGRITY-BLOCK-{i} ")
                .into_bytes()
                .into_iter()
                .cycle()
                .take(4096)
        })
        .collect()
}

fn cryptsetup(args: &[&str]) -> Result<(), String> {
    let out = Command::new("/usr/sbin/cryptsetup")
        .args(args)
        .env("DM_DISABLE_UDEV", "1")
        .output()
        .map_err(|e| format!("cryptsetup: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cryptsetup {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// The raw disk from `from`, read past the page cache.
fn raw(from: u64) -> Result<Vec<u8>, String> {
    let mut f = std::fs::File::open(DISK).map_err(s)?;
    // SAFETY: a valid fd; the advice only drops clean cached pages.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let mut b = Vec::new();
    f.seek(SeekFrom::Start(from)).map_err(s)?;
    f.read_to_end(&mut b).map_err(s)?;
    Ok(b)
}

fn open_agent() -> Result<mapping::Mapping, String> {
    let disk = std::fs::File::open(DISK).map_err(s)?;
    let rdev = disk.metadata().map_err(s)?.rdev();
    let o = mapping::Open {
        disk: Path::new(DISK),
        disk_dev: (libc::major(rdev), libc::minor(rdev)),
        name: "crust-int",
        read_only: false,
        allow_discards: false,
        limits: mapping::guest_limits(256 << 20),
    };
    mapping::open(&o, &Zeroizing::new(PASS.to_vec())).map_err(s)
}

/// Reads block `i` of the agent's mapping, past the page cache.
fn block(m: &mapping::Mapping, i: usize) -> std::io::Result<Vec<u8>> {
    let f = std::fs::File::open(format!("/dev/dm-{}", m.dev.1))?;
    // SAFETY: a valid fd; the advice only drops clean cached pages.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let mut b = vec![0u8; 4096];
    f.read_exact_at(&mut b, (i * 4096) as u64)?;
    Ok(b)
}

fn format_and_fill() -> Result<(), String> {
    std::fs::write("/pass", PASS).map_err(s)?;
    std::fs::create_dir_all("/run/cryptsetup").map_err(s)?;
    cryptsetup(&[
        "luksFormat",
        "-q",
        "--type",
        "luks2",
        "--cipher",
        "aes-xts-plain64",
        "--integrity",
        "hmac-sha256",
        "--integrity-no-wipe",
        "--sector-size",
        "4096",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        "/pass",
        DISK,
    ])?;
    cryptsetup(&["open", "--key-file", "/pass", DISK, "ref"])?;
    let mut f = std::fs::File::options()
        .write(true)
        .open("/dev/mapper/ref")
        .map_err(|e| format!("/dev/mapper/ref: {e}"))?;
    f.write_all(&plaintext())
        .and_then(|()| f.sync_all())
        .map_err(s)?;
    drop(f);
    cryptsetup(&["close", "ref"])
}

fn run_program(path: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(path)
        .args(args)
        .output()
        .map_err(|e| format!("{path}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{path} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// The VM test's image: the mapping's first block located on the raw disk
/// (the last block that writing it alone changed), then ext4 with a file.
fn make() -> Result<(), String> {
    let data = 16u64 << 20;
    std::fs::write("/pass", PASS).map_err(s)?;
    std::fs::create_dir_all("/run/cryptsetup").map_err(s)?;
    cryptsetup(&[
        "luksFormat",
        "-q",
        "--type",
        "luks2",
        "--cipher",
        "aes-xts-plain64",
        "--integrity",
        "hmac-sha256",
        "--integrity-no-wipe",
        "--sector-size",
        "4096",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        "/pass",
        DISK,
    ])?;
    let before = raw(data)?;
    cryptsetup(&["open", "--key-file", "/pass", DISK, "ref"])?;
    let mut f = std::fs::File::options()
        .write(true)
        .open("/dev/mapper/ref")
        .map_err(s)?;
    f.write_all(&plaintext()[..4096])
        .and_then(|()| f.sync_all())
        .map_err(s)?;
    drop(f);
    cryptsetup(&["close", "ref"])?;
    let after = raw(data)?;
    let block0 = (0..after.len() / 4096)
        .filter(|&b| after[b * 4096..][..4096] != before[b * 4096..][..4096])
        .max()
        .ok_or("nothing changed on the disk")?;
    say(&format!("BLOCK0 {}", data + block0 as u64 * 4096));
    cryptsetup(&["open", "--key-file", "/pass", DISK, "ref"])?;
    run_program(
        "/usr/sbin/mke2fs",
        &["-q", "-F", "-t", "ext4", "/dev/mapper/ref"],
    )?;
    std::fs::create_dir_all("/mnt").map_err(s)?;
    rustix::mount::mount(
        "/dev/mapper/ref",
        "/mnt",
        "ext4",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .map_err(|e| format!("mount: {e}"))?;
    std::fs::create_dir_all("/mnt/data").map_err(s)?;
    std::fs::write("/mnt/data/marker", b"crust integrity marker").map_err(s)?;
    rustix::mount::unmount("/mnt", rustix::mount::UnmountFlags::empty())
        .map_err(|e| format!("umount: {e}"))?;
    cryptsetup(&["close", "ref"])?;
    say("MADE");
    Ok(())
}

fn run() -> Result<(), String> {
    for w in crust_agent::init::early_mounts() {
        say(&format!("mount warning: {w}"));
    }
    let modules = Path::new("/lib/modules").join(crust_agent::system::kernel_release());
    let report = crust_agent::init::load_modules(&modules, &[]);
    say(&format!("modules failed {:?}", report.failed));
    for p in [
        "/usr/sbin/cryptsetup",
        "/lib64/ld-linux-x86-64.so.2",
        "/lib/x86_64-linux-gnu/libc.so.6",
    ] {
        if !Path::new(p).exists() {
            say(&format!("{p} is missing"));
        }
    }
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    if cmdline.split_whitespace().any(|w| w == "crust.make") {
        return make();
    }
    let data = 16u64 << 20;
    let before = raw(data)?;
    format_and_fill()?;
    say("cryptsetup formatted /dev/vda with hmac-sha256 and wrote through its mapping");
    let m = open_agent()?;
    say(&format!(
        "agent opened {} ({}), integrity {:?}, {} bits",
        m.name, m.dm_uuid, m.integrity, m.key_bits
    ));
    let c = Control::open().map_err(s)?;
    let (_, lines) = c.targets("crust-int_dif", true).map_err(s)?;
    say(&format!(
        "crust-int_dif: {:?}",
        lines.first().map(|l| l.text.to_string())
    ));
    let (_, lines) = c.targets("crust-int", true).map_err(s)?;
    say(&format!(
        "crust-int: {:?}",
        lines.first().map(|l| l.text.to_string())
    ));
    let want = plaintext();
    for i in 0..BLOCKS {
        let got = block(&m, i).map_err(|e| format!("block {i}: {e}"))?;
        if got != want[i * 4096..][..4096] {
            return Err(format!(
                "block {i} reads {:?}",
                String::from_utf8_lossy(&got[..32])
            ));
        }
    }
    let t = mapping::tampered_now(&m).map_err(s)?;
    say(&format!("plaintext read back; tampered {t}"));
    if t != 0 {
        return Err(format!("{t} sectors tampered before any tampering"));
    }
    let ours = mapping::agents_mappings().map_err(s)?;
    if ours != ["crust-int"] {
        return Err(format!("the agents' mappings are {ours:?}"));
    }
    // A close cut short: the mapping removed, its _dif left. Recovery sees
    // it as the agent's, and a new open replaces it.
    c.remove("crust-int").map_err(s)?;
    let ours = mapping::agents_mappings().map_err(s)?;
    if ours != ["crust-int"] {
        return Err(format!("with only the _dif left, the agents' are {ours:?}"));
    }
    let m = open_agent().map_err(|e| format!("reopen over a stale _dif: {e}"))?;
    say(&format!(
        "reopened over a stale _dif as /dev/dm-{}",
        m.dev.1
    ));
    if !mapping::close("crust-int").map_err(s)? || !c.list().map_err(s)?.is_empty() {
        return Err("close left devices".into());
    }
    flip_and_reopen(data, &before)
}

/// Flips one bit of the last plaintext block's ciphertext on the raw disk;
/// the agent's mapping must refuse that block and count it.
fn flip_and_reopen(data: u64, before: &[u8]) -> Result<(), String> {
    let want = plaintext();
    // The last 4 KiB block that changed is the last plaintext block's
    // ciphertext (the journal and the tags lie before it).
    let after = raw(data)?;
    let changed = (0..after.len() / 4096)
        .filter(|&b| after[b * 4096..][..4096] != before[b * 4096..][..4096])
        .max()
        .ok_or("nothing changed on the disk")?;
    let at = data + changed as u64 * 4096 + 100;
    let disk = std::fs::File::options().write(true).open(DISK).map_err(s)?;
    disk.write_all_at(&[after[changed * 4096 + 100] ^ 0x01], at)
        .and_then(|()| disk.sync_all())
        .map_err(s)?;
    say(&format!("flipped one bit at byte {at}"));
    let m = open_agent()?;
    let good = block(&m, 0).map_err(|e| format!("block 0 after the flip: {e}"))?;
    if good != want[..4096] {
        return Err("block 0 changed".into());
    }
    let bad = (0..BLOCKS)
        .map(|i| (i, block(&m, i)))
        .find(|(_, r)| r.is_err());
    let Some((i, Err(e))) = bad else {
        return Err("every block still reads after the flip: tampering went unseen".into());
    };
    say(&format!(
        "block {i} refused: {e} (errno {:?})",
        e.raw_os_error()
    ));
    let t = mapping::tampered_now(&m).map_err(s)?;
    say(&format!("tampered {t}"));
    if t == 0 {
        return Err("the agent counts no tampered sector".into());
    }
    mapping::close("crust-int").map_err(s)?;
    Ok(())
}

fn main() {
    match run() {
        Ok(()) => say("OK"),
        Err(e) => say(&format!("FAILED {e}")),
    }
    crust_agent::init::power_off();
}

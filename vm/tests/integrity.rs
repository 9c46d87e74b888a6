//! A LUKS2 volume with integrity (`cryptsetup luksFormat --integrity
//! hmac-sha256`) in a real QEMU guest. The host has no device-mapper, so
//! the image is made in a guest of its own first (scripts/integrity-guest.sh
//! with INTEGRITY_GUEST_MAKE: the host's cryptsetup and mke2fs in its
//! initrd, ext4 inside). Then the agent publishes it with its key: the list
//! says hmac(sha256) and a 768-bit key, health has nothing to say, and an
//! unpublish removes the mapping and its dm-integrity device, so the disk
//! publishes again. Then the host flips one byte of the ext4 superblock's
//! ciphertext: the publish fails with an I/O error, never reads other
//! bytes, the guest's kernel says it refused the block, and the publish's
//! error and the volume's health say DATA_LOSS.
//!
//! And a volume the agent makes with integrity (`format_if_blank`,
//! `integrity: hmac-sha256`): a blank disk formatted in the guest, wiped
//! through its mapping, ext4 made inside, its root given a group in the
//! guest and read back there after an unpublish; on the host cryptsetup
//! dumps it (hmac(sha256), a 768-bit key) and takes its passphrase, its
//! dm-integrity superblock is the one cryptsetup's format leaves on a disk
//! of its size, and a flipped byte of its first block is refused in the
//! guest as DATA_LOSS.
//! Run with `make test` (these tests need `make initrd` output and root).

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::protobuf::MessageField;
use crust_testkit::agent::{code, message, serial_publish_req, unpublish_req};
use crust_testkit::vm::{boot, console, ctx};

/// The probe's passphrase (examples/integrity_guest.rs).
const PASS: &[u8] = b"crust-integrity-pass";

fn encrypted_req(id: &str, serial: &str) -> pb::PublishVolumeRequest {
    let mut r = serial_publish_req(id, serial, "ext4", None);
    let mut e = pb::Encryption::new();
    e.kind = pb::encryption::Kind::LUKS2.into();
    e.set_passphrase(PASS.to_vec());
    r.encryption = MessageField::some(e);
    r
}

/// The image the probe makes, and the byte where the ciphertext of the
/// mapping's first block lies in it.
fn made_in_a_guest(dir: &Path) -> (std::path::PathBuf, u64) {
    let img = dir.join("int.img");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("sh")
        .arg(repo.join("scripts/integrity-guest.sh"))
        .env("INTEGRITY_GUEST_MAKE", &img)
        .current_dir(&repo)
        .output()
        .expect("sh runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the image is made in a guest: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let block0 = text
        .lines()
        .find_map(|l| l.strip_prefix("INTEGRITY_GUEST BLOCK0 "))
        .and_then(|n| n.trim().parse().ok())
        .expect("the probe says where block 0 lies");
    (img, block0)
}

fn health(c: &AgentClient, id: &str) -> Vec<pb::VolumeHealth> {
    let mut h = pb::GetVolumeHealthRequest::new();
    h.volume_id = id.into();
    c.get_volume_health(ctx(), &h).unwrap().health
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_cryptsetup_integrity_volume_opens_and_a_flipped_byte_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (img, block0) = made_in_a_guest(tmp.path());
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    vm.hotplug(&img, "ser-i", false).unwrap();

    let out = c
        .publish_volume(ctx(), &encrypted_req("vol-i", "ser-i"))
        .unwrap();
    assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    let info = l.volumes.iter().find(|v| v.volume_id == "vol-i").unwrap();
    let e = info.encryption.as_ref().unwrap();
    assert_eq!(
        (e.cipher.as_str(), e.key_bits, e.integrity.as_str()),
        ("aes-xts-plain64", 768, "hmac(sha256)")
    );
    assert!(health(&c, "vol-i").is_empty(), "{:?}", health(&c, "vol-i"));
    c.unpublish_volume(ctx(), &unpublish_req("vol-i")).unwrap();
    // Both devices are gone: the same disk publishes again.
    c.publish_volume(ctx(), &encrypted_req("vol-i", "ser-i"))
        .unwrap();
    c.unpublish_volume(ctx(), &unpublish_req("vol-i")).unwrap();
    vm.unplug("ser-i").unwrap();

    // One byte of the ext4 superblock's ciphertext (byte 1024 of block 0).
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, block0 + 1100).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], block0 + 1100).unwrap();
    f.sync_all().unwrap();
    drop(f);
    vm.hotplug(&img, "ser-i", false).unwrap();
    let r = c.publish_volume(ctx(), &encrypted_req("vol-i", "ser-i"));
    assert!(r.is_err(), "a tampered superblock published: {r:?}");
    let why = message(r.clone());
    eprintln!("publish of the tampered disk: {why}");
    assert_eq!(code(r), "DATA_LOSS", "{why}");
    assert!(
        why.contains("Input/output error") && why.contains("authentication tag"),
        "{why}"
    );
    let said = console(&vm);
    assert!(said.contains("INTEGRITY AEAD ERROR"), "{said}");
    let h = health(&c, "vol-i");
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(
        (h[0].status.enum_value(), h[0].reason.as_str()),
        (
            Ok(pb::volume_health::Status::DATA_LOSS),
            "IntegrityMismatches"
        ),
        "{h:?}"
    );
    vm.down().unwrap();
}

/// A publish asking a blank disk `serial` be made a volume with integrity.
fn made_with_integrity_req(id: &str, serial: &str) -> pb::PublishVolumeRequest {
    let mut r = encrypted_req(id, serial);
    let e = r.encryption.as_mut().unwrap();
    e.format_if_blank = true;
    e.integrity = "hmac-sha256".into();
    r
}

/// What cryptsetup 2.6.1's `luksFormat --integrity hmac-sha256
/// --sector-size 4096` left at byte 16 MiB of a 64 MiB disk under this
/// guest kernel (scripts/integrity-guest.sh): version 4, 2^15 sectors
/// between tag areas, 32-byte tags, 3 journal sections, 96,736 sectors
/// provided, fix_padding, 4096-byte blocks.
const CRYPTSETUPS_SUPERBLOCK: Fields = (4, 15, 32, 3, 96_736, 8, 3);

/// A superblock's version, log2 interleave sectors, tag size, journal
/// sections, provided sectors, flags and log2 sectors per block.
type Fields = (u8, u8, u16, u32, u64, u32, u8);

/// The superblock at 16 MiB of `img` as [`CRYPTSETUPS_SUPERBLOCK`]'s
/// fields, and the byte where the ciphertext of the mapping's first block
/// lies, from dm-integrity's layout (Linux 6.1, no journal MAC,
/// fix_padding): the superblock's 8 sectors, each journal section's
/// entries (a 4 KiB block and its tag, 112 bytes an entry, 4 a 512-byte
/// sector, 32 a section) and their 8 commit sectors, then the first tag
/// area (a tag per block of the 2^15 sectors that follow, padded to 4 KiB).
fn superblock_and_block0(img: &Path) -> (Fields, u64) {
    let f = std::fs::File::open(img).unwrap();
    let mut b = [0u8; 64];
    f.read_exact_at(&mut b, 16 << 20).unwrap();
    assert_eq!(&b[..8], b"integrt\0", "no dm-integrity superblock");
    let le32 = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let sb = (
        b[8],
        b[9],
        u16::from_le_bytes([b[10], b[11]]),
        le32(12),
        u64::from_le_bytes(b[16..24].try_into().unwrap()),
        le32(24),
        b[28],
    );
    let (_, interleave, tag, sections, _, _, log2_block) = sb;
    let section_sectors = (32u64 << log2_block) + 8;
    let tag_area = (u64::from(tag) << (interleave - log2_block)).div_ceil(4096) * 8;
    let sectors = 8 + section_sectors * u64::from(sections) + tag_area;
    (sb, (16 << 20) + sectors * 512)
}

/// The host's reading of the volume the agent made on `img`: cryptsetup
/// dumps it as made with integrity, finished, and takes its passphrase.
fn cryptsetup_reads(img: &Path, dir: &Path) {
    let dump = crust_testkit::luks::dump(img);
    for want in [
        "integrity: hmac(sha256)",
        "Key:        768 bits",
        "Cipher key: 512 bits",
        "sector: 4096 [bytes]",
        "Area length:385024 [bytes]",
    ] {
        assert!(dump.contains(want), "{want} not in\n{dump}");
    }
    assert!(
        !dump.contains("crust-unfinished") && !dump.contains("crust-wiped"),
        "{dump}"
    );
    let pass = dir.join("pass");
    std::fs::write(&pass, PASS).unwrap();
    assert!(crust_testkit::luks::opens(img, &pass));
    std::fs::write(&pass, b"another").unwrap();
    assert!(!crust_testkit::luks::opens(img, &pass));
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_volume_made_with_integrity_in_the_guest_keeps_its_writes_and_refuses_a_flip() {
    let tmp = tempfile::tempdir().unwrap();
    let img = crust_testkit::vm::blank(tmp.path(), "made.img", 64);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    vm.hotplug(&img, "ser-m", false).unwrap();
    let mut r = made_with_integrity_req("vol-m", "ser-m");
    r.fs_group = crust_testkit::agent::fs_group(4321, pb::FsGroupChangePolicy::ALWAYS);
    let t = std::time::Instant::now();
    let out = c.publish_volume(ctx(), &r).unwrap();
    eprintln!(
        "a 64 MiB blank disk made LUKS2 with integrity, wiped and published in {:?}",
        t.elapsed()
    );
    assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
    let said = console(&vm);
    let wiped = said
        .lines()
        .find(|l| l.contains("wiped through its integrity"));
    eprintln!("the guest: {}", wiped.expect("the wipe is logged"));
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    let e = l.volumes[0].encryption.as_ref().unwrap();
    assert_eq!(
        (e.cipher.as_str(), e.key_bits, e.integrity.as_str()),
        ("aes-xts-plain64", 768, "hmac(sha256)")
    );
    assert!(health(&c, "vol-m").is_empty(), "{:?}", health(&c, "vol-m"));
    c.unpublish_volume(ctx(), &unpublish_req("vol-m")).unwrap();
    // Published again: the group the guest gave the root is read back
    // through the tags, so OnRootMismatch has nothing to walk.
    r.fs_group = crust_testkit::agent::fs_group(4321, pb::FsGroupChangePolicy::ON_ROOT_MISMATCH);
    let again = c.publish_volume(ctx(), &r).unwrap();
    assert!(!again.already_published);
    assert!(again.ownership.skipped, "{again:?}");
    c.unpublish_volume(ctx(), &unpublish_req("vol-m")).unwrap();
    vm.unplug("ser-m").unwrap();

    cryptsetup_reads(&img, tmp.path());
    let (sb, block0) = superblock_and_block0(&img);
    assert_eq!(sb, CRYPTSETUPS_SUPERBLOCK);
    // One byte of the ext4 superblock's ciphertext (byte 1024 of block 0).
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, block0 + 1100).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], block0 + 1100).unwrap();
    f.sync_all().unwrap();
    drop(f);
    vm.hotplug(&img, "ser-m", false).unwrap();
    let r = c.publish_volume(ctx(), &made_with_integrity_req("vol-m", "ser-m"));
    let why = message(r.clone());
    assert_eq!(code(r), "DATA_LOSS", "{why}");
    let h = health(&c, "vol-m");
    assert_eq!(
        h.first()
            .map(|h| (h.status.enum_value(), h.reason.as_str())),
        Some((
            Ok(pb::volume_health::Status::DATA_LOSS),
            "IntegrityMismatches"
        )),
        "{h:?}"
    );
    vm.down().unwrap();
}

/// How far the wipe of the volume on `img` has gone, as its header's
/// subsystem field says (cryptsetup's luksDump shows it).
fn wiped_so_far(img: &Path) -> Option<u64> {
    let dump = crust_testkit::luks::dump(img);
    let at = dump.find("crust-wiped:")?;
    let digits: String = dump[at + 12..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// A publish whose deadline passes mid-wipe (a 1 GiB disk wipes for
/// longer than its 10 s) stops there, leaves no mapping and records how far
/// it went in the header; the next publish goes on from there.
#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_publish_stopped_mid_wipe_goes_on_from_where_it_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let img = crust_testkit::vm::blank(tmp.path(), "big.img", 1024);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    vm.hotplug(&img, "ser-w", false).unwrap();
    let r = made_with_integrity_req("vol-w", "ser-w");
    let short = crust_vm::ctx(std::time::Duration::from_secs(10));
    let stopped = c.publish_volume(short, &r);
    assert!(stopped.is_err(), "{stopped:?}");
    let said = crust_testkit::vm::console_until(&vm, std::time::Duration::from_secs(60), |t| {
        t.contains("deadline passed while wiping the new volume's sectors")
    })
    .unwrap_or_else(|t| panic!("no stopped wipe in {}", crust_testkit::vm::tail(&t, 4000)));
    assert!(!said.contains("wiped through its integrity"));
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert!(l.volumes.is_empty(), "{l:?}");
    let dump = crust_testkit::luks::dump(&img);
    assert!(dump.contains("crust-unfinished"), "{dump}");
    let reached = wiped_so_far(&img).unwrap_or_else(|| panic!("no progress in\n{dump}"));
    eprintln!("stopped at its deadline having wiped {reached} bytes");
    assert!(reached > 0 && reached < 1000 << 20, "{reached}");
    let long = crust_vm::ctx(std::time::Duration::from_secs(600));
    let t = std::time::Instant::now();
    c.publish_volume(long, &r).unwrap();
    eprintln!("the next publish finished in {:?}", t.elapsed());
    let said = console(&vm);
    let line = said
        .lines()
        .find(|l| l.contains("wiped through its integrity"))
        .expect("the wipe is logged");
    eprintln!("the guest: {line}");
    assert!(line.contains(&format!("from={reached} ")), "{line}");
    c.unpublish_volume(ctx(), &unpublish_req("vol-w")).unwrap();
    vm.down().unwrap();
    let dump = crust_testkit::luks::dump(&img);
    assert!(
        !dump.contains("crust-unfinished") && wiped_so_far(&img).is_none(),
        "{dump}"
    );
}

/// The least disk a volume with integrity is made on, 20 MiB (the header's
/// 16 and 4 for dm-integrity's journal and tags), is one the kernel takes,
/// as a block volume (wiped, with no filesystem); 1 MiB less is refused
/// before a byte is written.
#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn the_least_disk_made_with_integrity_is_20_mib() {
    let tmp = tempfile::tempdir().unwrap();
    let least = crust_testkit::vm::blank(tmp.path(), "least.img", 20);
    let less = crust_testkit::vm::blank(tmp.path(), "less.img", 19);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    vm.hotplug(&least, "ser-l", false).unwrap();
    vm.hotplug(&less, "ser-s", false).unwrap();
    let block = |id: &str, serial: &str| {
        let mut r = made_with_integrity_req(id, serial);
        r.fs_type = String::new();
        r.volume_mode = pb::VolumeMode::BLOCK.into();
        c.publish_volume(ctx(), &r)
    };
    let out = block("vol-l", "ser-l").unwrap();
    assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
    let refused = block("vol-s", "ser-s");
    let why = message(refused.clone());
    assert_eq!(code(refused), "FAILED_PRECONDITION", "{why}");
    assert!(why.contains("20971520 bytes in all"), "{why}");
    c.unpublish_volume(ctx(), &unpublish_req("vol-l")).unwrap();
    vm.down().unwrap();
    assert!(crust_testkit::allocated(&less) == 0, "a byte was written");
    let dump = crust_testkit::luks::dump(&least);
    assert!(dump.contains("integrity: hmac(sha256)"), "{dump}");
    assert!(!dump.contains("crust-unfinished"), "{dump}");
}

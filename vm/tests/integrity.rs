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

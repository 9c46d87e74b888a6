//! Encrypted volumes in a real QEMU guest: LUKS2 disks that cryptsetup made
//! on the host (PBKDF2 and Argon2id, ext4 and xfs, 512- and 4096-byte
//! sectors) hot-plugged and published with their key; a wrong key refused
//! with nothing left open; fsGroup, stats, online growth, freeze and a raw
//! block volume through the mapping; trim refused without allow_discards;
//! then the images read back on the host by cryptsetup's own key and an
//! independent AES-XTS: the files are there, the filesystems clean, and no
//! plaintext lies in the images.
//! Run with `make test` (these tests need `make initrd` output and root).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Instant;

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::protobuf::MessageField;
use crust_protocols::ttrpc;
use crust_testkit::agent::{code, message, serial_publish_req, unpublish_req};
use crust_testkit::luks::{self, Kdf};
use crust_testkit::run;
use crust_testkit::vm::{boot, ctx};

const PASS: &[u8] = b"a passphrase the host keeps in a file";
const MARK: &[u8] = b"plaintext-marker-0f1e2d3c4b5a";

/// A publish of the disk `serial` as encrypted volume `id` with `pass`.
fn encrypted_req(id: &str, serial: &str, fs: &str, pass: &[u8]) -> pb::PublishVolumeRequest {
    let mut r = serial_publish_req(id, serial, fs, None);
    let mut e = pb::Encryption::new();
    e.kind = pb::encryption::Kind::LUKS2.into();
    e.set_passphrase(pass.to_vec());
    r.encryption = MessageField::some(e);
    r
}

fn publish(
    c: &AgentClient,
    r: &pb::PublishVolumeRequest,
) -> ttrpc::Result<pb::PublishVolumeResponse> {
    c.publish_volume(ctx(), r)
}

fn listed(c: &AgentClient, id: &str) -> Option<pb::VolumeInfo> {
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    l.volumes.into_iter().find(|v| v.volume_id == id)
}

fn bytes_total(c: &AgentClient, id: &str) -> i64 {
    let s = crust_testkit::vm::stats(c, id).unwrap();
    assert!(!s.condition.abnormal, "{:?}", s.condition);
    s.usage
        .iter()
        .find(|u| u.unit.enum_value() == Ok(pb::volume_usage::Unit::BYTES))
        .unwrap()
        .total
}

/// An ext4 image of `mib` MiB with [`fill`]'s files, made LUKS2 by
/// cryptsetup with PBKDF2 (1,000 iterations) and 512-byte sectors.
fn pbkdf2_ext4(dir: &Path, name: &str, mib: u64, pass: &Path) -> std::path::PathBuf {
    luks::luks_image(dir, name, "ext4", mib, (Kdf::Pbkdf2(1000), 512), pass, fill)
}

/// The file `dir/pass` holding [`PASS`], as cryptsetup's --key-file reads it.
fn pass_file(dir: &Path) -> std::path::PathBuf {
    let pass = dir.join("pass");
    std::fs::write(&pass, PASS).unwrap();
    pass
}

/// The file `dir/other` holding a passphrase one byte short of [`PASS`].
fn other_pass_file(dir: &Path) -> std::path::PathBuf {
    let other = dir.join("other");
    std::fs::write(&other, &PASS[..PASS.len() - 1]).unwrap();
    other
}

/// Writes the files every image starts with: a marker a plaintext scan looks
/// for, owned by 1234.
fn fill(m: &Path) {
    std::fs::create_dir_all(m.join("data")).unwrap();
    let text: Vec<u8> = MARK.repeat(64);
    std::fs::write(m.join("data/marker"), &text).unwrap();
    run(
        "chown",
        &["-R", "1234:1234", m.join("data").to_str().unwrap()],
    );
}

/// Mounts the plaintext of `img` read-only on the host: (gid, mode) of `rel`.
fn owner_in_plaintext(plain: &Path, fs: &str, rel: &str) -> (u32, u32) {
    match fs {
        "ext4" => run("e2fsck", &["-f", "-n", plain.to_str().unwrap()]),
        _ => run("xfs_repair", &["-n", "-f", plain.to_str().unwrap()]),
    };
    let m = plain.with_extension("check");
    std::fs::create_dir_all(&m).unwrap();
    run(
        "mount",
        &[
            "-o",
            "loop,ro",
            plain.to_str().unwrap(),
            m.to_str().unwrap(),
        ],
    );
    let md = std::fs::symlink_metadata(m.join(rel));
    let content = std::fs::read(m.join("data/marker"));
    run("umount", &[m.to_str().unwrap()]);
    assert_eq!(
        content.unwrap(),
        MARK.repeat(64),
        "the file reads back as written"
    );
    let md = md.unwrap();
    (md.gid(), md.mode() & 0o7777)
}

/// On the host: cryptsetup still opens each image; its plaintext, decrypted
/// apart from the agent, holds a clean filesystem with the files and the
/// fsGroup (4321 on ext4, published with one); the images hold no plaintext.
fn checked_on_host(images: &[(&Path, &str)], pass: &Path) {
    for &(img, fs) in images {
        assert!(luks::opens(img, pass), "{fs}");
        assert!(!luks::contains(img, MARK), "{fs}: plaintext in the image");
        let plain = luks::plaintext(img, pass);
        let (gid, _) = owner_in_plaintext(&plain, fs, "data/marker");
        assert_eq!(gid, if fs == "ext4" { 4321 } else { 1234 }, "{fs}");
    }
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn cryptsetup_made_volumes_in_a_real_guest() {
    let tmp = tempfile::tempdir().unwrap();
    let pass = pass_file(tmp.path());
    let ext4 = pbkdf2_ext4(tmp.path(), "e.img", 96, &pass);
    let argon = Kdf::Argon2id {
        memory_kib: 65536,
        passes: 4,
        lanes: 2,
    };
    let xfs = luks::luks_image(tmp.path(), "x.img", "xfs", 336, (argon, 4096), &pass, fill);
    for img in [&ext4, &xfs] {
        assert!(
            !luks::contains(img, MARK),
            "cryptsetup left plaintext in {}",
            img.display()
        );
    }
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    vm.hotplug(&ext4, "ser-e", false).unwrap();
    vm.hotplug(&xfs, "ser-x", false).unwrap();

    // A wrong key: PERMISSION_DENIED naming no key, and nothing left open,
    // so the right key opens the same disk at once.
    let wrong = publish(&c, &encrypted_req("vol-e", "ser-e", "ext4", b"not it"));
    assert_eq!(code(wrong.clone()), "PERMISSION_DENIED", "{wrong:?}");
    assert!(!message(wrong).contains("not it"));
    assert!(listed(&c, "vol-e").is_none());

    // ext4, PBKDF2, with an fsGroup.
    let mut r = encrypted_req("vol-e", "ser-e", "ext4", PASS);
    r.fs_group = crust_testkit::agent::fs_group(4321, pb::FsGroupChangePolicy::ALWAYS);
    let t = Instant::now();
    let out = publish(&c, &r).unwrap();
    eprintln!("encrypted ext4 (PBKDF2) published in {:?}", t.elapsed());
    assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
    assert!(out.ownership.visited >= 2, "{out:?}");
    assert!(publish(&c, &r).unwrap().already_published);
    // The same volume asked with other encryption settings is a conflict.
    let mut other = r.clone();
    other.encryption.as_mut().unwrap().allow_discards = true;
    assert_eq!(code(publish(&c, &other)), "ALREADY_EXISTS");

    // xfs, Argon2id, 4096-byte sectors.
    let t = Instant::now();
    let out = publish(&c, &encrypted_req("vol-x", "ser-x", "xfs", PASS)).unwrap();
    eprintln!(
        "encrypted xfs (Argon2id 64 MiB) published in {:?}",
        t.elapsed()
    );
    assert!(out.device.starts_with("/dev/dm-"), "{out:?}");

    let info = listed(&c, "vol-e").unwrap();
    let e = info
        .encryption
        .as_ref()
        .expect("the list says it is encrypted");
    assert_eq!(
        (e.kind.as_str(), e.cipher.as_str(), e.key_bits),
        ("luks2", "aes-xts-plain64", 512)
    );
    // Named for the volume, tagged with the agent's owner.
    assert!(e.mapping.starts_with("crust-vol-e@"), "{}", e.mapping);
    assert_eq!(info.serial, "ser-e");
    assert!(!e.allow_discards && e.integrity.is_empty());

    // Trim is refused without allow_discards, and says why.
    let mut t = pb::TrimVolumeRequest::new();
    t.volume_id = "vol-e".into();
    let trimmed = c.trim_volume(ctx(), &t);
    assert_eq!(code(trimmed.clone()), "FAILED_PRECONDITION");
    assert!(message(trimmed).contains("allow_discards"));

    // Online growth through the mapping: the disk, then the mapping, then ext4.
    let before = bytes_total(&c, "vol-e");
    vm.resize("ser-e", 256 << 20).unwrap();
    let mut x = pb::ExpandVolumeRequest::new();
    x.volume_id = "vol-e".into();
    x.required_bytes = 256 << 20;
    x.timeout_ms = 30_000;
    let grown = c.expand_volume(ctx(), &x).unwrap();
    assert!(grown.capacity_bytes > 200 << 20, "{grown:?}");
    assert!(bytes_total(&c, "vol-e") > 2 * before);

    // Freeze and thaw by id.
    let mut f = pb::FreezeVolumesRequest::new();
    f.volume_ids = vec!["vol-e".into(), "vol-x".into()];
    f.timeout_ms = 60_000;
    let frozen = c.freeze_volumes(ctx(), &f).unwrap();
    let mut th = pb::ThawVolumesRequest::new();
    th.freeze_id = frozen.freeze_id.clone();
    c.thaw_volumes(ctx(), &th).unwrap();

    // Unpublish removes the mapping: the disk opens again under the same id.
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("vol-x"))
            .unwrap()
            .was_published
    );
    publish(&c, &encrypted_req("vol-x", "ser-x", "xfs", PASS)).unwrap();

    let how = vm.down().unwrap();
    assert!(how.contains("2 volumes unmounted"), "{how}");

    checked_on_host(&[(&ext4, "ext4"), (&xfs, "xfs")], &pass);
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn an_encrypted_raw_block_volume_binds_its_mapping() {
    let tmp = tempfile::tempdir().unwrap();
    let pass = pass_file(tmp.path());
    let img = pbkdf2_ext4(tmp.path(), "b.img", 64, &pass);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    let caps = c
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap()
        .capabilities;
    assert!(caps.contains(&pb::Capability::CAPABILITY_ENCRYPTION_LUKS2.into()));
    vm.hotplug(&img, "ser-b", false).unwrap();
    let mut r = encrypted_req("vol-b", "ser-b", "", PASS);
    r.volume_mode = pb::VolumeMode::BLOCK.into();
    let out = publish(&c, &r).unwrap();
    assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
    let info = listed(&c, "vol-b").unwrap();
    assert!(info.encryption.is_some());
    // The mapping's size: the disk less the LUKS2 header.
    assert_eq!(info.device_bytes, (64 - 8) << 20, "{info:?}");
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("vol-b"))
            .unwrap()
            .was_published
    );
    vm.down().unwrap();
    assert!(luks::opens(&img, &pass));
}

/// Blank disks made LUKS2 volumes in the guest (ext4 and xfs inside), read
/// on the host by cryptsetup; a plain ext4 with format_if_blank left byte
/// for byte; a keyslot asking for more memory than the guest has refused
/// at once, naming the cost and the limit.
#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn volumes_made_in_the_guest_open_with_cryptsetup_on_the_host() {
    let tmp = tempfile::tempdir().unwrap();
    let pass = pass_file(tmp.path());
    let blank_e = crust_testkit::vm::blank(tmp.path(), "be.img", 96);
    let blank_x = crust_testkit::vm::blank(tmp.path(), "bx.img", 336);
    let plain = crust_testkit::vm::image(tmp.path(), "plain.img", "ext4", 64, fill);
    let plain_before = std::fs::read(&plain).unwrap();
    let greedy = Kdf::Argon2id {
        memory_kib: 1 << 20,
        passes: 4,
        lanes: 4,
    };
    let hungry = luks::luks_image(tmp.path(), "g.img", "ext4", 64, (greedy, 512), &pass, fill);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    for (img, serial) in [
        (&blank_e, "ser-be"),
        (&blank_x, "ser-bx"),
        (&plain, "ser-p"),
        (&hungry, "ser-g"),
    ] {
        vm.hotplug(img, serial, false).unwrap();
    }
    for (id, serial, fs) in [("vol-be", "ser-be", "ext4"), ("vol-bx", "ser-bx", "xfs")] {
        let mut r = encrypted_req(id, serial, fs, PASS);
        r.encryption.as_mut().unwrap().format_if_blank = true;
        r.fs_group = crust_testkit::agent::fs_group(4321, pb::FsGroupChangePolicy::ALWAYS);
        let t = Instant::now();
        let out = publish(&c, &r).unwrap();
        eprintln!(
            "{fs}: blank disk made LUKS2 and published in {:?}",
            t.elapsed()
        );
        assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
        assert!(
            c.unpublish_volume(ctx(), &unpublish_req(id))
                .unwrap()
                .was_published
        );
        // Published again: opened as it is, not made again.
        r.fs_group = MessageField::none();
        assert!(!publish(&c, &r).unwrap().already_published);
    }
    // A plain ext4 asked to be formatted if blank: refused, named.
    let mut r = encrypted_req("vol-p", "ser-p", "ext4", PASS);
    r.encryption.as_mut().unwrap().format_if_blank = true;
    let refused = publish(&c, &r);
    assert_eq!(code(refused.clone()), "FAILED_PRECONDITION");
    assert!(message(refused).contains("ext2/3/4"));
    // 1 GiB of Argon2 memory in a 512 MiB guest: refused before any work.
    let t = Instant::now();
    let refused = publish(&c, &encrypted_req("vol-g", "ser-g", "ext4", PASS));
    let took = t.elapsed();
    assert_eq!(code(refused.clone()), "FAILED_PRECONDITION");
    let said = message(refused);
    assert!(said.contains("1048576 KiB"), "{said}");
    eprintln!("a 1 GiB Argon2 keyslot refused in {took:?}: {said}");
    assert!(listed(&c, "vol-g").is_none() && listed(&c, "vol-p").is_none());
    let how = vm.down().unwrap();
    assert!(how.contains("2 volumes unmounted"), "{how}");

    assert!(
        std::fs::read(&plain).unwrap() == plain_before,
        "not a byte written to the plain ext4"
    );
    for (img, fs) in [(&blank_e, "ext4"), (&blank_x, "xfs")] {
        let dump = luks::dump(img);
        for want in ["aes-xts-plain64", "512 bits", "argon2id"] {
            assert!(dump.contains(want), "{fs}: {want} not in\n{dump}");
        }
        assert!(!dump.contains("crust-unfinished"), "{fs}: {dump}");
        assert!(luks::opens(img, &pass), "{fs}");
        assert!(
            !luks::opens(img, &other_pass_file(tmp.path())),
            "{fs}: another passphrase opens it"
        );
        let plain = luks::plaintext(img, &pass);
        match fs {
            "ext4" => run("e2fsck", &["-f", "-n", plain.to_str().unwrap()]),
            _ => run("xfs_repair", &["-n", "-f", plain.to_str().unwrap()]),
        };
        assert!(
            !luks::contains(img, b"lost+found"),
            "{fs}: plaintext in the image"
        );
        let m = plain.with_extension("check");
        std::fs::create_dir_all(&m).unwrap();
        run(
            "mount",
            &[
                "-o",
                "loop,ro",
                plain.to_str().unwrap(),
                m.to_str().unwrap(),
            ],
        );
        let gid = std::fs::metadata(&m).map(|md| md.gid());
        run("umount", &[m.to_str().unwrap()]);
        assert_eq!(
            gid.unwrap(),
            4321,
            "{fs}: the fsGroup walked the new filesystem"
        );
    }
}

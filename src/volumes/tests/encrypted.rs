//! Encrypted volumes through the table, on the fake kernel: the mapping is
//! what is mounted and claimed behind the disk, a failed publish leaves no
//! mapping, an unpublish removes it last, a restart adopts it without a
//! key and removes one no record explains, trim waits for allow_discards,
//! and the record and the list hold no key.

use zeroize::Zeroizing;

use super::testkit::{bind, fake_table, mapping_name, reopen, request};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::keys::source::KeySource;
use crate::luks2::format::Mac;
use crate::model::FsType;
use crate::validate::STATE_DIR;
use crate::volumes::fake::Call;
use crate::volumes::request::{Encryption, PublishRequest};

const PASS: &[u8] = b"correct horse battery staple";

/// A publish of `disk` as encrypted ext4 volume `id` with `pass`.
fn encrypted(id: &str, disk: &crate::model::Device, pass: &[u8], discards: bool) -> PublishRequest {
    let mut r = request(id, disk, false, false);
    r.spec.encryption = Some(Encryption {
        allow_discards: discards,
        format_if_blank: false,
        integrity: None,
    });
    r.key = Some(KeySource::Passphrase(Zeroizing::new(pass.to_vec())));
    r
}

#[test]
fn an_encrypted_volume_mounts_its_mapping_and_unpublish_removes_it_after_the_unmount() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.luks_disk(dir.path(), "fkc", PASS, Some(FsType::Ext4));
    fake.journal(&root);
    let out = v
        .publish(&encrypted("e", &d, PASS, false), &Cancel::never())
        .unwrap();
    assert!(
        out.device.to_string_lossy().starts_with("/dev/dm-"),
        "{:?}",
        out.device
    );
    let name = mapping_name(&root, "e");
    assert!(name.starts_with("crust-e@"), "{name}");
    assert_eq!(fake.mappings(), [name.as_str()]);
    let listed = v.list();
    let info = listed[0].encryption.as_ref().unwrap();
    assert_eq!(
        (info.kind, info.mapping.as_str(), info.key_bits),
        ("luks2", name.as_str(), 512)
    );
    assert_eq!(
        listed[0].serial, "fkc",
        "the serial is the disk's, not the mapping's"
    );
    let record = std::fs::read(root.join(STATE_DIR).join("e.vol")).unwrap();
    assert!(
        !record.windows(PASS.len()).any(|w| w == PASS),
        "the record holds no key"
    );
    assert!(String::from_utf8_lossy(&record).contains(&format!("mapping={name}\t")));

    // A second volume on the same disk is refused by the disk's claim.
    let again = v.publish(&encrypted("f", &d, PASS, false), &Cancel::never());
    assert_eq!(again.unwrap_err().code(), Code::FailedPrecondition);
    assert_eq!(fake.mappings(), [name.as_str()]);

    assert!(v.unpublish("e", &Cancel::never()).unwrap());
    let journal = fake.journal(&root);
    let umount = journal
        .iter()
        .position(|j| j == "umount volumes/a" || j.starts_with("umount volumes/e"));
    let unmap = journal.iter().position(|j| *j == format!("unmap {name}"));
    assert!(umount.unwrap() < unmap.unwrap(), "{journal:?}");
    assert!(fake.mappings().is_empty());
}

#[test]
fn a_wrong_key_is_permission_denied_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.luks_disk(dir.path(), "fkc", PASS, Some(FsType::Ext4));
    let e = v
        .publish(&encrypted("e", &d, b"wrong", false), &Cancel::never())
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(!e.to_string().contains("wrong"), "{e}");
    assert!(fake.mappings().is_empty() && fake.mounts().is_empty());
    assert!(!root.join(STATE_DIR).join("e.vol").exists());
    assert!(!root.join("volumes/e").exists());
    // The disk is free again: the right key opens it.
    v.publish(&encrypted("e", &d, PASS, false), &Cancel::never())
        .unwrap();
}

#[test]
fn a_publish_that_fails_after_the_mapping_removes_it() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    // xfs asked, ext4 inside: refused after the mapping was made.
    let d = fake.luks_disk(dir.path(), "fkc", PASS, Some(FsType::Ext4));
    let mut r = encrypted("e", &d, PASS, false);
    r.spec.mode = crate::model::VolumeMode::Filesystem(FsType::Xfs);
    assert!(v.publish(&r, &Cancel::never()).is_err());
    assert!(fake.mappings().is_empty());
}

#[test]
fn a_restart_adopts_a_mapping_without_a_key_and_removes_one_no_record_explains() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.luks_disk(dir.path(), "fkc", PASS, Some(FsType::Ext4));
    v.publish(&encrypted("e", &d, PASS, false), &Cancel::never())
        .unwrap();
    bind(&v, "e", "pods/p/e").unwrap();
    // A mapping of the agent's that no record names (a publish killed
    // between the mapping and the record).
    let stray = fake.luks_disk(dir.path(), "fkd", PASS, Some(FsType::Ext4));
    let root = v.root().to_path_buf();
    use crate::volumes::kernel::Kernel;
    let key = Zeroizing::new(PASS.to_vec());
    fake.open_mapping(&stray, &mapping_name(&root, "stray"), false, &key)
        .unwrap();
    drop(v);
    let v = reopen(dir.path(), &fake);
    let name = mapping_name(&root, "e");
    assert_eq!(fake.mappings(), [name.as_str()]);
    let listed = v.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].encryption.as_ref().unwrap().mapping, name);
    assert_eq!(
        listed[0].bind_targets.len(),
        1,
        "its bind is taken back too"
    );
    assert!(v.unpublish("e", &Cancel::never()).unwrap());
    assert!(fake.mappings().is_empty());
}

#[test]
fn trim_of_an_encrypted_volume_needs_allow_discards() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.luks_disk(dir.path(), "fkc", PASS, Some(FsType::Ext4));
    v.publish(&encrypted("e", &d, PASS, false), &Cancel::never())
        .unwrap();
    let e = v.trim("e", 0, &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.to_string().contains("allow_discards"), "{e}");
}

#[test]
fn a_blank_disk_is_made_a_luks2_volume_with_its_filesystem_inside() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkn", None);
    let mut r = encrypted("n", &d, PASS, false);
    r.spec.encryption.as_mut().unwrap().format_if_blank = true;
    fake.journal(&root);
    v.publish(&r, &Cancel::never()).unwrap();
    let j = fake.journal(&root);
    let at = |p: &str| {
        j.iter()
            .position(|x| x.starts_with(p))
            .unwrap_or_else(|| panic!("{p}: {j:?}"))
    };
    assert!(
        at("format fkn") < at("map fkn") && at("map fkn") < at("mkfs.ext4 dm-"),
        "{j:?}"
    );
    assert!(fake.unfinished().is_empty(), "marked finished");
    // Unpublished and published again: opened as it is, not made again.
    assert!(v.unpublish("n", &Cancel::never()).unwrap());
    fake.journal(&root);
    v.publish(&r, &Cancel::never()).unwrap();
    let j = fake.journal(&root);
    assert!(
        !j.iter()
            .any(|x| x.starts_with("format") || x.starts_with("mkfs")),
        "{j:?}"
    );
}

#[test]
fn format_if_blank_never_touches_a_disk_that_holds_something() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.disk(dir.path(), "fkp", Some(FsType::Ext4));
    let mut r = encrypted("p", &d, PASS, false);
    r.spec.encryption.as_mut().unwrap().format_if_blank = true;
    let e = v.publish(&r, &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.to_string().contains("not blank"), "{e}");
    assert!(fake.mappings().is_empty() && fake.mounts().is_empty());
}

#[test]
fn a_mapping_with_integrity_says_so_and_tampering_is_data_loss() {
    use crate::stats::problem::Health;
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.luks_disk(dir.path(), "fki", PASS, Some(FsType::Ext4));
    fake.with_integrity("fki", "hmac(sha256)");
    v.publish(&encrypted("i", &d, PASS, false), &Cancel::never())
        .unwrap();
    let listed = v.list();
    let info = listed[0].encryption.as_ref().unwrap();
    assert_eq!(
        (info.integrity.as_str(), info.key_bits),
        ("hmac(sha256)", 768)
    );
    // (The fake's mounts are not statfs-able: only the mapping's answer is looked at.)
    let tamper_said = || {
        let said = v.health("i", &Cancel::never()).unwrap();
        said.into_iter()
            .filter(|s| s.reason == "IntegrityMismatches")
            .collect::<Vec<_>>()
    };
    assert!(tamper_said().is_empty());
    fake.tamper(&mapping_name(v.root(), "i"), 2);
    let said = tamper_said();
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(said[0].status, Health::DataLoss);
    assert!(
        said[0].message.contains("refused 2 sector(s)") && said[0].message.contains("hmac(sha256)"),
        "{}",
        said[0].message
    );
}

#[test]
fn a_publish_that_fails_on_a_tampered_block_is_data_loss() {
    use crate::stats::problem::Health;
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.luks_disk(dir.path(), "fkt", PASS, Some(FsType::Ext4));
    fake.with_integrity("fkt", "hmac(sha256)");
    fake.tamper_disk("fkt", 1);
    // xfs asked, ext4 inside: the publish fails after the mapping was made,
    // and the kernel has refused a sector of it by then.
    let mut r = encrypted("t", &d, PASS, false);
    r.spec.mode = crate::model::VolumeMode::Filesystem(FsType::Xfs);
    let e = v.publish(&r, &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::DataLoss, "{e}");
    assert!(e.to_string().contains("refused 1 sector(s)"), "{e}");
    assert!(fake.mappings().is_empty());
    let said = v.health("t", &Cancel::never()).unwrap();
    assert_eq!(
        (said[0].status, said[0].reason),
        (Health::DataLoss, "IntegrityMismatches")
    );
    // Without integrity, the same failure is what it was.
    let d = fake.luks_disk(dir.path(), "fku", PASS, Some(FsType::Ext4));
    let mut r = encrypted("u", &d, PASS, false);
    r.spec.mode = crate::model::VolumeMode::Filesystem(FsType::Xfs);
    let e = v.publish(&r, &Cancel::never()).unwrap_err();
    assert_ne!(e.code(), Code::DataLoss, "{e}");
}

/// An encrypted volume claims its mapping as well as its disk: a second
/// publish naming the mapping's node (device_path /dev/dm-N) would hand
/// the first volume's plaintext to another pod, and a bound block node is
/// no mount of that device in mountinfo, so only the claim refuses it.
#[test]
fn a_second_volume_on_an_encrypted_block_volumes_mapping_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.luks_disk(dir.path(), "fkc", PASS, None);
    let mut a = encrypted("a", &d, PASS, false);
    a.spec.mode = crate::model::VolumeMode::Block;
    let out = v.publish(&a, &Cancel::never()).unwrap();
    let mapped = out.device.clone();
    assert!(
        mapped.to_string_lossy().starts_with("/dev/dm-"),
        "{mapped:?}"
    );
    let mut c = request("c", &d, true, true);
    c.spec.source = crate::volumes::request::Source::Path(mapped.clone());
    let got = v.publish(&c, &Cancel::never());
    assert!(
        got.is_err(),
        "volume c was published on volume a's mapping {mapped:?}: {:?}",
        got.map(|o| o.device)
    );
}

/// A publish that fails after its mapping is made, while something still
/// holds the mapping (an mkfs killed at the caller's deadline and still
/// dying, its I/O stalled by the host), leaves it with no volume and no
/// record: Unpublish of the same id removes it once nothing holds it.
#[test]
fn a_mapping_left_by_a_failed_publish_is_removed_by_unpublish() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.luks_disk(dir.path(), "fkc", PASS, Some(FsType::Ext4));
    let holder = dir.path().join("holder");
    std::fs::create_dir(&holder).unwrap();
    // Something holds the mapping-to-be (dm-1, the fake's next minor) when
    // the publish, whose mount fails, undoes itself.
    let m = crate::model::Device {
        name: "dm-1".into(),
        path: "/dev/dm-1".into(),
        major: 240,
        minor: 1,
        serial: Some("dm-1".into()),
    };
    fake.mount_behind(&m, &holder);
    fake.fail(crate::volumes::fake::Call::Mount, 1, rustix::io::Errno::IO);
    let r = encrypted("e", &d, PASS, false);
    assert!(v.publish(&r, &Cancel::never()).is_err());
    let name = mapping_name(v.root(), "e");
    assert_eq!(fake.mappings(), [name], "left by the failed publish");
    // While it is held, Unpublish says so; once let go, Unpublish removes
    // it, and the volume publishes again.
    let held = v.unpublish("e", &Cancel::never()).unwrap_err();
    assert_eq!(held.code(), Code::FailedPrecondition, "{held}");
    fake.unmount_behind(&holder);
    assert!(
        !v.unpublish("e", &Cancel::never()).unwrap(),
        "no volume was published"
    );
    assert!(fake.mappings().is_empty());
    v.publish(&r, &Cancel::never()).unwrap();
}

/// A read-only publish asking format_if_blank is refused before anything
/// is written: a read-only publish writes nothing to the disk.
#[test]
fn a_read_only_publish_never_writes_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkr", None);
    let mut r = encrypted("r", &d, PASS, false);
    r.spec.options = crate::volumes::request::Options::parse(Vec::new(), true).unwrap();
    r.spec.encryption.as_mut().unwrap().format_if_blank = true;
    fake.journal(&root);
    let out = v.publish(&r, &Cancel::never());
    let j = fake.journal(&root);
    assert!(
        !j.iter()
            .any(|x| x.starts_with("format") || x.starts_with("mkfs")),
        "a read-only publish ({:?}) wrote the disk: {j:?}",
        out.map(|o| o.device).map_err(|e| e.code())
    );
}

/// The unfinished mark is a header label, which the host can write: a
/// finished volume labelled unfinished again is only marked finished, its
/// filesystem never made again over the data.
#[test]
fn a_finished_volume_labelled_unfinished_by_the_host_is_not_made_again() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkh", None);
    let mut r = encrypted("h", &d, PASS, false);
    r.spec.encryption.as_mut().unwrap().format_if_blank = true;
    v.publish(&r, &Cancel::never()).unwrap();
    assert!(v.unpublish("h", &Cancel::never()).unwrap());
    fake.label_unfinished("fkh");
    fake.journal(&root);
    v.publish(&r, &Cancel::never()).unwrap();
    let j = fake.journal(&root);
    assert!(
        !j.iter().any(|x| x.starts_with("mkfs")),
        "made again: {j:?}"
    );
    assert!(fake.unfinished().is_empty(), "marked finished");
}

/// A publish of blank `disk` as volume `id`, formatted with integrity.
fn with_integrity(id: &str, disk: &crate::model::Device) -> PublishRequest {
    let mut r = encrypted(id, disk, PASS, false);
    let e = r.spec.encryption.as_mut().unwrap();
    e.format_if_blank = true;
    e.integrity = Some(Mac::HmacSha256);
    r
}

/// Where in journal `j` the first entry starting with `p` is.
fn at(j: &[String], p: &str) -> usize {
    j.iter()
        .position(|x| x.starts_with(p))
        .unwrap_or_else(|| panic!("{p}: {j:?}"))
}

#[test]
fn a_blank_disk_made_with_integrity_is_wiped_before_its_filesystem_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkw", None);
    let r = with_integrity("w", &d);
    fake.journal(&root);
    v.publish(&r, &Cancel::never()).unwrap();
    let j = fake.journal(&root);
    assert!(
        at(&j, "format fkw with hmac-sha256") < at(&j, "map fkw")
            && at(&j, "map fkw") < at(&j, "wipe dm-")
            && at(&j, "wipe dm-") < at(&j, "mkfs.ext4 dm-"),
        "{j:?}"
    );
    assert!(fake.unfinished().is_empty(), "marked finished");
    let listed = v.list();
    let info = listed[0].encryption.as_ref().unwrap();
    assert_eq!(
        (info.integrity.as_str(), info.key_bits),
        ("hmac(sha256)", 768)
    );
    // The same request after a restart is the same volume; asking no
    // integrity of it is another request.
    let v = reopen(dir.path(), &fake);
    assert!(v.publish(&r, &Cancel::never()).unwrap().already_published);
    let mut other = with_integrity("w", &d);
    other.spec.encryption.as_mut().unwrap().integrity = None;
    let e = v.publish(&other, &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    // Unpublished and published again: opened as it is, not wiped again.
    assert!(v.unpublish("w", &Cancel::never()).unwrap());
    fake.journal(&root);
    v.publish(&r, &Cancel::never()).unwrap();
    let j = fake.journal(&root);
    assert!(
        !j.iter()
            .any(|x| ["format", "wipe", "mkfs"].iter().any(|p| x.starts_with(p))),
        "{j:?}"
    );
}

/// A publish whose wipe stops (its caller's deadline, a write that fails)
/// leaves the volume unfinished and unmapped; the next one goes on with the
/// wipe (reading nothing of the mapping before it: an unwiped sector has
/// no tag) and makes the filesystem.
#[test]
fn a_publish_stopped_mid_wipe_is_finished_by_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fks", None);
    let r = with_integrity("s", &d);
    fake.fail(Call::Wipe, 1, rustix::io::Errno::IO);
    let e = v.publish(&r, &Cancel::never()).unwrap_err();
    assert!(e.to_string().contains("Input/output error"), "{e}");
    assert!(fake.mappings().is_empty() && fake.mounts().is_empty());
    assert_eq!(fake.unfinished(), ["fks"]);
    assert!(v.list().is_empty());
    fake.journal(&root);
    v.publish(&r, &Cancel::never()).unwrap();
    let j = fake.journal(&root);
    assert!(!j.iter().any(|x| x.starts_with("format")), "{j:?}");
    assert!(at(&j, "wipe dm-") < at(&j, "mkfs.ext4 dm-"), "{j:?}");
    assert!(fake.unfinished().is_empty(), "marked finished");
}

/// With format_if_blank the request says what the volume is: a LUKS2
/// volume there without the integrity asked (or with integrity not asked)
/// is refused before it is unlocked, and nothing is mapped or made.
#[test]
fn a_volume_whose_integrity_is_not_the_one_asked_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let plain = fake.luks_disk(dir.path(), "fka", PASS, Some(FsType::Ext4));
    let tagged = fake.luks_disk(dir.path(), "fkb", PASS, Some(FsType::Ext4));
    fake.with_integrity("fkb", "hmac(sha256)");
    let mut no_integrity = encrypted("b", &tagged, PASS, false);
    no_integrity
        .spec
        .encryption
        .as_mut()
        .unwrap()
        .format_if_blank = true;
    fake.journal(&root);
    for (r, says) in [
        (
            with_integrity("a", &plain),
            "has integrity none where the request asks hmac(sha256)",
        ),
        (
            no_integrity,
            "has integrity hmac(sha256) where the request asks none",
        ),
    ] {
        let e = v.publish(&r, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains(says), "{says}: {e}");
    }
    let j = fake.journal(&root);
    assert!(
        !j.iter().any(|x| ["map", "format", "wipe", "mkfs"]
            .iter()
            .any(|p| x.starts_with(p))),
        "{j:?}"
    );
    assert!(fake.mappings().is_empty() && v.list().is_empty());
    // Without format_if_blank the header decides.
    v.publish(&encrypted("b", &tagged, PASS, false), &Cancel::never())
        .unwrap();
}

#[test]
fn a_block_volume_made_with_integrity_is_wiped_and_holds_no_filesystem() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkk", None);
    let mut r = with_integrity("k", &d);
    r.spec.mode = crate::model::VolumeMode::Block;
    fake.journal(&root);
    v.publish(&r, &Cancel::never()).unwrap();
    let j = fake.journal(&root);
    at(&j, "wipe dm-");
    assert!(!j.iter().any(|x| x.starts_with("mkfs")), "{j:?}");
    assert!(fake.unfinished().is_empty(), "marked finished");
}

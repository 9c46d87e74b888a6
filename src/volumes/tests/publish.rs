//! Publishes through the table.

use std::path::PathBuf;
use std::time::Duration;

use rustix::io::Errno;

use super::testkit::{
    fake_partitions, fake_table, publish_loop, reopen, request, table, with_disk,
};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::model::{FsType, RecursiveReadOnly, VolumeMode};
use crate::validate::STATE_DIR;
use crate::volumes::error::Error;
use crate::volumes::fake::Call;
use crate::volumes::request::{BindRequest, PublishRequest, Source, Spec};
use crate::volumes::table::Volumes;
use crate::volumes::volume::tests::sample;

#[test]
#[ignore = "needs root: make test runs it"]
fn partitions_that_overlap_are_one_volume() {
    crust_testkit::needs::loop_devices();
    let (a, b, c) = (
        crust_testkit::LoopDisk::new(32, Some("ext4")),
        crust_testkit::LoopDisk::new(32, None),
        crust_testkit::LoopDisk::new(32, None),
    );
    let dir = tempfile::tempdir().unwrap();
    // a: sectors 2048..67584; b overlaps its end; c lies after both.
    let sysfs = fake_partitions(
        dir.path(),
        &[(&a, 2048, 65536), (&b, 60000, 8192), (&c, 68216, 100)],
    );
    let v = Volumes::open(&dir.path().join("root"), sysfs, crate::logging::discard()).unwrap();
    let block = |id: &str, d: &crust_testkit::LoopDisk| PublishRequest {
        spec: Spec {
            volume_id: id.into(),
            source: Source::Path(d.device.clone()),
            mode: VolumeMode::Block,
            options: crate::volumes::request::Options::parse(Vec::new(), false).unwrap(),
            fs_group: None,
            encryption: None,
            trim_interval_s: 0,
        },
        timeout: Duration::from_secs(1),
        key: None,
    };
    publish_loop(&v, "pa", &a);
    let e = v.publish(&block("pb", &b), &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("volume pa") && msg.contains("60000..68192"),
        "{msg}"
    );
    assert!(
        v.list().iter().all(|i| i.volume_id != "pb"),
        "a refused publish leaves nothing"
    );
    // One that does not overlap is its own volume.
    v.publish(&block("pc", &c), &Cancel::never()).unwrap();
    // The other order: b first, then a is refused.
    assert!(v.unpublish("pa", &Cancel::never()).unwrap());
    v.publish(&block("pb", &b), &Cancel::never()).unwrap();
    let e = v.publish(&block("pa", &a), &Cancel::never()).unwrap_err();
    assert!(e.to_string().contains("volume pb"), "{e}");
    for id in ["pb", "pc"] {
        assert!(v.unpublish(id, &Cancel::never()).unwrap());
    }
}

#[test]
fn after_shutdown_nothing_new_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let v = table(dir.path());
    assert_eq!(v.shutdown(), 0);
    let mut spec = sample().spec;
    spec.volume_id = "late".into();
    spec.fs_group = None;
    let req = PublishRequest {
        spec,
        timeout: Duration::from_millis(1),
        key: None,
    };
    let e = v.publish(&req, &Cancel::never()).unwrap_err();
    assert!(
        matches!(e, crate::error::Error::Volume(Error::ShuttingDown)),
        "{e}"
    );
    assert_eq!(e.code(), Code::FailedPrecondition);
    let b = BindRequest {
        volume_id: "late".into(),
        subpath: PathBuf::new(),
        target: dir.path().join("t"),
        read_only: false,
        recursive_read_only: RecursiveReadOnly::Disabled,
        idmap: None,
    };
    assert!(matches!(
        v.bind(&b, &Cancel::never()),
        Err(crate::error::Error::Volume(Error::ShuttingDown))
    ));
}

/// The steps of a publish on the fake kernel, and an unpublish undoing
/// them: the guest directory, the record (incomplete, then complete with
/// its mount id), the mount; the same request again answers
/// `already_published` once the mount is checked.
#[test]
fn a_publish_is_recorded_mounted_and_listed_and_an_unpublish_undoes_it() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, d) = with_disk(dir.path(), "fka", Some(FsType::Ext4));
    let req = request("a", &d, false, false);
    let out = v.publish(&req, &Cancel::never()).unwrap();
    assert_eq!(out.guest_path, root.join("volumes/a"));
    assert!(!out.already_published);
    assert_eq!(fake.journal(&root), ["mount /dev/fka volumes/a"]);
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(record.contains("\ncomplete=true\n"), "{record}");
    assert!(!record.contains("\nmount_id=0\n"), "{record}");
    assert_eq!(v.list()[0].volume_id, "a");
    assert!(v.publish(&req, &Cancel::never()).unwrap().already_published);
    // Another request for the same id is refused, naming the difference.
    let e = v
        .publish(&request("a", &d, false, true), &Cancel::never())
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert!(v.unpublish("a", &Cancel::never()).unwrap());
    assert_eq!(
        fake.journal(&root),
        ["syncfs volumes/a", "umount volumes/a"]
    );
    assert!(!root.join(STATE_DIR).join("a.vol").exists() && !root.join("volumes/a").exists());
    assert!(v.list().is_empty() && fake.mounts().is_empty());
    assert!(!v.unpublish("a", &Cancel::never()).unwrap());
}

/// A publish the disk refuses (another filesystem, a disk already a
/// volume's, a disk mounted elsewhere) leaves nothing: no record, no guest
/// path, no mount; its failure is what health answers until a publish of
/// that id goes through.
#[test]
fn a_refused_publish_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, xfs) = with_disk(dir.path(), "fkx", Some(FsType::Xfs));
    let e = v
        .publish(&request("x", &xfs, false, false), &Cancel::never())
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("not the requested ext4"), "{e}");
    let health = v.health("x", &Cancel::never()).unwrap();
    assert_eq!(health[0].reason, "PublishFailed");
    let d = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    v.publish(&request("a", &d, false, false), &Cancel::never())
        .unwrap();
    let e = v
        .publish(&request("b", &d, false, false), &Cancel::never())
        .unwrap_err();
    assert!(e.to_string().contains("volume a"), "{e}");
    let elsewhere = fake.disk(dir.path(), "fke", Some(FsType::Ext4));
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    fake.mount_behind(&elsewhere, &mnt);
    let e = v
        .publish(&request("e", &elsewhere, false, false), &Cancel::never())
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("mnt"), "{e}");
    for id in ["x", "b", "e"] {
        assert!(!root.join("volumes").join(id).exists(), "{id}");
        assert!(
            !root.join(STATE_DIR).join(format!("{id}.vol")).exists(),
            "{id}"
        );
    }
    assert_eq!(fake.journal(&root), ["mount /dev/fka volumes/a"]);
    assert_eq!(v.list().len(), 1);
}

/// The mount check after mounting fails (statx says EIO): nothing is
/// undone, since undoing could hit what is there instead of the agent's
/// mount (rollback.rs). The record and the mount stay for recovery, which
/// takes the volume back at the next start; the same publish then
/// finishes it.
#[test]
fn a_publish_whose_mount_check_fails_leaves_its_steps_to_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, d) = with_disk(dir.path(), "fka", Some(FsType::Ext4));
    // The first statx is the guest node's, the second the mount check's.
    fake.fail(Call::Statx, 2, Errno::IO);
    let req = request("a", &d, false, false);
    let e = v.publish(&req, &Cancel::never()).unwrap_err();
    assert!(e.to_string().contains("statx"), "{e}");
    assert_eq!(
        fake.journal(&root),
        ["mount /dev/fka volumes/a", "statx failed"]
    );
    assert_eq!(fake.mounts(), [root.join("volumes/a")]);
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(
        record.contains("\nmount_id=0\ncomplete=false\n"),
        "{record}"
    );
    drop(v);
    let v = reopen(dir.path(), &fake);
    assert_eq!(v.list()[0].volume_id, "a", "recovery took it back");
    let out = v.publish(&req, &Cancel::never()).unwrap();
    assert!(!out.already_published, "its publish had not finished");
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(record.contains("\ncomplete=true\n"), "{record}");
    assert!(v.publish(&req, &Cancel::never()).unwrap().already_published);
}

/// A mount covered at once by another one (something mounted over it
/// meanwhile) fails the check the same way: the agent's mount is not what
/// the guest path shows, and nothing there is touched.
#[test]
fn a_publish_whose_mount_is_covered_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, d) = with_disk(dir.path(), "fka", Some(FsType::Ext4));
    fake.cover_next_mount();
    let e = v
        .publish(&request("a", &d, false, false), &Cancel::never())
        .unwrap_err();
    assert!(e.to_string().contains("no longer there"), "{e}");
    assert_eq!(fake.journal(&root), ["mount /dev/fka volumes/a"]);
    assert_eq!(fake.mounts().len(), 2);
    assert!(root.join(STATE_DIR).join("a.vol").exists());
}

/// The undo list stops at the first undo that fails: the record of the
/// mount's id cannot be written, so the publish is undone, last step
/// first; taking the mount down fails (EBUSY), so the record and the guest
/// path before it stay, for recovery to find the mount by. Where the
/// unmount works, everything goes.
#[test]
fn an_undo_that_fails_stops_the_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    for (id, disk, busy) in [("a", "fka", true), ("b", "fkb", false)] {
        let d = fake.disk(dir.path(), disk, Some(FsType::Ext4));
        // Once mounted, a directory where the record's temp file goes
        // fails the record's second write.
        let tmp = root.join(STATE_DIR).join(format!("{id}.vol.tmp"));
        fake.before(Call::Mount, 1, move || std::fs::create_dir(&tmp).unwrap());
        if busy {
            fake.fail(Call::Unmount, 1, Errno::BUSY);
        }
        let e = v
            .publish(&request(id, &d, false, false), &Cancel::never())
            .unwrap_err();
        assert_eq!(e.code(), Code::Internal, "{id}: {e}");
        let journal = fake.journal(&root);
        assert_eq!(journal[0], format!("mount /dev/{disk} volumes/{id}"));
        let kept = root.join(STATE_DIR).join(format!("{id}.vol")).exists();
        let guest = root.join("volumes").join(id).exists();
        if busy {
            assert_eq!(journal[1..], ["umount volumes/a failed"]);
            assert!(kept && guest, "the steps before the failed undo stay");
            assert_eq!(fake.mounts(), [root.join("volumes/a")]);
        } else {
            assert_eq!(journal[1..], ["umount volumes/b"]);
            assert!(!kept && !guest, "every step is undone");
        }
        std::fs::remove_dir(root.join(STATE_DIR).join(format!("{id}.vol.tmp"))).unwrap();
    }
    assert!(v.list().is_empty());
    // The next start finds the mount by its record, and takes it back.
    drop(v);
    let v = reopen(dir.path(), &fake);
    let listed: Vec<String> = v.list().into_iter().map(|i| i.volume_id).collect();
    assert_eq!(listed, ["a"]);
}

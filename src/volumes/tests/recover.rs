//! A restart on the fake kernel: what recovery takes back, and what it
//! takes down because no record explains it.

use super::testkit::{bind_request, fake_table, reopen, request};
use crate::cancel::Cancel;
use crate::model::FsType;
use crate::validate::STATE_DIR;

/// A mount directly in `volumes/` with no record (a publish killed between
/// its mount and its record would leave its record; this is a mount the
/// agent cannot account for), and a mount of a volume's disk beneath the
/// root that is not a recorded bind (copied behind the agent's back), are
/// taken down at start; the recorded volume and its recorded bind are
/// taken back, untouched.
#[test]
fn recovery_takes_down_what_no_record_explains() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    v.publish(&request("a", &d, false, false), &Cancel::never())
        .unwrap();
    v.bind(&bind_request(&v, "a", "pods/p/data"), &Cancel::never())
        .unwrap();
    v.close_freezes();
    drop(v);
    let ghost = fake.disk(dir.path(), "fkg", Some(FsType::Ext4));
    std::fs::create_dir_all(root.join("volumes/ghost")).unwrap();
    fake.mount_behind(&ghost, &root.join("volumes/ghost"));
    std::fs::create_dir_all(root.join("pods/q/copy")).unwrap();
    fake.mount_behind(&d, &root.join("pods/q/copy"));
    fake.journal(&root);

    let v = reopen(dir.path(), &fake);
    let mut journal = fake.journal(&root);
    journal.sort();
    assert_eq!(journal, ["umount pods/q/copy", "umount volumes/ghost"]);
    assert!(
        !root.join("volumes/ghost").exists(),
        "its guest node went too"
    );
    assert_eq!(
        fake.mounts(),
        [root.join("volumes/a"), root.join("pods/p/data")]
    );
    let listed = v.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].bind_targets,
        [root.join("pods/p/data").display().to_string()]
    );
}

/// A volume whose mount is gone is forgotten (its record removed, its bind
/// taken down as one no record explains); one still mounted is taken back,
/// with the binds that are still there.
#[test]
fn recovery_keeps_what_is_mounted_and_forgets_what_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    for (id, disk) in [("a", "fka"), ("b", "fkb")] {
        let d = fake.disk(dir.path(), disk, Some(FsType::Ext4));
        v.publish(&request(id, &d, false, false), &Cancel::never())
            .unwrap();
        v.bind(
            &bind_request(&v, id, &format!("pods/{id}/data")),
            &Cancel::never(),
        )
        .unwrap();
    }
    v.bind(&bind_request(&v, "a", "pods/a/gone"), &Cancel::never())
        .unwrap();
    v.close_freezes();
    drop(v);
    fake.unmount_behind(&root.join("volumes/b"));
    fake.unmount_behind(&root.join("pods/a/gone"));
    fake.journal(&root);

    let v = reopen(dir.path(), &fake);
    assert_eq!(fake.journal(&root), ["umount pods/b/data"]);
    let listed = v.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].volume_id, "a");
    assert_eq!(
        listed[0].bind_targets,
        [root.join("pods/a/data").display().to_string()]
    );
    assert!(!root.join(STATE_DIR).join("b.vol").exists());
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(!record.contains("pods/a/gone"), "{record}");
    // What was taken back is the table's as before: it comes down whole.
    assert!(v.unpublish("a", &Cancel::never()).unwrap());
    assert!(fake.mounts().is_empty());
}

/// A read-only block volume recovery forgets (its bind gone) has the flag
/// the agent set on its device cleared: nothing else would clear it.
#[test]
fn a_forgotten_block_volume_has_its_read_only_flag_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkb", None);
    v.publish(&request("blk", &d, true, true), &Cancel::never())
        .unwrap();
    assert!(fake.read_only(&d));
    v.close_freezes();
    drop(v);
    fake.unmount_behind(&root.join("volumes/blk"));
    fake.journal(&root);
    let v = reopen(dir.path(), &fake);
    assert!(v.list().is_empty());
    assert_eq!(fake.journal(&root), ["ro fkb off"]);
    assert!(!fake.read_only(&d));
}

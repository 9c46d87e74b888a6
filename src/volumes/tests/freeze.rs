//! Freezes through the table, on the fake kernel: all or none, what a
//! freeze refuses, and the order a thaw comes in.

use rustix::io::Errno;

use super::testkit::{bind, fake_table, published_ext4, request};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::volumes::fake::Call;
use crate::volumes::freeze::Thaw;
use crate::volumes::lease::DEFAULT_TIMEOUT;

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Freezing two volumes where FIFREEZE fails on the second: the call
/// fails, and the first, frozen already, is thawed before it answers.
#[test]
fn the_second_freeze_fails_and_the_first_is_thawed() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    for (id, disk) in [("a", "fka"), ("b", "fkb")] {
        let d = fake.disk(dir.path(), disk, Some(crate::model::FsType::Ext4));
        v.publish(&request(id, &d, false, false), &Cancel::never())
            .unwrap();
    }
    let root = v.root().to_path_buf();
    fake.journal(&root);
    fake.fail(Call::Freeze, 2, Errno::IO);
    let e = v
        .freeze(&ids(&["a", "b"]), DEFAULT_TIMEOUT, None, &Cancel::never())
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e}");
    assert!(e.to_string().contains("FIFREEZE"), "{e}");
    assert_eq!(
        fake.journal(&root),
        [
            "freeze volumes/a",
            "freeze volumes/b failed",
            "thaw volumes/a"
        ]
    );
    assert!(!fake.frozen(&root.join("volumes/a")));
    assert!(v.list().iter().all(|i| i.frozen.is_none()));
    // Nothing holds either volume now: the same freeze goes through.
    let f = v
        .freeze(&ids(&["a", "b"]), DEFAULT_TIMEOUT, None, &Cancel::never())
        .unwrap();
    assert!(fake.frozen(&root.join("volumes/a")) && fake.frozen(&root.join("volumes/b")));
    assert_eq!(
        v.thaw(&Thaw::Freeze(f.freeze_id)).unwrap(),
        ids(&["a", "b"])
    );
}

/// A frozen volume refuses what would write to it (a bind, a trim), naming
/// its freeze; an unpublish thaws it before it flushes and unmounts, since
/// a frozen filesystem would hang both.
#[test]
fn a_frozen_volume_refuses_writes_and_is_thawed_before_it_is_taken_down() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, _) = published_ext4(dir.path());
    let f = v
        .freeze(
            &ids(&["a"]),
            DEFAULT_TIMEOUT,
            Some("backup-1"),
            &Cancel::never(),
        )
        .unwrap();
    assert_eq!(f.freeze_id, "backup-1");
    let e = bind(&v, "a", "pods/p/data").unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("backup-1"), "{e}");
    let e = v.trim("a", 0, &Cancel::never()).unwrap_err();
    assert!(e.to_string().contains("backup-1"), "{e}");
    assert!(!root.join("pods").exists(), "a refused bind makes nothing");
    fake.journal(&root);
    assert!(v.unpublish("a", &Cancel::never()).unwrap());
    assert_eq!(
        fake.journal(&root),
        ["thaw volumes/a", "syncfs volumes/a", "umount volumes/a"]
    );
    // Its freeze heard how it ended.
    let e = v.thaw(&Thaw::Freeze("backup-1".into())).unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e}");
}

/// A freeze that reaches what cannot be frozen (a block volume, a volume
/// not published) undoes what it froze before it, all or none.
#[test]
fn a_freeze_of_what_cannot_be_frozen_freezes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let d = fake.disk(dir.path(), "fka", Some(crate::model::FsType::Ext4));
    let b = fake.disk(dir.path(), "fkb", None);
    v.publish(&request("a", &d, false, false), &Cancel::never())
        .unwrap();
    v.publish(&request("blk", &b, true, false), &Cancel::never())
        .unwrap();
    let root = v.root().to_path_buf();
    fake.journal(&root);
    for (vols, code) in [
        (ids(&["a", "blk"]), Code::FailedPrecondition),
        (ids(&["a", "nothing"]), Code::NotFound),
    ] {
        let e = v
            .freeze(&vols, DEFAULT_TIMEOUT, None, &Cancel::never())
            .unwrap_err();
        assert_eq!(e.code(), code, "{e}");
        assert!(!fake.frozen(&root.join("volumes/a")));
    }
    assert_eq!(
        fake.journal(&root),
        [
            "freeze volumes/a",
            "thaw volumes/a",
            "freeze volumes/a",
            "thaw volumes/a"
        ]
    );
    v.freeze(&ids(&["a"]), DEFAULT_TIMEOUT, None, &Cancel::never())
        .unwrap();
    assert!(fake.frozen(&root.join("volumes/a")));
}

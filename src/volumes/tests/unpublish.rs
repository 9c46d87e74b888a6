//! Unpublishes through the table, on the fake kernel: the order things
//! come down in, and what an unpublish stopped half-way leaves.

use rustix::io::Errno;

use super::testkit::{bind_request, fake_table, request};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::model::FsType;
use crate::validate::STATE_DIR;
use crate::volumes::fake::Call;

/// Binds come down last made first, then the volume's own mount, flushed
/// first; a mount of its disk left beneath the root (moved or copied
/// behind the agent's back) comes down after them.
#[test]
fn an_unpublish_takes_binds_down_last_made_first_then_its_mount() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    v.publish(&request("a", &d, false, false), &Cancel::never())
        .unwrap();
    for t in ["pods/p/one", "pods/p/two"] {
        v.bind(&bind_request(&v, "a", t), &Cancel::never()).unwrap();
    }
    std::fs::create_dir_all(root.join("elsewhere")).unwrap();
    fake.mount_behind(&d, &root.join("elsewhere"));
    fake.journal(&root);
    assert!(v.unpublish("a", &Cancel::never()).unwrap());
    assert_eq!(
        fake.journal(&root),
        [
            "umount pods/p/two",
            "umount pods/p/one",
            "syncfs volumes/a",
            "umount volumes/a",
            "umount elsewhere"
        ]
    );
    assert!(fake.mounts().is_empty());
    assert!(!root.join("pods/p/one").exists() && !root.join("pods/p/two").exists());
}

/// An unpublish stopped by a bind that will not come down (EBUSY) keeps
/// the volume with what is still up: ListVolumes says so, its record is
/// still there, and the next unpublish finishes the job.
#[test]
fn an_unpublish_stopped_half_way_keeps_what_is_still_up() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    v.publish(&request("a", &d, false, false), &Cancel::never())
        .unwrap();
    for t in ["pods/p/one", "pods/p/two"] {
        v.bind(&bind_request(&v, "a", t), &Cancel::never()).unwrap();
    }
    fake.journal(&root);
    fake.fail(Call::Unmount, 2, Errno::BUSY);
    let e = v.unpublish("a", &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e}");
    assert_eq!(
        fake.journal(&root),
        ["umount pods/p/two", "umount pods/p/one failed"]
    );
    let listed = v.list();
    assert_eq!(
        listed[0].bind_targets,
        [root.join("pods/p/one").display().to_string()]
    );
    assert!(root.join(STATE_DIR).join("a.vol").exists());
    // Its target stays the volume's: a bind inside it is refused.
    let e = v
        .bind(&bind_request(&v, "a", "pods/p/one/inner"), &Cancel::never())
        .unwrap_err();
    assert!(e.to_string().contains("inside"), "{e}");
    assert!(v.unpublish("a", &Cancel::never()).unwrap());
    assert!(fake.mounts().is_empty() && v.list().is_empty());
}

/// A mount of the volume's disk beneath the root that cannot be taken
/// down fails the unpublish, naming it: the host must not detach a disk
/// that is still mounted.
#[test]
fn an_unpublish_is_never_ok_while_the_disk_is_mounted_beneath_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
    v.publish(&request("a", &d, false, false), &Cancel::never())
        .unwrap();
    std::fs::create_dir_all(root.join("copy")).unwrap();
    fake.mount_behind(&d, &root.join("copy"));
    fake.fail(Call::Unmount, 2, Errno::BUSY);
    let e = v.unpublish("a", &Cancel::never()).unwrap_err();
    assert!(e.to_string().contains("copy"), "{e}");
    assert_eq!(fake.mounts(), [root.join("copy")]);
    assert!(v.unpublish("a", &Cancel::never()).unwrap());
    assert!(fake.mounts().is_empty());
}

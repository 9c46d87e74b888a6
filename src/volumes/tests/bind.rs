//! Binds and unmounts through the table.

use std::path::PathBuf;

use super::testkit::{bind, bind_request, publish_loop, published_ext4, table};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::model::{FsType, RecursiveReadOnly};
use crate::validate::STATE_DIR;
use crate::volumes::request::BindRequest;

/// A target is validated by the table, beneath its root, whatever spelling
/// it comes in: outside the root, relative, or not UTF-8 (which no wire
/// request can carry) is INVALID_ARGUMENT, and nothing is made.
#[test]
fn targets_outside_the_root_or_not_utf8_are_refused() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let v = table(dir.path());
    let not_utf8 = v.root().join(std::ffi::OsStr::from_bytes(b"pods/\xff"));
    for t in [
        PathBuf::from("/etc/x"),
        PathBuf::from("relative"),
        not_utf8.clone(),
    ] {
        let e = v.unmount(&t, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{}: {e}", t.display());
        let b = BindRequest {
            volume_id: "v".into(),
            subpath: PathBuf::new(),
            target: t.clone(),
            read_only: false,
            recursive_read_only: RecursiveReadOnly::Disabled,
            idmap: None,
        };
        let e = v.bind(&b, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{}: {e}", t.display());
    }
    assert!(!not_utf8.parent().unwrap().exists(), "nothing is made");
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_whose_record_cannot_be_written_leaves_nothing() {
    crust_testkit::needs::loop_devices();
    let disk = crust_testkit::LoopDisk::new(32, Some("ext4"));
    let dir = tempfile::tempdir().unwrap();
    let v = table(dir.path());
    publish_loop(&v, "rec", &disk);
    // A directory where the record's temp file goes: the next save fails.
    let tmp = v.root().join(STATE_DIR).join("rec.vol.tmp");
    std::fs::create_dir(&tmp).unwrap();
    let target = v.root().join("pods/p/data");
    let req = BindRequest {
        volume_id: "rec".into(),
        subpath: PathBuf::new(),
        target: target.clone(),
        read_only: false,
        recursive_read_only: RecursiveReadOnly::Disabled,
        idmap: None,
    };
    assert!(v.bind(&req, &Cancel::never()).is_err());
    assert!(
        !v.root().join("pods").exists(),
        "the directories the bind created are gone"
    );
    let table = crate::sys::mountinfo::read().unwrap();
    assert!(crate::sys::mountinfo::mounts_under(&table, &v.root().join("pods")).is_empty());
    assert!(v.list()[0].bind_targets.is_empty());
    // The target is free again: once the record can be written, the bind works.
    std::fs::remove_dir(&tmp).unwrap();
    let out = v.bind(&req, &Cancel::never()).unwrap();
    assert!(!out.already_mounted);
    // Binds per volume are bounded (MAX_BINDS; 2 here).
    v.limit_binds(2);
    let mut second = req.clone();
    second.target = v.root().join("pods/p/two");
    v.bind(&second, &Cancel::never()).unwrap();
    let mut third = req.clone();
    third.target = v.root().join("pods/p/three");
    let e = v.bind(&third, &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(!third.target.exists(), "a refused bind creates nothing");
    assert!(v.unpublish("rec", &Cancel::never()).unwrap());
    assert!(!target.exists());
}

/// Binds on the fake kernel: two binds never share, nest in or cover each
/// other, nor lie on a volume; a repeat of a live bind answers
/// `already_mounted`, and one gone behind the agent's back is made again.
#[test]
fn binds_are_refused_where_they_would_share_nest_cover_or_write_into_a_volume() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, d) = published_ext4(dir.path());
    let out = bind(&v, "a", "pods/p/data").unwrap();
    assert!(!out.already_mounted);
    // The volume's filesystem mounted again behind the agent's back.
    std::fs::create_dir_all(root.join("copy")).unwrap();
    fake.mount_behind(&d, &root.join("copy"));
    for (target, says) in [
        ("pods/p/data/inner", "inside"),
        ("pods/p", "holds"),
        ("copy/x", "volume a"),
    ] {
        let e = bind(&v, "a", target).unwrap_err();
        assert!(e.to_string().contains(says), "{target}: {e}");
        assert!(
            !root.join(target).exists() || target == "pods/p",
            "{target}"
        );
    }
    let mut other = bind_request(&v, "a", "pods/p/data");
    other.read_only = true;
    let e = v.bind(&other, &Cancel::never()).unwrap_err();
    assert!(e.to_string().contains("other parameters"), "{e}");
    fake.journal(&root);
    let again = bind(&v, "a", "pods/p/data").unwrap();
    assert!(again.already_mounted);
    assert!(fake.journal(&root).is_empty(), "nothing made again");
    fake.unmount_behind(&root.join("pods/p/data"));
    let again = bind(&v, "a", "pods/p/data").unwrap();
    assert!(
        !again.already_mounted,
        "gone behind the agent's back: made again"
    );
    assert_eq!(fake.journal(&root), ["bind volumes/a pods/p/data"]);
}

/// Unmount takes down the agent's own bind; a mount there the agent did
/// not make is refused and left alone; nothing there is not an error.
#[test]
fn unmount_takes_down_only_the_agents_binds() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, _) = published_ext4(dir.path());
    bind(&v, "a", "pods/p/data").unwrap();
    let other = fake.disk(dir.path(), "fko", Some(FsType::Ext4));
    std::fs::create_dir_all(root.join("pods/q/theirs")).unwrap();
    fake.mount_behind(&other, &root.join("pods/q/theirs"));
    fake.journal(&root);
    let e = v
        .unmount(&root.join("pods/q/theirs"), &Cancel::never())
        .unwrap_err();
    assert!(e.to_string().contains("/dev/fko"), "{e}");
    assert!(!v
        .unmount(&root.join("pods/q/nothing"), &Cancel::never())
        .unwrap());
    assert!(v
        .unmount(&root.join("pods/p/data"), &Cancel::never())
        .unwrap());
    assert_eq!(fake.journal(&root), ["umount pods/p/data"]);
    assert!(v.list()[0].bind_targets.is_empty());
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(!record.contains("\nbind="), "{record}");
    assert_eq!(
        fake.mounts(),
        [root.join("volumes/a"), root.join("pods/q/theirs")]
    );
}

/// A bind whose record cannot be written is taken down again, and the
/// nodes it made removed; binds per volume are bounded.
#[test]
fn a_bind_that_cannot_be_recorded_is_undone_and_binds_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, _) = published_ext4(dir.path());
    let tmp = root.join(STATE_DIR).join("a.vol.tmp");
    std::fs::create_dir(&tmp).unwrap();
    fake.journal(&root);
    let req = bind_request(&v, "a", "pods/p/data");
    assert!(v.bind(&req, &Cancel::never()).is_err());
    assert_eq!(
        fake.journal(&root),
        ["bind volumes/a pods/p/data", "umount pods/p/data"]
    );
    assert!(!root.join("pods").exists());
    std::fs::remove_dir(&tmp).unwrap();
    v.limit_binds(2);
    v.bind(&req, &Cancel::never()).unwrap();
    bind(&v, "a", "pods/p/two").unwrap();
    let e = bind(&v, "a", "pods/p/three").unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(!root.join("pods/p/three").exists());
}

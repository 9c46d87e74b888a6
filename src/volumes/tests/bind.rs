//! Binds and unmounts through the table.

use std::path::PathBuf;

use super::testkit::{publish_loop, table};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::model::RecursiveReadOnly;
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
        };
        let e = v.bind(&b, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{}: {e}", t.display());
    }
    assert!(!not_utf8.parent().unwrap().exists(), "nothing is made");
}

#[test]
fn a_bind_whose_record_cannot_be_written_leaves_nothing() {
    if !crate::testutil::root_or_skip("a_bind_whose_record_cannot_be_written_leaves_nothing") {
        return;
    }
    let disk = crate::testutil::LoopDisk::new(32, Some("ext4"));
    let dir = tempfile::tempdir().unwrap();
    let v = table(dir.path());
    publish_loop(&v, "rec", &disk);
    // A directory where the record's temp file goes: the next save fails.
    let tmp = v.root().join("state/rec.vol.tmp");
    std::fs::create_dir(&tmp).unwrap();
    let target = v.root().join("pods/p/data");
    let req = BindRequest {
        volume_id: "rec".into(),
        subpath: PathBuf::new(),
        target: target.clone(),
        read_only: false,
        recursive_read_only: RecursiveReadOnly::Disabled,
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

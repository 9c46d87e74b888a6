//! Idmapped binds through the table, on the fake kernel: the mappings are
//! a bind's parameters (a repeat must ask the same), recorded and listed;
//! a block volume refuses them; a restart takes an idmapped bind back only
//! while it is idmapped as recorded.

use super::testkit::{bind_request, published_block, published_ext4, reopen};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::model::{IdMap, IdRange};
use crate::validate::STATE_DIR;
use crate::volumes::request::BindRequest;

fn map(host: u32) -> IdMap {
    let r = vec![IdRange {
        container_id: 0,
        host_id: host,
        length: 65536,
    }];
    IdMap {
        uids: r.clone(),
        gids: r,
    }
}

fn mapped<K: crate::volumes::kernel::Kernel>(
    v: &crate::volumes::table::Volumes<K>,
    id: &str,
    target: &str,
    host: Option<u32>,
) -> BindRequest {
    BindRequest {
        idmap: host.map(map),
        ..bind_request(v, id, target)
    }
}

/// Made, recorded and listed with its mappings; the same bind again is
/// already mounted; other mappings, or none, at that target are
/// ALREADY_EXISTS and change nothing.
#[test]
fn mappings_are_a_bind_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, _) = published_ext4(dir.path());
    let req = mapped(&v, "a", "pods/p/data", Some(100000));
    let out = v.bind(&req, &Cancel::never()).unwrap();
    assert!(!out.already_mounted);
    let info = &v.list()[0].binds[0];
    assert_eq!(info.idmap, Some(map(100000)));
    assert_eq!(info.target, root.join("pods/p/data").display().to_string());
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(record.contains("\nbind_idmap="), "{record}");
    assert!(v.bind(&req, &Cancel::never()).unwrap().already_mounted);
    fake.journal(&root);
    for other in [Some(200000), None] {
        let e = v
            .bind(&mapped(&v, "a", "pods/p/data", other), &Cancel::never())
            .unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{e}");
        assert!(e.to_string().contains("other uid and gid mappings"), "{e}");
    }
    assert!(fake.journal(&root).is_empty(), "nothing was done");
    assert_eq!(v.list()[0].binds[0].idmap, Some(map(100000)));
    // A plain bind beside it lists no mappings.
    v.bind(&mapped(&v, "a", "pods/p/plain", None), &Cancel::never())
        .unwrap();
    assert_eq!(v.list()[0].binds[1].idmap, None);
}

/// A block volume has no file owners: mappings on its bind are
/// FAILED_PRECONDITION, and nothing is made.
#[test]
fn a_block_volume_refuses_mappings() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, _) = published_block(dir.path());
    fake.journal(&root);
    let e = v
        .bind(
            &mapped(&v, "blk", "pods/p/dev", Some(100000)),
            &Cancel::never(),
        )
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("KEP-127"), "{e}");
    assert!(fake.journal(&root).is_empty());
    assert!(!root.join("pods").exists());
    assert!(v.list()[0].binds.is_empty());
}

/// The ranges a volume's binds hold are bounded: past the bound, a bind is
/// RESOURCE_EXHAUSTED and nothing is made.
#[test]
fn the_ranges_one_volume_holds_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let (v, _fake, root, _) = published_ext4(dir.path());
    let wide = |first: u32| IdMap {
        uids: (0..340)
            .map(|i| IdRange {
                container_id: i,
                host_id: first + i,
                length: 1,
            })
            .collect(),
        gids: vec![map(100000).gids[0]],
    };
    let per = 341;
    let fits = crate::volumes::idmap::MAX_VOLUME_RANGES / per;
    for i in 0..fits {
        let mut req = bind_request(&v, "a", &format!("pods/{i}"));
        req.idmap = Some(wide(1000));
        v.bind(&req, &Cancel::never()).unwrap();
    }
    let mut req = bind_request(&v, "a", "pods/last");
    req.idmap = Some(wide(1000));
    let e = v.bind(&req, &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(!root.join("pods/last").exists());
    // A plain bind still goes.
    v.bind(&bind_request(&v, "a", "pods/last"), &Cancel::never())
        .unwrap();
}

/// A restart takes an idmapped bind back with its mappings; a bind whose
/// mount is not idmapped as recorded (either way, or with other mappings:
/// its mount id reused by another bind) is taken down and dropped from the
/// record, and the next bind makes it again.
#[test]
fn a_restart_checks_binds_are_idmapped_as_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, _) = published_ext4(dir.path());
    for (t, host) in [
        ("pods/kept", Some(100000)),
        ("pods/lost", Some(100000)),
        ("pods/other", Some(100000)),
        ("pods/plain", None),
    ] {
        v.bind(&mapped(&v, "a", t, host), &Cancel::never()).unwrap();
    }
    v.close_freezes();
    drop(v);
    fake.set_idmap_behind(&root.join("pods/lost"), None);
    fake.set_idmap_behind(&root.join("pods/plain"), Some(map(100000)));
    fake.set_idmap_behind(&root.join("pods/other"), Some(map(200000)));
    fake.journal(&root);
    let v = reopen(dir.path(), &fake);
    let mut journal = fake.journal(&root);
    journal.sort();
    assert_eq!(
        journal,
        ["umount pods/lost", "umount pods/other", "umount pods/plain"]
    );
    let binds = &v.list()[0].binds;
    assert_eq!(binds.len(), 1);
    assert_eq!(
        binds[0].target,
        root.join("pods/kept").display().to_string()
    );
    assert_eq!(binds[0].idmap, Some(map(100000)));
    let record = std::fs::read_to_string(root.join(STATE_DIR).join("a.vol")).unwrap();
    assert!(
        ["lost", "other", "plain"]
            .iter()
            .all(|t| !record.contains(&format!("pods/{t}"))),
        "{record}"
    );
    let again = mapped(&v, "a", "pods/lost", Some(100000));
    assert!(!v.bind(&again, &Cancel::never()).unwrap().already_mounted);
    let again = v.bind(&again, &Cancel::never()).unwrap();
    assert!(again.already_mounted);
}

/// A bind whose mount shows other mappings than recorded while the agent
/// runs (its mount id reused by a bind made behind the agent's back) is
/// no repeat: the target holds a mount that is not the agent's.
#[test]
fn a_repeat_checks_the_bind_is_idmapped_as_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake, root, _) = published_ext4(dir.path());
    for (t, host, behind) in [
        ("pods/lost", Some(100000), None),
        ("pods/other", Some(100000), Some(200000)),
        ("pods/plain", None, Some(100000)),
    ] {
        let req = mapped(&v, "a", t, host);
        v.bind(&req, &Cancel::never()).unwrap();
        assert!(v.bind(&req, &Cancel::never()).unwrap().already_mounted);
        fake.set_idmap_behind(&root.join(t), behind.map(map));
        let e = v.bind(&req, &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{t}: {e}");
    }
}

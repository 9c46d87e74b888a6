//! Publishes through the table.

use std::path::PathBuf;
use std::time::Duration;

use super::testkit::{fake_partitions, publish_loop, table};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::model::{RecursiveReadOnly, VolumeMode};
use crate::volumes::error::Error;
use crate::volumes::request::{BindRequest, PublishRequest, Source, Spec};
use crate::volumes::table::Volumes;
use crate::volumes::volume::tests::sample;

#[test]
fn partitions_that_overlap_are_one_volume() {
    if !crate::testutil::root_or_skip("partitions_that_overlap_are_one_volume") {
        return;
    }
    let (a, b, c) = (
        crate::testutil::LoopDisk::new(32, Some("ext4")),
        crate::testutil::LoopDisk::new(32, None),
        crate::testutil::LoopDisk::new(32, None),
    );
    let dir = tempfile::tempdir().unwrap();
    // a: sectors 2048..67584; b overlaps its end; c lies after both.
    let sysfs = fake_partitions(
        dir.path(),
        &[(&a, 2048, 65536), (&b, 60000, 8192), (&c, 68216, 100)],
    );
    let v = Volumes::open(&dir.path().join("root"), sysfs, crate::logging::discard()).unwrap();
    let block = |id: &str, d: &crate::testutil::LoopDisk| PublishRequest {
        spec: Spec {
            volume_id: id.into(),
            source: Source::Path(d.device.clone()),
            mode: VolumeMode::Block,
            options: crate::volumes::request::Options::parse(Vec::new(), false).unwrap(),
            fs_group: None,
        },
        timeout: Duration::from_secs(1),
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
    };
    assert!(matches!(
        v.bind(&b, &Cancel::never()),
        Err(crate::error::Error::Volume(Error::ShuttingDown))
    ));
}

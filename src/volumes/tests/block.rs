//! Block volumes through the table, on the fake kernel: the device's
//! read-only flag the agent sets, holds while published, and clears.

use rustix::io::Errno;

use super::testkit::{bind_request, fake_table, request};
use crate::cancel::Cancel;
use crate::code::Code;
use crate::validate::STATE_DIR;
use crate::volumes::fake::Call;

/// A read-only block volume: the flag is set before its node is bound,
/// and cleared after its binds and its own bind are down and the device
/// is flushed.
#[test]
fn a_read_only_block_volume_is_read_only_in_the_kernel_while_published() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkb", None);
    v.publish(&request("blk", &d, true, true), &Cancel::never())
        .unwrap();
    assert!(fake.read_only(&d));
    let listed = v.list();
    assert!(listed[0].block && listed[0].read_only);
    v.bind(&bind_request(&v, "blk", "pods/p/dev"), &Cancel::never())
        .unwrap();
    assert!(v.unpublish("blk", &Cancel::never()).unwrap());
    assert_eq!(
        fake.journal(&root),
        [
            "ro fkb on",
            "bind /dev/fkb volumes/blk",
            "bind volumes/blk pods/p/dev",
            "umount pods/p/dev",
            "umount volumes/blk",
            "flush fkb",
            "ro fkb off"
        ]
    );
    assert!(!fake.read_only(&d) && !root.join("volumes/blk").exists());
}

/// A block publish whose bind fails takes back the flag it set, and
/// leaves no record and no file; a disk the host made read-only is not
/// the agent's to make writable.
#[test]
fn a_failed_block_publish_clears_only_the_flag_it_set() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    let d = fake.disk(dir.path(), "fkb", None);
    fake.fail(Call::BindNode, 1, Errno::NOMEM);
    let e = v
        .publish(&request("blk", &d, true, true), &Cancel::never())
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e}");
    assert_eq!(
        fake.journal(&root),
        [
            "ro fkb on",
            "bind /dev/fkb volumes/blk failed",
            "ro fkb off"
        ]
    );
    assert!(!root.join("volumes/blk").exists() && !root.join(STATE_DIR).join("blk.vol").exists());
    // Read-only already (as the host attached it): the agent sets nothing,
    // and so clears nothing.
    v.publish(&request("blk", &d, true, false), &Cancel::never())
        .unwrap();
    assert!(v.unpublish("blk", &Cancel::never()).unwrap());
    fake.journal(&root);
    let ro = fake.disk(dir.path(), "fkr", None);
    let planted = fake.clone();
    let dev = ro.clone();
    fake.before(Call::OpenDisk, 1, move || {
        use crate::volumes::kernel::Kernel;
        let disk = planted.open_disk(&dev).unwrap();
        planted.set_read_only(&disk, &dev, true).unwrap();
    });
    v.publish(&request("host-ro", &ro, true, true), &Cancel::never())
        .unwrap();
    assert!(v.unpublish("host-ro", &Cancel::never()).unwrap());
    assert!(fake.read_only(&ro), "the host's flag stays");
    assert!(!fake.journal(&root).iter().any(|l| l == "ro fkr off"));
}

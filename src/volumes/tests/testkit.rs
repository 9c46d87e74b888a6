//! What the table's tests share: a table on a fresh root, a loop disk
//! published on it, and a fake sysfs whose partitions overlap.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cancel::Cancel;
use crate::model::testdisk::AgentDevice;
use crate::model::{FsType, VolumeMode};
use crate::sys::sysfs::Sysfs;
use crate::volumes::request::{Options, PublishRequest, Source, Spec};
use crate::volumes::table::Volumes;

pub(crate) fn table(root: &Path) -> std::sync::Arc<Volumes> {
    Volumes::open(root, Sysfs::system(), crate::logging::discard()).unwrap()
}

pub(crate) fn publish_loop(v: &Volumes, id: &str, disk: &crate::testutil::LoopDisk) {
    let req = PublishRequest {
        spec: Spec {
            volume_id: id.into(),
            source: Source::Path(disk.device.clone()),
            mode: VolumeMode::Filesystem(FsType::Ext4),
            options: Options::parse(Vec::new(), false).unwrap(),
            fs_group: None,
        },
        timeout: Duration::from_secs(1),
    };
    v.publish(&req, &Cancel::never()).unwrap();
}

/// A sysfs in which the real devices `parts` are partitions of one fake
/// disk at the given (start, sectors): what a hostile partition table
/// makes of a guest's disk.
pub(crate) fn fake_partitions(
    dir: &Path,
    parts: &[(&crate::testutil::LoopDisk, u64, u64)],
) -> Sysfs {
    let sysfs = Sysfs {
        sys_block: dir.join("sys/block"),
        dev_dir: PathBuf::from("/dev"),
        dev_block: dir.join("sys/dev/block"),
    };
    let disk = sysfs.sys_block.join("vdz");
    std::fs::create_dir_all(&disk).unwrap();
    std::fs::create_dir_all(&sysfs.dev_block).unwrap();
    std::fs::write(disk.join("dev"), "250:0\n").unwrap();
    for (i, (d, start, sectors)) in parts.iter().enumerate() {
        let dev = d.agent_device();
        let name = format!("vdz{}", i + 1);
        let p = disk.join(&name);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("partition"), format!("{}\n", i + 1)).unwrap();
        std::fs::write(p.join("start"), format!("{start}\n")).unwrap();
        std::fs::write(p.join("size"), format!("{sectors}\n")).unwrap();
        std::os::unix::fs::symlink(
            format!("../../block/vdz/{name}"),
            sysfs.dev_block.join(format!("{}:{}", dev.major, dev.minor)),
        )
        .unwrap();
    }
    sysfs
}

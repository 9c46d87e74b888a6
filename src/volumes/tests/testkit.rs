//! What the table's tests share: a table on a fresh root (on the real
//! kernel, or on the fake one), a loop disk published on it, requests, and
//! a fake sysfs whose partitions overlap.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cancel::Cancel;
use crate::error::Result;
use crate::model::testdisk::AgentDevice;
use crate::model::{Device, FsType, RecursiveReadOnly, VolumeMode};
use crate::sys::sysfs::Sysfs;
use crate::volumes::fake::Fake;
use crate::volumes::kernel::Kernel;
use crate::volumes::request::{BindOutcome, BindRequest, Options, PublishRequest, Source, Spec};
use crate::volumes::table::Volumes;

pub(crate) fn table(root: &Path) -> std::sync::Arc<Volumes> {
    Volumes::open(root, Sysfs::system(), crate::logging::discard()).unwrap()
}

pub(crate) fn publish_loop(v: &Volumes, id: &str, disk: &crust_testkit::LoopDisk) {
    let req = PublishRequest {
        spec: Spec {
            volume_id: id.into(),
            source: Source::Path(disk.device.clone()),
            mode: VolumeMode::Filesystem(FsType::Ext4),
            options: Options::parse(Vec::new(), false).unwrap(),
            fs_group: None,
            encryption: None,
            trim_interval_s: 0,
        },
        timeout: Duration::from_secs(1),
        key: None,
    };
    v.publish(&req, &Cancel::never()).unwrap();
}

/// A sysfs in which the real devices `parts` are partitions of one fake
/// disk at the given (start, sectors): what a hostile partition table
/// makes of a guest's disk.
pub(crate) fn fake_partitions(dir: &Path, parts: &[(&crust_testkit::LoopDisk, u64, u64)]) -> Sysfs {
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

/// The mapping the agent on `root` names volume `id`'s: tagged with the
/// identity of its state directory.
pub(crate) fn mapping_name(root: &Path, id: &str) -> String {
    use std::os::unix::fs::MetadataExt;
    let st = std::fs::metadata(root.join(crate::validate::STATE_DIR)).unwrap();
    crate::luks2::mapping::Owner::of_dir(st.dev(), st.ino()).name_for(id)
}

/// A table on a fresh root in `dir`, on a fake kernel, and that kernel.
pub(crate) fn fake_table(dir: &Path) -> (std::sync::Arc<Volumes<Fake>>, Fake) {
    let fake = Fake::default();
    (reopen(dir, &fake), fake)
}

/// What most tests on the fake kernel start from: the table, its kernel,
/// the table's root and the fake disk published on it.
pub(crate) type Published = (std::sync::Arc<Volumes<Fake>>, Fake, PathBuf, Device);

/// A table on a fake kernel in `dir` with volume `a` published on the fake
/// ext4 disk `fka`.
pub(crate) fn published_ext4(dir: &Path) -> Published {
    published(dir, "a", "fka", false)
}

/// A table on a fake kernel in `dir` with volume `blk` published read-only
/// on the unformatted fake disk `fkb`, as a block volume.
pub(crate) fn published_block(dir: &Path) -> Published {
    published(dir, "blk", "fkb", true)
}

fn published(dir: &Path, id: &str, disk: &str, block: bool) -> Published {
    let (v, fake, root, d) = with_disk(dir, disk, (!block).then_some(FsType::Ext4));
    v.publish(&request(id, &d, block, block), &Cancel::never())
        .unwrap();
    (v, fake, root, d)
}

/// A table on a fake kernel in `dir`, and a fake disk `disk` (with a
/// filesystem `fs`, or none) not yet published.
pub(crate) fn with_disk(dir: &Path, disk: &str, fs: Option<FsType>) -> Published {
    let (v, fake) = fake_table(dir);
    let root = v.root().to_path_buf();
    let d = fake.disk(dir, disk, fs);
    (v, fake, root, d)
}

/// The table on `dir`'s root opened again on `fake`, as after a restart:
/// recovery runs against what the fake has mounted. Its scheduled trims
/// run when the test calls `run_due_trims`, never on a thread.
pub(crate) fn reopen(dir: &Path, fake: &Fake) -> std::sync::Arc<Volumes<Fake>> {
    open_at(dir, fake, "root")
}

/// The table on root `dir/<root>` on `fake`: beside `reopen`'s, another
/// agent's in the same guest.
pub(crate) fn open_at(dir: &Path, fake: &Fake, root: &str) -> std::sync::Arc<Volumes<Fake>> {
    let sysfs = Sysfs {
        sys_block: dir.join("sys/block"),
        dev_dir: dir.join("dev"),
        dev_block: dir.join("sys/dev/block"),
    };
    Volumes::open_manual(
        fake.clone(),
        &dir.join(root),
        sysfs,
        crate::logging::discard(),
    )
    .unwrap()
}

/// A publish of `disk` (by its serial) as volume `id`: ext4, or a block
/// volume; read-write unless `read_only`.
pub(crate) fn request(id: &str, disk: &Device, block: bool, read_only: bool) -> PublishRequest {
    PublishRequest {
        spec: Spec {
            volume_id: id.into(),
            source: Source::Serial(disk.serial.clone().unwrap()),
            mode: if block {
                VolumeMode::Block
            } else {
                VolumeMode::Filesystem(FsType::Ext4)
            },
            options: Options::parse(Vec::new(), read_only).unwrap(),
            fs_group: None,
            encryption: None,
            trim_interval_s: 0,
        },
        timeout: Duration::from_millis(10),
        key: None,
    }
}

/// A bind of all of volume `id` at `target` (beneath `v`'s root).
pub(crate) fn bind_request<K: Kernel>(v: &Volumes<K>, id: &str, target: &str) -> BindRequest {
    BindRequest {
        volume_id: id.into(),
        subpath: PathBuf::new(),
        target: v.root().join(target),
        read_only: false,
        recursive_read_only: RecursiveReadOnly::Disabled,
        idmap: None,
    }
}

/// Binds all of volume `id` at `target` (beneath `v`'s root).
pub(crate) fn bind<K: Kernel>(v: &Volumes<K>, id: &str, target: &str) -> Result<BindOutcome> {
    v.bind(&bind_request(v, id, target), &Cancel::never())
}

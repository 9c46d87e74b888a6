//! A consistent snapshot taken the way a backup tool takes one, and free
//! space given back, in a real guest: the agent freezes an ext4 and an xfs
//! whose journals hold an fsGroup walk's changes, the host copies the image
//! files while they are frozen, the agent thaws them; the ext4 copy needs
//! no journal replay, the xfs copy only the covering records every xfs
//! freeze leaves (util-linux's fsfreeze too), and both hold every change
//! made before the freeze. Then a
//! trim in the guest punches the holes of deleted blocks into the host's
//! image file (QEMU's discard "unmap", which the hot-plug asks for).
//! Run with `make test` (these tests need `make initrd` output and root).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_testkit::vm::{boot, ctx};
use crust_testkit::{allocated, run};

/// A formatted image holding `data/` with many files owned by 1234, and a
/// 64 MiB file written and deleted on the host (its blocks stay allocated
/// in the image file: the host's loop mount does not discard).
fn image(dir: &Path, name: &str, fs: &str, mib: u64) -> PathBuf {
    crust_testkit::vm::image(dir, name, fs, mib, |m| {
        for d in 0..20 {
            std::fs::create_dir_all(m.join(format!("data/d{d}"))).unwrap();
            for f in 0..50 {
                std::fs::write(m.join(format!("data/d{d}/f{f}")), b"x").unwrap();
            }
        }
        std::fs::write(m.join("data/hello"), b"hello").unwrap();
        std::fs::write(m.join("big"), vec![0x5a; 64 << 20]).unwrap();
        run("sync", &[]);
        std::fs::remove_file(m.join("big")).unwrap();
        run(
            "chown",
            &["-R", "1234:1234", m.join("data").to_str().unwrap()],
        );
    })
}

/// A publish of the disk with `serial` with fsGroup 4321.
fn publish(c: &AgentClient, id: &str, serial: &str, fs: &str) -> pb::PublishVolumeResponse {
    crust_testkit::vm::publish(c, id, serial, fs, Some(4321)).unwrap()
}

/// The group of `rel` in the image, mounted read-only without log replay
/// (the copy is checked clean first, so there is nothing to replay).
fn group_in(img: &Path, fs: &str, rel: &str) -> u32 {
    let m = img.with_extension("check");
    std::fs::create_dir_all(&m).unwrap();
    let opts = if fs == "xfs" {
        "loop,ro,norecovery,nouuid"
    } else {
        "loop,ro,noload"
    };
    run(
        "mount",
        &["-o", opts, img.to_str().unwrap(), m.to_str().unwrap()],
    );
    let md = std::fs::symlink_metadata(m.join(rel));
    run("umount", &[m.to_str().unwrap()]);
    md.unwrap().gid()
}

/// Mounts and unmounts an xfs image, so its log is replayed.
fn replay_xfs_log(img: &Path) {
    let m = img.with_extension("replay");
    std::fs::create_dir_all(&m).unwrap();
    run(
        "mount",
        &[
            "-o",
            "loop,nouuid",
            img.to_str().unwrap(),
            m.to_str().unwrap(),
        ],
    );
    run("umount", &[m.to_str().unwrap()]);
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_snapshot_taken_while_frozen_needs_no_replay_and_trim_gives_blocks_back() {
    let tmp = tempfile::tempdir().unwrap();
    let ext4 = image(tmp.path(), "ext4.img", "ext4", 256);
    let xfs = image(tmp.path(), "xfs.img", "xfs", 320);
    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    vm.hotplug(&ext4, "ser-ext4", false).unwrap();
    vm.hotplug(&xfs, "ser-xfs", false).unwrap();
    // The fsGroup walk changes every entry: the journals hold it.
    for (id, serial, fs) in [("e", "ser-ext4", "ext4"), ("x", "ser-xfs", "xfs")] {
        let own = publish(&c, id, serial, fs).ownership.unwrap();
        assert!(own.changed >= 1000, "{id}: {own:?}");
    }

    let mut f = pb::FreezeVolumesRequest::new();
    f.volume_ids = vec!["e".into(), "x".into()];
    f.timeout_ms = 120_000;
    let frozen = c.freeze_volumes(ctx(), &f).unwrap();
    // The backup tool's copy, on the host, while the guest is frozen.
    let copies: Vec<(PathBuf, &str)> = [(&ext4, "ext4"), (&xfs, "xfs")]
        .into_iter()
        .map(|(img, fs)| {
            let copy = img.with_extension("snap");
            std::fs::copy(img, &copy).unwrap();
            (copy, fs)
        })
        .collect();
    let mut t = pb::ThawVolumesRequest::new();
    t.freeze_id = frozen.freeze_id.clone();
    let thawed = c.thaw_volumes(ctx(), &t).unwrap();
    assert_eq!(thawed.thawed.len(), 2, "{frozen:?}");

    for (copy, fs) in &copies {
        let p = copy.to_str().unwrap();
        if *fs == "ext4" {
            let features = run("dumpe2fs", &["-h", p]);
            let line = features
                .lines()
                .find(|l| l.starts_with("Filesystem features"))
                .unwrap();
            assert!(!line.contains("needs_recovery"), "{line}");
            run("e2fsck", &["-f", "-n", p]);
        } else {
            // A frozen xfs keeps a covered log (the dummy records of
            // xfs_log_cover) and its lazy superblock counters, so
            // `xfs_repair -n` on the copy reports "valuable metadata
            // changes in a log" and a free-block count off by the
            // counters: util-linux's fsfreeze leaves the same on this
            // kernel (6.1), checked by hand. The copy is checked after the
            // replay of that log (a mount and unmount), as any restore
            // mounts it: clean, and holding every change.
            replay_xfs_log(copy);
            run("xfs_repair", &["-n", "-f", p]);
        }
        assert_eq!(group_in(copy, fs, "data/d19/f49"), 4321, "{fs}");
        assert_eq!(group_in(copy, fs, "data/hello"), 4321, "{fs}");
    }

    // Trim: the deleted 64 MiB leave the image files.
    for (id, img) in [("e", &ext4), ("x", &xfs)] {
        let before = allocated(img);
        let mut r = pb::TrimVolumeRequest::new();
        r.volume_id = id.into();
        let out = c.trim_volume(ctx(), &r).unwrap();
        let after = allocated(img);
        assert!(
            before.saturating_sub(after) >= 60 << 20,
            "{id}: the image holds {before} then {after} bytes after a trim of {} bytes",
            out.trimmed_bytes
        );
    }
    let mut h = pb::GetVolumeHealthRequest::new();
    h.volume_id = "e".into();
    assert!(c.get_volume_health(ctx(), &h).unwrap().health.is_empty());
    vm.down().unwrap();
}

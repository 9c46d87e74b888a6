//! Hostile disks against the real agent on loop devices: superblocks that ask
//! for a panic on error, plant mount options, name other devices, hold the
//! mount for minutes (ext4 MMP), or claim more than the disk holds; and a
//! disk that shrinks under its mounted filesystem. Nothing here lets the host
//! kernel read a corrupt block: the corrupt-block case runs in the guest only
//! (vm/tests/hostile.rs).

mod support;

use std::time::{Duration, Instant};

use support::*;

/// A mount of `disk` (by device node), as mountinfo has it.
struct Mount {
    /// Per-superblock options ("rw,errors=remount-ro").
    super_options: String,
}

fn mount_of(disk: &LoopDisk) -> Option<Mount> {
    let table = std::fs::read("/proc/self/mountinfo").unwrap();
    String::from_utf8_lossy(&table).lines().find_map(|line| {
        // "… - fstype source super_options"
        let (_, tail) = line.split_once(" - ")?;
        let mut f = tail.split(' ');
        let (_fs, source, super_options) = (f.next()?, f.next()?, f.next()?);
        (source == disk.path()).then(|| Mount {
            super_options: super_options.to_string(),
        })
    })
}

/// A loop disk made by `mkfs` (`mkfs.ext4`, `mkfs.ext3`, `mkfs.ext2`), then
/// `tune2fs` with `tune` (no corruption: the host never meets an error).
fn ext_disk(mkfs: &str, tune: &[&str]) -> LoopDisk {
    let disk = LoopDisk::new(64, None);
    run(mkfs, &["-q", "-F", &disk.path()]);
    if !tune.is_empty() {
        let dev = disk.path();
        let args: Vec<&str> = tune.iter().copied().chain([dev.as_str()]).collect();
        run("tune2fs", &args);
    }
    disk
}

fn expand_req(id: &str, bytes: i64) -> pb::ExpandVolumeRequest {
    let mut r = pb::ExpandVolumeRequest::new();
    r.volume_id = id.into();
    r.required_bytes = bytes;
    r.timeout_ms = 2000;
    r
}

#[test]
#[ignore = "needs root: make test runs it"]
fn the_agent_decides_what_an_ext4_error_does_not_the_superblock() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    // (mkfs, tune2fs, request options, the super option mountinfo must show)
    let cases: &[(&str, &[&str], &[&str], &str)] = &[
        ("mkfs.ext4", &["-e", "panic"], &[], "errors=remount-ro"),
        (
            "mkfs.ext4",
            &["-E", "mount_opts=errors=panic"],
            &[],
            "errors=remount-ro",
        ),
        ("mkfs.ext3", &["-e", "panic"], &[], "errors=remount-ro"),
        (
            "mkfs.ext3",
            &["-E", "mount_opts=errors=panic"],
            &[],
            "errors=remount-ro",
        ),
        (
            "mkfs.ext2",
            &["-e", "panic"],
            &["noatime"],
            "errors=remount-ro",
        ),
        (
            "mkfs.ext2",
            &["-E", "mount_opts=errors=panic"],
            &[],
            "errors=remount-ro",
        ),
        // The caller's choice is honoured.
        (
            "mkfs.ext4",
            &["-e", "panic"],
            &["errors=continue"],
            "errors=continue",
        ),
        (
            "mkfs.ext4",
            &["-E", "mount_opts=errors=panic"],
            &["errors=remount-ro"],
            "errors=remount-ro",
        ),
        // s_errors remount-ro with errors=panic planted: the driver's full list says it.
        (
            "mkfs.ext4",
            &["-e", "remount-ro", "-E", "mount_opts=errors=panic"],
            &[],
            "",
        ),
    ];
    let mut bad = Vec::new();
    for (i, (mkfs, tune, opts, want)) in cases.iter().enumerate() {
        let what = format!("{mkfs} + tune2fs {tune:?}, options {opts:?}");
        let disk = ext_disk(mkfs, tune);
        let id = format!("hostile-errors-{i}");
        let mut req = publish_req(&id, &disk.path(), "ext4");
        req.mount_options = opts.iter().map(|o| o.to_string()).collect();
        let r = c.publish_volume(ctx(), &req);
        if r.is_err() {
            bad.push(format!("{what}: publish answered {}", said(&r)));
            continue;
        }
        let super_options = mount_of(&disk).map(|m| m.super_options).unwrap_or_default();
        // What the ext4 driver has in force, defaults included.
        let in_force =
            std::fs::read_to_string(format!("/proc/fs/ext4/{}/options", disk.name())).unwrap();
        let _ = c.unpublish_volume(ctx(), &unpublish_req(&id));
        if super_options.contains("errors=panic") || in_force.lines().any(|l| l == "errors=panic") {
            bad.push(format!(
                "{what}: mounted with errors=panic ({super_options})"
            ));
        }
        if !want.is_empty() && !super_options.split(',').any(|o| o == *want) {
            bad.push(format!(
                "{what}: super options {super_options:?}, not {want}"
            ));
        }
        let want_in_force = if want.is_empty() {
            "errors=remount-ro"
        } else {
            want
        };
        if !in_force.lines().any(|l| l == want_in_force) {
            bad.push(format!(
                "{what}: in force {in_force:?}, not {want_in_force}"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_filesystem_larger_than_its_device_is_refused_naming_both_sizes() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    for (fs, mb) in [("ext4", 64u64), ("xfs", 320)] {
        let disk = LoopDisk::new(mb, Some(fs));
        disk.resize(mb - 16);
        for opts in [&[][..], &["noatime", "discard"]] {
            let mut req = publish_req("hostile-big", &disk.path(), fs);
            req.mount_options = opts.iter().map(|o| o.to_string()).collect();
            let r = c.publish_volume(ctx(), &req);
            let got = said(&r);
            assert!(
                got.starts_with("FAILED_PRECONDITION")
                    && got.contains(&format!("{} bytes", mb << 20))
                    && got.contains(&format!("{} bytes", (mb - 16) << 20)),
                "{fs} with {opts:?}: {got}"
            );
            assert!(mount_of(&disk).is_none(), "{fs}: mounted anyway");
        }
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn expand_after_the_disk_shrank_is_out_of_range_and_stats_say_so() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    for (fs, mb) in [("ext4", 64u64), ("xfs", 320)] {
        let id = format!("hostile-shrunk-{fs}");
        let disk = LoopDisk::new(mb, Some(fs));
        c.publish_volume(ctx(), &publish_req(&id, &disk.path(), fs))
            .unwrap();
        let s = c.get_volume_stats(ctx(), &stats_req(&id)).unwrap();
        assert!(!s.condition.abnormal, "{fs}: {:?}", s.condition);
        disk.resize(mb - 16);
        // To the device's size, and to no more than the filesystem already has.
        for bytes in [0, 1 << 20] {
            let r = c.expand_volume(ctx(), &expand_req(&id, bytes));
            let got = said(&r);
            assert!(
                got.starts_with("OUT_OF_RANGE")
                    && got.contains(&format!("only {} bytes", (mb - 16) << 20)),
                "{fs}, expand to {bytes}: {got}"
            );
        }
        let s = c.get_volume_stats(ctx(), &stats_req(&id)).unwrap();
        assert!(
            s.condition.abnormal
                && s.condition
                    .message
                    .contains("the filesystem is larger than its device"),
            "{fs}: {:?}",
            s.condition
        );
        disk.resize(mb);
        let s = c.get_volume_stats(ctx(), &stats_req(&id)).unwrap();
        assert!(!s.condition.abnormal, "{fs}: {:?}", s.condition);
        assert!(
            c.unpublish_volume(ctx(), &unpublish_req(&id))
                .unwrap()
                .was_published
        );
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn hostile_superblocks_are_refused_before_anything_is_mounted() {
    needs::loop_devices_and_mkfs();
    let a = Agent::start();
    let c = a.client();
    let journal = LoopDisk::new(16, None);
    run(
        "mke2fs",
        &[
            "-q",
            "-F",
            "-O",
            "journal_dev",
            "-b",
            "4096",
            &journal.path(),
        ],
    );
    let with_journal = LoopDisk::new(64, None);
    run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-b",
            "4096",
            "-J",
            &format!("device={}", journal.path()),
            &with_journal.path(),
        ],
    );
    let log = LoopDisk::new(64, None);
    let with_log = LoopDisk::new(320, None);
    run(
        "mkfs.xfs",
        &[
            "-q",
            "-f",
            "-l",
            &format!("logdev={}", log.path()),
            &with_log.path(),
        ],
    );
    // After any unclean stop the kernel would sleep 720 s in mount(2).
    let mmp = LoopDisk::with_mkfs(
        64,
        Some("ext4"),
        &["-O", "mmp", "-E", "mmp_update_interval=300"],
    );
    let planted = ext_disk("mkfs.ext4", &["-E", "mount_opts=journal_dev=1793"]);
    let stalls = ext_disk("mkfs.ext4", &["-E", "mount_opts=max_batch_time=4000000000"]);
    let cases: [(&LoopDisk, &str, &str); 6] = [
        (&with_journal, "ext4", "external journal"),
        (&journal, "ext4", "external journal"),
        (&with_log, "xfs", "external log"),
        (&mmp, "ext4", "720 s"),
        (&planted, "ext4", "journal_dev=1793"),
        (&stalls, "ext4", "max_batch_time"),
    ];
    for (disk, fs, says) in cases {
        let started = Instant::now();
        let r = c.publish_volume(ctx(), &publish_req("hostile-sb", &disk.path(), fs));
        let got = said(&r);
        if r.is_ok() || mount_of(disk).is_some() {
            let _ = c.unpublish_volume(ctx(), &unpublish_req("hostile-sb"));
        }
        assert!(
            got.starts_with("FAILED_PRECONDITION") && got.contains(says),
            "{} ({fs}): {got}",
            disk.path()
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{}: took {:?}",
            disk.path(),
            started.elapsed()
        );
        assert!(mount_of(disk).is_none());
    }
    // The same other devices named in the request are refused as malformed.
    let disk = LoopDisk::new(320, Some("xfs"));
    for (fs, opt, d) in [
        ("xfs", format!("logdev={}", log.path()), &disk),
        (
            "ext4",
            format!("journal_path={}", journal.path()),
            &with_journal,
        ),
        ("ext4", "journal_dev=1793".to_string(), &with_journal),
    ] {
        let mut req = publish_req("hostile-opt", &d.path(), fs);
        req.mount_options = vec![opt.clone()];
        let r = c.publish_volume(ctx(), &req);
        assert_eq!(code(r), "INVALID_ARGUMENT", "{opt}");
        assert!(mount_of(d).is_none());
    }
    // An option the kernel does not know is named in the answer.
    let mut req = publish_req("hostile-opt", &disk.path(), "xfs");
    req.mount_options = vec!["noatime".into(), "no_such_xfs_option".into()];
    let m = message(c.publish_volume(ctx(), &req));
    assert!(m.contains("\"no_such_xfs_option\""), "{m}");
    assert!(mount_of(&disk).is_none());
}

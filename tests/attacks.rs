//! Targeted attacks on the agent through its public interface: symlinks
//! planted where it mounts, unmounts and deletes; a root reached through a
//! symlink; racing and stale binds; mounts it did not make; hostile names,
//! options and state files. Each test checks that nothing outside the root
//! was mounted, unmounted, created, deleted or chowned (the sentinel of
//! tests/support/rig.rs), and that the volume stays manageable.

mod support;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use crust_agent::validate::STATE_DIR;
use crust_protocols::crust_ttrpc::AgentClient;
use support::rig::{disk_with_tree, mount_table, Disk, Rig};
use support::*;

/// A started agent and one published ext4 volume `id`.
fn scene(id: &str) -> (LoopDisk, Disk, Rig) {
    let disk = disk_with_tree(64, "ext4", 0);
    let d = Disk::of(&disk, "ext4");
    let mut rig = Rig::new();
    rig.start();
    rig.client()
        .publish_volume(ctx(), &publish_req(id, &d.path, "ext4"))
        .expect("publish");
    (disk, d, rig)
}

/// The topmost mount at `path`, as (majmin, root).
fn mount_at(path: &Path) -> Option<(String, String)> {
    mount_table()
        .into_iter()
        .rev()
        .find(|m| m.mount_point == path)
        .map(|m| (m.majmin, m.root))
}

fn rw_bind(id: &str, target: &Path) -> pb::BindMountRequest {
    bind_req(id, target, "", false, pb::RecursiveReadOnly::DISABLED)
}

fn assert_clean(rig: &Rig, when: &str, c: &AgentClient, disks: &[Disk], ids: &[&str]) {
    rig.assert_invariant(when, c, disks, ids, None);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_symlink_at_the_guest_path_does_not_lead_outside() {
    needs::loop_devices_and_mkfs();
    let disk = disk_with_tree(64, "ext4", 20);
    let d = Disk::of(&disk, "ext4");
    let mut rig = Rig::new();
    rig.start();
    let c = rig.client();
    let victim = rig.outside.join("victim");
    let gp = rig.guest_path("atk-evil");
    std::os::unix::fs::symlink(&victim, &gp).unwrap();
    let mut req = publish_req("atk-evil", &d.path, "ext4");
    req.fs_group = fs_group(4242, pb::FsGroupChangePolicy::ALWAYS);
    let r = c.publish_volume(ctx(), &req);
    // Whatever the answer: nothing mounted or chowned outside the root.
    let bad = rig.problems(&c, std::slice::from_ref(&d), &["atk-evil"], None);
    assert!(
        bad.is_empty(),
        "publish over a symlinked guest path answered {}; {}",
        said(&r),
        rig.report("after the publish", &bad)
    );
    if r.is_ok() {
        assert_eq!(
            mount_at(&gp).map(|m| m.0),
            Some(d.majmin.clone()),
            "publish succeeded, but the disk is not mounted at the real guest path {}",
            gp.display()
        );
        let u = c
            .unpublish_volume(ctx(), &unpublish_req("atk-evil"))
            .unwrap();
        assert!(u.was_published);
    }
    assert!(mounts_of(&d.path).is_empty(), "{:?}", mounts_of(&d.path));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn unpublish_through_a_parent_swapped_for_a_symlink_deletes_nothing_outside() {
    needs::loop_devices_and_mkfs();
    let (_disk, d, mut rig) = scene("atk-swap");
    let c = rig.client();
    let pod = rig.root.join("pods/p");
    let (t1, t2) = (pod.join("t1"), pod.join("t2"));
    c.bind_mount(ctx(), &rw_bind("atk-swap", &t1)).unwrap();
    c.bind_mount(ctx(), &rw_bind("atk-swap", &t2)).unwrap();
    // Behind the agent's back: the pod directory moves away (its binds with
    // it) and a symlink to outside takes its name, where directories t1 and
    // t2 wait to be deleted by a path-following agent.
    std::fs::rename(&pod, rig.root.join("pods/p.moved")).unwrap();
    let decoy = rig.outside.join("victim");
    std::fs::create_dir(decoy.join("t1")).unwrap();
    std::fs::create_dir(decoy.join("t2")).unwrap();
    std::os::unix::fs::symlink(&decoy, &pod).unwrap();
    rig.resnapshot();

    let un = c.unmount(ctx(), &unmount_req(t1.display().to_string()));
    let bad = rig.sentinel_problems();
    assert!(
        bad.is_empty(),
        "Unmount of {} answered {}; {}",
        t1.display(),
        said(&un),
        rig.report("after Unmount", &bad)
    );
    let up = c.unpublish_volume(ctx(), &unpublish_req("atk-swap"));
    let bad = rig.sentinel_problems();
    assert!(
        bad.is_empty(),
        "UnpublishVolume answered {}; {}",
        said(&up),
        rig.report("after UnpublishVolume", &bad)
    );
    // Its own binds, moved or not, are still its own: nothing of the disk is left.
    assert!(
        up.as_ref().is_ok_and(|u| u.was_published),
        "unpublish answered {}",
        said(&up)
    );
    let left: Vec<String> = mount_table()
        .iter()
        .filter(|m| m.majmin == d.majmin)
        .map(|m| format!("{} (root {})", m.mount_point.display(), m.root))
        .collect();
    assert!(
        left.is_empty(),
        "unpublish answered was_published=true, but the disk is still mounted at {left:?}"
    );
}

#[test]
#[ignore = "needs root: make test runs it"]
fn unmount_through_an_overmounted_parent_unmounts_nothing_outside() {
    needs::loop_devices_and_mkfs();
    let (_disk, d, mut rig) = scene("atk-over");
    let c = rig.client();
    // The bind's last component is named like the sentinel's own mount.
    let target = rig.root.join("pods/p/mnt");
    c.bind_mount(ctx(), &rw_bind("atk-over", &target)).unwrap();
    // Behind the agent's back: a tmpfs over pods/ in which p is a symlink to
    // outside. mountinfo still lists the bind at its old path, but that path
    // now resolves to the sentinel's tmpfs.
    let pods = rig.root.join("pods");
    run(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            "size=1m",
            "atk",
            pods.to_str().unwrap(),
        ],
    );
    std::os::unix::fs::symlink(&rig.outside, pods.join("p")).unwrap();
    rig.resnapshot();

    let un = c.unmount(ctx(), &unmount_req(target.display().to_string()));
    let bad = rig.sentinel_problems();
    assert!(
        bad.is_empty(),
        "Unmount of {} answered {}; {}",
        target.display(),
        said(&un),
        rig.report("after Unmount", &bad)
    );
    let up = c.unpublish_volume(ctx(), &unpublish_req("atk-over"));
    let bad = rig.sentinel_problems();
    assert!(
        bad.is_empty(),
        "UnpublishVolume answered {}; {}",
        said(&up),
        rig.report("after UnpublishVolume", &bad)
    );
    assert!(
        mount_at(&rig.outside.join("mnt")).is_some(),
        "the sentinel's mount is gone"
    );
    let _ = d;
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_root_through_a_symlinked_parent_really_unmounts() {
    needs::loop_devices_and_mkfs();
    let disk = disk_with_tree(64, "ext4", 0);
    let d = Disk::of(&disk, "ext4");
    let mut rig = Rig::with_root(|w| {
        std::fs::create_dir(w.join("real")).unwrap();
        std::os::unix::fs::symlink(w.join("real"), w.join("link")).unwrap();
        w.join("link/root")
    });
    assert_ne!(rig.root, rig.root_arg);
    rig.start();
    let c = rig.client();
    let r = c
        .publish_volume(ctx(), &publish_req("atk-link", &d.path, "ext4"))
        .unwrap();
    let gp = rig.guest_path("atk-link");
    assert_eq!(mount_at(&gp).map(|m| m.0), Some(d.majmin.clone()));
    assert_eq!(
        Path::new(&r.guest_path).canonicalize().ok(),
        Some(gp.clone()),
        "the guest path {} is not where the disk is mounted",
        r.guest_path
    );
    // A bind spelled through the root as the agent was given it (a client
    // knows no other), or, if the agent insists, through the real path.
    let spelled = rig.root_arg.join("pods/t");
    let real = rig.root.join("pods/t");
    let target = match c.bind_mount(ctx(), &rw_bind("atk-link", &spelled)) {
        Ok(_) => spelled,
        Err(e) => {
            assert_eq!(code(Err::<(), _>(e)), "INVALID_ARGUMENT");
            c.bind_mount(ctx(), &rw_bind("atk-link", &real)).unwrap();
            real.clone()
        }
    };
    assert_eq!(mount_at(&real).map(|m| m.0), Some(d.majmin.clone()));
    let un = c.unmount(ctx(), &unmount_req(target.display().to_string()));
    assert!(
        un.as_ref().is_ok_and(|u| u.was_mounted) && mount_at(&real).is_none(),
        "Unmount of {} answered {}, and at {} there is still {:?} (majmin, root)",
        target.display(),
        said(&un),
        real.display(),
        mount_at(&real)
    );
    let up = c
        .unpublish_volume(ctx(), &unpublish_req("atk-link"))
        .unwrap();
    assert!(up.was_published);
    assert!(
        mounts_of(&d.path).is_empty(),
        "unpublish answered was_published=true, but the disk is still mounted at {:?}",
        mounts_of(&d.path)
    );
    let bad = rig.sentinel_problems();
    assert!(bad.is_empty(), "{}", rig.report("at the end", &bad));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn two_volumes_racing_for_one_target_never_both_win() {
    needs::loop_devices_and_mkfs();
    let (_a, da, rig) = scene("atk-ra");
    let b = disk_with_tree(64, "ext4", 0);
    let db = Disk::of(&b, "ext4");
    rig.client()
        .publish_volume(ctx(), &publish_req("atk-rb", &db.path, "ext4"))
        .unwrap();
    const TRIES: usize = 40;
    let barrier = Arc::new(Barrier::new(2));
    let racers: Vec<_> = ["atk-ra", "atk-rb"]
        .into_iter()
        .map(|id| {
            let (barrier, addr, root) = (barrier.clone(), rig.addr(), rig.root.clone());
            std::thread::spawn(move || {
                let c = connect(&addr).unwrap();
                (0..TRIES)
                    .map(|i| {
                        let t = root.join(format!("race/t{i}"));
                        barrier.wait();
                        let r = c.bind_mount(ctx(), &rw_bind(id, &t));
                        barrier.wait();
                        r
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<Vec<_>> = racers.into_iter().map(|t| t.join().unwrap()).collect();
    let c = rig.client();
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    let table = mount_table();
    let mut bad = Vec::new();
    for i in 0..TRIES {
        let t = rig.root.join(format!("race/t{i}"));
        let wins = results.iter().filter(|r| r[i].is_ok()).count();
        let stacked = table.iter().filter(|m| m.mount_point == t).count();
        let owners: Vec<&str> = list
            .volumes
            .iter()
            .filter(|v| v.bind_targets.iter().any(|b| Path::new(b) == t))
            .map(|v| v.volume_id.as_str())
            .collect();
        if wins > 1 || stacked > 1 || owners.len() > 1 {
            bad.push(format!(
                "try {i}: atk-ra got {}, atk-rb got {}; {stacked} mounts at {}, listed by {owners:?}",
                said(&results[0][i]),
                said(&results[1][i]),
                t.display()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {TRIES} races for one target let both volumes in:\n{}",
        bad.len(),
        bad.join("\n")
    );
    assert_clean(
        &rig,
        "after the races",
        &c,
        &[da, db],
        &["atk-ra", "atk-rb"],
    );
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_removed_behind_the_agents_back_is_not_already_mounted() {
    needs::loop_devices_and_mkfs();
    let (_disk, d, rig) = scene("atk-stale");
    let c = rig.client();
    let t = rig.root.join("pods/stale");
    c.bind_mount(ctx(), &rw_bind("atk-stale", &t)).unwrap();
    run("umount", &[t.to_str().unwrap()]);
    assert!(mount_at(&t).is_none());
    let r = c.bind_mount(ctx(), &rw_bind("atk-stale", &t));
    let now = mount_at(&t);
    if r.is_ok() {
        assert!(
            now.as_ref().is_some_and(|m| m.0 == d.majmin),
            "the repeated bind answered {} while at {} there is {} (the volume is {})",
            said(&r),
            t.display(),
            now.as_ref()
                .map_or("nothing mounted".to_string(), |m| format!(
                    "a mount of {}",
                    m.0
                )),
            d.majmin
        );
    }
    assert_clean(&rig, "after the repeated bind", &c, &[d], &["atk-stale"]);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn unmount_of_a_mount_the_agent_did_not_make_is_refused() {
    needs::loop_devices_and_mkfs();
    let mut rig = Rig::new();
    rig.start();
    let c = rig.client();
    let foreign = rig.root.join("pods/foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    run(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            "size=1m",
            "foreign",
            foreign.to_str().unwrap(),
        ],
    );
    let r = c.unmount(ctx(), &unmount_req(foreign.display().to_string()));
    let still = mount_at(&foreign);
    assert!(
        r.is_err() && still.is_some(),
        "Unmount of a tmpfs the agent did not make answered {}; the tmpfs is {}",
        said(&r),
        if still.is_some() {
            "still mounted"
        } else {
            "gone"
        }
    );
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_target_inside_another_volumes_bind_is_refused() {
    needs::loop_devices_and_mkfs();
    let (_a, da, rig) = scene("atk-outer");
    let b = disk_with_tree(64, "ext4", 0);
    let db = Disk::of(&b, "ext4");
    let c = rig.client();
    c.publish_volume(ctx(), &publish_req("atk-inner", &db.path, "ext4"))
        .unwrap();
    let outer = rig.root.join("pods/outer");
    c.bind_mount(ctx(), &rw_bind("atk-outer", &outer)).unwrap();
    let inner = outer.join("inner");
    let r = c.bind_mount(ctx(), &rw_bind("atk-inner", &inner));
    let written = rig.guest_path("atk-outer").join("inner").exists();
    assert!(
        r.is_err() && mount_at(&inner).is_none() && !written,
        "a bind inside volume atk-outer's bind answered {}; mounted there: {:?} (majmin, root); \
         the node it needs was created inside volume atk-outer: {written}",
        said(&r),
        mount_at(&inner)
    );
    assert_clean(
        &rig,
        "after the refused bind",
        &c,
        &[da, db],
        &["atk-outer", "atk-inner"],
    );
}

/// `<root>/long/xxx…/xxx` of exactly `len` bytes, in 200-byte components.
fn long_target(root: &Path, len: usize) -> PathBuf {
    let mut s = root.join("long").display().to_string();
    while s.len() < len {
        let n = (len - s.len() - 1).clamp(1, 200);
        s.push('/');
        s.push_str(&"x".repeat(n));
    }
    assert_eq!(s.len(), len);
    PathBuf::from(s)
}

#[test]
#[ignore = "needs root: make test runs it"]
fn bind_targets_longer_than_path_max_are_invalid() {
    needs::loop_devices_and_mkfs();
    let (_disk, d, rig) = scene("atk-long");
    let c = rig.client();
    let mut bad = Vec::new();
    for len in [4097, 4200, 5000] {
        let t = long_target(&rig.root, len);
        let r = said(&c.bind_mount(ctx(), &rw_bind("atk-long", &t)));
        if !r.starts_with("INVALID_ARGUMENT") {
            bad.push(format!("a {len}-byte target answered {r}"));
        }
    }
    let leftovers: Vec<String> = mount_table()
        .iter()
        .filter(|m| m.majmin == d.majmin && m.mount_point != rig.guest_path("atk-long"))
        .map(|m| format!("{} bytes", m.mount_point.as_os_str().len()))
        .collect();
    if !leftovers.is_empty() {
        bad.push(format!("binds left behind at paths of {leftovers:?}"));
    }
    if rig.root.join("long").exists() {
        bad.push(format!("{} was created", rig.root.join("long").display()));
    }
    let up = c.unpublish_volume(ctx(), &unpublish_req("atk-long"));
    if !up.as_ref().is_ok_and(|u| u.was_published) || !mounts_of(&d.path).is_empty() {
        bad.push(format!(
            "the volume could not be unpublished afterwards: {}; still mounted at {} places",
            said(&up),
            mount_table()
                .iter()
                .filter(|m| m.majmin == d.majmin)
                .count()
        ));
    }
    // 200-byte components make unreadable messages: shorten them.
    let long = "x".repeat(200);
    let bad: Vec<String> = bad.iter().map(|b| b.replace(&long, "x{200}")).collect();
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn errors_panic_is_refused() {
    needs::loop_devices_and_mkfs();
    let disk = disk_with_tree(64, "ext4", 0);
    let d = Disk::of(&disk, "ext4");
    let mut rig = Rig::new();
    rig.start();
    let c = rig.client();
    for opts in [
        &["errors=panic"][..],
        &["noatime,errors=panic"],
        &["noatime", "errors=panic"],
    ] {
        let mut req = publish_req("atk-panic", &d.path, "ext4");
        req.mount_options = opts.iter().map(|o| o.to_string()).collect();
        let r = c.publish_volume(ctx(), &req);
        let mounted = !mounts_of(&d.path).is_empty();
        if r.is_ok() || mounted {
            // Take it down at once: a filesystem error would now panic the host.
            let _ = c.unpublish_volume(ctx(), &unpublish_req("atk-panic"));
        }
        let got = said(&r);
        assert!(
            got.starts_with("INVALID_ARGUMENT") && !mounted,
            "mount options {opts:?} answered {got} (mounted: {mounted}); errors=panic must be refused"
        );
    }
}

/// Replaces `from` by `to` in every state file; returns how many files changed.
fn edit_state(rig: &Rig, from: &str, to: &str) -> usize {
    let mut n = 0;
    for (p, b) in rig.state_files() {
        let text = String::from_utf8_lossy(&b);
        if text.contains(from) {
            std::fs::write(&p, text.replace(from, to)).unwrap();
            n += 1;
        }
    }
    n
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_state_file_naming_a_target_outside_the_root_is_not_trusted() {
    needs::loop_devices_and_mkfs();
    let (_disk, d, mut rig) = scene("atk-state");
    let c = rig.client();
    let t = rig.root.join("pods/s");
    c.bind_mount(ctx(), &rw_bind("atk-state", &t)).unwrap();
    drop(c);
    rig.kill9();
    // Outside the root, the same disk is mounted (by someone else), and the
    // state file now names that place as the volume's bind.
    let victim = rig.outside.join("victim");
    run(
        "mount",
        &[
            "--bind",
            rig.guest_path("atk-state").to_str().unwrap(),
            victim.to_str().unwrap(),
        ],
    );
    rig.allow_outside_mount(&victim);
    rig.resnapshot();
    let edited = edit_state(
        &rig,
        &t.display().to_string(),
        &victim.display().to_string(),
    );
    assert!(
        edited > 0,
        "no state file names the bind target {}: this test must learn where the agent writes it",
        t.display()
    );
    rig.start();
    let c = rig.client();
    // Adopted or cleaned up, but nothing unaccounted and nothing listed outside.
    // (Which file says what is the agent's business after a tampered state:
    // the state directory is not compared here.)
    assert_clean(&rig, "after the restart", &c, std::slice::from_ref(&d), &[]);
    let listed = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap()
        .volumes
        .iter()
        .any(|v| v.volume_id == "atk-state");
    let up = c.unpublish_volume(ctx(), &unpublish_req("atk-state"));
    let bad = rig.sentinel_problems();
    assert!(
        bad.is_empty(),
        "UnpublishVolume answered {}; {}",
        said(&up),
        rig.report("after UnpublishVolume", &bad)
    );
    assert!(
        up.as_ref().is_ok_and(|u| u.was_published == listed),
        "the volume is {}listed, and unpublish answered {}",
        if listed { "" } else { "not " },
        said(&up)
    );
    run("umount", &[victim.to_str().unwrap()]);
    let bad = rig.manageability_problems(&c, &[("atk-state", &d)]);
    assert!(bad.is_empty(), "{}", rig.report("(d)", &bad));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn an_undecodable_state_file_leaves_the_volume_manageable() {
    needs::loop_devices_and_mkfs();
    let (_disk, d, mut rig) = scene("atk-garbled");
    let c = rig.client();
    c.bind_mount(ctx(), &rw_bind("atk-garbled", &rig.root.join("pods/g")))
        .unwrap();
    drop(c);
    rig.kill9();
    let mut garbled = 0;
    for (p, b) in rig.state_files() {
        if support::rig::mentions(&String::from_utf8_lossy(&b), "atk-garbled")
            || support::rig::mentions(&p.to_string_lossy(), "atk-garbled")
        {
            std::fs::write(&p, b"\xff\xfe\x00 not a state file\n=\n=\t=").unwrap();
            garbled += 1;
        }
    }
    assert!(garbled > 0, "no state file names volume atk-garbled");
    rig.start();
    let c = rig.client();
    let listed = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap()
        .volumes
        .iter()
        .any(|v| v.volume_id == "atk-garbled");
    // Taken back from mountinfo or cleaned up: either way, nothing orphaned
    // (an undecodable file names no volume the test could check against).
    let bad = rig.problems(&c, std::slice::from_ref(&d), &[], None);
    assert!(
        bad.is_empty(),
        "after a restart with an undecodable state file (volume listed: {listed}): {}",
        rig.report("after the restart", &bad)
    );
    let bad = rig.manageability_problems(&c, &[("atk-garbled", &d)]);
    assert!(bad.is_empty(), "{}", rig.report("(d)", &bad));
}

/// Every mount of `d`'s disk, anywhere: (mount point, root).
fn mounts_of_disk(d: &Disk) -> Vec<String> {
    mount_table()
        .iter()
        .filter(|m| support::rig::disk_majmin(m) == d.majmin)
        .map(|m| format!("{} (root {})", m.mount_point.display(), m.root))
        .collect()
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_moved_by_renaming_its_parent_is_taken_down() {
    needs::loop_devices_and_mkfs();
    let (_disk, d, rig) = scene("atk-moved");
    let c = rig.client();
    let (p, q) = (rig.root.join("pods/p"), rig.root.join("pods/q"));
    let (t1, t2) = (p.join("t1"), q.join("t2"));
    c.bind_mount(ctx(), &rw_bind("atk-moved", &t1)).unwrap();
    c.bind_mount(ctx(), &rw_bind("atk-moved", &t2)).unwrap();
    // Behind the agent's back, each bind's parent is renamed, and nothing
    // takes its old name: the old paths are simply gone.
    std::fs::rename(&p, rig.root.join("pods/p.moved")).unwrap();
    std::fs::rename(&q, rig.root.join("pods/q.moved")).unwrap();
    let moved1 = rig.root.join("pods/p.moved/t1");
    assert_eq!(mount_at(&moved1).map(|m| m.0), Some(d.majmin.clone()));

    let un = c.unmount(ctx(), &unmount_req(t1.display().to_string()));
    assert!(
        un.as_ref().is_ok_and(|u| u.was_mounted) && mount_at(&moved1).is_none(),
        "Unmount of {} (its parent renamed) answered {}; at {} there is still {:?}",
        t1.display(),
        said(&un),
        moved1.display(),
        mount_at(&moved1)
    );
    let up = c.unpublish_volume(ctx(), &unpublish_req("atk-moved"));
    let left = mounts_of_disk(&d);
    assert!(
        up.as_ref().is_ok_and(|u| u.was_published) && left.is_empty(),
        "UnpublishVolume answered {}, and the disk is still mounted at {left:?}",
        said(&up)
    );
    assert_clean(&rig, "after the unpublish", &c, &[d], &["atk-moved"]);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_moved_under_a_name_that_is_not_utf8_is_taken_down() {
    needs::loop_devices_and_mkfs();
    if !own_mount_namespace() {
        return;
    }
    use std::os::unix::ffi::OsStrExt;
    let odd = |s: &[u8]| std::ffi::OsStr::from_bytes(s).to_os_string();
    let (_disk, d, mut rig) = scene("atk-odd");
    let c = rig.client();
    let (t1, t2, t3) = (
        rig.root.join("pods/a/t1"),
        rig.root.join("pods/b/t2"),
        rig.root.join("pods/c/t3"),
    );
    for t in [&t1, &t2, &t3] {
        c.bind_mount(ctx(), &rw_bind("atk-odd", t)).unwrap();
    }
    let pods = rig.root.join("pods");
    let renamed = |from: &str, to: &[u8]| {
        let to = pods.join(odd(to));
        std::fs::rename(pods.join(from), &to).unwrap();
        to
    };
    // One old path gone, one with something else at it, both renamed to
    // names that are not UTF-8 (a space and a newline among them, which
    // mountinfo escapes).
    let m1 = renamed("a", b"\xff\xfe a").join("t1");
    let m2 = renamed("b", b"b\n\xc3(").join("t2");
    std::fs::create_dir_all(&t2).unwrap();
    let un1 = c.unmount(ctx(), &unmount_req(t1.display().to_string()));
    let un2 = c.unmount(ctx(), &unmount_req(t2.display().to_string()));
    assert!(
        un1.as_ref().is_ok_and(|u| u.was_mounted)
            && un2.as_ref().is_ok_and(|u| u.was_mounted)
            && mount_at(&m1).is_none()
            && mount_at(&m2).is_none(),
        "Unmount of binds moved under names that are not UTF-8 answered {} and {}; mounts of the disk: {:?}",
        said(&un1),
        said(&un2),
        mounts_of_disk(&d)
    );
    // The third is moved while the agent is down: the restart takes it down.
    drop(c);
    rig.kill9();
    let m3 = renamed("c", b"c\x80").join("t3");
    rig.start();
    let c = rig.client();
    assert!(
        mount_at(&m3).is_none(),
        "a bind moved to {:?} while the agent was down is still mounted after a restart; log:\n{}",
        m3,
        rig.log_tail(20)
    );
    let up = c.unpublish_volume(ctx(), &unpublish_req("atk-odd"));
    let left = mounts_of_disk(&d);
    assert!(
        up.as_ref().is_ok_and(|u| u.was_published) && left.is_empty(),
        "UnpublishVolume answered {}, and the disk is still mounted at {left:?}",
        said(&up)
    );
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_foreign_mount_whose_path_is_not_utf8_breaks_nothing() {
    needs::loop_devices_and_mkfs();
    if !own_mount_namespace() {
        return;
    }
    use std::os::unix::ffi::OsStrExt;
    let elsewhere = tempfile::tempdir().unwrap();
    let odd = elsewhere
        .path()
        .join(std::ffi::OsStr::from_bytes(b"foreign \xff\xfe\tmount"));
    std::fs::create_dir(&odd).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "foreign"])
        .arg(&odd)
        .status()
        .unwrap();
    assert!(status.success());
    let disk = disk_with_tree(64, "ext4", 10);
    let d = Disk::of(&disk, "ext4");
    let mut rig = Rig::new();
    rig.start();
    let c = rig.client();
    let mut req = publish_req("atk-foreign", &d.path, "ext4");
    req.fs_group = fs_group(4321, pb::FsGroupChangePolicy::ALWAYS);
    let p = c.publish_volume(ctx(), &req);
    assert!(p.is_ok(), "publish answered {}", said(&p));
    let t = rig.root.join("pods/f");
    let b = c.bind_mount(ctx(), &rw_bind("atk-foreign", &t));
    assert!(b.is_ok(), "bind answered {}", said(&b));
    let st = c
        .get_volume_stats(ctx(), &stats_req("atk-foreign"))
        .unwrap();
    assert!(
        !st.condition.abnormal,
        "the condition is {:?}",
        st.condition.message
    );
    assert_clean(
        &rig,
        "with a foreign mount",
        &c,
        std::slice::from_ref(&d),
        &["atk-foreign"],
    );
    // A restart takes the volume back, with the foreign mount still there.
    drop(c);
    rig.kill9();
    rig.start();
    let c = rig.client();
    assert_clean(
        &rig,
        "after a restart",
        &c,
        std::slice::from_ref(&d),
        &["atk-foreign"],
    );
    let un = c.unmount(ctx(), &unmount_req(t.display().to_string()));
    assert!(
        un.as_ref().is_ok_and(|u| u.was_mounted),
        "unmount answered {}",
        said(&un)
    );
    let up = c.unpublish_volume(ctx(), &unpublish_req("atk-foreign"));
    assert!(
        up.as_ref().is_ok_and(|u| u.was_published),
        "unpublish answered {}",
        said(&up)
    );
    assert!(mounts_of_disk(&d).is_empty());
    assert!(
        is_mount(&odd),
        "the foreign mount is not the agent's to touch"
    );
    let _ = rustix::mount::unmount(&odd, rustix::mount::UnmountFlags::DETACH);
}

/// Publishing `req` is refused: its sectors are volume `holder`'s.
fn refused(c: &AgentClient, req: pb::PublishVolumeRequest, holder: &str, when: &str) {
    let r = c.publish_volume(ctx(), &req);
    let got = said(&r);
    assert!(
        got.starts_with("FAILED_PRECONDITION") && got.contains(holder),
        "{when}: publishing {} as {} answered {got}; it shares sectors with volume {holder}",
        req.device_path(),
        req.volume_id
    );
}

/// Publishes in flight claim their sectors too: the whole disk and its
/// partition (`disks`, in that order) racing, never both win.
fn never_both_win_a_race(rig: &Rig, c: &AgentClient, disks: &[Disk; 2]) {
    let [whole, part] = disks;
    let (whole, p) = (whole.path.as_str(), part.path.as_str());
    let ids = ["atk-part", "atk-whole"];
    for round in 0..8 {
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = [
            publish_req("atk-whole", whole, "block"),
            publish_req("atk-part", p, "ext4"),
        ]
        .into_iter()
        .map(|req| {
            let (barrier, addr) = (barrier.clone(), rig.addr());
            std::thread::spawn(move || {
                let c = connect(&addr).unwrap();
                barrier.wait();
                c.publish_volume(ctx(), &req).is_ok()
            })
        })
        .collect();
        let won: Vec<bool> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            !(won[0] && won[1]),
            "round {round}: the whole disk and its partition were both published"
        );
        assert_clean(rig, &format!("after race {round}"), c, disks, &ids);
        for id in ids {
            c.unpublish_volume(ctx(), &unpublish_req(id)).unwrap();
        }
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_disk_and_its_partition_are_never_both_published() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, None);
    let part = disk.add_partition();
    run("mkfs.ext4", &["-q", "-F", part.to_str().unwrap()]);
    let p = part.display().to_string();
    let whole = Disk {
        path: disk.path(),
        majmin: support::rig::majmin(&disk.device),
        fs: "block".into(),
    };
    let pd = Disk {
        path: p.clone(),
        majmin: support::rig::majmin(&part),
        fs: "ext4".into(),
    };
    let disks = [whole.clone(), pd.clone()];
    let ids = ["atk-part", "atk-whole"];
    let mut rig = Rig::new();
    rig.start();

    // The partition first, then the whole disk: refused, as a filesystem
    // or as a block volume.
    let c = rig.client();
    c.publish_volume(ctx(), &publish_req("atk-part", &p, "ext4"))
        .unwrap();
    refused(
        &c,
        publish_req("atk-whole", &whole.path, "block"),
        "atk-part",
        "partition first",
    );
    refused(
        &c,
        publish_req("atk-whole", &whole.path, "ext4"),
        "atk-part",
        "partition first",
    );
    // The same after a restart: a volume taken back claims its sectors.
    drop(c);
    rig.kill9();
    rig.start();
    let c = rig.client();
    refused(
        &c,
        publish_req("atk-whole", &whole.path, "block"),
        "atk-part",
        "after a restart",
    );
    assert_clean(&rig, "with the partition published", &c, &disks, &ids);
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("atk-part"))
            .unwrap()
            .was_published
    );

    // The whole disk first, then its partition.
    c.publish_volume(ctx(), &publish_req("atk-whole", &whole.path, "block"))
        .unwrap();
    refused(
        &c,
        publish_req("atk-part", &p, "ext4"),
        "atk-whole",
        "whole disk first",
    );
    refused(
        &c,
        publish_req("atk-part", &p, "block"),
        "atk-whole",
        "whole disk first",
    );
    assert!(
        mounts_of(&p).is_empty(),
        "the partition's filesystem is mounted: {:?}",
        mounts_of(&p)
    );
    assert_clean(&rig, "with the whole disk published", &c, &disks, &ids);
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("atk-whole"))
            .unwrap()
            .was_published
    );

    never_both_win_a_race(&rig, &c, &disks);

    // The partition mounted by someone else: the whole disk is refused.
    let host = disk.scratch("host");
    run("mount", &[&p, host.to_str().unwrap()]);
    let r = c.publish_volume(ctx(), &publish_req("atk-whole", &whole.path, "block"));
    run("umount", &[host.to_str().unwrap()]);
    let got = said(&r);
    assert!(
        got.starts_with("FAILED_PRECONDITION") && got.contains(&host.display().to_string()),
        "publishing the whole disk while its partition is mounted at {} answered {got}",
        host.display()
    );
}

/// Fills the filesystem holding `dir` with a new file `dir/<name>` until a write fails.
fn fill(dir: &Path, name: &str) {
    use std::io::Write;
    let mut f = std::fs::File::create_new(dir.join(name)).unwrap();
    let block = vec![0u8; 4096];
    while f.write_all(&block).is_ok() {}
    let _ = f.sync_all();
}

fn agent_info(c: &AgentClient) -> pb::GetAgentInfoResponse {
    c.get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .unwrap()
}

/// The volume ids of the full-state test.
const FULL_STATE_IDS: [&str; 3] = ["atk-full1", "atk-full2", "atk-full3"];

/// The root's state directory on a small filesystem of its own (64 KiB).
fn small_state_fs(rig: &Rig) -> PathBuf {
    let state = rig.root.join(STATE_DIR);
    std::fs::create_dir_all(&state).unwrap();
    run(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            "size=64k,mode=700",
            "crust-state",
            state.to_str().unwrap(),
        ],
    );
    state
}

/// kill -9 with the state filesystem full: recovery cannot write its
/// records, and comes up all the same, with the volume left published
/// (bound at `t2`); its unpublish works. The new client.
fn comes_up_on_a_full_state(
    rig: &mut Rig,
    c: AgentClient,
    disks: &[Disk],
    t2: &Path,
) -> AgentClient {
    drop(c);
    rig.kill9();
    rig.start();
    let c = rig.client();
    let info = agent_info(&c);
    assert!(
        info.state_problem.contains("no space"),
        "GetAgentInfo says nothing of the state it cannot write: {:?}",
        info.state_problem
    );
    assert_clean(
        rig,
        "after a restart on a full state filesystem",
        &c,
        disks,
        &FULL_STATE_IDS,
    );
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap()
        .volumes;
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].bind_targets, vec![t2.display().to_string()]);
    let up = c.unpublish_volume(ctx(), &unpublish_req(FULL_STATE_IDS[0]));
    assert!(
        up.as_ref().is_ok_and(|u| u.was_published) && mounts_of(&disks[0].path).is_empty(),
        "unpublish after a restart on a full state filesystem answered {}",
        said(&up)
    );
    assert_clean(rig, "after the unpublish", &c, disks, &FULL_STATE_IDS);
    c
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_full_state_filesystem_changes_nothing_and_the_agent_still_starts() {
    needs::loop_devices_and_mkfs();
    let (d1, d2, d3) = (
        disk_with_tree(64, "ext4", 0),
        disk_with_tree(64, "ext4", 0),
        disk_with_tree(64, "ext4", 0),
    );
    let disks = [
        Disk::of(&d1, "ext4"),
        Disk::of(&d2, "ext4"),
        Disk::of(&d3, "ext4"),
    ];
    let ids = FULL_STATE_IDS;
    let mut rig = Rig::new();
    let state = small_state_fs(&rig);
    rig.start();
    let c = rig.client();
    let pods = rig.root.join("pods");
    let (t1, t2, t3, u1) = (
        pods.join("t1"),
        pods.join("t2"),
        pods.join("t3"),
        pods.join("u1"),
    );
    c.publish_volume(ctx(), &publish_req(ids[0], &disks[0].path, "ext4"))
        .unwrap();
    c.publish_volume(ctx(), &publish_req(ids[1], &disks[1].path, "ext4"))
        .unwrap();
    for (id, t) in [(ids[0], &t1), (ids[0], &t2), (ids[1], &u1)] {
        c.bind_mount(ctx(), &rw_bind(id, t)).unwrap();
    }
    assert_eq!(agent_info(&c).state_problem, "");
    fill(&state, "filler");

    // Unmount: the bind comes down, and the table says so.
    let un = c.unmount(ctx(), &unmount_req(t1.display().to_string()));
    assert_clean(
        &rig,
        &format!("after Unmount answered {}", said(&un)),
        &c,
        &disks,
        &ids,
    );
    assert!(
        un.as_ref().is_ok_and(|u| u.was_mounted) && mount_at(&t1).is_none(),
        "Unmount with a full state filesystem answered {}",
        said(&un)
    );
    // What needs a new record is refused, with a code that says so, and changes nothing.
    let b = c.bind_mount(ctx(), &rw_bind(ids[0], &t3));
    assert!(
        said(&b).starts_with("RESOURCE_EXHAUSTED") && mount_at(&t3).is_none() && !t3.exists(),
        "a bind with a full state filesystem answered {}",
        said(&b)
    );
    let p = c.publish_volume(ctx(), &publish_req(ids[2], &disks[2].path, "ext4"));
    assert!(
        said(&p).starts_with("RESOURCE_EXHAUSTED") && mounts_of(&disks[2].path).is_empty(),
        "a publish with a full state filesystem answered {}; mounted at {:?}",
        said(&p),
        mounts_of(&disks[2].path)
    );
    // Unpublish needs no space.
    let up = c.unpublish_volume(ctx(), &unpublish_req(ids[1]));
    assert!(
        up.as_ref().is_ok_and(|u| u.was_published) && mounts_of(&disks[1].path).is_empty(),
        "unpublish with a full state filesystem answered {}; mounted at {:?}",
        said(&up),
        mounts_of(&disks[1].path)
    );
    assert_clean(&rig, "with a full state filesystem", &c, &disks, &ids);
    assert!(!agent_info(&c).state_problem.is_empty());
    // (The record the unpublish removed freed some space: taken again.)
    fill(&state, "filler2");

    let c = comes_up_on_a_full_state(&mut rig, c, &disks, &t2);

    // Space again: everything works, and the problem is gone.
    std::fs::remove_file(state.join("filler")).unwrap();
    std::fs::remove_file(state.join("filler2")).unwrap();
    c.publish_volume(ctx(), &publish_req(ids[2], &disks[2].path, "ext4"))
        .unwrap();
    assert_eq!(agent_info(&c).state_problem, "");
    assert_clean(&rig, "with space again", &c, &disks, &ids);
}

//! Idmapped binds attacked through the real agent on loop devices: binds
//! racing at one target and for one volume's range bound, hostile mapping
//! sets at the kernel's edges, the namespace's child killed from outside,
//! and restarts over records and mounts changed while the agent was down.

mod support;

use std::path::Path;
use std::sync::Arc;

use crust_protocols::crust_ttrpc::AgentClient;
use support::*;

fn range(container_id: u32, host_id: u32, length: u32) -> pb::IDMapping {
    pb::IDMapping {
        container_id,
        host_id,
        length,
        ..Default::default()
    }
}

/// A bind of `id` at `target` with the pod map `0 → host, 65536` (none
/// for `host` None).
fn mapped(id: &str, target: &Path, host: Option<u32>) -> pb::BindMountRequest {
    let mut r = bind_req(id, target, "", false, pb::RecursiveReadOnly::DISABLED);
    if let Some(h) = host {
        r.uid_mappings = vec![range(0, h, 65536)];
        r.gid_mappings = vec![range(0, h, 65536)];
    }
    r
}

fn published(c: &AgentClient, id: &str, disk: &LoopDisk) {
    c.publish_volume(ctx(), &publish_req(id, &disk.path(), "ext4"))
        .unwrap();
}

/// Each of `reqs` sent at once, from a client of its own: the answers, in order.
fn at_once(a: &Agent, reqs: Vec<pb::BindMountRequest>) -> Vec<Result<bool, String>> {
    let gate = Arc::new(std::sync::Barrier::new(reqs.len()));
    let threads: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let (c, gate) = (a.client(), gate.clone());
            std::thread::spawn(move || {
                gate.wait();
                match c.bind_mount(ctx(), &r) {
                    Ok(out) => Ok(out.already_mounted),
                    e => Err(code(e)),
                }
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Binds at one target, racing with other mappings, none, and from another
/// volume: exactly one is made, each other is ALREADY_EXISTS (or, asking
/// the winner's parameters, already mounted), and one mount is there.
#[test]
#[ignore = "needs root: make test runs it"]
fn binds_racing_at_one_target_make_one() {
    needs::loop_devices_and_mkfs();
    let (d1, d2) = (
        LoopDisk::new(64, Some("ext4")),
        LoopDisk::new(64, Some("ext4")),
    );
    let a = Agent::start();
    let c = a.client();
    published(&c, "v1", &d1);
    published(&c, "v2", &d2);
    let t = a.root.join("pods/p/vol");
    for round in 0..10 {
        let reqs = vec![
            mapped("v1", &t, Some(100000)),
            mapped("v1", &t, Some(200000)),
            mapped("v1", &t, None),
            mapped("v2", &t, Some(100000)),
            mapped("v2", &t, None),
            mapped("v1", &t, Some(100000)),
        ];
        let out = at_once(&a, reqs.clone());
        let made: Vec<usize> = (0..out.len()).filter(|&i| out[i] == Ok(false)).collect();
        assert_eq!(made.len(), 1, "round {round}: {out:?}");
        let winner = &reqs[made[0]];
        for (r, o) in reqs.iter().zip(&out) {
            if r == winner {
                assert!(o.is_ok(), "round {round}: {out:?}");
            } else {
                assert_eq!(
                    o,
                    &Err("ALREADY_EXISTS".to_string()),
                    "round {round}: {out:?}"
                );
            }
        }
        let listed: Vec<_> = volumes(&c).into_iter().flat_map(|v| v.binds).collect();
        assert_eq!(listed.len(), 1, "round {round}");
        assert_eq!(listed[0].uid_mappings, winner.uid_mappings);
        let held = mounts_of(&d1.path()).len() + mounts_of(&d2.path()).len();
        assert_eq!(held, 3, "round {round}: two volumes and one bind");
        assert!(
            c.unmount(ctx(), &unmount_req(t.display().to_string()))
                .unwrap()
                .was_mounted
        );
    }
}

/// Binds of one volume racing for its range bound: as many as fit are
/// made, the rest RESOURCE_EXHAUSTED, and what is held stays under it.
#[test]
#[ignore = "needs root: make test runs it"]
fn binds_racing_hold_the_range_bound() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&c, "w", &disk);
    let reqs: Vec<_> = (0..16)
        .map(|i| {
            let mut r = mapped("w", &a.root.join(format!("pods/{i}")), Some(100000));
            r.uid_mappings = (0..340).map(|k| range(k, 1000 + k, 1)).collect();
            r
        })
        .collect();
    let out = at_once(&a, reqs);
    let fits = 4096 / 341;
    let made = out.iter().filter(|o| **o == Ok(false)).count();
    let refused = out
        .iter()
        .filter(|o| **o == Err("RESOURCE_EXHAUSTED".to_string()))
        .count();
    assert_eq!((made, refused), (fits, 16 - fits), "{out:?}");
    let held: usize = volumes(&c)[0]
        .binds
        .iter()
        .map(|b| b.uid_mappings.len() + b.gid_mappings.len())
        .sum();
    assert!(held <= 4096, "{held}");
    assert_eq!(mounts_of(&disk.path()).len(), 1 + fits);
}

/// `n` ranges of length 1 whose text (`inside outside length` lines) is
/// exactly `bytes` long, or None where that cannot be had.
fn ranges_of_text(bytes: usize) -> Vec<pb::IDMapping> {
    // 24 bytes a line: ten digits, ten digits, length 1.
    let full = (bytes - 15) / 24;
    let rest = bytes - full * 24;
    let mut v: Vec<_> = (0..u32::try_from(full).unwrap())
        .map(|i| range(1_000_000_000 + i, 3_000_000_000 + i, 1))
        .collect();
    // A last line of `rest` bytes (15 to 38): widths of its two ids.
    let c_digits = (rest - 4) / 2;
    let h_digits = rest - 4 - c_digits;
    let first = |d: usize| 10u32.pow(u32::try_from(d - 1).unwrap());
    v.push(range(first(c_digits), first(h_digits) + 7, 1));
    let text: usize = v
        .iter()
        .map(|r| format!("{} {} {}\n", r.container_id, r.host_id, r.length).len())
        .sum();
    assert_eq!(text, bytes);
    v
}

/// Mapping sets at the edges: what the rules take the kernel takes (the
/// bind is made), and each refusal is INVALID_ARGUMENT with nothing made.
#[test]
#[ignore = "needs root: make test runs it"]
fn mapping_sets_at_the_edges() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&c, "e", &disk);
    let pod = vec![range(0, 100000, 65536)];
    let good: Vec<Vec<pb::IDMapping>> = vec![
        (0..340).map(|i| range(i, 1000 + i, 1)).collect(),
        vec![range(4294967294, 4294967294, 1)],
        vec![range(0, 4294967294, 1)],
        vec![range(4294967285, 4294967285, 10)],
        vec![range(0, 0, u32::MAX)],
        vec![range(0, 100, 10), range(10, 90, 10)],
        ranges_of_text(4095),
    ];
    for (i, uids) in good.into_iter().enumerate() {
        let t = a.root.join(format!("pods/good{i}"));
        let mut r = mapped("e", &t, None);
        (r.uid_mappings, r.gid_mappings) = (uids.clone(), pod.clone());
        let out = c.bind_mount(ctx(), &r);
        assert!(out.is_ok(), "{i}: {out:?}");
        (r.uid_mappings, r.gid_mappings) = (pod.clone(), uids);
        let t2 = a.root.join(format!("pods/good{i}g"));
        r.target = t2.display().to_string();
        let out = c.bind_mount(ctx(), &r);
        assert!(out.is_ok(), "{i} as gids: {out:?}");
    }
    let before = mounts_of(&disk.path()).len();
    let bad: Vec<Vec<pb::IDMapping>> = vec![
        (0..341).map(|i| range(i, 1000 + i, 1)).collect(),
        vec![range(0, 4294967286, 10)],
        vec![range(4294967286, 0, 10)],
        vec![range(0, 1, u32::MAX)],
        vec![
            range(0, 100, u32::MAX / 2 + 1),
            range(u32::MAX / 2 + 1, 0, u32::MAX / 2),
        ],
        vec![range(0, 100, 10), range(9, 200, 10)],
        vec![range(0, 100, 0)],
        ranges_of_text(4096),
        ranges_of_text(4097),
    ];
    for (i, uids) in bad.into_iter().enumerate() {
        let t = a.root.join(format!("pods/bad{i}"));
        let mut r = mapped("e", &t, None);
        (r.uid_mappings, r.gid_mappings) = (uids, pod.clone());
        let out = c.bind_mount(ctx(), &r);
        assert!(out.is_err(), "{i}: {out:?}");
        assert_eq!(code(out), "INVALID_ARGUMENT", "{i}");
        assert!(!t.exists(), "{i}");
    }
    assert_eq!(mounts_of(&disk.path()).len(), before);
    assert!(a.log().lines().all(|l| !l.contains("panic")));
}

/// The agent's children (pids), from /proc.
fn children_of(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
        }
    }
    out
}

fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count()
}

/// An idmapped bind made and taken down: whether the bind was made, and
/// the code where it was not.
fn bind_and_unmount(c: &AgentClient, t: &Path) -> Result<(), String> {
    let r = c.bind_mount(ctx(), &mapped("k", t, Some(100000)));
    if r.is_err() {
        return Err(format!("{}: {}", code(r.clone()), message(r)));
    }
    // The volume's root, root's on disk, is the pod's root through the bind.
    assert_eq!(crust_testkit::ids::owner(t), (100000, 100000));
    c.unmount(ctx(), &unmount_req(t.display().to_string()))
        .unwrap();
    Ok(())
}

/// The namespace's child killed from outside at any moment: a bind fails
/// cleanly or is made, and afterwards binds work, with no child, fd or
/// thread left over.
#[test]
#[ignore = "needs root: make test runs it"]
fn the_namespace_child_killed_from_outside() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&c, "k", &disk);
    let t = a.root.join("pods/k");
    bind_and_unmount(&c, &t).unwrap();
    let pid = a.child.id();
    let (fds, threads) = (a.fd_count(), threads_of(pid));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let killer = std::thread::spawn(move || {
        let mut killed = 0;
        while !s.load(std::sync::atomic::Ordering::SeqCst) {
            for child in children_of(pid) {
                // SAFETY: kill(2) with plain integers.
                if unsafe { libc::kill(child, libc::SIGKILL) } == 0 {
                    killed += 1;
                }
            }
        }
        killed
    });
    let mut failed = Vec::new();
    for _ in 0..300 {
        if let Err(e) = bind_and_unmount(&c, &t) {
            failed.push(e);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let killed = killer.join().unwrap();
    eprintln!(
        "killed {killed}, failed {}: {:?}",
        failed.len(),
        failed.first()
    );
    for _ in 0..20 {
        bind_and_unmount(&c, &t).unwrap();
    }
    assert_eq!(children_of(pid), Vec::<i32>::new());
    assert_eq!((a.fd_count(), threads_of(pid)), (fds, threads));
    assert!(!is_mount(&t));
    assert_eq!(mounts_of(&disk.path()).len(), 1);
}

/// The namespace's child stopped from outside (SIGSTOP, a debugger
/// attaching): the bind still ends, and the next bind works.
#[test]
#[ignore = "needs root: make test runs it"]
fn the_namespace_child_stopped_from_outside() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&c, "k", &disk);
    let t = a.root.join("pods/k");
    let pid = a.child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = a.client();
    let t2 = t.clone();
    std::thread::spawn(move || {
        for _ in 0..50 {
            let _ = bind_and_unmount(&c2, &t2);
        }
        let _ = tx.send(());
    });
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let (mut stopped, mut done) = (0, false);
    while !done && std::time::Instant::now() < until {
        done = rx.try_recv().is_ok();
        for child in children_of(pid) {
            // SAFETY: kill(2) with plain integers.
            if unsafe { libc::kill(child, libc::SIGSTOP) } == 0 {
                stopped += 1;
            }
        }
    }
    assert!(stopped > 0);
    assert!(
        done || rx.recv_timeout(std::time::Duration::from_secs(10)).is_ok(),
        "binds hang on a stopped child: {:?}",
        children_of(pid)
    );
    bind_and_unmount(&c, &t).unwrap();
    assert_eq!(children_of(pid), Vec::<i32>::new());
}

/// The agent killed with an idmapped bind in place, and the bind replaced
/// while it was down by `replace` (of the agent's root, the volume's guest
/// path and the target), a bind that reuses its mount id: the restart
/// does not take it for its own, and a bind there is made again.
fn replaced_while_down(replace: impl FnOnce(&Path, &Path, &Path)) {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&c, "r", &disk);
    let t = a.root.join("pods/r");
    c.bind_mount(ctx(), &mapped("r", &t, Some(100000))).unwrap();
    let id = |p: &Path| {
        let table = crust_agent::sys::mountinfo::read().unwrap();
        crust_agent::sys::mountinfo::mount_at(&table, p).map(|e| e.mount_id)
    };
    let before = id(&t);
    let (root, gp) = (a.root.clone(), a.root.join("volumes/r"));
    let dir = a.kill9();
    run("umount", &[t.to_str().unwrap()]);
    replace(&root, &gp, &t);
    if id(&t) != before {
        eprintln!("the mount id was not reused: the test proves less");
    }
    let b = Agent::start_in(dir);
    let c = b.client();
    let v = &volumes(&c)[0];
    assert!(v.binds.is_empty(), "{:?}\n{}", v.binds, b.log());
    assert!(!is_mount(&t), "{}", b.log());
    let again = c.bind_mount(ctx(), &mapped("r", &t, Some(100000))).unwrap();
    assert!(!again.already_mounted);
    assert_eq!(crust_testkit::ids::owner(&t), (100000, 100000));
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_replaced_by_a_plain_one_while_down_is_not_adopted() {
    replaced_while_down(|_, gp, t| {
        run(
            "mount",
            &["--bind", gp.to_str().unwrap(), t.to_str().unwrap()],
        );
    });
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_replaced_by_one_of_other_mappings_while_down_is_not_adopted() {
    replaced_while_down(other_idmapped_bind);
}

/// An idmapped bind of the volume at `gp` onto `t` (beneath `root`), with
/// the pod map `0 → 200000`, made as the agent makes one.
fn other_idmapped_bind(root: &Path, gp: &Path, t: &Path) {
    use crust_agent::model::{IdMap, IdRange, RecursiveReadOnly};
    use rustix::fs::{open, Mode, OFlags};
    let dir = |p: &Path| {
        open(
            p,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    };
    let (src, base) = (dir(gp), dir(root));
    let r = vec![IdRange {
        container_id: 0,
        host_id: 200000,
        length: 65536,
    }];
    let map = IdMap {
        uids: r.clone(),
        gids: r,
    };
    crust_agent::mount::bind::bind(&crust_agent::mount::bind::BindSpec {
        source_root: std::os::fd::AsFd::as_fd(&src),
        source_path: gp,
        subpath: Path::new(""),
        target_base: std::os::fd::AsFd::as_fd(&base),
        target_rel: t.strip_prefix(root).unwrap(),
        target_path: t,
        read_only: false,
        recursive_read_only: RecursiveReadOnly::Disabled,
        idmap: Some(&map),
    })
    .unwrap();
}

/// An idmapped bind replaced behind the running agent's back by a bind of
/// the same volume that reuses its mount id (plain, or of other mappings):
/// a repeat is not answered already mounted.
#[test]
#[ignore = "needs root: make test runs it"]
fn a_bind_replaced_behind_the_agents_back_is_no_repeat() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&c, "r", &disk);
    let gp = a.root.join("volumes/r");
    let replace: [&dyn Fn(&Path); 2] = [
        &|t| {
            run(
                "mount",
                &["--bind", gp.to_str().unwrap(), t.to_str().unwrap()],
            )
            .truncate(0)
        },
        &|t| other_idmapped_bind(&a.root, &gp, t),
    ];
    for (i, replace) in replace.iter().enumerate() {
        let t = a.root.join(format!("pods/{i}"));
        let req = mapped("r", &t, Some(100000));
        c.bind_mount(ctx(), &req).unwrap();
        run("umount", &[t.to_str().unwrap()]);
        replace(&t);
        let again = c.bind_mount(ctx(), &req);
        assert!(
            !again.as_ref().is_ok_and(|r| r.already_mounted),
            "{i}: {again:?}"
        );
        run("umount", &[t.to_str().unwrap()]);
    }
}

/// A record whose `bind_idmap=` line is hostile (not ranges, 10,000
/// ranges, for a target no bind has): the restart does not panic, sets
/// the record aside and takes the volume's mounts down; nothing is
/// adopted with mappings it does not have.
#[test]
#[ignore = "needs root: make test runs it"]
fn hostile_bind_idmap_lines_adopt_nothing() {
    needs::loop_devices_and_mkfs();
    let many: Vec<String> = (0..10_000)
        .map(|i| format!("{i}:{}:1", 100000 + i))
        .collect();
    let many = many.join(",");
    for (i, line) in [
        "bind_idmap=garbage".to_string(),
        "bind_idmap={t}\t0:100000:x\t0:100000:65536".to_string(),
        format!("bind_idmap={{t}}\t{many}\t0:100000:65536"),
        "bind_idmap={t}/other\t0:100000:65536\t0:100000:65536".to_string(),
    ]
    .into_iter()
    .enumerate()
    {
        let disk = LoopDisk::new(64, Some("ext4"));
        let a = Agent::start();
        let c = a.client();
        published(&c, "h", &disk);
        let t = a.root.join("pods/h");
        c.bind_mount(ctx(), &mapped("h", &t, Some(100000))).unwrap();
        let dir = a.kill9();
        let record = dir.path().join("root/state/h.vol");
        let text = std::fs::read_to_string(&record).unwrap();
        let kept: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with("bind_idmap="))
            .collect();
        let line = line.replace("{t}", &t.display().to_string());
        std::fs::write(&record, format!("{}\n{line}\n", kept.join("\n"))).unwrap();
        let mut b = Agent::start_in(dir);
        let c = b.client();
        assert!(volumes(&c).is_empty(), "{i}: {}", b.log());
        assert!(mounts_of(&disk.path()).is_empty(), "{i}: {}", b.log());
        assert!(b.alive() && !b.log().contains("panic"), "{i}: {}", b.log());
    }
}

/// Targets and subpaths through symlinks and other binds: a target inside
/// an idmapped bind, or through a symlink, and a subpath symlink leaving
/// the volume are refused with nothing made; a subpath symlink inside it
/// is followed, and that bind is idmapped.
#[test]
#[ignore = "needs root: make test runs it"]
fn symlinks_and_nested_targets_with_mappings() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    published(&c, "s", &disk);
    let gp = a.root.join("volumes/s");
    std::fs::create_dir(gp.join("data")).unwrap();
    std::os::unix::fs::chown(gp.join("data"), Some(7), Some(8)).unwrap();
    std::os::unix::fs::symlink("data", gp.join("in")).unwrap();
    std::os::unix::fs::symlink("/etc", gp.join("out")).unwrap();
    let outer = a.root.join("pods/outer");
    c.bind_mount(ctx(), &mapped("s", &outer, Some(100000)))
        .unwrap();
    let before = mounts_of(&disk.path()).len();
    std::fs::create_dir_all(a.root.join("pods/real")).unwrap();
    std::os::unix::fs::symlink(a.root.join("pods/real"), a.root.join("pods/link")).unwrap();
    for (t, sub) in [
        (outer.join("data/inner"), ""),
        (a.root.join("pods/link/x"), ""),
        (a.root.join("pods/out"), "out"),
    ] {
        let mut r = mapped("s", &t, Some(200000));
        r.subpath = sub.into();
        let out = c.bind_mount(ctx(), &r);
        assert!(out.is_err(), "{}: {out:?}", t.display());
        assert!(!t.exists(), "{}", t.display());
    }
    assert!(!gp.join("data/inner").exists());
    assert_eq!(mounts_of(&disk.path()).len(), before);
    let t = a.root.join("pods/in");
    let mut r = mapped("s", &t, Some(200000));
    r.subpath = "in".into();
    c.bind_mount(ctx(), &r).unwrap();
    assert_eq!(crust_testkit::ids::owner(&t), (200007, 200008));
}

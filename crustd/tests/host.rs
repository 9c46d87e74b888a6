//! crustd as a process, driven over its unix socket by the CRUST client
//! generated in crustd-ctl (not crustd's code), against fake sandboxes (a
//! fake QEMU monitor and a fake agent, tests/fakes) with loop devices as host
//! volumes: what is plugged and unplugged, idempotency, restarts, the error
//! codes, undoing a half-done publish, and what runs at once. Needs root
//! (loop devices); the same calls against a real VM are in tests/vm.rs.

mod fakes;
mod support;

#[path = "../../tests/fixtures/disks.rs"]
mod disks;

use std::time::{Duration, Instant};

use crust_protocols::ttrpc;
use crustd_ctl::{code_name, pb};
use disks::{root_or_skip, LoopDisk};
use fakes::OnPublish;
use support::Crustd;

fn req(sandbox: &str, dev: &str, fs: &str) -> pb::RuntimePublishVolumeRequest {
    pb::RuntimePublishVolumeRequest {
        sandbox_id: sandbox.into(),
        host_volume_id: dev.into(),
        host_target_path: "/var/lib/kubelet/pods/p/volumes/x".into(),
        file_system: fs.into(),
        fsgroup_gid: Some(2000),
        ..Default::default()
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (String, String) {
    match r {
        Err(s) => (code_name(s.code()), s.message().to_string()),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

fn log_of(q: &fakes::Qemu) -> Vec<String> {
    std::mem::take(&mut q.lock().unwrap().log)
}

fn verbs(log: &[String]) -> Vec<&str> {
    log.iter().map(|l| l.split(' ').next().unwrap()).collect()
}

fn state(sb: &fakes::Sandbox) -> serde_json::Value {
    match std::fs::read_to_string(sb.dir.join("crustd.json")) {
        Ok(t) => serde_json::from_str(&t).unwrap(),
        Err(_) => serde_json::json!({"volumes": {}}),
    }
}

#[test]
fn publish_stats_expand_unpublish_and_restart() {
    if !root_or_skip("publish_stats_expand_unpublish_and_restart") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let sb = fakes::sandbox(&reg, "pod-a");
    let disk = LoopDisk::new(64, None);
    let dev = disk.path();
    let mut d = Crustd::start(&reg, &[]);
    let k = d.client();

    let caps: Vec<i32> = k
        .capabilities()
        .unwrap()
        .capabilities
        .iter()
        .map(|c| match c.r#type {
            Some(pb::runtime_capability::Type::Rpc(r)) => r.r#type,
            None => 0,
        })
        .collect();
    use pb::runtime_capability::rpc::Type as C;
    assert_eq!(
        caps,
        [
            C::FsGroupChangePolicyAlways,
            C::FsGroupChangePolicyRootMismatch,
            C::VolumeStats,
            C::VolumeResize,
            C::VolumeCondition,
            C::BlockVolume
        ]
        .map(|c| c as i32)
    );
    assert_eq!(k.file_systems().unwrap().file_systems, ["ext4", "xfs"]);

    let r = k.publish(req("pod-a", &dev, "ext4")).unwrap();
    assert!(
        r.guest_path.starts_with("/run/crust/volumes/crustd-"),
        "{r:?}"
    );
    let log = log_of(&sb.qemu);
    assert_eq!(verbs(&log), ["blockdev-add", "device_add"], "{log:?}");
    assert!(log[0].contains("\"driver\":\"host_device\""), "{}", log[0]);
    assert!(log[0].contains("\"cache\":{\"direct\":true}"), "{}", log[0]);
    assert!(
        log[0].contains(&format!("\"filename\":\"{dev}\"")),
        "{}",
        log[0]
    );
    assert!(
        log[1].contains("\"driver\":\"virtio-blk-pci\""),
        "{}",
        log[1]
    );
    let st = state(&sb);
    let v = &st["volumes"][&dev];
    assert_eq!(v["phase"], "published");
    assert_eq!(v["guest_path"], r.guest_path.as_str());
    assert_eq!(v["host_target_path"], "/var/lib/kubelet/pods/p/volumes/x");
    let serial = v["serial"].as_str().unwrap().to_string();
    assert!(serial.len() <= 20);
    assert!(sb.agent.lock().unwrap().log[0].ends_with(&format!("{serial} ext4 2000")));

    // Idempotent: the same call plugs nothing more, and answers the same path.
    assert_eq!(k.publish(req("pod-a", &dev, "ext4")).unwrap(), r);
    assert!(log_of(&sb.qemu).is_empty());

    // Stats as the agent has them, condition included.
    let s = k.stats("pod-a", &dev).unwrap();
    assert_eq!(crustd_ctl::bytes(&s), Some((700, 1000, 300)));
    assert_eq!(s.usage[1].unit(), pb::volume_usage::Unit::Inodes);
    let c = s.volume_condition.unwrap();
    assert!(c.abnormal && c.message == "3 I/O errors");

    // A restart between any two calls: the new crustd carries on.
    d.kill_and_restart();
    let k = d.client();
    assert_eq!(k.publish(req("pod-a", &dev, "ext4")).unwrap(), r);
    assert!(log_of(&sb.qemu).is_empty(), "nothing plugged twice");

    // Expand: more than the device has is OUT_OF_RANGE; after the host grows
    // it, QEMU is resized to the device's size and the agent asked.
    let (c, m) = code(k.expand("pod-a", &dev, 100 << 20));
    assert_eq!(c, "OUT_OF_RANGE", "{m}");
    assert!(m.contains("losetup -c"), "{m}");
    disk.resize(128);
    assert_eq!(k.expand("pod-a", &dev, 100 << 20).unwrap(), 100 << 20);
    let log = log_of(&sb.qemu);
    assert_eq!(verbs(&log), ["block_resize"], "{log:?}");
    assert!(
        log[0].contains(&format!("\"size\":{}", 128u64 << 20)),
        "{log:?}"
    );
    // Already as big in QEMU: no second resize.
    k.expand("pod-a", &dev, 0).unwrap();
    assert!(log_of(&sb.qemu).is_empty());
    assert_eq!(code(k.expand("pod-a", &dev, -1)).0, "INVALID_ARGUMENT");

    // Unpublish: agent first, then device_del, DEVICE_DELETED, blockdev-del.
    d.kill_and_restart();
    let k = d.client();
    k.unpublish("pod-a", &dev).unwrap();
    assert_eq!(verbs(&log_of(&sb.qemu)), ["device_del", "blockdev-del"]);
    assert!(sb
        .agent
        .lock()
        .unwrap()
        .log
        .last()
        .unwrap()
        .starts_with("unpublish crustd-"));
    assert!(sb.qemu.lock().unwrap().devices.is_empty());
    assert!(sb.qemu.lock().unwrap().nodes.is_empty());
    assert_eq!(state(&sb)["volumes"], serde_json::json!({}));
    // Idempotent, and not published any more.
    k.unpublish("pod-a", &dev).unwrap();
    assert!(log_of(&sb.qemu).is_empty());
    assert_eq!(code(k.stats("pod-a", &dev)).0, "NOT_FOUND");
    assert_eq!(code(k.expand("pod-a", &dev, 0)).0, "NOT_FOUND");

    // A crustd killed after device_add but before it recorded success: the
    // record says plugging, QEMU has the disk. The next publish adds nothing.
    let mut rec = v.clone();
    rec["phase"] = "plugging".into();
    let (node, device) = (
        rec["node"].as_str().unwrap(),
        rec["device"].as_str().unwrap(),
    );
    {
        let mut q = sb.qemu.lock().unwrap();
        q.nodes.insert(node.into(), 64 << 20);
        q.devices
            .insert(device.into(), (node.into(), serial.clone()));
    }
    std::fs::write(
        sb.dir.join("crustd.json"),
        serde_json::json!({"volumes": {dev.clone(): rec}}).to_string(),
    )
    .unwrap();
    d.kill_and_restart();
    let k = d.client();
    assert_eq!(k.publish(req("pod-a", &dev, "ext4")).unwrap(), r);
    assert!(log_of(&sb.qemu).is_empty(), "nothing plugged twice");
    assert_eq!(state(&sb)["volumes"][&dev]["phase"], "published");
    // And one killed during an unpublish, after device_del: unpublish finishes it.
    let mut rec = state(&sb)["volumes"][&dev].clone();
    rec["phase"] = "unplugging".into();
    std::fs::write(
        sb.dir.join("crustd.json"),
        serde_json::json!({"volumes": {dev.clone(): rec}}).to_string(),
    )
    .unwrap();
    d.kill_and_restart();
    let k = d.client();
    assert_eq!(code(k.stats("pod-a", &dev)).0, "NOT_FOUND");
    k.unpublish("pod-a", &dev).unwrap();
    assert_eq!(verbs(&log_of(&sb.qemu)), ["device_del", "blockdev-del"]);
    assert_eq!(state(&sb)["volumes"], serde_json::json!({}));
}

#[test]
fn bad_input_is_refused_and_leaves_nothing() {
    if !root_or_skip("bad_input_is_refused_and_leaves_nothing") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let sb = fakes::sandbox(&reg, "pod-a");
    let other = fakes::sandbox(&reg, "pod-b");
    let disk = LoopDisk::new(32, None);
    let dev = disk.path();
    let file = t.path().join("plain.img");
    std::fs::write(&file, b"x").unwrap();
    let d = Crustd::start(&reg, &[]);
    let k = d.client();

    let mut cases: Vec<(pb::RuntimePublishVolumeRequest, &str, &str)> = vec![
        (
            req("pod-a", "dev/loop0", "ext4"),
            "INVALID_ARGUMENT",
            "absolute",
        ),
        (
            req("pod-a", file.to_str().unwrap(), "ext4"),
            "INVALID_ARGUMENT",
            "regular file",
        ),
        (
            req("pod-a", "/dev/null", "ext4"),
            "INVALID_ARGUMENT",
            "not a block device",
        ),
        (
            req("pod-a", "/dev/nonexistent", "ext4"),
            "INVALID_ARGUMENT",
            "not a block device",
        ),
        (req("pod-a", &dev, "btrfs"), "INVALID_ARGUMENT", "ext4, xfs"),
        (req("pod-a", &dev, ""), "INVALID_ARGUMENT", "not supported"),
        (
            req("", &dev, "ext4"),
            "INVALID_ARGUMENT",
            "sandbox_id is empty",
        ),
        (
            req("../pod-a", &dev, "ext4"),
            "INVALID_ARGUMENT",
            "sandbox_id",
        ),
        (
            req("pod-zz", &dev, "ext4"),
            "NOT_FOUND",
            "no sandbox pod-zz",
        ),
    ];
    let mut block = req("pod-a", &dev, "ext4");
    block.block = true;
    cases.push((block, "INVALID_ARGUMENT", "no filesystem"));
    let mut block = req("pod-a", &dev, "");
    block.block = true;
    block.mount_options = vec!["noatime".into()];
    cases.push((block, "INVALID_ARGUMENT", "not mounted"));
    let mut policy = req("pod-a", &dev, "ext4");
    policy.fsgroup_policy = "always".into();
    cases.push((policy, "INVALID_ARGUMENT", "OnRootMismatch"));
    let mut gid = req("pod-a", &dev, "ext4");
    gid.fsgroup_gid = Some(-5);
    cases.push((gid, "INVALID_ARGUMENT", "fsgroup_gid"));
    for (r, want, says) in cases {
        let (c, m) = code(k.publish(r.clone()));
        assert_eq!(c, want, "{r:?}: {m}");
        assert!(m.contains(says), "{r:?}: {m}");
    }
    let id = "pod-zz";
    assert_eq!(code(k.stats(id, &dev)).0, "NOT_FOUND");
    assert_eq!(code(k.unpublish(id, &dev)).0, "NOT_FOUND");
    assert_eq!(code(k.expand(id, &dev, 0)).0, "NOT_FOUND");
    assert_eq!(code(k.stats("pod-a", "rel")).0, "INVALID_ARGUMENT");

    // Malformed sandbox.json: FAILED_PRECONDITION naming the file.
    std::fs::create_dir_all(reg.join("pod-bad")).unwrap();
    std::fs::write(reg.join("pod-bad/sandbox.json"), r#"{"qmp": "/x"}"#).unwrap();
    let (c, m) = code(k.publish(req("pod-bad", &dev, "ext4")));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(
        m.contains("pod-bad/sandbox.json") && m.contains("agent"),
        "{m}"
    );

    // Nothing of the above reached QEMU or the agent.
    assert!(log_of(&sb.qemu).is_empty());
    assert!(sb.agent.lock().unwrap().log.is_empty());
    assert_eq!(state(&sb)["volumes"], serde_json::json!({}));

    // One host device, one sandbox.
    k.publish(req("pod-a", &dev, "ext4")).unwrap();
    let (c, m) = code(k.publish(req("pod-b", &dev, "ext4")));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(m.contains("sandbox pod-a"), "{m}");
    assert!(log_of(&other.qemu).is_empty());
    // The same device under another name (a symlink) in the same sandbox.
    let link = t.path().join("by-id-link");
    std::os::unix::fs::symlink(&dev, &link).unwrap();
    let (c, m) = code(k.publish(req("pod-a", link.to_str().unwrap(), "ext4")));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    k.unpublish("pod-a", &dev).unwrap();
    k.publish(req("pod-b", &dev, "ext4")).unwrap();
    // A sandbox whose entry is gone (VM down, crustd.json left) claims nothing.
    std::fs::rename(other.dir.join("sandbox.json"), other.dir.join("gone.json")).unwrap();
    k.publish(req("pod-a", &dev, "ext4")).unwrap();
    k.unpublish("pod-a", &dev).unwrap();
    std::fs::rename(other.dir.join("gone.json"), other.dir.join("sandbox.json")).unwrap();
    k.unpublish("pod-b", &dev).unwrap();
}

#[test]
fn a_failed_publish_unplugs_what_it_plugged() {
    if !root_or_skip("a_failed_publish_unplugs_what_it_plugged") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let sb = fakes::sandbox(&reg, "pod-a");
    let disk = LoopDisk::new(32, None);
    let dev = disk.path();
    let d = Crustd::start(&reg, &["--agent-timeout", "2", "--device-wait", "1"]);
    let k = d.client();
    let empty = |sb: &fakes::Sandbox| {
        let q = sb.qemu.lock().unwrap();
        assert!(q.nodes.is_empty() && q.devices.is_empty(), "{:?}", q.log);
    };

    // The agent says no: its code and message come through; the disk leaves.
    sb.agent.lock().unwrap().on_publish =
        OnPublish::Fail(ttrpc::Code::FAILED_PRECONDITION, "vdb holds xfs, not ext4");
    let (c, m) = code(k.publish(req("pod-a", &dev, "ext4")));
    assert_eq!(
        (c.as_str(), m.as_str()),
        ("FAILED_PRECONDITION", "vdb holds xfs, not ext4")
    );
    assert_eq!(
        verbs(&log_of(&sb.qemu)),
        ["blockdev-add", "device_add", "device_del", "blockdev-del"]
    );
    empty(&sb);
    assert_eq!(state(&sb)["volumes"], serde_json::json!({}));

    // QEMU refuses the device: the node it just added is removed again.
    sb.agent.lock().unwrap().on_publish = OnPublish::Ok;
    sb.qemu.lock().unwrap().refuse_device_add = true;
    let (c, m) = code(k.publish(req("pod-a", &dev, "ext4")));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(m.contains("does not support hotplugging"), "{m}");
    assert_eq!(
        verbs(&log_of(&sb.qemu)),
        ["blockdev-add", "device_add", "blockdev-del"]
    );
    empty(&sb);
    assert_eq!(state(&sb)["volumes"], serde_json::json!({}));
    sb.qemu.lock().unwrap().refuse_device_add = false;

    // An agent that accepts connections and never answers: UNAVAILABLE, unplugged.
    let silent = t.path().join("silent.sock");
    let _l = std::os::unix::net::UnixListener::bind(&silent).unwrap();
    let hung = fakes::qemu(&t.path().join("hung-qmp.sock"));
    std::fs::create_dir_all(reg.join("pod-hung")).unwrap();
    std::fs::write(
        reg.join("pod-hung/sandbox.json"),
        serde_json::json!({"qmp": t.path().join("hung-qmp.sock"), "agent": format!("unix://{}", silent.display())}).to_string(),
    )
    .unwrap();
    let t0 = Instant::now();
    let (c, m) = code(k.publish(req("pod-hung", &dev, "ext4")));
    assert_eq!(c, "UNAVAILABLE", "{m}");
    assert!(m.contains("pod-hung"), "{m}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let q = hung.lock().unwrap();
    assert!(q.nodes.is_empty() && q.devices.is_empty(), "{:?}", q.log);
    assert_eq!(
        verbs(&q.log),
        ["blockdev-add", "device_add", "device_del", "blockdev-del"]
    );
    drop(q);
    assert!(
        !reg.join("pod-hung/crustd.json").exists()
            || std::fs::read_to_string(reg.join("pod-hung/crustd.json"))
                .unwrap()
                .contains("\"volumes\": {}")
    );

    // The QMP socket vanished (the VM is gone): UNAVAILABLE, nothing recorded.
    std::fs::remove_file(sb.dir.join("qmp.sock")).unwrap();
    let (c, m) = code(k.publish(req("pod-a", &dev, "ext4")));
    assert_eq!(c, "UNAVAILABLE", "{m}");
    assert!(
        m.contains("qmp.sock") && m.contains("does not exist"),
        "{m}"
    );
    assert_eq!(state(&sb)["volumes"], serde_json::json!({}));
}

#[test]
fn calls_for_different_volumes_run_at_once_one_volume_waits() {
    if !root_or_skip("calls_for_different_volumes_run_at_once_one_volume_waits") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let a = fakes::sandbox(&reg, "pod-a");
    let b = fakes::sandbox(&reg, "pod-b");
    let disks: Vec<LoopDisk> = (0..3).map(|_| LoopDisk::new(16, None)).collect();
    let d = Crustd::start(&reg, &[]);
    let slow = Duration::from_millis(1500);
    a.agent.lock().unwrap().on_publish = OnPublish::Slow(slow);
    b.agent.lock().unwrap().on_publish = OnPublish::Slow(slow);

    let go = |sandbox: &'static str, dev: String| {
        let k = d.client();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            k.publish(req(sandbox, &dev, "ext4")).unwrap();
            t0.elapsed()
        })
    };
    // Two volumes of pod-a and one of pod-b at once: about one agent call long.
    let t0 = Instant::now();
    let hs = [
        go("pod-a", disks[0].path()),
        go("pod-a", disks[1].path()),
        go("pod-b", disks[2].path()),
    ];
    for h in hs {
        h.join().unwrap();
    }
    let together = t0.elapsed();
    assert!(together < slow * 2, "{together:?}");
    // Two calls for one volume: one after the other.
    let t0 = Instant::now();
    let hs = [go("pod-a", disks[0].path()), go("pod-a", disks[0].path())];
    for h in hs {
        h.join().unwrap();
    }
    assert!(t0.elapsed() >= slow * 2, "{:?}", t0.elapsed());
    // Each disk was plugged exactly once.
    let q = a.qemu.lock().unwrap();
    assert_eq!(
        q.log.iter().filter(|l| l.starts_with("device_add")).count(),
        2
    );
    assert_eq!(q.devices.len(), 2);
}

//! RuntimeFreezeVolumes across sandboxes (all or none, the host's own
//! timer), RuntimeThawVolumes, RuntimeTrimVolume and RuntimeGetVolumeHealth
//! through crustd as a process, against fake sandboxes (tests/fakes) with
//! loop devices as host volumes. Needs root (loop devices); the same calls
//! against real guests are in tests/vm.rs.

mod fakes;
mod support;

#[path = "../../tests/fixtures/disks.rs"]
mod disks;

use std::time::{Duration, Instant};

use crust_protocols::crust::volume_health::Status as AgentStatus;
use crust_protocols::ttrpc;
use crustd_ctl::{code_name, pb};
use disks::{root_or_skip, LoopDisk};
use support::Crustd;

fn req(sandbox: &str, dev: &str) -> pb::RuntimePublishVolumeRequest {
    pb::RuntimePublishVolumeRequest {
        sandbox_id: sandbox.into(),
        host_volume_id: dev.into(),
        file_system: "ext4".into(),
        ..Default::default()
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (String, String) {
    match r {
        Err(s) => (code_name(s.code()), s.message().to_string()),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

/// The agent calls of a sandbox's fake agent since the last look, without
/// publishes and lists.
fn calls(sb: &fakes::Sandbox) -> Vec<String> {
    std::mem::take(&mut sb.agent.lock().unwrap().log)
        .into_iter()
        .filter(|l| !l.starts_with("publish"))
        .collect()
}

#[test]
fn a_freeze_across_sandboxes_is_all_or_none_and_ends_on_the_host_too() {
    if !root_or_skip("a_freeze_across_sandboxes_is_all_or_none_and_ends_on_the_host_too") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let (a, b) = (fakes::sandbox(&reg, "pod-a"), fakes::sandbox(&reg, "pod-b"));
    let (d1, d2) = (LoopDisk::new(64, None), LoopDisk::new(64, None));
    let (v1, v2) = (d1.path(), d2.path());
    let d = Crustd::start(&reg, &[]);
    let k = d.client();
    k.publish(req("pod-a", &v1)).unwrap();
    k.publish(req("pod-b", &v2)).unwrap();
    calls(&a);
    calls(&b);
    let both = [
        ("pod-a".to_string(), v1.clone()),
        ("pod-b".to_string(), v2.clone()),
    ];

    // pod-b refuses: pod-a, frozen first, is thawed; the error names pod-b.
    b.agent.lock().unwrap().fail_freeze = Some((
        ttrpc::Code::FAILED_PRECONDITION,
        "volume x is still applying fsGroup",
    ));
    let (c, m) = code(k.freeze(&both, 30_000));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(
        m.contains("sandbox pod-b") && m.contains("none is frozen"),
        "{m}"
    );
    let ca = calls(&a);
    assert_eq!(ca.len(), 2, "{ca:?}");
    assert!(
        ca[0].starts_with("freeze crustd-") && ca[0].ends_with(" 30000"),
        "{ca:?}"
    );
    assert!(ca[1].starts_with("thaw crustd-"), "{ca:?}");
    b.agent.lock().unwrap().fail_freeze = None;
    calls(&b);

    // Both freeze; the thaw reaches both.
    let f = k.freeze(&both, 0).unwrap();
    assert!(f.freeze_id.starts_with("group-"), "{f:?}");
    assert!(calls(&a)[0].ends_with(" 60000"), "the default timeout");
    calls(&b);
    k.thaw(&both).unwrap();
    assert_eq!(calls(&a).len(), 1);
    assert_eq!(calls(&b).len(), 1);

    // Nobody thaws: crustd's timer thaws both a second after the guests'
    // timeout, and the late thaw answers ABORTED.
    let t0 = Instant::now();
    k.freeze(&both, 500).unwrap();
    calls(&a);
    calls(&b);
    while calls(&a).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the host's timer never thawed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t0.elapsed()
    );
    let (c, m) = code(k.thaw(&both));
    assert_eq!(c, "ABORTED", "{m}");
    assert!(m.contains("by crustd's timer"), "{m}");
    // Once said, a thaw is OK again; a guest that says ABORTED is passed on.
    k.thaw(&both).unwrap();
    a.agent.lock().unwrap().thaw_aborted = true;
    let (c, m) = code(k.thaw(&both));
    assert_eq!(c, "ABORTED", "{m}");
    assert!(
        m.contains("sandbox pod-a") && m.contains("ended by itself"),
        "{m}"
    );
    a.agent.lock().unwrap().thaw_aborted = false;

    // Bad requests change nothing.
    calls(&a);
    let v1s = || ("pod-a".to_string(), v1.clone());
    for (refs, timeout, want) in [
        (vec![], 0, "INVALID_ARGUMENT"),
        (vec![v1s(), v1s()], 0, "INVALID_ARGUMENT"),
        (vec![v1s()], 600_001, "INVALID_ARGUMENT"),
        (vec![("pod-x".to_string(), v1.clone())], 0, "NOT_FOUND"),
        (
            vec![v1s(), ("pod-b".to_string(), "dev/loop1".to_string())],
            0,
            "INVALID_ARGUMENT",
        ),
        (
            vec![v1s(), ("pod-b".to_string(), v1.clone())],
            0,
            "NOT_FOUND",
        ),
    ] {
        let (c, m) = code(k.freeze(&refs, timeout));
        assert_eq!(c, want, "{refs:?}: {m}");
    }
    assert!(calls(&a).is_empty(), "a refused freeze asked a guest");
}

#[test]
fn trim_and_health_go_to_the_guest_and_a_hostile_health_is_refused() {
    if !root_or_skip("trim_and_health_go_to_the_guest_and_a_hostile_health_is_refused") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let a = fakes::sandbox(&reg, "pod-a");
    let disk = LoopDisk::new(64, None);
    let v = disk.path();
    let d = Crustd::start(&reg, &[]);
    let k = d.client();
    k.publish(req("pod-a", &v)).unwrap();
    calls(&a);
    assert_eq!(k.trim("pod-a", &v, 4096).unwrap(), 12345);
    assert!(calls(&a)[0].ends_with(" 4096"));
    assert!(k.health("pod-a", &v).unwrap().is_empty());
    a.agent.lock().unwrap().health = vec![(
        AgentStatus::INACCESSIBLE,
        "Unmounted".into(),
        "/run/crust/volumes/x is no longer a mount point".into(),
    )];
    let h = k.health("pod-a", &v).unwrap();
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].status(), pb::volume_health::Status::Inaccessible);
    assert_eq!(h[0].reason, "Unmounted");
    // A guest's reason that is not a CamelCase word, or a status CSI lacks.
    for (status, reason) in [
        (AgentStatus::DEGRADED, "not camel\n"),
        (AgentStatus::STATUS_UNKNOWN, "Unmounted"),
    ] {
        a.agent.lock().unwrap().health = vec![(status, reason.into(), "m".into())];
        let (c, m) = code(k.health("pod-a", &v));
        assert_eq!(c, "FAILED_PRECONDITION", "{m}");
        assert!(m.contains("crustd refuses"), "{m}");
    }
    // Not published: NOT_FOUND, the guest not asked.
    calls(&a);
    let (c, _) = code(k.trim("pod-a", "/dev/loop-none", 0));
    assert_eq!(c, "NOT_FOUND");
    k.unpublish("pod-a", &v).unwrap();
    let (c, _) = code(k.health("pod-a", &v));
    assert_eq!(c, "NOT_FOUND");
    assert!(!calls(&a).iter().any(|l| l.starts_with("health")));
}

//! The table's rules without a guest: ids, idempotency, bounds, ends
//! recorded against the id, the timer, and the records across a restart.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use super::*;
use crust_protocols::code::Code;

fn plan(sandbox: &str, vols: &[&str]) -> Plan {
    vec![(
        sandbox.to_string(),
        vols.iter()
            .map(|v| (format!("/dev/{v}"), format!("crustd-{v}")))
            .collect(),
    )]
}

fn new_id(b: Begun) -> String {
    match b {
        Begun::New { id, .. } => id,
        other => panic!("expected a new group, got {other:?}"),
    }
}

/// A group of `vols` in sandbox "pod", made (every part called).
fn made(f: &Freezes, asked: Option<&str>, vols: &[&str], timeout_ms: u32) -> String {
    let id = new_id(f.begin(asked, &plan("pod", vols), timeout_ms).unwrap());
    f.calling(&id, 0).unwrap();
    f.made(&id).unwrap();
    id
}

#[test]
fn a_callers_id_names_one_group_and_a_retry_gets_the_same_answer() {
    let f = Freezes::default();
    let p = plan("pod", &["a", "b"]);
    let b = f.begin(Some("backup-1"), &p, 30_000).unwrap();
    let Begun::New {
        id,
        thaw_at_unix_ms,
        start_timer,
        ..
    } = b
    else {
        panic!("{b:?}")
    };
    assert_eq!(id, "backup-1");
    assert!(start_timer, "the first group starts the timer");
    let e = f.begin(Some("backup-1"), &p, 30_000).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    f.calling(&id, 0).unwrap();
    f.made(&id).unwrap();
    // In any order, the same volumes and timeout: the same answer.
    let again = f.begin(Some("backup-1"), &plan("pod", &["b", "a"]), 30_000);
    assert_eq!(
        again.unwrap(),
        Begun::Again {
            id: id.clone(),
            thaw_at_unix_ms
        }
    );
    for (other, timeout) in [(plan("pod", &["a"]), 30_000), (p.clone(), 20_000)] {
        let e = f.begin(Some("backup-1"), &other, timeout).unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    }
    f.close(&id, end_now(How::Thawed, "")).unwrap();
    let e = f.begin(Some("backup-1"), &p, 30_000).unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    assert!(e.to_string().contains("thawed by its id"), "{e}");
    for bad in ["", "-x", "a/b", &"x".repeat(129)] {
        let e = f.begin(Some(bad), &p, 30_000).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e}");
    }
    // crustd's own ids never repeat.
    let a = new_id(f.begin(None, &plan("pod", &["c"]), 1000).unwrap());
    let b = new_id(f.begin(None, &plan("pod", &["d"]), 1000).unwrap());
    assert!(a.starts_with("group-") && a != b, "{a} {b}");
    assert_eq!(crust_protocols::freeze::check_id(&a), Ok(()));
}

#[test]
fn ends_are_recorded_against_the_id_and_said_once_per_way() {
    let f = Freezes::default();
    let id = made(&f, None, &["a", "b", "c"], 60_000);
    let other = made(&f, None, &["x"], 60_000);
    assert_eq!(
        f.end_volume("pod", "/dev/a", How::Unpublished),
        vec![id.clone()]
    );
    assert!(
        f.end_volume("pod", "/dev/a", How::Forced).is_empty(),
        "ended once"
    );
    assert!(f.get(&other).unwrap().holds(), "another group is untouched");
    let g = f.close(&id, end_now(How::Thawed, "")).unwrap();
    assert_eq!(g.pending(), vec![0]);
    assert!(!g.is_over());
    let g = f
        .settle(
            &id,
            &[(0, end_now(How::Guest, "volume crustd-b timed out"))],
        )
        .unwrap();
    assert!(g.is_over());
    let broken = g.broken(unix_ms()).join("; ");
    assert!(
        broken.contains("volume /dev/a of sandbox pod was thawed when the volume was unpublished"),
        "{broken}"
    );
    assert!(
        broken.contains("volumes /dev/b, /dev/c of sandbox pod ended in its guest (its guest's answer: the group's part there did not hold)"),
        "{broken}"
    );
    assert_eq!(broken.matches("timed out").count(), 1, "{broken}");
    // A later close keeps the first: a repeated thaw hears the same.
    let g = f.close(&id, end_now(How::Timer, "")).unwrap();
    assert_eq!(g.closing.as_ref().unwrap().how, How::Thawed);
    assert_eq!(f.len(), (1, 1));
    let e = f.close("group-0-00", end_now(How::Thawed, "")).unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[test]
fn a_group_being_made_stops_when_something_ends_it() {
    let f = Freezes::default();
    let id = new_id(f.begin(None, &plan("pod", &["a"]), 60_000).unwrap());
    f.calling(&id, 0).unwrap();
    f.end_volume("pod", "/dev/a", How::Forced);
    let why = f.made(&id).unwrap_err();
    assert!(why.contains("forced"), "{why}");
    let id = new_id(f.begin(None, &plan("pod", &["b"]), 60_000).unwrap());
    f.close(&id, end_now(How::Timer, "")).unwrap();
    let why = f.calling(&id, 0).unwrap_err();
    assert!(why.contains("crustd's timer"), "{why}");
    // Its freeze stops: the part never called is skipped, the group over.
    let g = f.unmade(&id, end_now(How::Undone, "")).unwrap();
    assert_eq!(
        g.closing.as_ref().unwrap().how,
        How::Timer,
        "the first end stays"
    );
    let broken = g.broken(unix_ms());
    assert!(g.is_over() && broken.len() == 1, "{broken:?}");
    assert!(
        broken[0].starts_with("the group was thawed by crustd's timer"),
        "{broken:?}"
    );
}

#[test]
fn live_groups_are_bounded_and_ended_ones_kept_up_to_ended_kept() {
    let t = tempfile::tempdir().unwrap();
    let f = Freezes::new(Some(Store::new(t.path())));
    let ids: Vec<String> = (0..MAX_GROUPS)
        .map(|i| made(&f, None, &[&format!("v{i}")], 60_000))
        .collect();
    let e = f
        .begin(None, &plan("pod", &["one-more"]), 60_000)
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    for id in &ids {
        f.close(id, end_now(How::Thawed, "")).unwrap();
        f.settle(id, &[(0, end_now(How::Thawed, ""))]).unwrap();
    }
    assert_eq!(f.len(), (0, MAX_GROUPS));
    let more = ENDED_KEPT + 3 - MAX_GROUPS;
    for i in 0..more {
        let id = made(&f, None, &[&format!("w{i}")], 60_000);
        f.settle(&id, &[(0, end_now(How::Thawed, ""))]).unwrap();
    }
    assert_eq!(f.len(), (0, ENDED_KEPT));
    assert!(
        f.get(&ids[2]).is_none() && f.get(&ids[3]).is_some(),
        "the oldest go first"
    );
    let files = std::fs::read_dir(t.path().join(DIR_NAME)).unwrap().count();
    assert_eq!(files, ENDED_KEPT, "their records go with them");
}

#[test]
fn the_timer_finds_a_live_group_at_its_deadline_and_tries_it_again_later() {
    let f = Freezes::default();
    assert_eq!(f.next_expired(Duration::from_secs(1)), None, "nothing live");
    let t0 = Instant::now();
    let id = made(&f, None, &["a"], 100);
    let (due, tries) = f.next_expired(Duration::from_millis(200)).unwrap();
    assert_eq!((due.as_str(), tries), (id.as_str(), 1));
    assert!(
        t0.elapsed() >= Duration::from_millis(1100),
        "{:?}",
        t0.elapsed()
    );
    let t1 = Instant::now();
    assert_eq!(f.next_expired(Duration::from_millis(200)).unwrap().1, 2);
    assert!(t1.elapsed() >= Duration::from_millis(150), "re-armed later");
    f.settle(&id, &[(0, end_now(How::Timer, ""))]);
    assert_eq!(
        f.next_expired(Duration::from_millis(200)),
        None,
        "over: the timer ends"
    );
}

#[test]
fn groups_survive_a_restart_and_hostile_records_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let f = Freezes::new(Some(Store::new(t.path())));
    let live = made(&f, None, &["a"], 60_000);
    let making = new_id(
        f.begin(Some("being-made"), &plan("pod", &["b", "c"]), 60_000)
            .unwrap(),
    );
    let ended = made(&f, None, &["d"], 60_000);
    f.close(&ended, end_now(How::Timer, "")).unwrap();
    f.settle(
        &ended,
        &[(0, end_now(How::Timer, "its guest said: timed out"))],
    );
    let dir = t.path().join(DIR_NAME);
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    // What a restart must not take: garbage, a record under another
    // group's name, one too large, too many volumes, a bad path, a symlink;
    // and a temporary a write left behind.
    let mut bad = f.get(&live).unwrap();
    bad.id = "elsewhere".into();
    let wrong_name = serde_json::to_string(&bad).unwrap();
    let mut wide = f.get(&live).unwrap();
    wide.id = "wide".into();
    wide.parts[0].volumes = (0..65)
        .map(|i| Volume {
            host_volume: format!("/dev/x{i}"),
            volume_id: format!("crustd-{i}"),
            end: None,
        })
        .collect();
    let mut relative = f.get(&live).unwrap();
    relative.id = "relative".into();
    relative.parts[0].volumes[0].host_volume = "dev/a".into();
    for (name, text) in [
        ("garbage.json", "{not json".to_string()),
        ("mine.json", wrong_name),
        ("wide.json", serde_json::to_string(&wide).unwrap()),
        ("relative.json", serde_json::to_string(&relative).unwrap()),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    std::fs::File::create(dir.join("huge.json"))
        .unwrap()
        .set_len(store::MAX_RECORD + 1)
        .unwrap();
    std::os::unix::fs::symlink(dir.join(format!("{live}.json")), dir.join("link.json")).unwrap();
    std::fs::write(dir.join(".x.json.tmp.0123456789abcdef"), "{").unwrap();

    let g = Freezes::new(Some(Store::new(t.path())));
    let (orphans, start, refused) = g.load();
    assert_eq!(
        orphans,
        vec![making.clone()],
        "its call died with the last crustd"
    );
    assert!(start, "live groups re-arm the timer");
    assert_eq!(refused.len(), 6, "{refused:#?}");
    for said in [
        "not a group's record",
        "not its own file's",
        "65 volumes",
        "host volume",
        "more than crustd reads",
        "symbolic link",
    ] {
        assert!(
            refused.iter().any(|r| r.to_string().contains(said)),
            "{said}: {refused:#?}"
        );
    }
    assert!(!dir.join(".x.json.tmp.0123456789abcdef").exists());
    assert_eq!(g.get(&live), f.get(&live));
    assert!(g.get(&live).unwrap().holds());
    let e = g.get(&ended).unwrap();
    assert!(e.is_over() && e.broken(unix_ms()).join(" ").contains("crustd's timer"));
    assert!(
        g.get(&making).unwrap().parts.iter().all(|p| p.called),
        "every part may be frozen"
    );
    assert_eq!(g.len(), (2, 1));
    // The live group's deadline is its recorded one: not yet.
    let t0 = Instant::now();
    g.settle(&making, &[(0, end_now(How::Restarted, ""))]);
    g.unmade(&making, end_now(How::Restarted, ""));
    let soon = std::thread::spawn(move || g.next_expired(Duration::from_secs(1)));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !soon.is_finished(),
        "fired at once, {:?} after a restart",
        t0.elapsed()
    );
    drop(soon);
}

#[test]
fn a_records_directory_others_may_write_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join(DIR_NAME);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let f = Freezes::new(Some(Store::new(t.path())));
    let e = f.begin(None, &plan("pod", &["a"]), 60_000).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("others may write"), "{e}");
    assert!(f.is_empty(), "nothing frozen that is not recorded");
    std::fs::remove_dir(&dir).unwrap();
    std::os::unix::fs::symlink(t.path(), &dir).unwrap();
    let e = f.begin(None, &plan("pod", &["a"]), 60_000).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "a symlink: {e}");
}

#[test]
fn an_aborted_groups_message_names_every_volume_that_did_not_hold() {
    let plan: Plan = (0..10)
        .map(|i| {
            (
                format!("pod-{i}"),
                vec![(format!("/dev/v{i}"), format!("crustd-{i}"))],
            )
        })
        .collect();
    let mut g = Group::new("g", &plan, 60_000, 1_000);
    g.making = false;
    for (i, p) in (1_000u64..).zip(g.parts.iter_mut()) {
        p.called = true;
        p.end(&End::new(How::Guest, i, "in the guest's words"));
    }
    let said = g.broken(2_000).join("; ");
    for i in 0..10 {
        assert!(
            said.contains(&format!(
                "volume /dev/v{i} of sandbox pod-{i} ended in its guest"
            )),
            "{said}"
        );
    }
    assert_eq!(said.matches("in the guest's words").count(), 8, "{said}");
}

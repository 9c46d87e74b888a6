//! Two agents in one guest, each with its own root, sharing the guest's
//! device-mapper and root's user keyring (docs/encryption.md, "Whose a
//! mapping is"). In the systemd guest (`make guest-image`), agent A is the
//! service (root /run/crust, on vsock), and the guest starts agent B (root
//! /run/crust-b, on a unix socket) once A has published an encrypted raw
//! block volume, whose mapping nothing holds open. B publishes the same
//! volume id on a disk of its own (crustctl in the guest), restarts, and
//! unpublishes it: A's mapping and its key stay through all of it, the
//! guest's cryptsetup reads A's tagged mapping as LUKS2, and A's volume is
//! healthy until A unpublishes it.
//! Run with `make test-vm` (root, `make initrd` and `make guest-image`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::protobuf::MessageField;
use crust_testkit::agent::{serial_publish_req, unpublish_req};
use crust_testkit::guest;
use crust_testkit::luks::{self, Kdf};
use crust_testkit::vm::ctx;
use crust_vm::Vm;

const PASS: &[u8] = b"one passphrase for both agents' disks";

/// Agent B: the same binary, another root, no vsock; started by the test.
const B_UNIT: &str = "[Unit]\nDescription=A second crust-agent, with a root of its own\n\
[Service]\nType=notify\nNotifyAccess=main\n\
ExecStart=/usr/local/bin/crust-agent --root /run/crust-b --listen unix:///run/crust-b.sock --on-sigterm exit\n\
StandardError=journal+console\n";

/// The guest's side, paced by A's publish: B started, B's publish of the
/// same id on ser-c, B restarted, B's unpublish and restart, and at each
/// step the mappings, A's key, and cryptsetup's status of A's mapping.
const TEST_SCRIPT: &str = r#"#!/bin/sh
say() { echo "CRUST-TEST $*"; }
until_true() {
    i=0
    until eval "$1"; do
        i=$((i + 1)); [ $i -gt 1200 ] && { say "never: $1"; exit 1; }
        sleep 0.5
    done
}
names() { for d in /sys/block/dm-*; do [ -e "$d/dm/name" ] && cat "$d/dm/name"; done | sort | tr '\n' ' '; }
key() { grep -c -F "crust:$1:" /proc/keys; }
state() { say "$1: mappings [$(names)] a-key $(key "$a")"; }
status() { cryptsetup status "$a" | tr -s ' \t' ' ' | while read -r l; do say "status-$1: $l"; done; }
b() { crustctl --addr unix:///run/crust-b.sock "$@"; }

until_true '[ -b /run/crust/volumes/vol-b ]'
a=$(names | tr ' ' '\n' | grep '^crust-vol-b@')
say "a: $a"
state before
status before
systemctl start crust-agent-b && say "b started"
state b-started
b publish vol-b --serial ser-c --block --encryption luks2 --key-file /etc/crust-test/pass >/dev/null &&
    say "b published"
state b-published
systemctl restart crust-agent-b && say "b restarted"
state b-restarted
b unpublish vol-b >/dev/null && say "b unpublished"
systemctl restart crust-agent-b && say "b restarted again"
state after
status after
systemctl stop crust-agent-b
say done
"#;

/// A copy of the guest image with agent B's unit, crustctl, the
/// passphrase B's disk is opened with, and the test's script.
fn guest_image(dir: &Path) -> PathBuf {
    crust_testkit::build::cargo_build("crust-client", &["--bin", "crustctl"]);
    let crustctl = crust_testkit::build::profile_dir().join("crustctl");
    let image = guest::Image::new(dir);
    image.put(
        "usr/local/bin/crustctl",
        &std::fs::read(&crustctl).unwrap(),
        0o755,
    );
    image.put(
        "etc/systemd/system/crust-agent-b.service",
        B_UNIT.as_bytes(),
        0o644,
    );
    image.put("etc/crust-test/pass", PASS, 0o600);
    image.test_unit(TEST_SCRIPT);
    image.done()
}

/// A 64 MiB LUKS2 image (PBKDF2, so that its unlock is quick under TCG)
/// with an empty ext4 inside.
fn luks_disk(dir: &Path, name: &str, pass: &Path) -> PathBuf {
    luks::luks_image(
        dir,
        name,
        "ext4",
        64,
        (Kdf::Pbkdf2(1000), 512),
        pass,
        |_| (),
    )
}

/// A's encrypted raw block volume vol-b on ser-a.
fn block_req() -> pb::PublishVolumeRequest {
    let mut r = serial_publish_req("vol-b", "ser-a", "", None);
    r.volume_mode = pb::VolumeMode::BLOCK.into();
    let mut e = pb::Encryption::new();
    e.kind = pb::encryption::Kind::LUKS2.into();
    e.set_passphrase(PASS.to_vec());
    r.encryption = MessageField::some(e);
    r
}

fn a_mapping(c: &AgentClient) -> String {
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    let v = l.volumes.iter().find(|v| v.volume_id == "vol-b").unwrap();
    v.encryption.as_ref().unwrap().mapping.clone()
}

/// What the guest said at step `step`: its mappings, and A's key's count.
fn state_at<'a>(said: &'a str, step: &str) -> &'a str {
    let at = format!("CRUST-TEST {step}: mappings [");
    said.lines()
        .find_map(|l| l.split_once(&at).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no {step} in\n{said}"))
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_second_agent_in_the_guest_never_touches_the_firsts_mapping() {
    luks::tools();
    let t = tempfile::tempdir().unwrap();
    let pass = t.path().join("pass");
    std::fs::write(&pass, PASS).unwrap();
    let (da, dc) = (
        luks_disk(t.path(), "a.img", &pass),
        luks_disk(t.path(), "c.img", &pass),
    );
    let root = guest_image(t.path());
    let mut vm = Vm::up(guest::options(t.path().join("vm"), root, 512))
        .expect("the systemd guest boots and the agent answers");
    let c = vm.agent().unwrap();
    vm.hotplug(&da, "ser-a", false).unwrap();
    vm.hotplug(&dc, "ser-c", false).unwrap();
    let out = c.publish_volume(ctx(), &block_req()).unwrap();
    assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
    let a = a_mapping(&c);
    assert!(a.starts_with("crust-vol-b@"), "{a}");

    let wait = Duration::from_secs(600);
    let said = guest::said(&guest::console_until(&vm, "CRUST-TEST done", wait));
    eprintln!("{said}");
    assert!(said.contains(&format!("CRUST-TEST a: {a}")), "{said}");
    assert_eq!(
        state_at(&said, "before"),
        format!("{a} ] a-key 1"),
        "{said}"
    );
    for step in ["b-started", "b-restarted", "after"] {
        let s = state_at(&said, step);
        assert!(
            s.contains(&format!("{a} ")) && s.ends_with("a-key 1"),
            "{step}: {s}"
        );
    }
    // B's own mapping of the same id: another name, adopted at its restart,
    // and gone with its unpublish.
    for step in ["b-published", "b-restarted"] {
        let s = state_at(&said, step);
        assert_eq!(s.matches("crust-vol-b@").count(), 2, "{step}: {s}");
    }
    assert_eq!(state_at(&said, "after"), format!("{a} ] a-key 1"), "{said}");
    for line in ["b published", "b unpublished", "b restarted again"] {
        assert!(
            said.contains(&format!("CRUST-TEST {line}")),
            "{line}\n{said}"
        );
    }
    // The guest's cryptsetup reads A's tagged mapping as its own kind.
    for when in ["before", "after"] {
        for line in [
            format!("/dev/mapper/{a} is active"),
            "type: LUKS2".into(),
            "key location: keyring".into(),
            "device: /dev/vd".into(),
        ] {
            let want = format!("status-{when}: {line}");
            assert!(said.contains(&want), "{want}\n{said}");
        }
    }

    let stats = crust_testkit::vm::stats(&c, "vol-b").unwrap();
    assert!(!stats.condition.abnormal, "{:?}", stats.condition);
    assert_eq!(a_mapping(&c), a);
    let r = c.unpublish_volume(ctx(), &unpublish_req("vol-b")).unwrap();
    assert!(r.was_published);
    vm.down().unwrap();
}

//! The agent as a service in a real sandbox guest: Debian 12 with systemd
//! as init, udev and crun (`make guest-image`), the release agent and the
//! repository's `guest/crust-agent.service` copied into a copy of the image,
//! nothing else of ours. crustd publishes a loop device there with an
//! fsGroup; the agent binds it read-write and recursively read-only; a crun
//! container, run by a oneshot unit inside the guest as uid 1000 in the
//! pod's group, writes through the first and gets EROFS on the second; the
//! unit then kills the agent with SIGKILL, systemd restarts it, and the
//! volume and both binds are still listed, and unpublish works.
//! Run with `make test-vm` (root, `make initrd` and `make guest-image`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_kubelet::pb;
use crust_protocols::crust as agent_pb;
use crust_testkit::crustd::Crustd;
use crust_testkit::guest;
use crust_testkit::vm::{console, tail};
use crust_testkit::{run, LoopDisk, Mounted};
use crust_vm::Vm;

const SANDBOX: &str = "pod-guest-1";

/// What the guest's oneshot unit runs: waits for both binds, runs the
/// container, says what it saw on the console, then SIGKILLs the agent.
const TEST_SCRIPT: &str = r#"#!/bin/sh
say() { echo "CRUST-TEST $*"; }
i=0
until mountpoint -q /run/crust/pods/p/rw && mountpoint -q /run/crust/pods/p/ro; do
    i=$((i + 1)); [ $i -gt 1200 ] && { say "no binds"; exit 1; }
    sleep 0.5
done
say "udev $(systemctl is-active systemd-udevd.service)"
say "agent $(systemctl is-active crust-agent.service)"
cd /var/lib/crust-test/bundle
crun run crust-test 2>&1 | while read -r line; do say "container: $line"; done
pid=$(systemctl show -p MainPID --value crust-agent.service)
systemctl kill --signal=KILL crust-agent.service
say "killed $pid"
"#;

/// The container: uid 1000, group 2000 (the pod's fsGroup), both binds.
const CONTAINER: guest::Container = guest::Container {
    uid: 1000,
    gid: 2000,
    script: "id -u; id -g; echo written-by-the-container > /data-rw/by-container && echo rw=ok; \
             (echo x > /data-ro/ro-attempt) 2>&1; [ -e /data-ro/ro-attempt ] || echo ro=refused",
    binds: &[
        ("/data-rw", "/run/crust/pods/p/rw", false),
        ("/data-ro", "/run/crust/pods/p/ro", true),
    ],
    userns: None,
};

/// A copy of the guest image with the agent and the test's oneshot unit
/// and container bundle.
fn guest_image(dir: &Path) -> PathBuf {
    let image = guest::Image::new(dir);
    image.test_unit(TEST_SCRIPT);
    image.bundle(&CONTAINER);
    image.done()
}

fn bind(c: &crust_protocols::crust_ttrpc::AgentClient, volume: &str, target: &str, ro: bool) {
    let mut b = agent_pb::BindMountRequest::new();
    b.volume_id = volume.into();
    b.target = target.into();
    b.read_only = ro;
    if ro {
        b.recursive_read_only = agent_pb::RecursiveReadOnly::ENABLED.into();
    }
    let r = c
        .bind_mount(crust_vm::ctx(Duration::from_secs(60)), &b)
        .unwrap();
    assert_eq!(r.recursive_read_only_applied, ro, "{target}");
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn the_agent_as_a_service_beside_crun_survives_sigkill() {
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let root = guest_image(t.path());
    let opts = guest::options(reg.join(SANDBOX), root, 1024);
    let t0 = Instant::now();
    let mut vm = Vm::up(opts).expect("the systemd guest boots and the agent answers");
    eprintln!("systemd guest: agent answering after {:?}", t0.elapsed());
    let c = vm.agent().unwrap();
    let info = c
        .get_agent_info(crust_vm::ctx(Duration::from_secs(30)), &Default::default())
        .unwrap();
    assert!(!info.init_mode, "the agent runs as a service, not as PID 1");

    // A disk with files owned by someone else, published through crustd
    // with the pod's fsGroup.
    let disk = LoopDisk::new(128, Some("ext4"));
    {
        let m = Mounted::new(&disk.device, "ext4", "");
        std::fs::create_dir_all(m.path.join("app")).unwrap();
        std::fs::write(m.path.join("app/config"), b"x").unwrap();
        run("chown", &["-R", "1234:1234", m.path.to_str().unwrap()]);
        run("chmod", &["-R", "go-rwx", m.path.to_str().unwrap()]);
    }
    let d = Crustd::start(&reg, &[]);
    let k = d.client();
    let published = k
        .publish(pb::RuntimePublishVolumeRequest {
            sandbox_id: SANDBOX.into(),
            host_volume_id: disk.path(),
            host_target_path: "/var/lib/kubelet/pods/uid/volumes/data".into(),
            file_system: "ext4".into(),
            fsgroup_gid: Some(2000),
            fsgroup_policy: "Always".into(),
            ..Default::default()
        })
        .unwrap();
    let volume = Path::new(&published.guest_path)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    bind(&c, &volume, "/run/crust/pods/p/rw", false);
    bind(&c, &volume, "/run/crust/pods/p/ro", true);

    // The guest's unit runs the container, then kills the agent.
    let text = guest::console_until(&vm, "CRUST-TEST killed", Duration::from_secs(240));
    let said = guest::said(&text);
    assert!(said.contains("udev active"), "{said}");
    assert!(
        said.contains("container: 1000") && said.contains("container: 2000"),
        "{said}"
    );
    assert!(said.contains("container: rw=ok"), "{said}");
    assert!(
        said.contains("cannot create /data-ro/ro-attempt: Read-only file system"),
        "{said}"
    );
    assert!(said.contains("container: ro=refused"), "{said}");

    // systemd restarts it; it adopts the volume and both binds.
    let t1 = Instant::now();
    let list = loop {
        let answer = vm.agent().ok().and_then(|c| {
            c.list_volumes(crust_vm::ctx(Duration::from_secs(5)), &Default::default())
                .ok()
        });
        let restarted = vm.agent().ok().and_then(|c| {
            c.get_agent_info(crust_vm::ctx(Duration::from_secs(5)), &Default::default())
                .ok()
        });
        match (answer, restarted) {
            // A new process: up for less than the time since the kill.
            (Some(l), Some(i)) if u128::from(i.uptime_ms) <= t1.elapsed().as_millis() + 1000 => {
                break l
            }
            _ => {}
        }
        assert!(
            t1.elapsed() < Duration::from_secs(120),
            "the agent did not come back after SIGKILL; console:\n{}",
            tail(&console(&vm), 3000)
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!("restarted by systemd after SIGKILL in {:?}", t1.elapsed());
    assert_eq!(list.volumes.len(), 1, "{list:?}");
    let mut binds = list.volumes[0].bind_targets.clone();
    binds.sort();
    assert_eq!(binds, ["/run/crust/pods/p/ro", "/run/crust/pods/p/rw"]);

    // Unpublish through crustd: the binds, the mount, the disk out of the VM.
    k.unpublish(SANDBOX, &disk.path()).unwrap();
    drop(d);
    vm.down().unwrap();

    // On the host: what the container wrote, in the pod's group.
    let m = Mounted::new(&disk.device, "ext4", "ro");
    let f = m.path.join("by-container");
    assert_eq!(std::fs::read(&f).unwrap(), b"written-by-the-container\n");
    let md = std::fs::metadata(&f).unwrap();
    assert_eq!((md.uid(), md.gid()), (1000, 2000));
}

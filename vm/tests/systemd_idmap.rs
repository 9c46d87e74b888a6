//! An idmapped bind in a real sandbox guest (KEP-127): the systemd + crun
//! guest (`make guest-image`) with the release agent as a service. crustd
//! publishes a loop device with a file owned on disk by 1000; the agent
//! binds it with the pod's mappings (container 0 is guest 100000, for
//! 65536 ids); a crun container with a user namespace of the same mappings
//! runs as its uid 0, sees the file as 1000 and writes a file through the
//! bind, which it sees as its own (0), the guest's initial namespace sees
//! as 100000 through the bind and as 0 on the volume, and the host reads
//! on the disk as uid 0.
//! Run with `make test-vm` (root, `make initrd` and `make guest-image`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_kubelet::{pb, Kubelet};
use crust_protocols::crust as agent_pb;
use crust_testkit::crustd::Crustd;
use crust_testkit::guest;
use crust_testkit::{LoopDisk, Mounted};
use crust_vm::Vm;

const SANDBOX: &str = "pod-idmap-1";
const TARGET: &str = "/run/crust/pods/u/data";

/// What the guest's oneshot unit runs: waits for the bind, lets the pod's
/// root reach it (a runtime puts the bind in the pod's own tree; the
/// agent's directories above it are 0750), runs the container, then says
/// what the guest's initial namespace sees.
const TEST_SCRIPT: &str = r#"#!/bin/sh
say() { echo "CRUST-TEST $*"; }
i=0
until mountpoint -q /run/crust/pods/u/data; do
    i=$((i + 1)); [ $i -gt 1200 ] && { say "no bind"; exit 1; }
    sleep 0.5
done
chmod 755 /run/crust /run/crust/pods /run/crust/pods/u
say "bind-idmapped $(grep -c ' /run/crust/pods/u/data .*idmapped' /proc/self/mountinfo)"
cd /var/lib/crust-test/bundle
crun run crust-idmap 2>&1 | while read -r line; do say "container: $line"; done
say "guest-bind $(stat -c %u:%g /run/crust/pods/u/data/by-root)"
say "guest-volume $(stat -c %u:%g /run/crust/volumes/*/by-root)"
say "done"
"#;

/// The container: its uid 0 (guest 100000), the volume at /data.
const CONTAINER: guest::Container = guest::Container {
    uid: 0,
    gid: 0,
    script: "echo uid=$(id -u); echo by-the-pods-root > /data/by-root && echo write=ok; \
             stat -c mine=%u:%g /data/mine; stat -c made=%u:%g /data/by-root",
    binds: &[("/data", TARGET, false)],
    userns: Some((0, 100_000, 65536)),
};

/// A copy of the guest image with the agent, the test's unit and bundle.
fn guest_image(dir: &Path) -> PathBuf {
    let image = guest::Image::new(dir);
    image.test_unit(TEST_SCRIPT);
    image.bundle(&CONTAINER);
    image.done()
}

/// A disk with `mine` owned on disk by 1000, published through crustd:
/// the volume's id in the guest.
fn published(k: &Kubelet, disk: &LoopDisk) -> String {
    {
        let m = Mounted::new(&disk.device, "ext4", "");
        std::fs::write(m.path.join("mine"), b"1000's").unwrap();
        std::os::unix::fs::chown(m.path.join("mine"), Some(1000), Some(1000)).unwrap();
    }
    let published = k
        .publish(pb::RuntimePublishVolumeRequest {
            sandbox_id: SANDBOX.into(),
            host_volume_id: disk.path(),
            host_target_path: "/var/lib/kubelet/pods/uid/volumes/data".into(),
            file_system: "ext4".into(),
            ..Default::default()
        })
        .unwrap();
    let gp = Path::new(&published.guest_path);
    gp.file_name().unwrap().to_string_lossy().into_owned()
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_user_namespace_pod_writes_as_root_through_an_idmapped_bind() {
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let opts = guest::options(reg.join(SANDBOX), guest_image(t.path()), 1024);
    let t0 = Instant::now();
    let mut vm = Vm::up(opts).expect("the systemd guest boots and the agent answers");
    eprintln!("systemd guest: agent answering after {:?}", t0.elapsed());
    let c = vm.agent().unwrap();
    let ctx = || crust_vm::ctx(Duration::from_secs(60));

    let disk = LoopDisk::new(128, Some("ext4"));
    let d = Crustd::start(&reg, &[]);
    let k = d.client();
    let volume = published(&k, &disk);
    let mut b = agent_pb::BindMountRequest::new();
    b.volume_id = volume;
    b.target = TARGET.into();
    let range = agent_pb::IDMapping {
        container_id: 0,
        host_id: 100000,
        length: 65536,
        ..Default::default()
    };
    (b.uid_mappings, b.gid_mappings) = (vec![range.clone()], vec![range]);
    let t1 = Instant::now();
    assert!(!c.bind_mount(ctx(), &b).unwrap().already_mounted);
    eprintln!("idmapped bind in the guest: {:?}", t1.elapsed());
    let caps = c.get_capabilities(ctx(), &Default::default()).unwrap();
    let idmapped = agent_pb::Capability::CAPABILITY_IDMAPPED_BINDS;
    assert!(caps.capabilities.contains(&idmapped.into()), "{caps:?}");
    let listed = c.list_volumes(ctx(), &Default::default()).unwrap();
    assert_eq!(listed.volumes[0].binds[0].uid_mappings, b.uid_mappings);

    let text = guest::console_until(&vm, "CRUST-TEST done", Duration::from_secs(240));
    let said = guest::said(&text);
    assert!(said.contains("bind-idmapped 1"), "{said}");
    assert!(said.contains("container: uid=0"), "{said}");
    assert!(said.contains("container: write=ok"), "{said}");
    assert!(
        said.contains("container: mine=1000:1000"),
        "the pod sees on-disk ids: {said}"
    );
    assert!(said.contains("container: made=0:0"), "{said}");
    assert!(said.contains("guest-bind 100000:100000"), "{said}");
    assert!(said.contains("guest-volume 0:0"), "{said}");

    k.unpublish(SANDBOX, &disk.path()).unwrap();
    drop(d);
    vm.down().unwrap();

    // On the host: the pod's root wrote a file of uid 0 on the volume.
    let m = Mounted::new(&disk.device, "ext4", "ro");
    let f = m.path.join("by-root");
    assert_eq!(std::fs::read(&f).unwrap(), b"by-the-pods-root\n");
    let md = std::fs::metadata(&f).unwrap();
    assert_eq!((md.uid(), md.gid()), (0, 0));
}

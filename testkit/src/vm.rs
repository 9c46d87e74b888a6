//! The VM harness: the guest (`make initrd` output) under QEMU through
//! crust-vm, disk images made on the host, the agent's answers and the
//! guest's console. Every VM test lives in crust-vm's `tests/` and is
//! `#[ignore = "needs a VM: make test-vm runs it"]`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::ttrpc;
use crust_vm::{Vm, VmOptions};

use crate::agent::serial_publish_req;
use crate::disks::run;

/// A call context for a guest under TCG: two minutes.
pub fn ctx() -> ttrpc::context::Context {
    crust_vm::ctx(Duration::from_secs(120))
}

/// Options for a guest in `dir`; fails the test when `make initrd` has not
/// been run.
#[track_caller]
pub fn options(dir: &Path) -> VmOptions {
    let o = VmOptions::new(dir);
    assert!(
        o.kernel.is_file() && o.initrd.is_file(),
        "run `make initrd` first ({} missing)",
        o.initrd.display()
    );
    o
}

/// A guest in `dir/vm`, its agent answering.
#[track_caller]
pub fn boot(dir: &Path) -> Vm {
    Vm::up(options(&dir.join("vm"))).expect("the VM boots and the agent answers")
}

/// An empty image file `dir/name` of `mib` MiB.
pub fn blank(dir: &Path, name: &str, mib: u64) -> PathBuf {
    let img = dir.join(name);
    std::fs::File::create(&img)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    img
}

/// An image `dir/name` of `mib` MiB with an ext4 or xfs (`fs`), loop-mounted
/// on the host while `fill` writes into it.
#[track_caller]
pub fn image(dir: &Path, name: &str, fs: &str, mib: u64, fill: impl FnOnce(&Path)) -> PathBuf {
    crate::needs::root();
    let img = blank(dir, name, mib);
    match fs {
        "ext4" => run("mkfs.ext4", &["-q", "-F", img.to_str().unwrap()]),
        _ => run("mkfs.xfs", &["-q", "-f", img.to_str().unwrap()]),
    };
    let m = dir.join(format!("{name}.mnt"));
    std::fs::create_dir_all(&m).unwrap();
    run(
        "mount",
        &["-o", "loop", img.to_str().unwrap(), m.to_str().unwrap()],
    );
    fill(&m);
    run("umount", &[m.to_str().unwrap()]);
    img
}

/// Publishes the disk with `serial` as `fs`, with `gid` as the fsGroup.
pub fn publish(
    c: &AgentClient,
    id: &str,
    serial: &str,
    fs: &str,
    gid: Option<u32>,
) -> ttrpc::Result<pb::PublishVolumeResponse> {
    c.publish_volume(ctx(), &serial_publish_req(id, serial, fs, gid))
}

pub fn stats(c: &AgentClient, id: &str) -> ttrpc::Result<pb::GetVolumeStatsResponse> {
    c.get_volume_stats(ctx(), &crate::agent::stats_req(id))
}

/// The guest's console so far.
pub fn console(vm: &Vm) -> String {
    String::from_utf8_lossy(&std::fs::read(vm.console_log()).unwrap_or_default()).into_owned()
}

/// The last `bytes` of `text` (from a character boundary), for failure messages.
pub fn tail(text: &str, bytes: usize) -> &str {
    let start = text.len().saturating_sub(bytes);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    &text[start..]
}

/// Waits up to `limit` for the console to satisfy `pred`: Ok(the console)
/// once it does, Err(the console) when the time is up.
pub fn console_until(
    vm: &Vm,
    limit: Duration,
    pred: impl Fn(&str) -> bool,
) -> Result<String, String> {
    let t = Instant::now();
    loop {
        let text = console(vm);
        if pred(&text) {
            return Ok(text);
        }
        if t.elapsed() > limit {
            return Err(text);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

//! Hostile disks in a real guest, where a kernel panic or a mount that sleeps
//! for minutes would end or freeze the sandbox: an ext4 that asks for a
//! panic on error (s_errors, or errors=panic planted in s_mount_opts) with one
//! corrupt directory block that the agent's own fsGroup walk reads, and an
//! ext4 whose multi-mount protection would hold mount(2) for 12 minutes.
//! The images are made and corrupted on the host with mkfs, debugfs and
//! plain writes to the image file; the host never mounts them.
//! Run with `make test` (these tests need `make initrd` output and root).

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::ttrpc;
use crust_testkit::agent::said;
use crust_testkit::run;
use crust_testkit::vm::{blank, boot, ctx, stats, tail};
use crust_vm::Vm;

/// Overwrites `bytes` at `offset` of the image file.
fn poke(img: &Path, offset: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

/// A field of `dumpe2fs -h`.
fn dumpe2fs(img: &Path, field: &str) -> u64 {
    let out = run("dumpe2fs", &["-h", img.to_str().unwrap()]);
    let line = out
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in {out}"));
    line[field.len()..].trim().parse().unwrap()
}

/// An ext4 whose error behaviour is panic (`tune` sets it: `-e panic` or
/// `-E mount_opts=errors=panic`), holding `data/` with a few files, whose
/// one directory block is then overwritten with garbage. Built with
/// debugfs only: the host kernel never sees it.
fn corrupt_ext4(dir: &Path, name: &str, tune: &[&str]) -> PathBuf {
    let img = blank(dir, name, 64);
    let p = img.to_str().unwrap();
    run("mkfs.ext4", &["-q", "-F", "-b", "4096", p]);
    let args: Vec<&str> = tune.iter().copied().chain([p]).collect();
    run("tune2fs", &args);
    let payload = dir.join("payload");
    std::fs::write(&payload, b"hello").unwrap();
    let mut cmds = String::from("mkdir data\n");
    for i in 0..8 {
        cmds.push_str(&format!("write {} data/f{i}\n", payload.display()));
    }
    let cmdfile = dir.join(format!("{name}.debugfs"));
    std::fs::write(&cmdfile, cmds).unwrap();
    run("debugfs", &["-w", "-f", cmdfile.to_str().unwrap(), p]);
    let blocks = run("debugfs", &["-R", "blocks data", p]);
    let block: u64 = blocks
        .split_whitespace()
        .next()
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("no block for data/ in {blocks:?}"));
    poke(&img, block * 4096, &[0xA5; 4096]);
    img
}

/// An ext4 publish of the disk with `serial`, with `gid` as the fsGroup.
fn publish(
    c: &AgentClient,
    id: &str,
    serial: &str,
    gid: Option<u32>,
) -> ttrpc::Result<pb::PublishVolumeResponse> {
    crust_testkit::vm::publish(c, id, serial, "ext4", gid)
}

/// The end of the guest's console, for failure messages.
fn console(vm: &Vm) -> String {
    tail(&crust_testkit::vm::console(vm), 3000).to_string()
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn a_hostile_ext4_neither_panics_nor_hangs_the_guest() {
    let tmp = tempfile::tempdir().unwrap();
    let by_s_errors = corrupt_ext4(tmp.path(), "s-errors.img", &["-e", "panic"]);
    let by_mount_opts = corrupt_ext4(
        tmp.path(),
        "mount-opts.img",
        &["-E", "mount_opts=errors=panic"],
    );
    // MMP that the kernel, finding it in use, would wait 2 x 360 s on.
    let mmp = blank(tmp.path(), "mmp.img", 64);
    run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-O",
            "mmp",
            "-E",
            "mmp_update_interval=300",
            mmp.to_str().unwrap(),
        ],
    );
    let at = dumpe2fs(&mmp, "MMP block number:") * dumpe2fs(&mmp, "Block size:");
    poke(&mmp, at + 4, &42u32.to_le_bytes());

    let mut vm = boot(tmp.path());
    let c = vm.agent().unwrap();
    for (img, serial, id) in [
        (&by_s_errors, "hostile-s-errors", "vol-s-errors"),
        (&by_mount_opts, "hostile-mount-opts", "vol-mount-opts"),
    ] {
        vm.hotplug(img, serial, false).unwrap();
        // The fsGroup walk reads every directory, the corrupt one too.
        let r = publish(&c, id, serial, Some(2000));
        let answer = said(&r);
        let alive = c.get_agent_info(ctx(), &pb::GetAgentInfoRequest::new());
        assert!(
            alive.is_ok() && !answer.starts_with("no answer"),
            "{id}: the guest went down: publish said {answer}; the agent said {}\nconsole:\n{}",
            said(&alive),
            console(&vm)
        );
        eprintln!("{id}: publish with fsGroup answered {answer}");
        if r.is_err() {
            // A clear refusal; the mount was undone. Published again without
            // the walk, the errors the walk met are on record.
            assert!(
                answer.starts_with("INTERNAL") || answer.starts_with("FAILED_PRECONDITION"),
                "{id}: {answer}"
            );
            assert!(
                answer.contains(id) || answer.contains("data"),
                "{id}: {answer}"
            );
            let again = publish(&c, id, serial, None);
            assert!(again.is_ok(), "{id}: {}", said(&again));
        }
        let s = stats(&c, id);
        let cond = s
            .as_ref()
            .ok()
            .and_then(|s| s.condition.as_ref())
            .cloned()
            .unwrap_or_default();
        assert!(
            cond.abnormal && cond.message.contains("error"),
            "{id}: stats said {}\nconsole:\n{}",
            said(&s),
            console(&vm)
        );
        eprintln!("{id}: condition {:?}", cond.message);
        let mut u = pb::UnpublishVolumeRequest::new();
        u.volume_id = id.into();
        let u = c.unpublish_volume(ctx(), &u);
        assert!(u.is_ok(), "{id}: {}", said(&u));
    }

    // The MMP disk is refused at once instead of holding mount(2) for 720 s.
    vm.hotplug(&mmp, "hostile-mmp", false).unwrap();
    let t = Instant::now();
    let r = publish(&c, "vol-mmp", "hostile-mmp", None);
    let answer = said(&r);
    assert!(
        answer.starts_with("FAILED_PRECONDITION") && answer.contains("MMP"),
        "{answer}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t.elapsed()
    );

    let how = vm.down().unwrap();
    assert!(how.contains("agent shut down"), "{how}");
}

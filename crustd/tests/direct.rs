//! Kata's direct-assigned volume records through crustd, as a process, with
//! fake sandboxes (tests/fakes) and loop devices: records written by Go's
//! own encoders exactly as Kata's package writes them (tests/kata_writer),
//! RuntimePublishDirectVolume, the sandbox-id file, `crustd-ctl
//! direct-volume`, every hostile record refused with nothing plugged,
//! createFilesystem on blank, same-filesystem and foreign devices,
//! encrypted records (the key passed to the guest by reference, the disk
//! never written on the host), and sandboxes whose VM is gone. Needs root
//! (loop devices), Go and cryptsetup.

mod fakes;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crust_kubelet::{pb, Kubelet};
use crust_testkit::crustd::{code, ctl, kata, kata_writer, state, Crustd};
use crust_testkit::{mode, needs, run, LoopDisk};

/// A registry with sandboxes pod-a and pod-b, a direct-volume root, the Go
/// writer and crustd serving both.
struct Rig {
    t: tempfile::TempDir,
    _reg: PathBuf,
    root: PathBuf,
    a: fakes::Sandbox,
    b: fakes::Sandbox,
    writer: PathBuf,
    d: Crustd,
}

impl Rig {
    fn new(extra: &[&str]) -> Rig {
        needs::loop_devices();
        let writer = kata_writer();
        let t = tempfile::tempdir().unwrap();
        let reg = t.path().join("sandboxes");
        let root = t.path().join("direct-volumes");
        let a = fakes::sandbox(&reg, "pod-a");
        let b = fakes::sandbox(&reg, "pod-b");
        let mut args = vec!["--direct-volumes", root.to_str().unwrap()];
        args.extend_from_slice(extra);
        let d = Crustd::start_logged(&reg, &args);
        Rig {
            t,
            _reg: reg,
            root,
            a,
            b,
            writer,
            d,
        }
    }

    fn root(&self) -> &str {
        self.root.to_str().unwrap()
    }

    /// Files a record for `vol` with Go, as Kata's AddMountInfo does.
    fn add(&self, vol: &str, dev: &str, fs: &str, more: &[&str]) -> PathBuf {
        let mut args = vec!["add", self.root(), vol, dev, fs];
        args.extend_from_slice(more);
        kata(&self.writer, &args);
        self.record_dir(vol)
    }

    /// Files `json` verbatim for `vol` with Go, as Kata's Add does.
    fn add_raw(&self, vol: &str, json: &str) -> PathBuf {
        kata(&self.writer, &["add-raw", self.root(), vol, json]);
        self.record_dir(vol)
    }

    fn record_dir(&self, vol: &str) -> PathBuf {
        self.root.join(crustd::direct::encode(vol.as_bytes()))
    }

    /// `crustd-ctl --socket S --direct-volumes ROOT ARGS...`.
    fn ctl(&self, args: &[&str]) -> (u8, String, String) {
        let sock = self.d.socket.to_str().unwrap().to_string();
        let mut all = vec!["--socket", &sock, "--direct-volumes", self.root()];
        all.extend_from_slice(args);
        ctl(&all)
    }

    /// Nothing reached either QEMU or agent, and no volume is recorded.
    fn nothing_plugged(&self, what: &str) {
        for sb in [&self.a, &self.b] {
            let q = sb.qemu.lock().unwrap();
            assert!(
                q.log.is_empty() && q.nodes.is_empty() && q.devices.is_empty(),
                "{what}: QEMU of {} was asked {:?}",
                sb.id,
                q.log
            );
            assert!(
                sb.agent.lock().unwrap().log.is_empty(),
                "{what}: the agent of {} was asked",
                sb.id
            );
            assert_eq!(state(&sb.dir)["volumes"], serde_json::json!({}), "{what}");
        }
    }
}

fn verbs(q: &fakes::Qemu) -> Vec<String> {
    std::mem::take(&mut q.lock().unwrap().log)
        .iter()
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect()
}

#[test]
#[ignore = "needs root and go: make test runs it"]
fn a_record_as_kata_writes_it_is_published_and_found_again() {
    let r = Rig::new(&[]);
    let disk = LoopDisk::new(64, Some("ext4"));
    let dev = disk.path();
    let vol = "/var/lib/kubelet/pods/7f1c-uid/volumes/kubernetes.io~csi/pvc-1/mount";
    let dir = r.add(
        vol,
        &dev,
        "ext4",
        &[
            "fsGroup=2000",
            "fsGroupChangePolicy=OnRootMismatch",
            "azure.csi.disk/volume-id=/subscriptions/x/disks/d",
            "-o",
            "noatime",
        ],
    );
    let file = dir.join("mountInfo.json");
    let bytes = std::fs::read(&file).unwrap();
    let mtime = std::fs::metadata(&file).unwrap().mtime_nsec();
    assert_eq!((mode(&dir), mode(&file)), (0o700, 0o600));
    let k = r.d.client();

    let p = k.publish_direct("pod-a", vol, false).unwrap();
    assert!(
        p.guest_path.starts_with("/run/crust/volumes/crustd-"),
        "{p:?}"
    );
    assert_eq!(p.host_volume_id, dev);
    assert_eq!(verbs(&r.a.qemu), ["blockdev-add", "device_add"]);
    let agent = r.a.agent_log();
    assert_eq!(agent.len(), 1);
    assert!(
        agent[0].ends_with(" ext4 2000 OnRootMismatch -o noatime"),
        "{agent:?}"
    );
    // The sandbox-id file as Kata's RecordSandboxID writes it, found by Go's lookup.
    let id = dir.join("pod-a");
    assert_eq!(std::fs::read(&id).unwrap(), b"");
    assert_eq!(mode(&id), 0o600);
    assert_eq!(kata(&r.writer, &["sandbox", r.root(), vol]), "pod-a");
    // The driver's record is never touched.
    assert_eq!(std::fs::read(&file).unwrap(), bytes);
    assert_eq!(std::fs::metadata(&file).unwrap().mtime_nsec(), mtime);
    let st = state(&r.a.dir);
    assert_eq!(st["volumes"][&dev]["direct"], vol);
    assert_eq!(st["volumes"][&dev]["host_target_path"], vol);

    // Idempotent: the same answer, nothing plugged twice.
    assert_eq!(k.publish_direct("pod-a", vol, false).unwrap(), p);
    assert!(verbs(&r.a.qemu).is_empty());

    stats_and_resize(&r, &disk, vol);
    unpublished(&r, &k, &dev, vol, &dir, &bytes);
    removed(&r, &k, vol, &dir);
    added_as_kata_adds(&r, vol);
}

/// crustd-ctl direct-volume stats and resize find the sandbox by its file.
fn stats_and_resize(r: &Rig, disk: &LoopDisk, vol: &str) {
    let (c, out, err) = r.ctl(&["direct-volume", "stats", "--volume-path", vol]);
    assert_eq!(c, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["usage"][0]["used"], 300, "{out}");
    assert_eq!(v["volume_condition"]["abnormal"], true);
    disk.resize(128);
    let (c, out, err) = r.ctl(&[
        "direct-volume",
        "resize",
        "--volume-path",
        vol,
        "--size",
        &(100u64 << 20).to_string(),
    ]);
    assert_eq!(c, 0, "{err}");
    assert_eq!(out, format!("{{\"capacity_bytes\":{}}}", 100u64 << 20));
    assert_eq!(verbs(&r.a.qemu), ["block_resize"]);
}

/// Unpublish with the device: the sandbox-id file goes, the record stays.
fn unpublished(r: &Rig, k: &Kubelet, dev: &str, vol: &str, dir: &Path, bytes: &[u8]) {
    let (id, file) = (dir.join("pod-a"), dir.join("mountInfo.json"));
    k.unpublish("pod-a", dev).unwrap();
    assert!(!id.exists());
    assert_eq!(std::fs::read(&file).unwrap(), bytes);
    assert_eq!(verbs(&r.a.qemu), ["device_del", "blockdev-del"]);
    let (c, _, err) = r.ctl(&["direct-volume", "stats", "--volume-path", vol]);
    assert_eq!(c, 1, "{err}");
    assert!(err.contains("is in no sandbox"), "{err}");
}

/// remove deletes the record; then there is none to publish.
fn removed(r: &Rig, k: &Kubelet, vol: &str, dir: &Path) {
    let (c, _, err) = r.ctl(&["direct-volume", "remove", "--volume-path", vol]);
    assert_eq!(c, 0, "{err}");
    assert!(!dir.exists());
    let (c, m) = code(k.publish_direct("pod-a", vol, false));
    assert_eq!(c, "NOT_FOUND", "{m}");
    assert!(m.contains(vol) && m.contains(r.root()), "{m}");
    let (c, _, err) = r.ctl(&["direct-volume", "stats", "--volume-path", vol]);
    assert!(c == 1 && err.contains("NOT_FOUND"), "{err}");
}

/// crustd-ctl direct-volume add writes what Kata's Add writes, byte for
/// byte, and refuses what is not a record.
fn added_as_kata_adds(r: &Rig, vol: &str) {
    let json =
        r#"{"volume-type":"block","device":"/dev/sdz","fstype":"xfs","metadata":{"fsGroup":"7"}}"#;
    let (c, _, err) = r.ctl(&[
        "direct-volume",
        "add",
        "--volume-path",
        vol,
        "--mount-info",
        json,
    ]);
    assert_eq!(c, 0, "{err}");
    let other = r.t.path().join("go-root");
    kata(&r.writer, &["add-raw", other.to_str().unwrap(), vol, json]);
    let name = crustd::direct::encode(vol.as_bytes());
    for root in [&r.root, &other] {
        assert_eq!(mode(&root.join(&name)), 0o700);
        assert_eq!(mode(&root.join(&name).join("mountInfo.json")), 0o600);
    }
    assert_eq!(
        std::fs::read(r.root.join(&name).join("mountInfo.json")).unwrap(),
        std::fs::read(other.join(&name).join("mountInfo.json")).unwrap()
    );
    let (c, _, err) = r.ctl(&[
        "direct-volume",
        "add",
        "--volume-path",
        "/x",
        "--mount-info",
        "{not json",
    ]);
    assert!(c == 1 && err.contains("not a record"), "{err}");
    // publish-direct from a shell.
    let (c, _, err) = r.ctl(&["publish-direct", "pod-a", "--volume-path", vol]);
    assert!(
        c == 1 && err.contains("INVALID_ARGUMENT") && err.contains("/dev/sdz"),
        "{err}"
    );
}

/// A Kata direct-volume record for `dev`, with `meta` inside its metadata
/// and `opts` inside its options.
fn rec(dev: &str, fs: &str, meta: &str, opts: &str) -> String {
    format!(
        r#"{{"volume-type":"directvol","device":"{dev}","fstype":"{fs}","metadata":{{{meta}}},"options":[{opts}]}}"#
    )
}

/// A hostile record: its volume path, how it is made, the code it is
/// refused with, words the message has.
type Case<'a> = (
    &'static str,
    Box<dyn Fn(&str) + 'a>,
    &'static str,
    Vec<String>,
);

/// A case whose record is `json`, filed as Kata's Add files it.
fn raw(r: &Rig, json: String) -> Box<dyn Fn(&str) + '_> {
    Box::new(move |vol: &str| drop(r.add_raw(vol, &json)))
}

/// Records whose files are not what Kata's Add writes: links, modes,
/// owners, sizes, kinds, contents.
fn hostile_files<'a>(r: &'a Rig, g: &'a str) -> Vec<Case<'a>> {
    use std::os::unix::fs::symlink;
    vec![
        (
            "/v/dir-symlink",
            Box::new(move |vol: &str| {
                let real = r.add_raw("/v/real", &rec(g, "ext4", "", ""));
                symlink(&real, r.record_dir(vol)).unwrap();
            }),
            "INVALID_ARGUMENT",
            vec!["a symbolic link".into(), "not a real directory".into()],
        ),
        (
            "/v/file-symlink",
            Box::new(move |vol: &str| {
                let d = r.add_raw(vol, &rec(g, "ext4", "", ""));
                let real = r.record_dir("/v/real").join("mountInfo.json");
                std::fs::remove_file(d.join("mountInfo.json")).unwrap();
                symlink(real, d.join("mountInfo.json")).unwrap();
            }),
            "INVALID_ARGUMENT",
            vec!["a symbolic link".into(), "mountInfo.json".into()],
        ),
        (
            "/v/dir-writable",
            Box::new(move |vol: &str| {
                let d = r.add_raw(vol, &rec(g, "ext4", "", ""));
                std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
            }),
            "INVALID_ARGUMENT",
            vec!["writable by group or others".into()],
        ),
        (
            "/v/file-writable",
            Box::new(move |vol: &str| {
                let d = r.add_raw(vol, &rec(g, "ext4", "", ""));
                std::fs::set_permissions(
                    d.join("mountInfo.json"),
                    std::fs::Permissions::from_mode(0o620),
                )
                .unwrap();
            }),
            "INVALID_ARGUMENT",
            vec![
                "writable by group or others".into(),
                "mountInfo.json".into(),
            ],
        ),
        (
            "/v/file-not-roots",
            Box::new(move |vol: &str| {
                let d = r.add_raw(vol, &rec(g, "ext4", "", ""));
                std::os::unix::fs::chown(d.join("mountInfo.json"), Some(1000), Some(1000)).unwrap();
            }),
            "INVALID_ARGUMENT",
            vec!["owned by uid 1000".into()],
        ),
        (
            "/v/dir-not-roots",
            Box::new(move |vol: &str| {
                let d = r.add_raw(vol, &rec(g, "ext4", "", ""));
                std::os::unix::fs::chown(&d, Some(1000), Some(1000)).unwrap();
            }),
            "INVALID_ARGUMENT",
            vec!["owned by uid 1000".into()],
        ),
        (
            "/v/oversized",
            raw(
                r,
                format!("{}{}", rec(g, "ext4", "", ""), " ".repeat(64 << 10)),
            ),
            "INVALID_ARGUMENT",
            vec!["more than crustd reads".into()],
        ),
        (
            "/v/fifo",
            Box::new(move |vol: &str| {
                let d = r.add_raw(vol, &rec(g, "ext4", "", ""));
                std::fs::remove_file(d.join("mountInfo.json")).unwrap();
                run("mkfifo", &[d.join("mountInfo.json").to_str().unwrap()]);
            }),
            "INVALID_ARGUMENT",
            vec!["a FIFO".into()],
        ),
        (
            // Kata's Add would not file it: written over a good record.
            "/v/malformed",
            Box::new(move |vol: &str| {
                let d = r.add_raw(vol, &rec(g, "ext4", "", ""));
                let bad = rec(g, "ext4", "", "").replace('}', "");
                std::fs::write(d.join("mountInfo.json"), bad).unwrap();
            }),
            "INVALID_ARGUMENT",
            vec!["not JSON".into()],
        ),
    ]
}

/// Records whose fields are refused.
fn hostile_fields<'a>(r: &'a Rig, g: &'a str) -> Vec<Case<'a>> {
    vec![
        (
            "/v/duplicate-device",
            raw(
                r,
                format!(
                    r#"{{"volume-type":"block","device":"{g}","fstype":"ext4","device":"/dev/sda"}}"#
                ),
            ),
            "INVALID_ARGUMENT",
            vec!["given twice".into()],
        ),
        (
            "/v/case-variant",
            raw(
                r,
                format!(r#"{{"volume-type":"block","Device":"{g}","fstype":"ext4"}}"#),
            ),
            "INVALID_ARGUMENT",
            vec!["not spelled".into()],
        ),
        (
            "/v/volume-type",
            raw(r, rec(g, "ext4", "", "").replace("directvol", "nfs")),
            "INVALID_ARGUMENT",
            vec!["volume-type \"nfs\"".into()],
        ),
        (
            "/v/fstype",
            raw(r, rec(g, "btrfs", "", "")),
            "INVALID_ARGUMENT",
            vec!["fstype \"btrfs\"".into()],
        ),
        (
            "/v/fsgroup",
            raw(r, rec(g, "ext4", r#""fsGroup":"-2000""#, "")),
            "INVALID_ARGUMENT",
            vec!["fsGroup \"-2000\"".into()],
        ),
        (
            "/v/fsgroup-big",
            raw(r, rec(g, "ext4", r#""fsGroup":"4294967295""#, "")),
            "INVALID_ARGUMENT",
            vec!["fsGroup".into()],
        ),
        (
            "/v/policy",
            raw(
                r,
                rec(
                    g,
                    "ext4",
                    r#""fsGroup":"1","fsGroupChangePolicy":"Never""#,
                    "",
                ),
            ),
            "INVALID_ARGUMENT",
            vec!["fsGroupChangePolicy".into()],
        ),
        (
            "/v/option",
            raw(r, rec(g, "ext4", "", r#""noatime","errors=panic""#)),
            "INVALID_ARGUMENT",
            vec!["errors=panic".into()],
        ),
    ]
}

/// Records whose encryptionKey crustd cannot pass to the guest by reference.
fn hostile_keys<'a>(r: &'a Rig, g: &'a str) -> Vec<Case<'a>> {
    vec![
        (
            // A key itself (base64 of "secret"): never held, never shown.
            "/v/key-bytes",
            raw(r, rec(g, "ext4", r#""encryptionKey":"c2VjcmV0""#, "")),
            "INVALID_ARGUMENT",
            vec!["encryptionKey".into(), "never holds key bytes".into()],
        ),
        (
            // Kata's encrypted emptyDir: a key crustd would have to make.
            "/v/ephemeral",
            raw(
                r,
                rec(
                    g,
                    "ext4",
                    r#""encryptionKey":"ephemeral","createFilesystem":"true""#,
                    "",
                ),
            ),
            "UNIMPLEMENTED",
            vec!["\"ephemeral\"".into(), "kbs:///repository/type/tag".into()],
        ),
        (
            "/v/key-scheme",
            raw(r, rec(g, "ext4", r#""encryptionKey":"vault://k/1""#, "")),
            "INVALID_ARGUMENT",
            vec!["scheme \"vault\"".into()],
        ),
        (
            "/v/kbs-host",
            raw(
                r,
                rec(
                    g,
                    "ext4",
                    r#""encryptionKey":"kbs://kbs.example/a/b/c""#,
                    "",
                ),
            ),
            "INVALID_ARGUMENT",
            vec!["names a KBS host".into()],
        ),
    ]
}

/// The disks a record may name but not have: not a disk, not there, or
/// the host's (mounted, swap, under a loop device) or another sandbox's.
struct Taken {
    plain: PathBuf,
    mounted: LoopDisk,
    swap: LoopDisk,
    under: LoopDisk,
    /// The loop device over `under`, as losetup printed it.
    upper: String,
    taken: LoopDisk,
}

/// Records naming a device they cannot have.
fn hostile_devices<'a>(r: &'a Rig, d: &'a Taken) -> Vec<Case<'a>> {
    let Taken {
        plain,
        mounted,
        swap,
        under,
        upper,
        taken,
    } = d;
    vec![
        (
            "/v/regular-file",
            raw(r, rec(plain.to_str().unwrap(), "ext4", "", "")),
            "INVALID_ARGUMENT",
            vec!["regular file".into(), "mountInfo.json".into()],
        ),
        (
            "/v/dev-null",
            raw(r, rec("/dev/null", "ext4", "", "")),
            "INVALID_ARGUMENT",
            vec!["not a block device".into()],
        ),
        (
            "/v/no-device",
            raw(r, rec("/dev/crust-no-such-disk", "ext4", "", "")),
            "INVALID_ARGUMENT",
            vec!["/dev/crust-no-such-disk".into()],
        ),
        (
            "/v/relative",
            raw(r, rec("dev/sda", "ext4", "", "")),
            "INVALID_ARGUMENT",
            vec!["not an absolute path".into()],
        ),
        (
            "/v/mounted",
            raw(r, rec(&mounted.path(), "ext4", "", "")),
            "FAILED_PRECONDITION",
            vec!["is mounted at".into(), mounted.path()],
        ),
        (
            "/v/swap",
            raw(r, rec(&swap.path(), "ext4", "", "")),
            "FAILED_PRECONDITION",
            vec!["is used as swap".into()],
        ),
        (
            "/v/under-a-loop",
            raw(r, rec(&under.path(), "ext4", "", "")),
            "FAILED_PRECONDITION",
            vec![format!("is under loop device {}", &upper[5..])],
        ),
        (
            "/v/elsewhere",
            raw(r, rec(&taken.path(), "ext4", "", "")),
            "FAILED_PRECONDITION",
            vec!["sandbox pod-b".into()],
        ),
    ]
}

/// Publishes each case's record into pod-a and checks it is refused as it says.
fn refused(r: &Rig, k: &Kubelet, cases: Vec<Case<'_>>) {
    for (vol, make, want, says) in cases {
        make(vol);
        let file = r.record_dir(vol).join("mountInfo.json");
        let (c, m) = code(k.publish_direct("pod-a", vol, false));
        assert_eq!(c, want, "{vol}: {m}");
        for s in &says {
            assert!(m.contains(s.as_str()), "{vol}: {m:?} lacks {s:?}");
        }
        // The sentence names the record, or the device it names.
        assert!(
            m.contains(file.parent().unwrap().to_str().unwrap()) || c == "FAILED_PRECONDITION",
            "{vol}: {m}"
        );
        assert!(!r.record_dir(vol).join("pod-a").exists(), "{vol}");
    }
}

/// Every hostile record of docs/crustd.md §8.2: refused with its code and a
/// sentence naming the file or the device, and nothing plugged.
#[test]
#[ignore = "needs root and go: make test runs it"]
fn every_hostile_record_is_refused_before_anything_is_plugged() {
    let r = Rig::new(&[]);
    let good = LoopDisk::new(32, Some("ext4"));
    let plain = r.t.path().join("plain.img");
    std::fs::write(&plain, b"x").unwrap();
    let d = Taken {
        plain,
        mounted: LoopDisk::new(32, Some("ext4")),
        swap: LoopDisk::new(32, Some("swap")),
        under: LoopDisk::new(32, Some("ext4")),
        upper: String::new(),
        taken: LoopDisk::new(32, Some("ext4")),
    };
    let _m = crust_testkit::Mounted::new(&d.mounted.device, "ext4", "");
    let _swap = Off::swap_on(d.swap.path());
    // A loop device over another: the lower one is the host's.
    let upper = Detach::over(&d.under.path());
    let d = Taken {
        upper: upper.0.clone(),
        ..d
    };
    let k = r.d.client();
    let g = good.path();
    // pod-b has `taken` through a plain publish; its QEMU log is cleared below.
    k.publish(pb::RuntimePublishVolumeRequest {
        sandbox_id: "pod-b".into(),
        host_volume_id: d.taken.path(),
        file_system: "ext4".into(),
        ..Default::default()
    })
    .unwrap();
    std::mem::take(&mut r.b.qemu.lock().unwrap().log);
    std::mem::take(&mut r.b.agent.lock().unwrap().log);
    let b_state = state(&r.b.dir);

    refused(&r, &k, hostile_files(&r, &g));
    refused(&r, &k, hostile_fields(&r, &g));
    refused(&r, &k, hostile_keys(&r, &g));
    refused(&r, &k, hostile_devices(&r, &d));
    // A directory planted where the sandbox-id file goes.
    let slot = r.add_raw("/v/slot", &rec(&g, "ext4", "", ""));
    std::fs::create_dir(slot.join("pod-a")).unwrap();
    let (c, m) = code(k.publish_direct("pod-a", "/v/slot", false));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(m.contains("a directory") && m.contains("sandbox-id"), "{m}");
    // No record at all.
    let (c, m) = code(k.publish_direct("pod-a", "/v/none", false));
    assert_eq!(c, "NOT_FOUND", "{m}");
    assert!(m.contains("/v/none") && m.contains(r.root()), "{m}");
    r.nothing_plugged_but(&b_state);
    // The good record goes in after all of that.
    r.add_raw("/v/good", &rec(&g, "ext4", "", ""));
    k.publish_direct("pod-a", "/v/good", false).unwrap();
    k.unpublish("pod-a", &g).unwrap();
    k.unpublish("pod-b", &d.taken.path()).unwrap();
}

/// Swap on a device for as long as it lives.
struct Off(String);

impl Off {
    fn swap_on(dev: String) -> Off {
        run("swapon", &[&dev]);
        Off(dev)
    }
}

impl Drop for Off {
    fn drop(&mut self) {
        let _ = std::process::Command::new("swapoff").arg(&self.0).output();
    }
}

/// A loop device over another, for as long as it lives.
struct Detach(String);

impl Detach {
    fn over(lower: &str) -> Detach {
        Detach(
            run("losetup", &["--find", "--show", lower])
                .trim()
                .to_string(),
        )
    }
}

impl Drop for Detach {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.0])
            .output();
    }
}

impl Rig {
    /// As `nothing_plugged`, pod-b keeping the state it had.
    fn nothing_plugged_but(&self, b_state: &serde_json::Value) {
        for sb in [&self.a, &self.b] {
            let q = sb.qemu.lock().unwrap();
            assert!(q.log.is_empty(), "QEMU of {} was asked {:?}", sb.id, q.log);
            assert!(sb.agent.lock().unwrap().log.is_empty());
        }
        let q = self.a.qemu.lock().unwrap();
        assert!(q.nodes.is_empty() && q.devices.is_empty());
        assert_eq!(state(&self.a.dir)["volumes"], serde_json::json!({}));
        assert_eq!(&state(&self.b.dir), b_state);
    }
}

/// The whole image, for "not one byte written".
fn image(d: &LoopDisk) -> Vec<u8> {
    std::fs::read(&d.image).unwrap()
}

fn blkid(dev: &str, tag: &str) -> String {
    let out = std::process::Command::new("blkid")
        .args(["-p", "-s", tag, "-o", "value", dev])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
#[ignore = "needs root and go: make test runs it"]
fn create_filesystem_formats_only_a_provably_blank_device() {
    let r = Rig::new(&[]);
    let k = r.d.client();
    let create = ["createFilesystem=true", "fsGroup=2000"];

    // Blank: formatted on the host before the hot-plug.
    let blank = LoopDisk::new(64, None);
    r.add("/c/blank", &blank.path(), "ext4", &create);
    assert_eq!(blkid(&blank.path(), "TYPE"), "");
    k.publish_direct("pod-a", "/c/blank", false).unwrap();
    assert_eq!(blkid(&blank.path(), "TYPE"), "ext4");
    let uuid = blkid(&blank.path(), "UUID");
    assert_eq!(verbs(&r.a.qemu), ["blockdev-add", "device_add"]);
    // Held again after mkfs: the host cannot mount it.
    let at = blank.scratch("m");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "ext4", &blank.path()])
        .arg(&at)
        .output()
        .unwrap();
    assert!(!mounted.status.success(), "mounted a published disk");
    // A republish never reformats, nor does a publish after unpublish.
    k.publish_direct("pod-a", "/c/blank", false).unwrap();
    k.unpublish("pod-a", &blank.path()).unwrap();
    k.publish_direct("pod-a", "/c/blank", false).unwrap();
    assert_eq!(blkid(&blank.path(), "UUID"), uuid);
    k.unpublish("pod-a", &blank.path()).unwrap();
    verbs(&r.a.qemu);

    // The requested filesystem already there: published as it is, unwritten.
    let same = LoopDisk::new(64, Some("ext4"));
    let before = image(&same);
    r.add("/c/same", &same.path(), "ext4", &create);
    k.publish_direct("pod-a", "/c/same", false).unwrap();
    k.unpublish("pod-a", &same.path()).unwrap();
    assert!(image(&same) == before, "a device holding ext4 was written");
    verbs(&r.a.qemu);
    std::mem::take(&mut r.a.agent.lock().unwrap().log);

    // Anything else: FAILED_PRECONDITION naming it, not a byte written, nothing plugged.
    let xfs = LoopDisk::new(320, Some("xfs"));
    let parted = LoopDisk::new(64, None);
    parted.add_partition();
    let dirty_head = LoopDisk::new(64, None);
    let dirty_tail = LoopDisk::new(64, None);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&dirty_head.image)
            .unwrap();
        f.write_at(b"\x01", 5000).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&dirty_tail.image)
            .unwrap();
        f.write_at(b"old data", (64 << 20) - 100).unwrap();
    }
    for (disk, says) in [
        (&xfs, "holds xfs, not ext4".to_string()),
        (&parted, "a dos partition table".to_string()),
        (&dirty_head, "byte 5000 is not zero".to_string()),
        (
            &dirty_tail,
            format!("byte {} is not zero", (64u64 << 20) - 100),
        ),
    ] {
        let before = image(disk);
        let vol = format!("/c/{}", disk.name());
        r.add(&vol, &disk.path(), "ext4", &create);
        let (c, m) = code(k.publish_direct("pod-a", &vol, false));
        assert_eq!(c, "FAILED_PRECONDITION", "{says}: {m}");
        assert!(m.contains(&says) && m.contains(&disk.path()), "{m}");
        assert!(image(disk) == before, "{says}: the device was written");
    }
    r.nothing_plugged("foreign signatures");

    // The same rule through RuntimePublishVolume's create_file_system.
    let scratch = LoopDisk::new(320, None);
    let req = |fs: &str, block: bool| pb::RuntimePublishVolumeRequest {
        sandbox_id: "pod-b".into(),
        host_volume_id: scratch.path(),
        file_system: fs.into(),
        block,
        create_file_system: true,
        ..Default::default()
    };
    let (c, m) = code(k.publish(req("", true)));
    assert_eq!(c, "INVALID_ARGUMENT", "{m}");
    k.publish(req("xfs", false)).unwrap();
    assert_eq!(blkid(&scratch.path(), "TYPE"), "xfs");
    k.unpublish("pod-b", &scratch.path()).unwrap();
    let before = image(&scratch);
    let (c, m) = code(k.publish(req("ext4", false)));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(image(&scratch) == before);
}

/// The last PublishVolume request pod-a's agent was sent.
fn last_published(r: &Rig) -> crust_protocols::crust::PublishVolumeRequest {
    r.a.published()
        .pop()
        .expect("the agent was asked to publish")
}

/// Checks that `req` asks for LUKS2 with `key` by reference, no key bytes.
fn by_reference(req: &crust_protocols::crust::PublishVolumeRequest, key: &str, format: bool) {
    use crust_protocols::crust::encryption::Kind;
    let e = req.encryption.as_ref().expect("an encryption part");
    assert_eq!(e.kind.enum_value(), Ok(Kind::LUKS2));
    assert_eq!(e.key_uri(), key);
    assert!(!e.has_passphrase() && e.passphrase().is_empty(), "{e:?}");
    assert_eq!((e.format_if_blank, e.allow_discards), (format, false));
    assert_eq!(req.fs_type, "ext4");
}

/// An encrypted record: the guest gets its key's reference and formats it
/// itself; the host never writes a byte of the disk, and refuses first,
/// with crustd's own look, a disk that is neither blank nor LUKS.
#[test]
#[ignore = "needs root, go and cryptsetup: make test runs it"]
fn an_encrypted_record_reaches_the_guest_by_reference_and_the_host_never_formats_it() {
    let r = Rig::new(&[]);
    let k = r.d.client();
    let kbs = "kbs:///default/key/1";
    let with = |key: &str, create: bool| {
        let mut m = vec![format!("encryptionKey={key}"), "fsGroup=2000".into()];
        if create {
            m.push("createFilesystem=true".into());
        }
        m
    };
    let add = |vol: &str, disk: &LoopDisk, meta: &[String]| {
        let meta: Vec<&str> = meta.iter().map(String::as_str).collect();
        r.add(vol, &disk.path(), "ext4", &meta);
    };

    // Blank, createFilesystem: the guest may format it; the host writes nothing.
    let blank = LoopDisk::new(64, None);
    let before = image(&blank);
    add("/e/blank", &blank, &with(kbs, true));
    k.publish_direct("pod-a", "/e/blank", false).unwrap();
    by_reference(&last_published(&r), kbs, true);
    assert!(
        image(&blank) == before,
        "the host wrote to an encrypted volume's disk"
    );
    assert_eq!(blkid(&blank.path(), "TYPE"), "");
    assert_eq!(verbs(&r.a.qemu), ["blockdev-add", "device_add"]);
    // A republish asks the same, and still writes nothing.
    k.publish_direct("pod-a", "/e/blank", false).unwrap();
    by_reference(&last_published(&r), kbs, true);
    k.unpublish("pod-a", &blank.path()).unwrap();
    assert!(image(&blank) == before);

    // Already LUKS, createFilesystem: published as it is, for the guest to open.
    let luks = LoopDisk::new(64, None);
    let pass = r.t.path().join("pass");
    std::fs::write(&pass, b"passphrase").unwrap();
    run(
        "cryptsetup",
        &[
            "luksFormat",
            "-q",
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            pass.to_str().unwrap(),
            &luks.path(),
        ],
    );
    let before = image(&luks);
    add("/e/luks", &luks, &with(kbs, true));
    k.publish_direct("pod-a", "/e/luks", false).unwrap();
    by_reference(&last_published(&r), kbs, true);
    k.unpublish("pod-a", &luks.path()).unwrap();
    assert!(image(&luks) == before, "a LUKS disk was written");

    // No createFilesystem: an existing volume, never formatted by anyone;
    // crustd does not look (the guest opens it, or refuses what is not LUKS2).
    let file_key = "file:///run/keys/vol-1";
    let plain = LoopDisk::new(64, Some("ext4"));
    let before = image(&plain);
    add("/e/existing", &plain, &with(file_key, false));
    k.publish_direct("pod-a", "/e/existing", false).unwrap();
    by_reference(&last_published(&r), file_key, false);
    k.unpublish("pod-a", &plain.path()).unwrap();
    assert!(image(&plain) == before);
    verbs(&r.a.qemu);
    std::mem::take(&mut r.a.agent.lock().unwrap().log);

    // createFilesystem on a disk that holds a filesystem: refused on the
    // host, nothing written, nothing plugged, the guest never asked.
    add("/e/not-blank", &plain, &with(kbs, true));
    let (c, m) = code(k.publish_direct("pod-a", "/e/not-blank", false));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(
        m.contains("holds ext4, not crypto_LUKS") && m.contains(&plain.path()),
        "{m}"
    );
    assert!(image(&plain) == before);
    r.nothing_plugged("an encrypted record on a disk holding ext4");

    // The key itself in the record: refused, and never repeated.
    add("/e/bytes", &blank, &with("c2VjcmV0LWtleQ==", true));
    let (c, m) = code(k.publish_direct("pod-a", "/e/bytes", false));
    assert_eq!(c, "INVALID_ARGUMENT", "{m}");
    assert!(
        m.contains("never holds key bytes") && !m.contains("c2VjcmV0"),
        "{m}"
    );
    r.nothing_plugged("a key in the record");
}

/// A disk holding an ext4 at 1 MiB (the usual first partition) whose
/// partition table sector was lost is never formatted, though its first
/// and last MiB are zeros and `blkid -p` finds nothing at offset 0.
#[test]
#[ignore = "needs root and go: make test runs it"]
fn a_file_system_behind_a_lost_partition_table_is_never_formatted() {
    let r = Rig::new(&[]);
    let k = r.d.client();
    let disk = LoopDisk::new(64, None);
    let img = disk.image.to_str().unwrap().to_string();
    run(
        "mkfs.ext4",
        &["-q", "-F", "-E", "offset=1048576", &img, "40M"],
    );
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&disk.image)
            .unwrap();
        f.write_at(&vec![0u8; 1 << 20], 0).unwrap();
        f.write_at(&vec![0u8; 1 << 20], (64 << 20) - (1 << 20))
            .unwrap();
    }
    run("losetup", &["-c", &disk.path()]);
    assert_eq!(
        blkid(&disk.path(), "TYPE"),
        "",
        "blkid -p sees nothing at 0"
    );
    let before = image(&disk);
    r.add("/c/lost", &disk.path(), "ext4", &["createFilesystem=true"]);
    let (c, m) = code(k.publish_direct("pod-a", "/c/lost", false));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(m.contains("ext4 at byte 1048576"), "{m}");
    let req = pb::RuntimePublishVolumeRequest {
        sandbox_id: "pod-b".into(),
        host_volume_id: disk.path(),
        file_system: "xfs".into(),
        create_file_system: true,
        ..Default::default()
    };
    let (c, m) = code(k.publish(req));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(image(&disk) == before, "the old file system was written");
    r.nothing_plugged("a file system at 1 MiB");
}

/// Writes sandbox.json of `sb` so its agent cannot be reached either (a
/// dead VM's vsock has nobody behind it).
fn agent_gone(sb: &fakes::Sandbox) {
    std::fs::write(
        sb.dir.join("sandbox.json"),
        serde_json::json!({"qmp": sb.dir.join("qmp.sock"), "agent": format!("unix://{}", sb.dir.join("gone.sock").display())}).to_string(),
    )
    .unwrap();
}

#[test]
#[ignore = "needs root and go: make test runs it"]
fn a_dead_sandbox_lets_go_of_its_volumes() {
    let mut r = Rig::new(&["--qmp-timeout", "2"]);
    let disk = LoopDisk::new(64, Some("ext4"));
    let dev = disk.path();
    r.add("/d/vol", &dev, "ext4", &["fsGroup=10"]);
    let k = r.d.client();
    k.publish_direct("pod-a", "/d/vol", false).unwrap();
    let id = r.record_dir("/d/vol").join("pod-a");
    assert!(id.exists());

    // The VM dies: its devices closed, its QMP socket and agent gone.
    fakes::die(&r.a.qemu);
    std::fs::remove_file(r.a.dir.join("qmp.sock")).unwrap();
    agent_gone(&r.a);
    // A restarted crustd says so, and forgets nothing.
    r.d.kill_and_restart();
    let log = r.d.log();
    let line = log
        .lines()
        .find(|l| l.contains("VM is gone"))
        .unwrap_or_else(|| panic!("no dead sandbox reported: {log}"));
    assert!(line.contains("pod-a") && line.contains(&dev), "{line}");
    assert_eq!(state(&r.a.dir)["volumes"][&dev]["phase"], "published");
    let k = r.d.client();
    // Still claimed meanwhile.
    let (c, m) = code(k.publish_direct("pod-b", "/d/vol", false));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");

    // Stats and expand: FAILED_PRECONDITION, the VM is gone.
    for (what, got) in [
        ("stats", code(k.stats("pod-a", &dev))),
        ("expand", code(k.expand("pod-a", &dev, 0))),
    ] {
        assert_eq!(got.0, "FAILED_PRECONDITION", "{what}: {}", got.1);
        assert!(
            got.1.contains("VM is gone") && got.1.contains("does not exist"),
            "{}",
            got.1
        );
    }
    // A process that still has the device open (a VMM whose socket was
    // removed under it would): not freed.
    let opened = std::fs::File::open(&dev).unwrap();
    let (c, m) = code(k.unpublish("pod-a", &dev));
    assert_eq!(c, "FAILED_PRECONDITION", "{m}");
    assert!(
        m.contains(&format!("process {}", std::process::id())),
        "{m}"
    );
    drop(opened);
    // Unpublish: OK, forgotten, its sandbox-id file removed, the device freed.
    // Another test's losetup or a udev probe may hold the node for a moment,
    // and is refused like any opener: kubelet retries, so does this test.
    let t = std::time::Instant::now();
    while let Err(e) = k.unpublish("pod-a", &dev) {
        let (c, m) = code(Err::<(), _>(e));
        assert_eq!(c, "FAILED_PRECONDITION", "{m}");
        assert!(
            !m.contains(&format!("process {} ", std::process::id())),
            "{m}"
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "{m}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(state(&r.a.dir)["volumes"], serde_json::json!({}));
    assert!(!id.exists());
    k.unpublish("pod-a", &dev).unwrap();
    k.publish_direct("pod-b", "/d/vol", false).unwrap();
    assert_eq!(kata(&r.writer, &["sandbox", r.root(), "/d/vol"]), "pod-b");

    // A busy monitor is not a dead VM: a socket that accepts and never greets.
    std::fs::remove_file(r.b.dir.join("qmp.sock")).unwrap();
    let _busy = std::os::unix::net::UnixListener::bind(r.b.dir.join("qmp.sock")).unwrap();
    let (c, m) = code(k.unpublish("pod-b", &dev));
    assert_eq!(c, "UNAVAILABLE", "{m}");
    assert!(m.contains("did not greet"), "{m}");
    assert!(
        state(&r.b.dir)["volumes"][&dev].is_object(),
        "forgotten while alive"
    );
    assert_eq!(
        code(k.publish_direct("pod-a", "/d/vol", false)).0,
        "FAILED_PRECONDITION"
    );
}

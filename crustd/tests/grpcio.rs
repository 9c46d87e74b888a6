//! Any gRPC client can talk to crustd, not only Go's: Python's grpcio (gRPC
//! C-core, as C++, Ruby and PHP use) on a default channel sends the unix
//! socket's path, percent-encoded, as `:authority`; grpc-java and grpcurl
//! send it plainly. h2 as published refuses both with
//! RST_STREAM(PROTOCOL_ERROR) before any handler runs (every call failed
//! with INTERNAL "Received RST_STREAM with error code 1"); crustd's patched
//! h2 (third_party/h2) leaves such an authority out. The client is
//! tests/grpcio/client.py on grpcio from build/py (scripts/deps.sh installs
//! the pinned version there); the messages are encoded here from the .proto.

mod fakes;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crust_kubelet::pb;
use crust_testkit::crustd::Crustd;
use crust_testkit::{needs, LoopDisk};
use prost::Message;

const SERVICE: &str = "/crust.runtime.v1alpha1.RuntimeAssistedStorageManagement/";

/// Where scripts/deps.sh installs grpcio.
fn grpcio_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../build/py")
}

fn have_grpcio() -> bool {
    Command::new("python3")
        .args(["-c", "import grpc"])
        .env("PYTHONPATH", grpcio_path())
        .output()
        .is_ok_and(|o| o.status.success())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// One call's outcome: Ok(response bytes) or Err((code name, details)).
type Answer = Result<Vec<u8>, (String, String)>;

/// Runs the Python client against `socket` with `authority` ("-": a
/// default channel) for `calls` of (method, request).
fn python(socket: &Path, authority: &str, calls: &[(&str, Vec<u8>)]) -> Vec<Answer> {
    let input: Vec<serde_json::Value> = calls
        .iter()
        .map(|(m, r)| serde_json::json!({"method": format!("{SERVICE}{m}"), "request": hex(r)}))
        .collect();
    let mut child = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grpcio/client.py"))
        .arg(socket)
        .arg(authority)
        .env("PYTHONPATH", grpcio_path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        child.stdin.as_mut().unwrap(),
        serde_json::to_string(&input).unwrap().as_bytes(),
    )
    .unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "client.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    answers
        .iter()
        .map(|a| match a["code"].as_str().unwrap() {
            "OK" => Ok(unhex(a["response"].as_str().unwrap())),
            code => Err((code.to_string(), a["details"].as_str().unwrap_or("").into())),
        })
        .collect()
}

fn ok<M: Message + Default>(a: &Answer) -> M {
    match a {
        Ok(b) => M::decode(b.as_slice()).unwrap(),
        Err((c, d)) => panic!("{c}: {d}"),
    }
}

#[test]
#[ignore = "needs root and python grpcio in build/py: make test runs it"]
fn pythons_grpcio_on_a_default_channel_drives_crustd() {
    needs::loop_devices();
    if !have_grpcio() {
        needs::missing("it needs python3 with grpcio in build/py (scripts/deps.sh installs it)");
    }
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("sandboxes");
    let root = t.path().join("direct-volumes");
    let sb = fakes::sandbox(&reg, "pod-a");
    let d = Crustd::start(&reg, &["--direct-volumes", root.to_str().unwrap()]);
    let disk = LoopDisk::new(64, Some("ext4"));
    let dev = disk.path();
    let vol = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount";
    crustd::direct::Records::new(&root)
        .add(
            vol.as_bytes(),
            format!(r#"{{"volume-type":"directvol","device":"{dev}","fstype":"ext4","metadata":{{"fsGroup":"3000"}}}}"#).as_bytes(),
        )
        .unwrap();

    // Default channel (percent-encoded path), then the plain path as
    // grpc-java and grpcurl send it, then Go's "localhost".
    let sock = d.socket.to_str().unwrap().to_string();
    for authority in ["-", sock.as_str(), "localhost"] {
        let publish = pb::RuntimePublishDirectVolumeRequest {
            sandbox_id: "pod-a".into(),
            volume_path: vol.into(),
            read_only: false,
        };
        let stats = pb::RuntimeGetVolumeStatsRequest {
            sandbox_id: "pod-a".into(),
            host_volume_id: dev.clone(),
        };
        let unpublish = pb::RuntimeUnpublishVolumeRequest {
            sandbox_id: "pod-a".into(),
            host_volume_id: dev.clone(),
        };
        let unknown = pb::RuntimeGetVolumeStatsRequest {
            sandbox_id: "pod-none".into(),
            host_volume_id: dev.clone(),
        };
        let a = python(
            &d.socket,
            authority,
            &[
                ("RuntimeGetCapabilities", vec![]),
                ("RuntimeGetSupportedFileSystems", vec![]),
                ("RuntimePublishDirectVolume", publish.encode_to_vec()),
                ("RuntimeGetVolumeStats", stats.encode_to_vec()),
                ("RuntimeUnpublishVolume", unpublish.encode_to_vec()),
                ("RuntimeGetVolumeStats", unknown.encode_to_vec()),
            ],
        );
        let caps: pb::RuntimeGetCapabilitiesResponse = ok(&a[0]);
        assert!(!caps.capabilities.is_empty(), "{authority}");
        let fs: pb::RuntimeGetSupportedFileSystemsResponse = ok(&a[1]);
        assert_eq!(fs.file_systems, ["ext4", "xfs"], "{authority}");
        let p: pb::RuntimePublishDirectVolumeResponse = ok(&a[2]);
        assert_eq!(p.host_volume_id, dev, "{authority}");
        assert!(p.guest_path.starts_with("/run/crust/volumes/"), "{p:?}");
        let s: pb::RuntimeGetVolumeStatsResponse = ok(&a[3]);
        assert_eq!(crust_kubelet::bytes(&s), Some((700, 1000, 300)));
        let _: pb::RuntimeUnpublishVolumeResponse = ok(&a[4]);
        // crustd's own codes and messages come through as well.
        let (code, details) = a[5].clone().unwrap_err();
        assert_eq!(code, "NOT_FOUND", "{details}");
        assert!(details.contains("no sandbox pod-none"), "{details}");
    }
    let q = sb.qemu.lock().unwrap();
    let plugged = q.log.iter().filter(|l| l.starts_with("device_add")).count();
    assert_eq!(plugged, 3, "{:?}", q.log);
    assert!(q.devices.is_empty());
}

//! Go's containerd/ttrpc client (tests/go_client, built here against the
//! Debian package golang-github-containerd-ttrpc-dev) talks to the agent:
//! calls, concurrent calls on one connection, an unknown method, malformed
//! payloads and the caller's deadline — the wire as another implementation
//! speaks it, not only as the Rust crate does.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::*;

/// Where Debian's Go packages live (GOPATH mode: no module download).
const GOCODE: &str = "/usr/share/gocode";

#[test]
#[ignore = "needs go and golang-github-containerd-ttrpc-dev: make test runs it"]
fn go_ttrpc_client_interoperates() {
    let have_go = Command::new("go").arg("version").output().is_ok();
    let have_ttrpc = Path::new(GOCODE)
        .join("src/github.com/containerd/ttrpc")
        .is_dir();
    if !have_go || !have_ttrpc {
        needs::missing(&format!(
            "it needs go and {GOCODE}/src/github.com/containerd/ttrpc \
             (apt-get install golang-go golang-github-containerd-ttrpc-dev)"
        ));
    }
    let work = tempfile::tempdir().unwrap();
    let pkg = work.path().join("src/goclient");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/go_client/main.go"),
        pkg.join("main.go"),
    )
    .unwrap();
    let bin = work.path().join("go_client");
    let out = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(&pkg)
        .env("GO111MODULE", "off")
        .env("GOPATH", format!("{}:{GOCODE}", work.path().display()))
        .env("GOCACHE", work.path().join("cache"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "go build: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let a = Agent::start();
    let t = Instant::now();
    let out = Command::new(&bin).arg(&a.sock).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(said.trim(), "ok");
    assert!(t.elapsed() < Duration::from_secs(20));
    // The publish the Go client gave up on ended at its deadline in the agent too.
    let line = a
        .log()
        .lines()
        .find(|l| l.contains("method=PublishVolume") && l.contains("volume=go-vol"))
        .map(str::to_string)
        .expect("the deadline-bound publish logged its end");
    assert!(line.contains("code=DEADLINE_EXCEEDED"), "{line}");
    a.client()
        .get_capabilities(ctx(), &pb::GetCapabilitiesRequest::new())
        .unwrap();
}

//! Keys through [`resolve`] against stand-ins for the Confidential Data
//! Hub on a unix socket in a temporary directory: one served by the ttrpc
//! crate's own server with the stubs generated from cdh.proto
//! (`crust_testkit::cdh`: the method's path and the messages' encoding are
//! the CDH's, as a real CDH serves them), and raw ones that never answer,
//! or announce an answer too large to take.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_protocols::ttrpc;
use crust_testkit::cdh;
use zeroize::Zeroizing;

use super::error::Error;
use super::resolve::{resolve, Config};
use super::source::{KeySource, RequestKey, MAX_KEY_LEN};
use crate::cancel::{Cancel, Token, Why};
use crate::code::Code;

/// The key the stand-in holds, with bytes a text reader would trip on.
const KEY: &[u8] = b"a LUKS passphrase\0\xff\n";

/// A CDH that holds one resource and answers for others as the real one
/// does: NOT_FOUND where a KBS says so, INTERNAL for every other failure;
/// serving at `dir/cdh.sock`.
fn stand_in(dir: &Path) -> (ttrpc::Server, PathBuf) {
    let path = dir.join("cdh.sock");
    let server = cdh::serve(&path, |resource| match resource {
        "kbs:///default/key/1" => Ok(KEY.to_vec()),
        "kbs:///default/key/big" => Ok(vec![0x5a; MAX_KEY_LEN + 1]),
        "kbs:///default/key/empty" => Ok(Vec::new()),
        "kbs:///default/key/missing" => Err((
            ttrpc::Code::NOT_FOUND,
            "no resource default/key/missing".into(),
        )),
        _ => Err((
            ttrpc::Code::INTERNAL,
            "[CDH] [ERROR]: get resource failed: attestation refused\nby policy".into(),
        )),
    });
    (server, path)
}

fn kbs(uri: &str) -> KeySource {
    KeySource::from_request(Some(RequestKey::Uri(uri.to_string()))).unwrap()
}

fn config(socket: &Path) -> Config {
    Config {
        cdh_socket: socket.to_path_buf(),
        ..Config::default()
    }
}

fn within_a_few_seconds() -> Cancel {
    Cancel::never().with_timeout(Duration::from_secs(10))
}

#[test]
fn the_stand_in_cdh_gives_its_resource_and_its_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let (server, socket) = stand_in(dir.path());
    let cfg = config(&socket);
    let get = |uri: &str| resolve(&kbs(uri), &cfg, &within_a_few_seconds());

    let key: Zeroizing<Vec<u8>> = get("kbs:///default/key/1").unwrap();
    assert_eq!(*key, KEY);
    // Again, on a new connection.
    assert_eq!(*get("kbs:///default/key/1").unwrap(), KEY);

    let e = get("kbs:///default/key/missing").unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&socket.display().to_string())
            && msg.contains("kbs:///default/key/missing")
            && msg.contains("NOT_FOUND: no resource default/key/missing"),
        "{msg}"
    );

    let e = get("kbs:///default/key/denied").unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.to_string()
            .ends_with("it answered INTERNAL: [CDH] [ERROR]: get resource failed: attestation refused by policy"),
        "{e}"
    );

    let e = get("kbs:///default/key/big").unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.to_string().contains("65537 bytes, more than the 65536"),
        "{e}"
    );
    assert!(!format!("{e:?}").contains("ZZZZ"), "{e:?}");

    let e = get("kbs:///default/key/empty").unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("is empty"), "{e}");
    server.shutdown();
}

/// A listener that takes connections, reads what comes, and then does
/// what `answer` says with the connection (or nothing: never answers).
fn raw_stand_in(dir: &Path, answer: fn(&mut std::os::unix::net::UnixStream)) -> PathBuf {
    let path = dir.join("raw.sock");
    let listener = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut buf = [0u8; 512];
            let _ = conn.read(&mut buf);
            answer(&mut conn);
            held.push(conn);
        }
    });
    path
}

#[test]
fn a_cdh_that_never_answers_is_left_at_the_callers_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let socket = raw_stand_in(dir.path(), |_| {});
    let source = kbs("kbs:///default/key/1");
    let start = Instant::now();
    let cancel = Cancel::never().with_timeout(Duration::from_millis(300));
    let e = resolve(&source, &config(&socket), &cancel).unwrap_err();
    let took = start.elapsed();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    assert!(matches!(e, Error::Stopped(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("waiting for the Confidential Data Hub at"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );

    // The agent's own limit on the CDH, when the caller allows longer.
    let short = Config {
        cdh_timeout: Duration::from_millis(200),
        ..config(&socket)
    };
    let e = resolve(&source, &short, &Cancel::never()).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(
        e.to_string()
            .contains("did not answer for kbs:///default/key/1"),
        "{e}"
    );

    // A token fired from elsewhere stops the wait within a slice.
    let token = Token::new(Why::CallerGone);
    let firer = {
        let token = token.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            token.fire();
        })
    };
    let start = Instant::now();
    let e = resolve(
        &source,
        &config(&socket),
        &Cancel::never().with_token(&token),
    )
    .unwrap_err();
    firer.join().unwrap();
    assert_eq!(e.code(), Code::Cancelled, "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn no_cdh_at_the_socket_is_unavailable_and_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("cdh.sock");
    // Nothing there; then a socket nobody listens on any more.
    let stale = dir.path().join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    for socket in [&missing, &stale] {
        let start = Instant::now();
        let e = resolve(&kbs("kbs:///a/b/c"), &config(socket), &Cancel::never()).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        assert!(matches!(e, Error::CdhNotRunning { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!(
                "the Confidential Data Hub is not running at {}",
                socket.display()
            )),
            "{msg}"
        );
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}

#[test]
fn an_answer_too_large_is_refused_from_its_header() {
    let dir = tempfile::tempdir().unwrap();
    // A response frame announcing 100 MiB, of which nothing follows.
    let socket = raw_stand_in(dir.path(), |conn| {
        let head: Vec<u8> = ttrpc::MessageHeader::new_response(1, 100 << 20).into();
        let _ = conn.write_all(&head);
    });
    let start = Instant::now();
    let e = resolve(
        &kbs("kbs:///a/b/c"),
        &config(&socket),
        &within_a_few_seconds(),
    )
    .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.to_string()
            .contains("answered 104857600 bytes for kbs:///a/b/c"),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn what_is_not_the_cdh_is_told_apart() {
    let dir = tempfile::tempdir().unwrap();
    // Answers on another stream, then hangs up without answering.
    let socket = raw_stand_in(dir.path(), |conn| {
        let head: Vec<u8> = ttrpc::MessageHeader::new_response(3, 0).into();
        let _ = conn.write_all(&head);
    });
    let e = resolve(
        &kbs("kbs:///a/b/c"),
        &config(&socket),
        &within_a_few_seconds(),
    )
    .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("on stream 3"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let socket = raw_stand_in(dir.path(), |conn| {
        let _ = conn.shutdown(std::net::Shutdown::Both);
    });
    let e = resolve(
        &kbs("kbs:///a/b/c"),
        &config(&socket),
        &within_a_few_seconds(),
    )
    .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(matches!(e, Error::CdhClosed { .. }), "{e:?}");
}

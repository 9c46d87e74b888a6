//! The agent as a process among others on its host: what it creates is for
//! root alone whatever umask it was started with (a unix socket any local
//! user could connect to lets them unmount every volume and power the guest
//! off), one agent per root (a second one would take the first one's
//! volumes as its own and take them down), and a socket something still
//! listens on is never replaced.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crust_agent::validate::STATE_DIR;
use support::*;

/// The uid (and gid) of `nobody`: a local user who is not root.
const NOBODY: u32 = 65534;
/// Set to a socket path in the copy of this test run as `nobody`: it
/// connects to it and exits 0 (connected), 13 (EACCES) or 1 (anything else).
const CONNECT_ENV: &str = "CRUST_TEST_CONNECT_TO";

/// An agent process started with `umask` and these arguments, its stderr in `log`.
fn spawn(umask: u32, args: &[&str], log: &Path) -> Child {
    let err = std::fs::File::create(log).unwrap();
    let mut c = Command::new(agent_bin());
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err);
    // SAFETY: umask(2) is async-signal-safe and touches no memory; this runs
    // in the child between fork and exec.
    unsafe {
        c.pre_exec(move || {
            libc::umask(umask);
            Ok(())
        });
    }
    c.spawn().unwrap()
}

fn wait_for_socket(child: &mut Child, sock: &Path, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::os::unix::net::UnixStream::connect(sock).is_ok() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "the agent exited ({st}) before listening: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "the agent did not listen on {}: {}",
        sock.display(),
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// Waits up to 20 s for `child` to exit.
fn exit_of(child: &mut Child) -> Option<ExitStatus> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn stop(mut child: Child, sock: &Path) {
    if let Ok(c) = connect(&format!("unix://{}", sock.display())) {
        let _ = c.shutdown(ctx(), &pb::ShutdownRequest::new());
    }
    if exit_of(&mut child).is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// What the copy of `a_root_agent_under_umask_0_is_private` run as
/// `nobody` does: connect to `path`, and exit with what it met.
fn connect_as_nobody(path: &std::ffi::OsStr) -> ! {
    let code = match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => 0,
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => 13,
        Err(_) => 1,
    };
    std::process::exit(code);
}

/// Whether `nobody` can connect to `sock`: Some(true) if it did, Some(false)
/// if refused (EACCES), None if it failed otherwise. `helper` is a copy of
/// this test binary where `nobody` may run it (the build's may sit in a
/// directory only root can enter); it runs this test with `CONNECT_ENV` set.
fn nobody_connects(helper: &Path, sock: &Path) -> Option<bool> {
    let run = || {
        Command::new(helper)
            .args(crust_testkit::child::alone(
                "a_root_agent_under_umask_0_is_private",
            ))
            .env(CONNECT_ENV, sock)
            .uid(NOBODY)
            .gid(NOBODY)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    };
    // The helper was just written: a child another test thread forks
    // meanwhile holds the write descriptor until it execs, and exec then
    // says ETXTBSY. It goes away once that child has exec'd.
    let mut st = run();
    for _ in 0..50 {
        match &st {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
                st = run();
            }
            _ => break,
        }
    }
    let st = st.unwrap();
    match st.code() {
        Some(0) => Some(true),
        Some(13) => Some(false),
        _ => None,
    }
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_root_agent_under_umask_0_is_private() {
    if let Some(path) = std::env::var_os(CONNECT_ENV) {
        connect_as_nobody(&path);
    }
    needs::root();
    // A scratch directory that `nobody` may traverse, as /run is.
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root: PathBuf = dir.path().join("new/root");
    let sock = dir.path().join("agent.sock");
    let log = dir.path().join("agent.log");
    let mut a = spawn(
        0,
        &[
            "--listen",
            &format!("unix://{}", sock.display()),
            "--root",
            root.to_str().unwrap(),
        ],
        &log,
    );
    wait_for_socket(&mut a, &sock, &log);

    // What the kernel enforces: a local user who is not root cannot connect
    // (before the fix the socket was 0777 and they could, then Shutdown).
    let helper = dir.path().join("helper");
    std::fs::copy(std::env::current_exe().unwrap(), &helper).unwrap();
    std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let helper_works = {
        let open = dir.path().join("open.sock");
        let _l = std::os::unix::net::UnixListener::bind(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        nobody_connects(&helper, &open)
    };
    assert_eq!(
        helper_works,
        Some(true),
        "the helper must be able to connect to an open socket, or this test proves nothing"
    );
    assert_eq!(
        nobody_connects(&helper, &sock),
        Some(false),
        "a user who is not root could connect to the agent's socket (mode {:o})",
        mode(&sock)
    );
    assert_eq!(mode(&sock), 0o600, "the socket");
    // The root, the directory made on the way to it, and what the agent made in it.
    for d in [
        dir.path().join("new"),
        root.clone(),
        root.join(STATE_DIR),
        root.join("volumes"),
    ] {
        assert_eq!(mode(&d), 0o700, "{}", d.display());
    }
    stop(a, &sock);
}

#[test]
#[ignore = "needs root: make test runs it"]
fn a_second_agent_on_the_same_root_is_refused() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let a = Agent::start();
    let c = a.client();
    c.publish_volume(ctx(), &publish_req("mine", &disk.path(), "ext4"))
        .unwrap();
    let target = a.root.join("pods/p");
    c.bind_mount(
        ctx(),
        &bind_req("mine", &target, "", false, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();

    // The same root, another socket: refused at once, having touched nothing.
    let other = tempfile::tempdir().unwrap();
    let sock2 = other.path().join("b.sock");
    let log2 = other.path().join("b.log");
    let args = [
        "--listen".to_string(),
        format!("unix://{}", sock2.display()),
        "--root".to_string(),
        a.root.display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut b = spawn(0o022, &args, &log2);
    let st = exit_of(&mut b);
    let said = std::fs::read_to_string(&log2).unwrap_or_default();
    if st.is_none() {
        let _ = b.kill();
        let _ = b.wait();
    }
    assert_eq!(
        st.and_then(|s| s.code()),
        Some(1),
        "a second agent on the root must exit 1; it said:\n{said}"
    );
    assert!(
        said.contains("another crust-agent is serving the root"),
        "{said}"
    );
    assert!(!sock2.exists(), "the refused agent listened");
    // The first agent's volume and bind are as they were, and it still serves.
    let list = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!(list.volumes.len(), 1, "{}", a.log());
    assert_eq!(
        list.volumes[0].bind_targets,
        vec![target.display().to_string()]
    );
    assert!(is_mount(&target) && is_mount(&a.root.join("volumes/mine")));

    // The lock dies with its holder, however it ends: after kill -9 the next
    // agent takes the root (and the volume) back.
    let dir = a.kill9();
    let a2 = Agent::start_in(dir);
    let list = a2
        .client()
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!(list.volumes.len(), 1, "{}", a2.log());
    a2.client()
        .unpublish_volume(ctx(), &unpublish_req("mine"))
        .unwrap();
}

#[test]
fn a_socket_another_agent_listens_on_is_not_taken() {
    let a = Agent::start();
    // Another root, the same socket: the live socket is not stale.
    let other = tempfile::tempdir().unwrap();
    let log2 = other.path().join("b.log");
    let args = [
        "--listen".to_string(),
        a.addr(),
        "--root".to_string(),
        other.path().join("root").display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut b = spawn(0o022, &args, &log2);
    let st = exit_of(&mut b);
    let said = std::fs::read_to_string(&log2).unwrap_or_default();
    if st.is_none() {
        let _ = b.kill();
        let _ = b.wait();
    }
    assert_eq!(st.and_then(|s| s.code()), Some(1), "{said}");
    assert!(said.contains("something already listens on"), "{said}");
    // The first agent still answers on its socket.
    a.client()
        .get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .expect("the first agent is still reachable");

    // Given that address and one of its own, an agent serves on its own;
    // stopping, it removes only the socket it made.
    let own = other.path().join("own.sock");
    let log4 = other.path().join("d.log");
    let args = [
        "--listen".to_string(),
        a.addr(),
        "--listen".to_string(),
        format!("unix://{}", own.display()),
        "--root".to_string(),
        other.path().join("root4").display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut d = spawn(0o022, &args, &log4);
    wait_for_socket(&mut d, &own, &log4);
    stop(d, &own);
    assert!(!own.exists());
    a.client()
        .get_agent_info(ctx(), &pb::GetAgentInfoRequest::new())
        .expect("the first agent's socket outlived the other agent");

    // A stale socket (nothing listens) is replaced as before.
    let stale = other.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let log3 = other.path().join("c.log");
    let args = [
        "--listen".to_string(),
        format!("unix://{}", stale.display()),
        "--root".to_string(),
        other.path().join("root3").display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut c = spawn(0o022, &args, &log3);
    wait_for_socket(&mut c, &stale, &log3);
    stop(c, &stale);
}

/// Under a service manager (`--on-sigterm exit`, as crust-agent.service
/// runs it), SIGTERM thaws what is frozen, flushes and exits 0, leaving
/// volumes and binds mounted; the next start adopts them. Without the flag,
/// SIGTERM unpublishes everything.
#[test]
#[ignore = "needs root: make test runs it"]
fn sigterm_under_a_service_manager_leaves_volumes_for_the_next_start() {
    needs::loop_devices_and_mkfs();
    let disk = LoopDisk::new(64, Some("ext4"));
    let dir = tempfile::tempdir().unwrap();
    let (root, sock, log) = (
        dir.path().join("root"),
        dir.path().join("a.sock"),
        dir.path().join("a.log"),
    );
    let args = [
        "--listen".to_string(),
        format!("unix://{}", sock.display()),
        "--root".to_string(),
        root.display().to_string(),
        "--on-sigterm".to_string(),
        "exit".to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut a = spawn(0o022, &args, &log);
    wait_for_socket(&mut a, &sock, &log);
    let addr = format!("unix://{}", sock.display());
    let c = connect(&addr).unwrap();
    let guest = c
        .publish_volume(ctx(), &publish_req("v", &disk.path(), "ext4"))
        .unwrap()
        .guest_path;
    let target = root.join("pods/p/data");
    c.bind_mount(
        ctx(),
        &bind_req("v", &target, "", false, pb::RecursiveReadOnly::DISABLED),
    )
    .unwrap();
    let mut f = pb::FreezeVolumesRequest::new();
    f.volume_ids = vec!["v".into()];
    c.freeze_volumes(ctx(), &f).unwrap();
    drop(c);
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(a.id() as libc::pid_t, libc::SIGTERM) };
    let st = exit_of(&mut a).expect("the agent exits on SIGTERM");
    assert!(st.success(), "{st}");
    assert!(is_mount(Path::new(&guest)), "the volume stays mounted");
    assert!(is_mount(&target), "the bind stays mounted");
    // Thawed before it went: a write goes through.
    std::fs::write(Path::new(&guest).join("after"), b"x").unwrap();
    // The next start adopts both.
    let mut b = spawn(0o022, &args, &log);
    wait_for_socket(&mut b, &sock, &log);
    let c = connect(&addr).unwrap();
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    assert_eq!(l.volumes.len(), 1);
    assert_eq!(
        l.volumes[0].bind_targets,
        vec![target.display().to_string()]
    );
    assert!(
        c.unpublish_volume(ctx(), &unpublish_req("v"))
            .unwrap()
            .was_published
    );
    assert!(!is_mount(&target) && !is_mount(Path::new(&guest)));
    stop(b, &sock);
}

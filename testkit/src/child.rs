//! A test run again, alone, in a child process: for a test whose effects no
//! other test may see (mounts in a mount namespace of its own) or that
//! changes process-wide limits. The child is this test binary run with
//! `--exact` and the test's own name; a variable tells the test that it is
//! that child, so there is no helper "test" that passes by doing nothing.

use std::ffi::OsStr;
use std::process::Command;

/// Set in the child: the name of the test it runs.
const CHILD: &str = "CRUST_TEST_CHILD";

/// The name of the running test: libtest names each test's thread after it.
pub fn this_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or_default()
        .to_string()
}

/// Whether this process is the child that [`rerun`] or
/// [`own_mount_namespace`] started for the running test.
pub fn is_child() -> bool {
    std::env::var(CHILD).is_ok_and(|t| t == this_test())
}

/// libtest's arguments that run `test` alone, ignored or not. (Not
/// `--test-threads=1`: libtest then prints the test's name before it runs,
/// and what the test prints lands on that line.)
pub fn alone(test: &str) -> [&str; 4] {
    ["--exact", test, "--include-ignored", "--nocapture"]
}

/// Runs the calling test again, alone, in a child process with `env` added;
/// answers whether it passed and its output. In that child [`is_child`] is
/// true: the test does there what must not touch the tests beside it.
pub fn rerun<K: AsRef<OsStr>, V: AsRef<OsStr>>(env: &[(K, V)]) -> (bool, String) {
    let test = this_test();
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(alone(&test)).env(CHILD, &test);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && text.contains("1 passed"), text)
}

/// For a test that makes mounts no other test may see (a mount point whose
/// name is not UTF-8 breaks every reader of the shared mount table that
/// expects text, other engineers' tests and tools included): runs the
/// calling test again, alone, in a child process with a mount namespace of
/// its own (`unshare --mount`, propagation private), and answers false once
/// it passed there (panicking with its output if it failed). In that child
/// it answers true: run the test's body.
///
/// The child first detaches its copies of loop-device mounts it inherited,
/// so they do not keep other tests' disks busy while it runs.
pub fn own_mount_namespace() -> bool {
    let test = this_test();
    if is_child() {
        let table = std::fs::read("/proc/self/mountinfo").unwrap_or_default();
        for (source, point) in crate::disks::mount_table(table) {
            if source.starts_with(b"/dev/loop") {
                let _ = rustix::mount::unmount(&point, rustix::mount::UnmountFlags::DETACH);
            }
        }
        return true;
    }
    crate::needs::tools(&["unshare"], "util-linux");
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private"])
        .arg(std::env::current_exe().unwrap())
        .args(alone(&test))
        .env(CHILD, &test)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} failed in its own mount namespace:\n{text}"
    );
    eprintln!("{test} passed in its own mount namespace");
    false
}

/// `program` with `args` started, stdin closed: a child for tests of the
/// agent's own child handling (the agent's source starts no process but
/// mkfs).
pub fn start(program: &str, args: &[&str]) -> std::io::Result<std::process::Child> {
    Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .spawn()
}

/// What `program` with `args` prints on stdout, run in the user namespace
/// `ns` (an fd of it): for tests of the namespaces the agent makes.
pub fn output_in_user_namespace(
    ns: std::os::fd::BorrowedFd<'_>,
    program: &str,
    args: &[&str],
) -> String {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let fd = ns.as_raw_fd();
    let mut c = Command::new(program);
    c.args(args).stdin(std::process::Stdio::null());
    // SAFETY: between fork and exec the child only calls setns, a raw
    // syscall, on `fd`, which the parent keeps open until the child has run.
    unsafe {
        c.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWUSER) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{program} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

//! Acting as another user for a moment, without a process: Linux keeps a
//! thread's credentials per thread, so a thread of its own sets its
//! filesystem uid and gid (setfsuid, setfsgid) and does the work. With a
//! filesystem uid other than 0 the thread loses CAP_DAC_OVERRIDE and
//! friends, as such a user would.

/// Runs `f` on a thread whose filesystem ids are `uid` and `gid`; its answer.
pub fn as_ids<T: Send + 'static>(uid: u32, gid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        // SAFETY: setfsgid/setfsuid change only this thread's credentials,
        // on a thread that ends with `f`; they take plain integers.
        unsafe {
            libc::syscall(libc::SYS_setfsgid, gid);
            libc::syscall(libc::SYS_setfsuid, uid);
            // The calls answer the old id, never an error: check they took.
            assert_eq!(libc::syscall(libc::SYS_setfsuid, uid), i64::from(uid));
            assert_eq!(libc::syscall(libc::SYS_setfsgid, gid), i64::from(gid));
        }
        f()
    })
    .join()
    .unwrap()
}

/// The owner and group of `path` (not following a symlink), as this
/// process's user namespace sees them.
pub fn owner(path: &std::path::Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.uid(), m.gid())
}

//! What this kernel and this process can do, probed once: the syscalls the
//! agent prefers where the kernel has them (mount_setattr, openat2,
//! open_tree/move_mount), and CAP_SYS_RESOURCE, which ext4 online growth
//! needs. A leaf: binds and growth ask it, and GetCapabilities reports it.

use std::sync::OnceLock;

use super::userns;
use crate::model::{IdMap, IdRange};

/// Whether a syscall exists: it is called with arguments it must reject,
/// and only ENOSYS (or EPERM from a seccomp filter) means "absent".
fn syscall_exists(nr: libc::c_long) -> bool {
    // SAFETY: every pointer argument is null and the fd is -1: the kernel
    // rejects the call (EBADF/EFAULT/EINVAL) without touching memory.
    let r = unsafe {
        libc::syscall(
            nr,
            -1 as libc::c_long,
            0 as libc::c_long,
            0 as libc::c_long,
            0 as libc::c_long,
            0 as libc::c_long,
        )
    };
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    !(r == -1 && (errno == libc::ENOSYS || errno == libc::EPERM))
}

/// Kernel features the agent depends on, probed once.
#[derive(Clone, Copy, Debug)]
pub struct Features {
    /// mount_setattr(2) (Linux 5.12): recursive read-only binds.
    pub mount_setattr: bool,
    /// openat2(2) (Linux 5.6): subpaths resolved beneath the volume root.
    pub openat2: bool,
    /// open_tree(2)/move_mount(2) (Linux 5.2): binds with no writable window.
    pub open_tree: bool,
    /// A user namespace with maps can be made here (the kernel has them,
    /// and nothing around the agent forbids them: systemd's
    /// RestrictNamespaces=, a bounding set without CAP_SETUID): idmapped
    /// binds, with mount_setattr.
    pub user_namespaces: bool,
}

impl Features {
    /// Whether binds can be idmapped here (Linux 5.12, user namespaces);
    /// whether a filesystem can be is the kernel's answer per bind.
    pub fn idmapped_binds(&self) -> bool {
        self.mount_setattr && self.open_tree && self.user_namespaces
    }
}

/// Whether a user namespace with maps can be made here: tried once, as a
/// bind would make one (a clone that is reaped at once; sys::userns). It
/// maps nobody (65534), as a pod's map names no host root: mapping host
/// id 0 takes CAP_SETFCAP too (Linux 5.12+).
fn user_namespaces() -> bool {
    let one = vec![IdRange {
        container_id: 0,
        host_id: 65534,
        length: 1,
    }];
    let map = IdMap {
        uids: one.clone(),
        gids: one,
    };
    std::path::Path::new("/proc/self/ns/user").exists() && userns::make(&map).is_ok()
}

/// The probed features of the running kernel.
pub fn features() -> Features {
    static F: OnceLock<Features> = OnceLock::new();
    *F.get_or_init(|| Features {
        mount_setattr: syscall_exists(libc::SYS_mount_setattr),
        openat2: syscall_exists(libc::SYS_openat2),
        open_tree: syscall_exists(libc::SYS_open_tree) && syscall_exists(libc::SYS_move_mount),
        user_namespaces: user_namespaces(),
    })
}

/// Whether this process holds CAP_SYS_RESOURCE, which ext4 online growth
/// needs. Asked once: the agent never changes its own capabilities, and
/// GetCapabilities, answered on the event loop, then costs no syscall.
pub fn has_sys_resource() -> bool {
    static CAP: OnceLock<bool> = OnceLock::new();
    *CAP.get_or_init(|| {
        caps::has_cap(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_SYS_RESOURCE,
        )
        .unwrap_or(false)
    })
}

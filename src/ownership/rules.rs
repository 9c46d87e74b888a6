//! kubelet's rules for fsGroup (SetVolumeOwnership), pure: the group access
//! every entry gets, the setgid bit directories get, and when
//! OnRootMismatch finds the root already right and does not walk.

use rustix::fs::FileType;

/// Group read/write, added to every entry (kubelet's rwMask).
pub(crate) const RW: u32 = 0o660;
/// Group (and owner) search on directories (kubelet's execMask).
pub(crate) const X: u32 = 0o110;
pub(crate) const S_ISUID: u32 = 0o4000;
pub(crate) const S_ISGID: u32 = 0o2000;
pub(crate) const PERM_BITS: u32 = 0o7777;

/// kubelet's requiresPermissionChange, negated: a directory with the group,
/// setgid, and group+owner rwx (r-x when read-only).
pub fn root_is_right(mode: u32, has_gid: u32, gid: u32, read_only: bool) -> bool {
    let mask = if read_only { 0o550 } else { 0o770 };
    FileType::from_raw_mode(mode) == FileType::Directory
        && has_gid == gid
        && mode & S_ISGID != 0
        && mode & mask == mask
}

/// The mode an entry should end with: nothing removed, group access added.
pub fn wanted_mode(mode: u32, is_dir: bool) -> u32 {
    let perm = mode & PERM_BITS;
    if is_dir {
        perm | RW | X | S_ISGID
    } else {
        perm | RW
    }
}

/// Whether a chmod to `want` is due after a chown (`chown`) of an entry
/// whose mode was `mode`: the mode is not yet right, or the chown may have
/// cleared a setuid/setgid bit that must be put back.
pub fn chmod_due(mode: u32, want: u32, chown: bool) -> bool {
    want != mode & PERM_BITS || (chown && mode & (S_ISUID | S_ISGID) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GID: u32 = 4321;

    #[test]
    fn wanted_modes() {
        let table = [
            (0o600, false, 0o660),
            (0o644, false, 0o664),
            (0o4755, false, 0o4775),
            (0o000, false, 0o660),
            (0o777, false, 0o777),
            (0o700, true, 0o2770),
            (0o755, true, 0o2775),
            (0o1777, true, 0o3777),
            (0o2770, true, 0o2770),
        ];
        for (mode, dir, want) in table {
            assert_eq!(
                wanted_mode(mode | if dir { 0o040000 } else { 0o100000 }, dir),
                want,
                "{mode:o} dir={dir}"
            );
        }
    }

    #[test]
    fn root_mismatch_test() {
        let dir = 0o040000;
        let table = [
            (dir | 0o2770, GID, false, true),
            (dir | 0o2775, GID, false, true),
            (dir | 0o2770, GID + 1, false, false),
            (dir | 0o0770, GID, false, false),
            (dir | 0o2750, GID, false, false),
            (dir | 0o2550, GID, true, true),
            (dir | 0o2550, GID, false, false),
            (dir | 0o2540, GID, true, false),
            (0o100000 | 0o2770, GID, false, false),
        ];
        for (mode, gid, ro, right) in table {
            assert_eq!(
                root_is_right(mode, gid, GID, ro),
                right,
                "{mode:o} gid={gid} ro={ro}"
            );
        }
    }
}

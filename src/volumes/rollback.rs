//! One operation's undo list (a publish, a block publish, a bind): each step
//! that changes something pushes, right after it, how to take it back. If
//! the operation fails (a `?` anywhere, or a refusal), dropping the list
//! undoes the steps last first; an undo that fails stops it there, leaving
//! the earlier steps for recovery at the next start (a record kept for a
//! mount that could not be taken down is how recovery finds it). Once the
//! operation went through, `done` keeps everything.

use std::path::PathBuf;

use slog::{warn, Logger};

use super::kernel::Kernel;
use super::mounts::Mounts;
use super::state::Store;
use crate::model::Device;
use crate::mount::unmount::Expect;
use crate::sys::beneath::{remove_created, Created};

/// How to take back one step; `D` is the kernel's opened block device.
pub(crate) enum Undo<D> {
    /// Nodes made on the way to a guest path or a bind target: removed,
    /// last made first (a node that is not empty any more stays).
    Nodes(Vec<Created>),
    /// The volume's record, written: removed (so recovery does not look
    /// for a mount that is not there).
    Record,
    /// The device's read-only flag, set by the agent through this open
    /// device: cleared.
    ReadOnly(D),
    /// A mount the agent made and checked (by id, with its disk): taken
    /// down, with whatever is mounted below it.
    Mount {
        /// Where, relative to the root.
        rel: PathBuf,
        /// Which mount it is.
        expect: Expect,
    },
}

/// The undo list of one operation on volume `id` (see the module doc).
#[must_use = "dropping a Rollback undoes its steps"]
pub(crate) struct Rollback<'a, K: Kernel> {
    /// Where the mounts and nodes to take back are, and the kernel that
    /// takes them back.
    mounts: Mounts<'a, K>,
    /// Where the record to take back is.
    store: &'a Store,
    log: &'a Logger,
    /// "publish", "bind": for the log.
    what: &'static str,
    id: &'a str,
    /// The volume's disk, whose read-only flag an undo clears.
    device: &'a Device,
    steps: Vec<Undo<K::Disk>>,
}

impl<'a, K: Kernel> Rollback<'a, K> {
    /// An empty list for a `what` ("publish", "bind") of volume `id` on
    /// `device`, undone through `mounts` and `store`.
    pub(crate) fn new(
        mounts: Mounts<'a, K>,
        store: &'a Store,
        log: &'a Logger,
        what: &'static str,
        id: &'a str,
        device: &'a Device,
    ) -> Rollback<'a, K> {
        Rollback {
            mounts,
            store,
            log,
            what,
            id,
            device,
            steps: Vec::new(),
        }
    }

    /// A step went through; `undo` takes it back if a later one fails.
    pub(crate) fn push(&mut self, undo: Undo<K::Disk>) {
        self.steps.push(undo);
    }

    /// The operation went through: nothing is undone.
    pub(crate) fn done(mut self) {
        self.steps.clear();
    }

    /// The operation failed where undoing could do harm (its mount is no
    /// longer where it was made, and might not be the agent's): nothing is
    /// undone here; the record written stays, and recovery takes the
    /// mount down at the next start.
    pub(crate) fn leave_to_recovery(mut self) {
        warn!(self.log, "the guest path changed during {}; recovery at the next start takes the mount down", self.what;
              "volume" => self.id);
        self.steps.clear();
    }

    /// Takes back one step; false when it could not be (the rest stays).
    fn undo(&self, step: Undo<K::Disk>) -> bool {
        let log = self.log;
        match step {
            Undo::Nodes(mut created) => remove_created(&mut created),
            Undo::Record => {
                if let Err(e) = self.store.remove(self.id) {
                    warn!(log, "could not remove the record of a failed {}", self.what;
                          "volume" => self.id, "error" => %e);
                }
            }
            Undo::ReadOnly(f) => {
                if let Err(e) = self.mounts.kernel.set_read_only(&f, self.device, false) {
                    warn!(log, "could not clear the read-only flag of a failed {}", self.what;
                          "volume" => self.id, "error" => %e);
                }
            }
            Undo::Mount { rel, expect } => {
                let root = self.mounts.root;
                let undone = self
                    .mounts
                    .kernel
                    .unmount_tree(root.fd(), root.path(), &rel, expect);
                if let Err(e) = undone {
                    warn!(log, "could not undo a failed {}; recovery at the next start takes it down", self.what;
                          "volume" => self.id, "error" => %e);
                    return false;
                }
            }
        }
        true
    }
}

impl<K: Kernel> Drop for Rollback<'_, K> {
    fn drop(&mut self) {
        while let Some(step) = self.steps.pop() {
            if !self.undo(step) {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rustix::io::Errno;

    use super::*;
    use crate::model::FsType;
    use crate::sys::beneath::{self, Leaf, Root};
    use crate::validate::STATE_DIR;
    use crate::volumes::fake::{Call, Fake};
    use crate::volumes::volume::tests::sample;

    /// A publish's three undoable steps, undone by dropping the list: the
    /// mount first, then the record, then the nodes. When the unmount
    /// fails, the list stops there: the record (how recovery finds the
    /// mount) and the guest path stay.
    #[test]
    fn undo_runs_last_first_and_stops_at_the_first_that_fails() {
        for busy in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let root = Root::open(dir.path()).unwrap();
            let store = Store::open(&root).unwrap();
            let fake = Fake::default();
            let log = crate::logging::discard();
            let disk = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
            let vol = sample();
            let rel = PathBuf::from("volumes/vol-1");
            {
                let mounts = Mounts {
                    root: &root,
                    kernel: &fake,
                };
                let mut undo = Rollback::new(mounts, &store, &log, "publish", vol.id(), &disk);
                let mut created = Vec::new();
                beneath::make_path(root.fd(), &rel, 0o750, Leaf::Dir(0o750), &mut created).unwrap();
                undo.push(Undo::Nodes(created));
                store.save(&vol).unwrap();
                undo.push(Undo::Record);
                let id = fake.mount_behind(&disk, &root.join(&rel));
                let expect = Expect::Mount(id, disk.major, disk.minor);
                undo.push(Undo::Mount {
                    rel: rel.clone(),
                    expect,
                });
                if busy {
                    fake.fail(Call::Unmount, 1, Errno::BUSY);
                }
            }
            let left = (
                fake.mounts().len(),
                root.path().join(STATE_DIR).join("vol-1.vol").exists(),
                root.join(&rel).exists(),
            );
            match busy {
                false => assert_eq!(left, (0, false, false)),
                true => assert_eq!(left, (1, true, true)),
            }
        }
    }

    /// Done keeps every step; so does leaving them to recovery.
    #[test]
    fn a_list_done_or_left_to_recovery_undoes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::open(dir.path()).unwrap();
        let store = Store::open(&root).unwrap();
        let fake = Fake::default();
        let log = crate::logging::discard();
        let disk = fake.disk(dir.path(), "fka", Some(FsType::Ext4));
        let vol = sample();
        let mounts = Mounts {
            root: &root,
            kernel: &fake,
        };
        store.save(&vol).unwrap();
        let mut undo = Rollback::new(mounts, &store, &log, "publish", vol.id(), &disk);
        undo.push(Undo::Record);
        undo.done();
        let mut undo = Rollback::new(mounts, &store, &log, "publish", vol.id(), &disk);
        undo.push(Undo::Record);
        undo.leave_to_recovery();
        assert!(root.path().join(STATE_DIR).join("vol-1.vol").exists());
    }
}

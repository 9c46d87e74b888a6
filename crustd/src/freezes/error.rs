//! What a group's freeze or thaw answers when it is not plain OK, each
//! message written once.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use crust_protocols::freeze::ENDED_KEPT;
use rustix::io::Errno;

use super::group::{unix_ms, MAX_GROUPS};

crust_protocols::coded_errors! {
/// Why a freeze or a thaw of a group did not answer OK.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FreezeError {
    /// `check_id`'s sentence.
    #[code(InvalidArgument)]
    #[error("{0}")]
    BadId(String),
    #[code(AlreadyExists)]
    #[error("freeze_id {id} is taken: {why}; a freeze id names one group: choose a new one")]
    Taken { id: String, why: String },
    #[code(Unavailable)]
    #[error("group {id} is still being frozen by an earlier call; ask again in a moment")]
    BeingMade { id: String },
    #[code(ResourceExhausted)]
    #[error("{MAX_GROUPS} groups are frozen or being frozen on this node, as many as crustd keeps: thaw one first")]
    Full,
    #[code(NotFound)]
    #[error("no group {id}: crustd never made it, or it ended so long ago that its record is gone (crustd keeps the last {ENDED_KEPT}); to end whatever holds a volume, thaw with force and its volumes")]
    Unknown { id: String },
    #[code(Aborted)]
    #[error("group {id} did not hold: {ends}; the rest of it is thawed, and a snapshot taken after that may be torn: freeze again and take the snapshot again")]
    Broken { id: String, ends: String },
    #[code(Unavailable)]
    #[error("group {id} is thawed except in {sandboxes}, which crustd could not reach: thaw it again; crustd's timer thaws what is left at unix time {timer_at_unix_ms} ms")]
    Unreached {
        id: String,
        /// Each with why.
        sandboxes: String,
        timer_at_unix_ms: u64,
    },
    #[code(InvalidArgument)]
    #[error("RuntimeThawVolumes names volumes without force: a group is ended by its freeze_id alone, never by its volumes, so that a late thaw cannot end a newer freeze; give the freeze_id RuntimeFreezeVolumes answered, or set force to end whatever holds the volumes")]
    VolumesWithoutForce,
    #[code(InvalidArgument)]
    #[error("RuntimeThawVolumes with force names a freeze_id: force ends whatever holds the volumes named; thaw a group by its freeze_id without force")]
    ForceWithId,
    #[code(InvalidArgument)]
    #[error("RuntimeThawVolumes names nothing: give the freeze_id RuntimeFreezeVolumes answered (or force and volumes)")]
    NothingNamed,
    #[code(FailedPrecondition)]
    #[error("crustd keeps its freeze records in {}, which {why}: crustd freezes nothing it cannot record; remove it, and crustd makes it again", .dir.display())]
    Place { dir: PathBuf, why: Placement },
    #[code(Internal)]
    #[error("crustd cannot record group {id} in {}: {why}", .dir.display())]
    Write { id: String, dir: PathBuf, why: Unwritten },
    #[code(Aborted)]
    #[error("group {id} ended while it was being frozen ({why}), so its freeze is undone: {left}")]
    Stopped {
        id: String,
        why: String,
        left: Leftover,
    },
    #[code(Cancelled)]
    #[error("the caller went away before group {id} was frozen, so its freeze is undone: {left}")]
    CallerLeft { id: String, left: Leftover },
}
}

/// What is wrong with the records' directory.
#[derive(Debug, Clone)]
pub enum Placement {
    /// The registry cannot be opened.
    Unreachable(Arc<io::Error>),
    Unmade(Errno),
    NotADirectory(Arc<io::Error>),
    Unstated(Errno),
    /// It belongs to this user, not crustd's.
    Owner(u32),
    /// Others may write it: its mode.
    Writable(u32),
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Unreachable(e) => write!(f, "cannot be reached: {e}"),
            Placement::Unmade(e) => write!(f, "cannot be made: {e}"),
            Placement::NotADirectory(e) => {
                write!(f, "is not a directory crustd can open ({e})")
            }
            Placement::Unstated(e) => write!(f, "{e}"),
            Placement::Owner(uid) => write!(f, "belongs to user {uid}, not crustd's"),
            Placement::Writable(mode) => write!(f, "others may write (mode {mode:o})"),
        }
    }
}

/// Why a group's record was not written or removed.
#[derive(Debug, Clone)]
pub enum Unwritten {
    Encode(Arc<serde_json::Error>),
    /// What crustd would not read back: its size in bytes, and the most read.
    TooLarge {
        bytes: usize,
        max: u64,
    },
    RegistryGone,
    Write(Arc<io::Error>),
    Remove(Errno),
}

impl fmt::Display for Unwritten {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unwritten::Encode(e) => write!(f, "{e}"),
            Unwritten::TooLarge { bytes, max } => write!(
                f,
                "it would hold {bytes} bytes, more than the {max} crustd reads back"
            ),
            Unwritten::RegistryGone => f.write_str("the registry is gone"),
            Unwritten::Write(e) => write!(f, "{e}"),
            Unwritten::Remove(e) => write!(f, "cannot remove its record: {e}"),
        }
    }
}

/// What a failed freeze could not confirm it undid: the sandboxes of the
/// group that may still be frozen, which crustd's timer ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub group: String,
    /// Each with why its thaw is not confirmed.
    pub sandboxes: Vec<String>,
    /// When crustd's timer ends them.
    pub timer_at_unix_ms: u64,
}

impl fmt::Display for Leftover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.sandboxes.is_empty() {
            return write!(
                f,
                "none is frozen (every sandbox called confirmed the thaw of {})",
                self.group
            );
        }
        let secs = self
            .timer_at_unix_ms
            .saturating_sub(unix_ms())
            .div_ceil(1000);
        write!(
            f,
            "group {} may still hold {} (crustd could not confirm the thaw): crustd's timer thaws it there by the group's id at unix time {} ms, {secs} s from now, and each guest's own timer a second before",
            self.group,
            self.sandboxes.join("; "),
            self.timer_at_unix_ms
        )
    }
}

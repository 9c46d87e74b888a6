//! What a group's freeze or thaw answers when it is not plain OK, each
//! message written once.

use std::fmt;

use crust_protocols::freeze::ENDED_KEPT;

use super::group::{unix_ms, MAX_GROUPS};
use crate::error::{Code, Error};

/// Why a freeze or a thaw of a group did not answer OK.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FreezeError {
    /// `check_id`'s sentence.
    #[error("{0}")]
    BadId(String),
    #[error("freeze_id {id} is taken: {why}; a freeze id names one group: choose a new one")]
    Taken { id: String, why: String },
    #[error("group {id} is still being frozen by an earlier call; ask again in a moment")]
    BeingMade { id: String },
    #[error("{MAX_GROUPS} groups are frozen or being frozen on this node, as many as crustd keeps: thaw one first")]
    Full,
    #[error("no group {id}: crustd never made it, or it ended so long ago that its record is gone (crustd keeps the last {ENDED_KEPT}); to end whatever holds a volume, thaw with force and its volumes")]
    Unknown { id: String },
    #[error("group {id} did not hold: {ends}; the rest of it is thawed, and a snapshot taken after that may be torn: freeze again and take the snapshot again")]
    Broken { id: String, ends: String },
    #[error("group {id} is thawed except in {sandboxes}, which crustd could not reach: thaw it again; crustd's timer thaws what is left at unix time {timer_at_unix_ms} ms")]
    Unreached {
        id: String,
        /// Each with why.
        sandboxes: String,
        timer_at_unix_ms: u64,
    },
    #[error("RuntimeThawVolumes names volumes without force: a group is ended by its freeze_id alone, never by its volumes, so that a late thaw cannot end a newer freeze; give the freeze_id RuntimeFreezeVolumes answered, or set force to end whatever holds the volumes")]
    VolumesWithoutForce,
    #[error("RuntimeThawVolumes with force names a freeze_id: force ends whatever holds the volumes named; thaw a group by its freeze_id without force")]
    ForceWithId,
    #[error("RuntimeThawVolumes names nothing: give the freeze_id RuntimeFreezeVolumes answered (or force and volumes)")]
    NothingNamed,
    #[error("crustd keeps its freeze records in {dir}, which {why}: crustd freezes nothing it cannot record; remove it, and crustd makes it again")]
    Place { dir: String, why: String },
    #[error("crustd cannot record group {id} in {dir}: {error}")]
    Write {
        id: String,
        dir: String,
        error: String,
    },
    #[error("sandbox {sandbox} could not freeze its volumes ({error}), so the group's freeze is undone: {left}")]
    Refused {
        sandbox: String,
        /// The sandbox's code, passed on.
        code: Code,
        error: String,
        left: Leftover,
    },
    #[error("group {id} ended while it was being frozen ({why}), so its freeze is undone: {left}")]
    Stopped {
        id: String,
        why: String,
        left: Leftover,
    },
    #[error("the caller went away before group {id} was frozen, so its freeze is undone: {left}")]
    CallerLeft { id: String, left: Leftover },
}

impl FreezeError {
    /// The gRPC code a call answers with for this.
    pub fn code(&self) -> Code {
        match self {
            FreezeError::BadId(_)
            | FreezeError::VolumesWithoutForce
            | FreezeError::ForceWithId
            | FreezeError::NothingNamed => Code::InvalidArgument,
            FreezeError::Taken { .. } => Code::AlreadyExists,
            FreezeError::BeingMade { .. } | FreezeError::Unreached { .. } => Code::Unavailable,
            FreezeError::Full => Code::ResourceExhausted,
            FreezeError::Unknown { .. } => Code::NotFound,
            FreezeError::Broken { .. } | FreezeError::Stopped { .. } => Code::Aborted,
            FreezeError::Place { .. } => Code::FailedPrecondition,
            FreezeError::Write { .. } => Code::Internal,
            FreezeError::Refused { code, .. } => *code,
            FreezeError::CallerLeft { .. } => Code::Cancelled,
        }
    }
}

impl From<FreezeError> for Error {
    fn from(e: FreezeError) -> Error {
        Error::new(e.code(), e.to_string())
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

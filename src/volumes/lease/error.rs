//! What a freeze or a thaw refuses, each message written once.

crate::code::coded_errors! {
/// What the leases refuse.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(NotFound)]
    #[error("no freeze {freeze} was made on this agent's root, or it ended so long ago that its record is gone (the agent keeps the last {kept}); to end whatever holds a volume, thaw with force and its volume id")]
    Unknown {
        freeze: String,
        /// How many ended freezes are kept.
        kept: usize,
    },
    #[code(Aborted)]
    #[error("freeze {freeze} did not hold: {ends}; the rest of it is thawed, and a snapshot taken after that may be torn: freeze again and take the snapshot again")]
    Broken {
        freeze: String,
        /// Each volume that ended first: how and when, as sentences.
        ends: String,
    },
    #[code(AlreadyExists)]
    #[error("freeze id {freeze} is taken: {why}; a freeze id names one freeze: choose a new one")]
    Taken {
        freeze: String,
        /// What holds the id.
        why: String,
    },
    #[code(Unavailable)]
    #[error("freeze {freeze} is still being made by an earlier call; ask again in a moment")]
    BeingMade { freeze: String },
    #[code(FailedPrecondition)]
    #[error("volume {id} is frozen by {freeze} ({seconds_left} s left before it thaws by itself); thaw that freeze first (ThawVolumes with its freeze_id), then retry")]
    Frozen {
        id: String,
        freeze: String,
        /// Until it ends by itself.
        seconds_left: u64,
    },
    #[code(Internal)]
    #[error("could not thaw {volumes} of freeze {freeze}: {error}; the agent tries again every second until it can")]
    ThawFailed {
        freeze: String,
        /// The volumes still frozen.
        volumes: String,
        /// The first FITHAW's error.
        error: String,
    },
    #[code(NotFound)]
    #[error("{missing} not published here, so nothing holds it frozen; the other volumes named are thawed ({thawed})")]
    Missing {
        /// The volumes not published, as a phrase ("volume v1 is").
        missing: String,
        /// What this thaw thawed ("none" when nothing).
        thawed: String,
    },
}
}

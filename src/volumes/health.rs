//! A volume's health in CSI 1.13's shape (NodeGetVolumeHealth): the
//! condition's problems (stats/), each with its status and reason; empty
//! when healthy. A volume whose last publish failed and left nothing is
//! INACCESSIBLE with that failure (DATA_LOSS when it read a block the
//! kernel refused as tampered); an id never seen is NOT_FOUND.

use super::error::Error;
use super::failures::Failures;
use crate::code::Code;
use crate::error::Result;
use crate::stats::problem::Health;
use crate::stats::{Condition, Measured};

/// One thing wrong with a volume, as CSI says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Said {
    /// How bad.
    pub status: Health,
    /// Why, in CamelCase.
    pub reason: &'static str,
    /// The sentence the condition says.
    pub message: String,
}

/// The health of a volume that is not published: its publish's last
/// failure (INACCESSIBLE), or NOT_FOUND for an id never seen.
pub(crate) fn unpublished(failures: &Failures, id: &str) -> Result<Vec<Said>> {
    match failures.of(id) {
        // A publish that read a block the kernel refused as tampered.
        Some(f) if f.code == Code::DataLoss => Ok(vec![Said {
            status: Health::DataLoss,
            reason: "IntegrityMismatches",
            message: f.message,
        }]),
        Some(f) => Ok(vec![Said {
            status: Health::Inaccessible,
            reason: "PublishFailed",
            message: f.message,
        }]),
        None => Err(Error::NotPublished(id.to_string()).into()),
    }
}

/// The health of a published volume, from its stats' condition.
pub(crate) fn published(stats: Result<(Option<Measured>, Condition)>) -> Result<Vec<Said>> {
    let (_, condition) = match stats {
        // Its fsGroup walk still runs: nothing is wrong yet.
        Err(crate::error::Error::Volume(Error::StillPublishing { .. })) => return Ok(Vec::new()),
        r => r?,
    };
    Ok(condition
        .problems
        .iter()
        .map(|p| {
            let (status, reason) = p.health();
            Said {
                status,
                reason,
                message: p.to_string(),
            }
        })
        .collect())
}

/// A scheduled trim of volume `id` that failed (`why`): DEGRADED until a
/// later one goes through; the volume itself works.
pub(crate) fn trim_failed(id: &str, why: String) -> Said {
    Said {
        status: Health::Degraded,
        reason: "TrimFailed",
        message: format!("the last scheduled trim of volume {id} failed: {why}; the volume works, and the schedule tries again at its next time"),
    }
}

//! One group as crustd records it: its id, its volumes by sandbox, and how
//! each volume's part ended. The record is what a restarted crustd reads
//! back (`store`), so everything in it is checked on load as untrusted
//! input: [`Group::check`].

use std::collections::BTreeSet;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crust_protocols::freeze::{check_id, MAX_TIMEOUT_MS, MAX_VOLUMES};

/// Groups frozen or being frozen at once on the node.
pub const MAX_GROUPS: usize = 64;
/// How long after a group's timeout the host thaws it, so that the guest's
/// own timer (which the thaw's ABORTED reports) normally comes first.
pub const HOST_SLACK: Duration = Duration::from_secs(1);

/// Milliseconds since the epoch, now.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The longest detail kept with an end (a guest's message, cut).
pub const MAX_DETAIL: usize = 1024;
/// The longest agent volume id a record may hold (crustd's are 23 bytes).
const MAX_VOLUME_ID: usize = 64;
/// The longest host volume path (PATH_MAX).
const MAX_HOST_VOLUME: usize = 4096;
/// How many clauses of an ABORTED message say when and in what words a
/// part ended; the rest name their volumes and how only.
const NAMED: usize = 8;

/// How a volume's part of a group ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum How {
    /// By a thaw naming the group's id: the one way that keeps a snapshot whole.
    Thawed,
    /// Never frozen: the group's freeze stopped before its sandbox.
    Skipped,
    /// Its guest answered a thaw by the group's id that its part there did
    /// not hold (a volume ended first: its timeout, an unpublish, a restart,
    /// a forced thaw), in words crustd keeps but does not read: which of the
    /// part's volumes held is the guest's to say.
    Guest,
    /// Its sandbox's agent does not know the group's id.
    Unknown,
    /// Its sandbox is gone.
    Gone,
    /// crustd's timer, at the group's timeout.
    Timer,
    /// The volume was unpublished.
    Unpublished,
    /// A forced thaw of the volume.
    Forced,
    /// The caller of the freeze went away before the answer.
    CallerLeft,
    /// The group's freeze failed and undid itself.
    Undone,
    /// crustd restarted while the group was being frozen.
    Restarted,
}

/// Each way an end happens, as a sentence says it after "volume V of sandbox S".
const HOWS: [(How, &str); 11] = [
    (How::Thawed, "was thawed by the group's id"),
    (
        How::Skipped,
        "was never frozen: the group's freeze stopped before it",
    ),
    (
        How::Guest,
        "ended in its guest (its guest's answer: the group's part there did not hold)",
    ),
    (
        How::Unknown,
        "is unknown to its sandbox's agent (its VM replaced or its agent's records lost)",
    ),
    (How::Gone, "ended with its sandbox, which is gone"),
    (
        How::Timer,
        "was thawed by crustd's timer when the group's timeout passed",
    ),
    (
        How::Unpublished,
        "was thawed when the volume was unpublished",
    ),
    (How::Forced, "was thawed by a forced thaw"),
    (
        How::CallerLeft,
        "was thawed because the freeze's caller went away before the answer",
    ),
    (How::Undone, "was thawed because the group's freeze failed"),
    (
        How::Restarted,
        "was thawed because crustd restarted while the group was being frozen",
    ),
];

impl How {
    /// As a sentence says it.
    pub fn said(self) -> &'static str {
        HOWS.iter().find(|h| h.0 == self).map_or("", |h| h.1)
    }

    /// Whether a part that ended so kept a snapshot whole.
    pub fn keeps_snapshot(self) -> bool {
        matches!(self, How::Thawed | How::Skipped)
    }
}

/// How and when a part ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct End {
    pub how: How,
    pub at_unix_ms: u64,
    /// What the guest or crustd said of it (bounded by [`MAX_DETAIL`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl End {
    pub fn new(how: How, at_unix_ms: u64, detail: &str) -> End {
        End {
            how,
            at_unix_ms,
            detail: cut(detail, MAX_DETAIL),
        }
    }

    /// "was thawed … 12 s ago (unix time N ms): detail".
    fn said(&self, now: u64) -> String {
        let mut s = format!(
            "{} {} s ago (unix time {} ms)",
            self.how.said(),
            now.saturating_sub(self.at_unix_ms) / 1000,
            self.at_unix_ms
        );
        if !self.detail.is_empty() {
            s.push_str(": ");
            s.push_str(&self.detail);
        }
        s
    }
}

/// One volume of a group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Volume {
    pub host_volume: String,
    /// The agent's volume id.
    pub volume_id: String,
    /// How its part ended; none while it may be frozen.
    pub end: Option<End>,
}

/// A group's volumes in one sandbox: one FreezeVolumes, one thaw by id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    pub sandbox: String,
    /// Its FreezeVolumes was sent (its outcome may be unknown).
    pub called: bool,
    pub volumes: Vec<Volume>,
}

impl Part {
    /// Whether each of its volumes has ended.
    pub fn is_over(&self) -> bool {
        self.volumes.iter().all(|v| v.end.is_some())
    }

    /// Ends each of its volumes not ended yet with `end`.
    pub fn end(&mut self, end: &End) {
        for v in &mut self.volumes {
            v.end.get_or_insert_with(|| end.clone());
        }
    }
}

/// A group: a freeze across sandboxes, ended only by its id, its timeout,
/// an unpublish, a forced thaw or its caller going away.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    pub id: String,
    pub timeout_ms: u32,
    /// When it ends by itself: what its freeze answered.
    pub thaw_at_unix_ms: u64,
    /// Its freeze call is still at work.
    pub making: bool,
    /// What ended the group as a whole (its thaw, its timer, its caller
    /// leaving, a failed freeze), once something did.
    pub closing: Option<End>,
    /// In the order the freeze named them.
    pub parts: Vec<Part>,
    /// When its last part ended.
    pub ended_unix_ms: Option<u64>,
}

/// A freeze's volumes: (sandbox, [(host volume, agent volume id)]) in order.
pub type Plan = Vec<(String, Vec<(String, String)>)>;

impl Group {
    /// A group being made of `plan`, frozen for `timeout_ms` from `now`.
    pub fn new(id: &str, plan: &Plan, timeout_ms: u32, now: u64) -> Group {
        let parts = plan
            .iter()
            .map(|(sandbox, vols)| Part {
                sandbox: sandbox.clone(),
                called: false,
                volumes: vols
                    .iter()
                    .map(|(host_volume, volume_id)| Volume {
                        host_volume: host_volume.clone(),
                        volume_id: volume_id.clone(),
                        end: None,
                    })
                    .collect(),
            })
            .collect();
        Group {
            id: id.to_string(),
            timeout_ms,
            thaw_at_unix_ms: now.saturating_add(u64::from(timeout_ms)),
            making: true,
            closing: None,
            parts,
            ended_unix_ms: None,
        }
    }

    /// When crustd's timer ends it: its timeout, and [`HOST_SLACK`] more.
    pub fn host_deadline_unix_ms(&self) -> u64 {
        let slack = u64::try_from(HOST_SLACK.as_millis()).unwrap_or(u64::MAX);
        self.thaw_at_unix_ms.saturating_add(slack)
    }

    /// Whether it holds every volume: made, nothing ended.
    pub fn holds(&self) -> bool {
        !self.making
            && self.closing.is_none()
            && self
                .parts
                .iter()
                .all(|p| p.volumes.iter().all(|v| v.end.is_none()))
    }

    /// Whether nothing of it can be frozen any more.
    pub fn is_over(&self) -> bool {
        !self.making && self.parts.iter().all(Part::is_over)
    }

    /// Whether it was made of `plan` for `timeout_ms` (in any order).
    pub fn same(&self, plan: &Plan, timeout_ms: u32) -> bool {
        let mine: BTreeSet<(&str, &str)> = self
            .parts
            .iter()
            .flat_map(|p| {
                p.volumes
                    .iter()
                    .map(|v| (p.sandbox.as_str(), v.host_volume.as_str()))
            })
            .collect();
        let asked: BTreeSet<(&str, &str)> = plan
            .iter()
            .flat_map(|(s, vols)| vols.iter().map(move |(h, _)| (s.as_str(), h.as_str())))
            .collect();
        self.timeout_ms == timeout_ms && mine == asked
    }

    /// Ends every volume not ended yet, of every part whose sandbox was
    /// never called, as skipped.
    pub fn skip_uncalled(&mut self, now: u64) {
        let skipped = End::new(How::Skipped, now, "");
        for p in self.parts.iter_mut().filter(|p| !p.called) {
            p.end(&skipped);
        }
    }

    /// What ended it some other way than its id, as clauses: empty while
    /// every part it has ended kept a snapshot whole. Every volume that did
    /// not is named; those of a sandbox that ended the same way in one
    /// clause, and those that ended as the whole group did not again. The
    /// first [`NAMED`] clauses say when and in what words.
    pub fn broken(&self, now: u64) -> Vec<String> {
        let mut out = Vec::new();
        let closing = self.closing.as_ref().filter(|c| !c.how.keeps_snapshot());
        if let Some(c) = closing {
            out.push(format!("the group {}", c.said(now)));
        }
        let named = |e: &&End| !e.how.keeps_snapshot() && Some(e.how) != closing.map(|c| c.how);
        let mut clauses = Vec::new();
        for p in &self.parts {
            let mut alike: Vec<(&End, Vec<&str>)> = Vec::new();
            for v in &p.volumes {
                let Some(e) = v.end.as_ref().filter(named) else {
                    continue;
                };
                match alike.iter_mut().find(|(x, _)| *x == e) {
                    Some((_, names)) => names.push(&v.host_volume),
                    None => alike.push((e, vec![&v.host_volume])),
                }
            }
            for (e, names) in alike {
                let (noun, list) = match names.as_slice() {
                    [one] => ("volume", one.to_string()),
                    many => ("volumes", many.join(", ")),
                };
                let how = if clauses.len() < NAMED {
                    e.said(now)
                } else {
                    e.how.said().to_string()
                };
                clauses.push(format!("{noun} {list} of sandbox {} {how}", p.sandbox));
            }
        }
        out.extend(clauses);
        out
    }

    /// The sandboxes a thaw by id must still reach: called, and not over.
    pub fn pending(&self) -> Vec<usize> {
        (0..self.parts.len())
            .filter(|&i| self.parts[i].called && !self.parts[i].is_over())
            .collect()
    }

    /// Checks a record read back from disk (untrusted): the id, the
    /// bounds of a freeze, each name, and each detail.
    pub fn check(&self) -> Result<(), Unlike> {
        check_id(&self.id).map_err(Unlike::Id)?;
        if self.timeout_ms == 0 || self.timeout_ms > MAX_TIMEOUT_MS {
            return Err(Unlike::Timeout(self.timeout_ms));
        }
        let count: usize = self.parts.iter().map(|p| p.volumes.len()).sum();
        if self.parts.is_empty() || count > MAX_VOLUMES {
            return Err(Unlike::Volumes {
                count,
                sandboxes: self.parts.len(),
            });
        }
        let mut seen = BTreeSet::new();
        for p in &self.parts {
            crust_protocols::names::sandbox_id(&p.sandbox).map_err(Unlike::Sandbox)?;
            if p.volumes.is_empty() {
                return Err(Unlike::Empty(p.sandbox.clone()));
            }
            for v in &p.volumes {
                check_volume(v)?;
                if !seen.insert((&p.sandbox, &v.host_volume)) {
                    return Err(Unlike::Twice(v.host_volume.clone()));
                }
            }
        }
        let ends = self.closing.iter().chain(
            self.parts
                .iter()
                .flat_map(|p| p.volumes.iter().filter_map(|v| v.end.as_ref())),
        );
        for e in ends {
            if e.detail.len() > MAX_DETAIL {
                return Err(Unlike::Detail(e.detail.len()));
            }
        }
        Ok(())
    }
}

/// What in a record read back is unlike any group crustd writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unlike {
    /// The freeze id rule's sentence.
    Id(String),
    /// A timeout in ms.
    Timeout(u32),
    Volumes {
        count: usize,
        sandboxes: usize,
    },
    Sandbox(crust_protocols::names::BadName),
    /// A sandbox without volumes.
    Empty(String),
    HostVolume(String),
    VolumeId(String),
    /// A host volume named twice.
    Twice(String),
    /// A detail of this many bytes.
    Detail(usize),
}

impl fmt::Display for Unlike {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unlike::Id(why) => f.write_str(why),
            Unlike::Timeout(ms) => write!(f, "a timeout of {ms} ms"),
            Unlike::Volumes { count, sandboxes } => {
                write!(f, "{count} volumes in {sandboxes} sandboxes")
            }
            Unlike::Sandbox(e) => write!(f, "{e}"),
            Unlike::Empty(sandbox) => write!(f, "no volume in sandbox {sandbox}"),
            Unlike::HostVolume(h) => write!(f, "host volume {:?}", cut(h, 80)),
            Unlike::VolumeId(id) => write!(f, "volume id {:?}", cut(id, 80)),
            Unlike::Twice(h) => write!(f, "volume {h:?} twice"),
            Unlike::Detail(n) => write!(f, "a detail of {n} bytes"),
        }
    }
}

/// One volume's names, as a record holds them.
fn check_volume(v: &Volume) -> Result<(), Unlike> {
    let h = &v.host_volume;
    if !h.starts_with('/') || h.len() > MAX_HOST_VOLUME || h.contains('\0') {
        return Err(Unlike::HostVolume(h.clone()));
    }
    let id = &v.volume_id;
    if id.is_empty() || id.len() > MAX_VOLUME_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Unlike::VolumeId(id.clone()));
    }
    Ok(())
}

/// `text` cut to at most `max` bytes, on a character boundary, an
/// ellipsis saying so.
pub fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

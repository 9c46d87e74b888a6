//! Calls to the crust-agent of one sandbox through crust-client. The
//! connection is kept per sandbox and shared by its calls (ttrpc multiplexes
//! them); one that broke (the VM restarted, the agent was replaced) is
//! dropped and the call tried once more on a fresh one; every agent call is
//! idempotent, so the retry is safe. An agent that cannot be reached or does
//! not answer is UNAVAILABLE; an agent that answers with an error has its
//! code and message passed through, the message bounded. Each call is
//! crust-client's typed `call`: the request's type names the method and
//! the answer's type, so no answer is matched to its method at run time.
//!
//! The guest is untrusted: what it answers is checked and bounded before
//! crustd records it or passes it on. A guest path must be the agent's
//! `<root>/volumes/<volume id>`; usage counts must be counts; messages are
//! cut at [`MAX_MESSAGE`] bytes. Of ListVolumes, crustd reads only whether
//! a volume id is listed: nothing else a guest says of its volumes (an
//! encrypted volume's mapping, cipher and uuid included) is kept, logged
//! or passed on.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_client::proto as pb;
use crust_client::{protobuf::MessageField, Address, CallError, ConnectError, CrustClient, Rpc};
use crust_protocols::code::Code;
use crust_protocols::sync::LockExt;

crust_protocols::coded_errors! {
/// What a sandbox's agent answered, or why it did not; and the answers of
/// a guest crustd refuses (the guest is untrusted).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(Unavailable)]
    #[error("cannot reach the agent of sandbox {sandbox} at {addr}: {source}")]
    Unreachable { sandbox: String, addr: Address, source: Arc<ConnectError> },
    /// The agent answered with an error: its code, and its message cut at
    /// [`MAX_MESSAGE`] bytes.
    #[code(code => *code)]
    #[error("{}", Bounded(.message))]
    Answered { code: Code, message: String },
    /// No answer: none in time, or the connection broke.
    #[code(Unavailable)]
    #[error("the agent of sandbox {sandbox} at {addr}: {error}")]
    Silent { sandbox: String, addr: Address, error: CallError },
    #[code(FailedPrecondition)]
    #[error("{0}")]
    GuestPath(Box<GuestPath>),
    #[code(FailedPrecondition)]
    #[error("the agent of sandbox {sandbox} answered stats for volume {volume_id} that crustd refuses: {why}")]
    Stats { sandbox: String, volume_id: String, why: BadStats },
    #[code(FailedPrecondition)]
    #[error("the agent of sandbox {sandbox} answered a capacity of {capacity} bytes for volume {volume_id}, less than the {required} asked for, without an error: crustd refuses it")]
    Capacity { sandbox: String, volume_id: String, capacity: i64, required: i64 },
    #[code(FailedPrecondition)]
    #[error("the agent of sandbox {sandbox} answered freeze id {} for the group's {asked}: it does not keep freezes by the id it is given (an agent older than crustd?); update it", Shown(.answered))]
    OtherFreeze { sandbox: String, answered: String, asked: String },
    /// Too little of a group's time was left for this guest: it was not asked.
    #[code(Aborted)]
    #[error("its turn came with only {left_ms} ms left before the group ends by itself, and crustd gives each guest at least {} ms, its own timer set to end {} ms before the group's, so that no guest stays frozen past the time the caller was told: it was not asked to freeze; freeze again with a longer timeout", LEAST_FROZEN.as_millis(), FREEZE_MARGIN.as_millis())]
    Late { left_ms: u128 },
    #[code(FailedPrecondition)]
    #[error("the agent of sandbox {sandbox} answered a health for volume {volume_id} that crustd refuses: {why}")]
    Health { sandbox: String, volume_id: String, why: BadHealth },
}
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// Open connections by sandbox id, with the address they were made to.
pub type Connections = Mutex<HashMap<String, (String, CrustClient)>>;

/// One agent, with the deadlines crustd gives it.
pub struct Agent<'a> {
    /// Where connections are kept between calls.
    pub connections: &'a Connections,
    /// Where it listens.
    pub addr: &'a Address,
    /// The sandbox, for messages.
    pub sandbox: &'a str,
    /// Deadline of a call (and of connecting).
    pub timeout: Duration,
    /// How long the agent may wait for a disk to appear or grow.
    pub device_wait: Duration,
    /// When the caller (kubelet) gives up: its gRPC deadline. None: it set
    /// none, and a publish gets crustd's own `--agent-timeout`.
    pub deadline: Option<Instant>,
}

/// What an agent publish needs.
pub struct Publish<'a> {
    pub volume_id: &'a str,
    pub serial: &'a str,
    pub fs_type: &'a str,
    pub mount_options: &'a [String],
    pub read_only: bool,
    /// fsGroup gid and whether OnRootMismatch (else Always).
    pub fs_group: Option<(u32, bool)>,
    /// volumeMode: Block: the raw device, no filesystem.
    pub block: bool,
    /// An encrypted volume: how the guest opens it.
    pub encryption: Option<&'a Encryption>,
}

/// An encrypted volume's part of a publish: LUKS2, its key named by a
/// reference the guest resolves. crustd never holds key bytes, so it never
/// sends `Encryption.passphrase`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Encryption {
    /// `kbs:///repository/type/tag` or `file:///path`.
    pub key_uri: String,
    /// The guest may make a disk it proves blank a LUKS2 volume, with the
    /// filesystem inside.
    pub format_if_blank: bool,
}

/// The PublishVolume request for `p`, by serial, the agent told to wait
/// `timeout_ms` for the disk.
pub fn publish_request(p: &Publish, timeout_ms: u32) -> pb::PublishVolumeRequest {
    let mut r = pb::PublishVolumeRequest::new();
    r.volume_id = p.volume_id.into();
    r.set_serial(p.serial.into());
    r.fs_type = p.fs_type.into();
    r.mount_options = p.mount_options.to_vec();
    r.read_only = p.read_only;
    r.timeout_ms = timeout_ms;
    if p.block {
        r.volume_mode = pb::VolumeMode::BLOCK.into();
    }
    if let Some((gid, on_root_mismatch)) = p.fs_group {
        let mut g = pb::FsGroup::new();
        g.gid = gid;
        g.change_policy = if on_root_mismatch {
            pb::FsGroupChangePolicy::ON_ROOT_MISMATCH
        } else {
            pb::FsGroupChangePolicy::ALWAYS
        }
        .into();
        r.fs_group = MessageField::some(g);
    }
    if let Some(e) = p.encryption {
        let mut enc = pb::Encryption::new();
        enc.kind = pb::encryption::Kind::LUKS2.into();
        enc.set_key_uri(e.key_uri.clone());
        enc.format_if_blank = e.format_if_blank;
        // Discards through the mapping would tell the host which blocks
        // are free: nothing crustd is given asks for them.
        enc.allow_discards = false;
        r.encryption = MessageField::some(enc);
    }
    r
}

/// How long the agent's answer may take to come back, past the deadline it was
/// told, when the caller set none (the agent starts counting once it has read
/// the request, so its DEADLINE_EXCEEDED comes a little after the deadline).
const ANSWER_SLACK: Duration = Duration::from_secs(1);

/// The part of the caller's time left that the agent is not told: half of it
/// for the agent's answer to come back late, half for crustd to look at the
/// volume (ListVolumes), record it and answer. A tenth of what is left, at
/// least 200 ms and at most 2 s: 200 ms of a 2 s deadline, 2 s of kubelet's 2 minutes.
pub fn margin(left: Duration) -> Duration {
    (left / 10).clamp(Duration::from_millis(200), Duration::from_secs(2))
}

/// The least deadline the agent is told, even when the caller has almost no
/// time left: enough to start, so that a walk can begin and a retry join it.
const LEAST_TOLD: Duration = Duration::from_millis(100);

/// (the deadline the agent is told, how long crustd waits for its answer),
/// for a caller with `left` time left.
pub fn publish_deadlines(left: Duration) -> (Duration, Duration) {
    let m = margin(left);
    let told = left.saturating_sub(m).max(LEAST_TOLD);
    let wait = left.saturating_sub(m / 2).max(told);
    (told, wait)
}

/// The least time an agent call is given, even when the caller has almost
/// none left: enough to be answered by an agent that is there.
const LEAST_BUDGET: Duration = Duration::from_millis(100);

/// How much sooner than the group's own end each guest's freeze timeout
/// ends: room for the request to reach the guest (its timer starts when it
/// reads the request) and for one retry on a fresh connection, which must
/// carry the same timeout (the agent answers a retried freeze again only
/// when it names the same), so that no guest's timer ends after the time
/// the caller was told.
pub const FREEZE_MARGIN: Duration = Duration::from_millis(200);
/// The least a guest's freeze timeout may be: a guest whose turn comes with
/// less left is not asked, and the group's freeze fails.
pub const LEAST_FROZEN: Duration = Duration::from_millis(100);

impl Agent<'_> {
    /// How long a call may take now: `--agent-timeout`, or less when the
    /// caller's deadline comes sooner (a call never outlives its caller by
    /// more than [`LEAST_BUDGET`]).
    fn budget(&self) -> Duration {
        self.deadline
            .map_or(self.timeout, |d| {
                d.saturating_duration_since(Instant::now())
                    .min(self.timeout)
            })
            .max(LEAST_BUDGET)
    }

    /// The kept connection to this agent, or a new one.
    fn client(&self, fresh: bool) -> Result<CrustClient> {
        let addr = self.addr.to_string();
        {
            let mut map = self.connections.locked();
            match map.get(self.sandbox) {
                Some((a, c)) if *a == addr && !fresh => return Ok(c.clone()),
                _ => {
                    map.remove(self.sandbox);
                }
            }
        }
        let c = CrustClient::connect(self.addr, self.budget()).map_err(|e| Error::Unreachable {
            sandbox: self.sandbox.to_string(),
            addr: self.addr.clone(),
            source: Arc::new(e),
        })?;
        self.connections
            .locked()
            .insert(self.sandbox.to_string(), (addr, c.clone()));
        Ok(c)
    }

    fn forget(&self) {
        self.connections.locked().remove(self.sandbox);
    }

    /// Calls the method `req` is the request of (its type says the answer's)
    /// on the kept connection, within [`Agent::budget`]; once more on a
    /// fresh one if it broke.
    fn call<R: Rpc>(&self, req: &R) -> Result<R::Response> {
        self.call_within(req, |budget| budget)
    }

    /// [`call`](Self::call) within `within(budget)`: for a request that has
    /// the agent wait itself.
    fn call_within<R: Rpc>(
        &self,
        req: &R,
        within: impl Fn(Duration) -> Duration,
    ) -> Result<R::Response> {
        let timed = |c: CrustClient| c.call_within(req, within(self.budget()));
        let first = timed(self.client(false)?);
        let out = match first {
            Err(CallError::Connection { .. }) => timed(self.client(true)?),
            other => other,
        };
        out.map_err(|e| {
            if !matches!(e, CallError::Status { .. }) {
                self.forget();
            }
            self.sort(e)
        })
    }

    fn sort(&self, e: CallError) -> Error {
        match e {
            CallError::Status { code, message } => Error::Answered { code, message },
            error => Error::Silent {
                sandbox: self.sandbox.to_string(),
                addr: self.addr.clone(),
                error,
            },
        }
    }

    /// How long the agent may wait for a disk: `--device-wait`, or less
    /// when the caller's deadline comes sooner.
    fn wait_ms(&self) -> u32 {
        let wait = match self.deadline {
            Some(_) => self.device_wait.min(self.budget()),
            None => self.device_wait,
        };
        u32::try_from(wait.as_millis()).unwrap_or(u32::MAX)
    }

    /// PublishVolume by serial; answers the guest path.
    pub fn publish(&self, p: &Publish) -> Result<String> {
        let r = publish_request(p, self.wait_ms());
        let (told, wait) = match self.deadline {
            Some(d) => publish_deadlines(d.saturating_duration_since(Instant::now())),
            None => {
                let told = crust_client::deadline_for_wait(self.timeout, r.timeout_ms);
                (told, told + ANSWER_SLACK)
            }
        };
        // A connection of its own, so the agent is told `told` while crustd
        // waits `wait` for the answer (crust_client::unary says why); once
        // more on a fresh one if it broke: publish is idempotent.
        let once = || crust_client::unary::publish_volume(self.addr, self.timeout, &r, told, wait);
        let out = match once() {
            Err(CallError::Connection { .. }) => once(),
            other => other,
        };
        let guest_path = out.map(|resp| resp.guest_path).map_err(|e| self.sort(e))?;
        if let Err(why) = check_guest_path(p.volume_id, &guest_path) {
            return Err(Error::GuestPath(Box::new(GuestPath {
                sandbox: self.sandbox.to_string(),
                addr: self.addr.clone(),
                volume_id: p.volume_id.to_string(),
                path: guest_path,
                why,
            })));
        }
        Ok(guest_path)
    }

    /// Whether the agent lists `volume_id` (mounted, its walk running or done).
    pub fn lists(&self, volume_id: &str) -> Result<bool> {
        self.call(&pb::ListVolumesRequest::new())
            .map(|l| l.volumes.iter().any(|v| v.volume_id == volume_id))
    }

    /// UnpublishVolume; OK when it was not published.
    pub fn unpublish(&self, volume_id: &str) -> Result<()> {
        let mut r = pb::UnpublishVolumeRequest::new();
        r.volume_id = volume_id.into();
        self.call(&r).map(|_| ())
    }

    /// GetVolumeStats: the usage and condition the agent answers, checked.
    pub fn stats(&self, volume_id: &str) -> Result<Stats> {
        let mut r = pb::GetVolumeStatsRequest::new();
        r.volume_id = volume_id.into();
        let s = self.call(&r)?;
        stats_of(&s).map_err(|why| Error::Stats {
            sandbox: self.sandbox.to_string(),
            volume_id: volume_id.to_string(),
            why,
        })
    }

    /// ExpandVolume; answers the capacity in bytes.
    pub fn expand(&self, volume_id: &str, required_bytes: i64) -> Result<i64> {
        let mut r = pb::ExpandVolumeRequest::new();
        r.volume_id = volume_id.into();
        r.required_bytes = required_bytes;
        r.timeout_ms = self.wait_ms();
        // The call's deadline covers the agent's own wait for the disk.
        let wait = r.timeout_ms;
        let capacity = self
            .call_within(&r, |budget| crust_client::deadline_for_wait(budget, wait))?
            .capacity_bytes;
        if capacity < required_bytes {
            return Err(Error::Capacity {
                sandbox: self.sandbox.to_string(),
                volume_id: volume_id.to_string(),
                capacity,
                required: required_bytes,
            });
        }
        Ok(capacity)
    }
}

/// A FreezeVolumes that failed, by what it tells of the guest.
#[derive(Debug, Clone)]
pub enum FreezeFailed {
    /// Never sent (no connection could be made): nothing of it is frozen.
    NotSent(Error),
    /// The agent refused it: by its all-or-none rule nothing of it is frozen.
    Refused(Error),
    /// No answer settles it (none in time, a connection that broke, the
    /// agent's UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED, or an answer
    /// naming another freeze): the guest may be frozen, or be about to.
    Unknown(Error),
}

impl FreezeFailed {
    pub fn error(&self) -> &Error {
        match self {
            FreezeFailed::NotSent(e) | FreezeFailed::Refused(e) | FreezeFailed::Unknown(e) => e,
        }
    }

    /// Whether it is known that nothing of it is frozen.
    pub fn settled(&self) -> bool {
        !matches!(self, FreezeFailed::Unknown(_))
    }
}

/// Whether the agent's refusal with `code` says its freeze did nothing: the
/// codes of a request judged and turned down, not of one cut short.
fn refusal(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::ResourceExhausted
            | Code::FailedPrecondition
            | Code::Aborted
            | Code::OutOfRange
            | Code::Unimplemented
    )
}

impl Agent<'_> {
    /// FreezeVolumes of `ids` under the group's id `freeze_id`, its timeout
    /// what is left until `until` (the group's end), less [`FREEZE_MARGIN`],
    /// measured once the connection is there; a guest left less than
    /// [`LEAST_FROZEN`] is not asked. Once more on a fresh connection if the
    /// first broke, within [`FREEZE_MARGIN`] (the same id and timeout make
    /// the retry safe: the agent answers a freeze it holds again).
    pub fn freeze(
        &self,
        ids: &[String],
        until: Instant,
        freeze_id: &str,
    ) -> std::result::Result<(), FreezeFailed> {
        let timed = |c: CrustClient, r: &pb::FreezeVolumesRequest| c.call_within(r, self.budget());
        let first = self.client(false).map_err(FreezeFailed::NotSent)?;
        let sent = Instant::now();
        let left = until.saturating_duration_since(sent);
        let timeout = left.saturating_sub(FREEZE_MARGIN);
        if timeout < LEAST_FROZEN {
            return Err(FreezeFailed::NotSent(Error::Late {
                left_ms: left.as_millis(),
            }));
        }
        let mut r = pb::FreezeVolumesRequest::new();
        r.volume_ids = ids.to_vec();
        r.timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        r.freeze_id = freeze_id.into();
        let out = match timed(first, &r) {
            Err(e @ CallError::Connection { .. }) => match self.client(true) {
                Ok(c) if sent.elapsed() <= FREEZE_MARGIN => timed(c, &r),
                // Sent now, it could end after the group: the first may
                // have arrived, so the outcome is unknown.
                Ok(_) => return Err(FreezeFailed::Unknown(self.sort(e))),
                Err(e) => return Err(FreezeFailed::Unknown(e)),
            },
            other => other,
        };
        match out {
            Ok(resp) if resp.freeze_id == freeze_id => Ok(()),
            Ok(resp) => Err(FreezeFailed::Unknown(Error::OtherFreeze {
                sandbox: self.sandbox.to_string(),
                answered: resp.freeze_id,
                asked: freeze_id.to_string(),
            })),
            Err(e) => {
                let refused = matches!(&e, CallError::Status { code, .. } if refusal(*code));
                if !matches!(e, CallError::Status { .. }) {
                    self.forget();
                }
                let e = self.sort(e);
                Err(if refused {
                    FreezeFailed::Refused(e)
                } else {
                    FreezeFailed::Unknown(e)
                })
            }
        }
    }

    /// ThawVolumes of the freeze `freeze_id`: ABORTED (a part of it ended
    /// first) and NOT_FOUND (an id the agent never issued) pass through.
    pub fn thaw_id(&self, freeze_id: &str) -> Result<()> {
        let mut r = pb::ThawVolumesRequest::new();
        r.freeze_id = freeze_id.into();
        self.call(&r).map(|_| ())
    }

    /// ThawVolumes with force: ends whatever freeze holds `ids`; NOT_FOUND
    /// (after the others are thawed) for one not published.
    pub fn thaw_forced(&self, ids: &[String]) -> Result<()> {
        let mut r = pb::ThawVolumesRequest::new();
        r.volume_ids = ids.to_vec();
        r.force = true;
        self.call(&r).map(|_| ())
    }

    /// TrimVolume; answers the bytes given back.
    pub fn trim(&self, volume_id: &str, min_extent_bytes: u64) -> Result<u64> {
        let mut r = pb::TrimVolumeRequest::new();
        r.volume_id = volume_id.into();
        r.min_extent_bytes = min_extent_bytes;
        Ok(self.call(&r)?.trimmed_bytes)
    }

    /// GetVolumeHealth: the agent's list, checked.
    pub fn health(&self, volume_id: &str) -> Result<Vec<Health>> {
        let mut r = pb::GetVolumeHealthRequest::new();
        r.volume_id = volume_id.into();
        let out = self.call(&r)?;
        health_of(&out).map_err(|why| Error::Health {
            sandbox: self.sandbox.to_string(),
            volume_id: volume_id.to_string(),
            why,
        })
    }
}

/// One entry of a volume's health (CSI 1.13).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// 1 INACCESSIBLE, 2 DATA_LOSS, 3 DEGRADED (the protos' numbers).
    pub status: i32,
    /// CamelCase.
    pub reason: String,
    pub message: String,
}

/// The most entries of a health list taken from a guest.
const MAX_HEALTH: usize = 32;

/// The agent's health list, checked: a bounded list of known statuses,
/// reasons that are CamelCase words, messages bounded.
fn health_of(h: &pb::GetVolumeHealthResponse) -> Result<Vec<Health>, BadHealth> {
    if h.health.len() > MAX_HEALTH {
        return Err(BadHealth::TooMany(h.health.len()));
    }
    h.health
        .iter()
        .map(|e| {
            let status = match e.status.enum_value() {
                Ok(
                    s @ (pb::volume_health::Status::INACCESSIBLE
                    | pb::volume_health::Status::DATA_LOSS
                    | pb::volume_health::Status::DEGRADED),
                ) => s as i32,
                _ => return Err(BadHealth::Status(e.status.value())),
            };
            let camel = !e.reason.is_empty()
                && e.reason.len() <= 64
                && e.reason.starts_with(|c: char| c.is_ascii_uppercase())
                && e.reason.bytes().all(|b| b.is_ascii_alphanumeric());
            if !camel {
                return Err(BadHealth::Reason(e.reason.clone()));
            }
            Ok(Health {
                status,
                reason: e.reason.clone(),
                message: bounded(&e.message),
            })
        })
        .collect()
}

/// Bytes or inodes, as the agent counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub available: i64,
    pub total: i64,
    pub used: i64,
    /// true: inodes; false: bytes.
    pub inodes: bool,
}

/// RuntimeGetVolumeStats, in plain types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    pub usage: Vec<Usage>,
    pub abnormal: bool,
    pub message: String,
}

/// The longest message from the agent passed on (an error's, a volume
/// condition's): a sentence, not a file.
pub const MAX_MESSAGE: usize = 4096;

/// The longest guest path taken (PATH_MAX).
const MAX_GUEST_PATH: usize = 4096;

/// `text` cut at [`MAX_MESSAGE`] bytes (on a character boundary), saying so.
fn bounded(text: &str) -> String {
    Bounded(text).to_string()
}

/// A message from the guest, shown cut at [`MAX_MESSAGE`] bytes (on a
/// character boundary), saying so.
struct Bounded<'a>(&'a str);

impl fmt::Display for Bounded<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0;
        if text.len() <= MAX_MESSAGE {
            return f.write_str(text);
        }
        let mut end = MAX_MESSAGE;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        write!(
            f,
            "{}… ({} bytes in all, cut by crustd)",
            &text[..end],
            text.len()
        )
    }
}

/// An answer from the guest, shown in a message: escaped and at most 80 characters.
struct Shown<'a>(&'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0;
        let cut: String = text.chars().take(80).collect();
        write!(f, "{cut:?}")?;
        if cut.len() < text.len() {
            write!(f, " ({} bytes in all)", text.len())?;
        }
        Ok(())
    }
}

/// A guest path the agent answered, refused: crustd cannot trust that agent.
#[derive(Debug, Clone)]
pub struct GuestPath {
    pub sandbox: String,
    pub addr: Address,
    pub volume_id: String,
    /// What the guest answered.
    pub path: String,
    pub why: BadPath,
}

impl fmt::Display for GuestPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the agent of sandbox {} answered the guest path {} for volume {}, which crustd refuses: {}; the agent at {} is not one crustd can trust",
            self.sandbox,
            Shown(&self.path),
            self.volume_id,
            self.why,
            self.addr
        )
    }
}

/// Why a guest path is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadPath {
    /// More bytes than PATH_MAX: how many.
    TooLong(usize),
    Control,
    NotAbsolute,
    /// An empty, `.` or `..` component.
    NotNormal,
    /// Not `<root>/volumes/<this volume id>`.
    NotTheVolume(String),
}

impl fmt::Display for BadPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadPath::TooLong(n) => write!(f, "it has {n} bytes, more than PATH_MAX"),
            BadPath::Control => f.write_str("it holds control characters"),
            BadPath::NotAbsolute => f.write_str("it is not absolute"),
            BadPath::NotNormal => {
                f.write_str("it is not a normal path (an empty, . or .. component)")
            }
            BadPath::NotTheVolume(id) => write!(f, "it is not <root>/volumes/{id}"),
        }
    }
}

/// Why a stats answer is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadStats {
    /// A unit the protos do not have: its number.
    Unit(i32),
    TwoInOneUnit,
    /// Counts that cannot be one volume's.
    NotCounts {
        available: i64,
        total: i64,
        used: i64,
    },
}

impl fmt::Display for BadStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadStats::Unit(u) => write!(f, "a usage in unit {u}"),
            BadStats::TwoInOneUnit => f.write_str("two usages in one unit"),
            BadStats::NotCounts {
                available,
                total,
                used,
            } => write!(
                f,
                "available {available}, total {total}, used {used} are not counts of one volume"
            ),
        }
    }
}

/// Why a health answer is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadHealth {
    /// More entries than crustd takes: how many.
    TooMany(usize),
    /// A status CSI does not have: its number.
    Status(i32),
    /// A reason that is no CamelCase word.
    Reason(String),
}

impl fmt::Display for BadHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadHealth::TooMany(n) => write!(f, "{n} entries, more than {MAX_HEALTH}"),
            BadHealth::Status(s) => write!(f, "status {s} is none of CSI's"),
            BadHealth::Reason(r) => write!(f, "reason {} is not a CamelCase word", Shown(r)),
        }
    }
}

/// Whether `path` can be the agent's `<root>/volumes/<volume_id>`: an
/// absolute, normal path (no empty, `.` or `..` component) of at most
/// PATH_MAX bytes, without control characters, whose last two components
/// are `volumes` and the volume's id.
pub fn check_guest_path(volume_id: &str, path: &str) -> Result<(), BadPath> {
    if path.len() > MAX_GUEST_PATH {
        return Err(BadPath::TooLong(path.len()));
    }
    if path.chars().any(char::is_control) {
        return Err(BadPath::Control);
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(BadPath::NotAbsolute);
    };
    let parts: Vec<&str> = rest.split('/').collect();
    if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == "..")
    {
        return Err(BadPath::NotNormal);
    }
    match parts.as_slice() {
        [.., "volumes", id] if *id == volume_id => Ok(()),
        _ => Err(BadPath::NotTheVolume(volume_id.to_string())),
    }
}

/// The usage and condition of a stats answer, checked: each count at least
/// 0 and used at most total, one entry per unit at most, the message bounded.
fn stats_of(s: &pb::GetVolumeStatsResponse) -> Result<Stats, BadStats> {
    let mut usage = Vec::new();
    for u in &s.usage {
        let inodes = match u.unit.enum_value() {
            Ok(pb::volume_usage::Unit::BYTES) => false,
            Ok(pb::volume_usage::Unit::INODES) => true,
            _ => return Err(BadStats::Unit(u.unit.value())),
        };
        if usage.iter().any(|x: &Usage| x.inodes == inodes) {
            return Err(BadStats::TwoInOneUnit);
        }
        if u.available < 0 || u.total < 0 || u.used < 0 || u.used > u.total {
            return Err(BadStats::NotCounts {
                available: u.available,
                total: u.total,
                used: u.used,
            });
        }
        usage.push(Usage {
            available: u.available,
            total: u.total,
            used: u.used,
            inodes,
        });
    }
    Ok(Stats {
        usage,
        abnormal: s.condition.abnormal,
        message: bounded(&s.condition.message),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_encrypted_publish_names_its_key_and_carries_none() {
        let enc = Encryption {
            key_uri: "kbs:///default/key/1".into(),
            format_if_blank: true,
        };
        let opts = ["noatime".to_string()];
        let mut p = Publish {
            volume_id: "v",
            serial: "s",
            fs_type: "ext4",
            mount_options: &opts,
            read_only: false,
            fs_group: Some((7, false)),
            block: false,
            encryption: Some(&enc),
        };
        let r = publish_request(&p, 1000);
        let e = r.encryption.as_ref().expect("an encryption part");
        assert_eq!(e.kind.enum_value(), Ok(pb::encryption::Kind::LUKS2));
        assert_eq!(e.key_uri(), "kbs:///default/key/1");
        assert!(!e.has_passphrase() && e.passphrase().is_empty());
        assert!(e.format_if_blank && !e.allow_discards);
        assert_eq!((r.serial(), r.timeout_ms), ("s", 1000));
        assert_eq!(r.mount_options, opts);
        p.encryption = None;
        assert!(publish_request(&p, 1000).encryption.is_none());
    }

    #[test]
    fn an_agent_call_never_outlives_its_caller() {
        let connections = Connections::default();
        let addr: Address = "unix:///nowhere".parse().unwrap();
        let mut a = Agent {
            connections: &connections,
            addr: &addr,
            sandbox: "s",
            timeout: Duration::from_secs(30),
            device_wait: Duration::from_secs(30),
            deadline: None,
        };
        assert_eq!(a.budget(), Duration::from_secs(30));
        assert_eq!(a.wait_ms(), 30_000);
        a.deadline = Some(Instant::now() + Duration::from_secs(2));
        assert!(a.budget() <= Duration::from_secs(2), "{:?}", a.budget());
        assert!(a.wait_ms() <= 2000);
        a.deadline = Some(Instant::now());
        assert_eq!(a.budget(), LEAST_BUDGET);
        a.deadline = Some(Instant::now() + Duration::from_secs(3600));
        assert_eq!(a.budget(), Duration::from_secs(30));
    }

    #[test]
    fn only_a_judged_refusal_says_a_freeze_froze_nothing() {
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::ResourceExhausted,
            Code::Unimplemented,
        ] {
            assert!(refusal(code), "{code:?}");
        }
        // Cut short, or still at work (the same id being frozen): unknown.
        for code in [
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::Cancelled,
            Code::Internal,
            Code::Unknown,
        ] {
            assert!(!refusal(code), "{code:?}");
        }
        let e = Error::Answered {
            code: Code::Unavailable,
            message: "x".into(),
        };
        assert!(FreezeFailed::NotSent(e.clone()).settled());
        assert!(FreezeFailed::Refused(e.clone()).settled());
        assert!(!FreezeFailed::Unknown(e).settled());
    }

    #[test]
    fn a_guest_path_is_the_agents_volume_path_and_nothing_else() {
        let id = "crustd-0123456789abcdef";
        for ok in [
            format!("/run/crust/volumes/{id}"),
            format!("/volumes/{id}"),
            format!("/a b/volumes/{id}"),
        ] {
            assert_eq!(check_guest_path(id, &ok), Ok(()), "{ok}");
        }
        let huge = format!("/{}/volumes/{id}", "\x01".repeat(700_000));
        for (bad, says) in [
            (format!("run/crust/volumes/{id}"), "not absolute"),
            (format!("/run/crust/volumes/{id}/"), "not a normal path"),
            (format!("/run/../volumes/{id}"), "not a normal path"),
            (format!("/run//volumes/{id}"), "not a normal path"),
            ("/run/crust/volumes/other".to_string(), "not <root>/volumes"),
            (format!("/run/crust/{id}"), "not <root>/volumes"),
            (format!("/run/\u{1}/volumes/{id}"), "control"),
            (format!("/run/x\ny/volumes/{id}"), "control"),
            ("/etc/passwd".to_string(), "not <root>/volumes"),
            (huge, "more than PATH_MAX"),
        ] {
            let why = check_guest_path(id, &bad).unwrap_err().to_string();
            assert!(why.contains(says), "{bad:?}: {why}");
        }
        assert!(Shown(&"\u{1}".repeat(1000)).to_string().len() < 1000);
    }

    #[test]
    fn stats_are_counts_and_messages_are_bounded() {
        let mut s = pb::GetVolumeStatsResponse::new();
        let mut u = pb::VolumeUsage::new();
        (u.available, u.total, u.used) = (700, 1000, 300);
        u.unit = pb::volume_usage::Unit::BYTES.into();
        s.usage.push(u.clone());
        let mut c = pb::VolumeCondition::new();
        c.message = "é".repeat(10_000);
        s.condition = crust_client::protobuf::MessageField::some(c);
        let st = stats_of(&s).unwrap();
        assert_eq!(st.usage.len(), 1);
        assert!(st.message.len() < MAX_MESSAGE + 64, "{}", st.message.len());
        assert!(st.message.ends_with("cut by crustd)"));
        s.usage.push(u.clone());
        assert!(stats_of(&s).unwrap_err().to_string().contains("two usages"));
        s.usage.pop();
        s.usage[0].used = 1001;
        assert!(stats_of(&s).is_err());
        s.usage[0].used = -1;
        assert!(stats_of(&s).is_err());
    }

    #[test]
    fn the_agent_is_told_the_callers_deadline_less_a_margin() {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        // (time the caller has left, told, waited)
        let table = [
            (s(2), ms(1800), ms(1900)),  // 200 ms margin at least
            (s(10), s(9), ms(9500)),     // a tenth
            (s(120), s(118), s(119)),    // kubelet's 2 minutes: 2 s at most
            (s(3600), s(3598), s(3599)), // however long the caller waits
            (ms(150), ms(100), ms(100)), // almost nothing left: enough to start
            (Duration::ZERO, ms(100), ms(100)),
        ];
        for (left, told, wait) in table {
            assert_eq!(publish_deadlines(left), (told, wait), "{left:?}");
        }
    }
}

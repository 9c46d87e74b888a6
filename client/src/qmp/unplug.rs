//! Taking a disk out of a running VM over short sessions: device_del, the
//! wait for the guest to let go, then blockdev-del, asked again while QEMU
//! still says the node is in use. Each step opens a session of its own
//! through the caller's factory and closes it before any sleep, so a caller
//! that keeps one session per monitor at a time (crustd does, per sandbox,
//! under a lock) holds the monitor for one exchange, never across the
//! guest's wait.

use std::borrow::BorrowMut;
use std::thread::sleep;
use std::time::{Duration, Instant};

use super::refusal::Refusal;
use super::session::{Qmp, QmpError};

/// How long a wait sleeps between looks.
const POLL: Duration = Duration::from_millis(100);

/// The step of an unplug that failed, for the caller's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// device_del.
    Detach,
    /// qom-list, looking whether the guest let go.
    Look,
    /// blockdev-del.
    RemoveNode,
}

/// Why an unplug did not finish.
#[derive(Debug, thiserror::Error)]
pub enum UnplugError<E> {
    /// The factory opened no session: its own error.
    #[error(transparent)]
    Session(E),
    /// QEMU failed or refused `step`.
    #[error("{error}")]
    Qmp { step: Step, error: QmpError },
    /// QEMU still had the device when the wait for the guest ended.
    #[error("QEMU still has the device: the guest did not let go of it in time")]
    NotReleased,
}

/// How long each wait of an unplug may last.
#[derive(Debug, Clone, Copy)]
pub struct Patience {
    /// Each wait (the guest's release, then the node's) lasts at most this long…
    pub each: Duration,
    /// …and never past this, the caller's own deadline.
    pub deadline: Option<Instant>,
}

impl Patience {
    /// When a wait that starts now ends.
    fn until(&self) -> Instant {
        let mut until = Instant::now() + self.each;
        if let Some(d) = self.deadline {
            until = until.min(d);
        }
        until
    }
}

/// One step on a fresh session from `open`.
fn step<S, E, T>(
    open: &mut impl FnMut() -> Result<S, E>,
    which: Step,
    f: impl FnOnce(&mut Qmp) -> Result<T, QmpError>,
) -> Result<T, UnplugError<E>>
where
    S: BorrowMut<Qmp>,
{
    let mut s = open().map_err(UnplugError::Session)?;
    f(s.borrow_mut()).map_err(|error| UnplugError::Qmp { step: which, error })
}

/// Sleeps one poll, never past `until`.
fn nap(until: Instant) {
    sleep(POLL.min(until.saturating_duration_since(Instant::now())));
}

/// Takes virtio-blk device `device` and its block node `node` out of the
/// VM: device_del if QEMU has the device, a look every 100 ms until QEMU
/// no longer lists it (the guest let go; [`Step::Look`]), then
/// [`remove_node_until`]. Each wait lasts as `patience` allows. Every step
/// runs on a fresh session from `open`; none is held across a sleep.
/// Repeatable: what QEMU no longer has is skipped.
pub fn unplug<S, E>(
    mut open: impl FnMut() -> Result<S, E>,
    device: &str,
    node: &str,
    patience: Patience,
) -> Result<(), UnplugError<E>>
where
    S: BorrowMut<Qmp>,
{
    if step(&mut open, Step::Detach, |q| q.request_unplug(device))? {
        let until = patience.until();
        while step(&mut open, Step::Look, |q| q.device_present(device))? {
            if Instant::now() >= until {
                return Err(UnplugError::NotReleased);
            }
            nap(until);
        }
    }
    remove_node_until(open, node, patience.until()).map(|_| ())
}

/// Removes block node `node` (blockdev-del) if QEMU has it, asking again
/// while QEMU says the node is in use ([`Refusal::NodeInUse`]: a device
/// leaves QEMU's list a moment before its deferred finalization lets go of
/// its node), until `until`; then the refusal is the caller's. Each try
/// runs on a fresh session from `open`, none held between tries. Answers
/// whether QEMU had the node.
pub fn remove_node_until<S, E>(
    mut open: impl FnMut() -> Result<S, E>,
    node: &str,
    until: Instant,
) -> Result<bool, UnplugError<E>>
where
    S: BorrowMut<Qmp>,
{
    loop {
        match step(&mut open, Step::RemoveNode, |q| q.remove_node(node)) {
            Err(UnplugError::Qmp { error, .. })
                if error.refusal() == Some(Refusal::NodeInUse) && Instant::now() < until =>
            {
                nap(until);
            }
            other => return other,
        }
    }
}

//! A QMP session: JSON lines over QEMU's Unix monitor socket, for crustd
//! and crust-vm alike. QEMU serves one client per monitor socket at a time,
//! so a session lives for one operation and is closed after it (other
//! clients get their turn); callers serialize their own sessions.
//! Asynchronous events that arrive between replies are kept for
//! [`Qmp::wait_event`].
//!
//! The socket is whatever a sandbox's record names, so nothing about it is
//! trusted: connecting has a deadline (a listener that never accepts fills
//! its backlog and would block a plain connect for ever), every read and
//! write has one, a monitor that accepts but never greets is told apart from
//! a VM that is gone ([`gone`]), and a line longer than [`MAX_LINE`] ends the
//! session.

mod block;
#[cfg(test)]
mod fake;
mod session;

pub use block::{Added, BlockDisk, Source};
pub use session::{gone, Qmp, QmpError, MAX_LINE};

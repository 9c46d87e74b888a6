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
//! session. A caller that must know whose monitor it reached connects
//! through a socket it opened and judged ([`Socket::Opened`]) and vets the
//! process that listens there before a byte is exchanged
//! ([`Qmp::connect_vetted`]).

mod block;
#[cfg(test)]
mod fake;
mod session;
mod socket;

pub use block::{Added, BlockDisk, Source};
pub use session::{gone, gone_at, Qmp, QmpError, MAX_LINE};
pub use socket::Socket;

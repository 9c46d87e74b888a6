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
//!
//! QEMU's refusals are classified once ([`Refusal`]), and the unplug, whose
//! waits span several sessions, is written once ([`unplug`],
//! [`remove_node_until`]). `fake` (with the `test-util` feature) is a
//! stand-in QEMU for tests.

mod block;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
mod refusal;
mod session;
mod socket;
mod unplug;

pub use block::{Added, BlockDisk, Source};
pub use refusal::Refusal;
pub use session::{gone, gone_at, Qmp, QmpError, MAX_LINE};
pub use socket::Socket;
pub use unplug::{remove_node_until, unplug, Patience, Step, UnplugError};

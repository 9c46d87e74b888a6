//! The agent's ttrpc transport: the wire protocol of ttrpc (Go's
//! containerd/ttrpc and the Rust crate speak it alike) served by a bounded
//! loop instead of the ttrpc crate's thread-per-connection server, so that
//! no client, however it behaves, can make the agent spawn threads, hold
//! memory or keep descriptors without bound. It knows no agent type: it
//! serves whatever generated service table it is given, with the lanes that
//! service's rule gives its methods.
//!
//! One event-loop thread (`reactor`) owns every connection (`conn`, whose
//! answers leave through its `wire`) and answers inline methods itself; a
//! fixed pool of workers (`pool`) runs the rest through the generated
//! service table (`dispatch`), exactly as ttrpc's server would; each
//! method's lane is settled once at start (`table`); `transport` starts
//! and stops them within the `limits`. Every frame (`frame`) gets an
//! answer; its envelope is read in place where it can be (`envelope`).
//! `listen` makes the sockets and says who may connect; `lograte` keeps the
//! transport's own log lines bounded.

pub mod conn;
pub mod dispatch;
pub mod envelope;
pub mod frame;
pub mod limits;
pub mod listen;
pub mod lograte;
pub mod pool;
pub mod reactor;
pub mod table;
#[cfg(test)]
mod tests;
pub mod transport;
pub mod wire;
mod worker;

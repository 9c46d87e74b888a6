//! crust-client: the host's ways into a sandbox. Parse an agent
//! [`Address`], [`connect`] to it (Unix, vsock, or hybrid vsock through a
//! VMM's socket) and call it through the typed [`CrustClient`]; talk to the
//! VM's QEMU through a [`qmp::Qmp`] session, knowing which process serves
//! its socket when that matters ([`Peer`]). crustctl, crustd and crust-vm
//! all connect through here, so every bound is kept once: each connect has
//! a deadline, a hybrid vsock `CONNECT` is never abandoned unanswered, a
//! QMP monitor is read in bounded lines.
//!
//! ```no_run
//! use std::time::Duration;
//! use crust_client::{Address, CrustClient};
//!
//! let addr: Address = "hvsock:///run/vm/vsock.sock:1024".parse()?;
//! let agent = CrustClient::connect(&addr, Duration::from_secs(10))?;
//! println!("{}", agent.get_agent_info()?.version);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod address;
mod client;
mod connect;
mod connect_error;
mod hvsock;
mod peer;
pub mod qmp;
pub mod unary;

pub use address::{Address, AddressError, VSOCK_CID_ANY};
pub use client::{code_name, deadline_for_wait, CallError, Code, CrustClient};
pub use connect::{
    connect, connect_opened, connect_stream, connect_stream_until, connect_until, ConnectError,
};
pub use crust_protocols::{crust as proto, protobuf, rpc::Rpc, ttrpc};
pub use hvsock::{settle, unanswered};
pub use peer::{peer_pid, Peer};

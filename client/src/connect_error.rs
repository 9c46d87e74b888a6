//! Why no connection to a sandbox could be made: the one error of every
//! way in (a unix socket, AF_VSOCK, the hybrid vsock handshake), shared by
//! `connect` and `hvsock`.

use std::{io, path::PathBuf, time::Duration};

use thiserror::Error;

use crate::address::AddressError;

/// Why no connection to the agent could be made.
#[derive(Debug, Error)]
pub enum ConnectError {
    #[error(transparent)]
    Address(#[from] AddressError),
    #[error("cannot connect to {addr}: {source}; is the agent, or the VM's vsock backend, running there?")]
    Unreachable { addr: String, source: io::Error },
    #[error("connecting to {addr} timed out after {}: the agent did not accept the connection", secs(*.timeout))]
    TimedOut { addr: String, timeout: Duration },
    #[error("hybrid vsock handshake with {} failed: the backend {reply} instead of OK (is the guest agent listening on port {port}?)", .path.display())]
    Handshake {
        path: PathBuf,
        port: u32,
        reply: String,
    },
    #[error("hybrid vsock handshake with {} timed out after {}: the backend did not answer CONNECT {port} (is the guest agent listening on port {port}?)", .path.display(), secs(*.timeout))]
    HandshakeTimedOut {
        path: PathBuf,
        port: u32,
        timeout: Duration,
    },
    #[error("{waiting} earlier connections to the hybrid vsock backend {} are still unanswered (CONNECT {port}): its guest is not accepting (hung, paused, or the backend lost the VM's vsock); not asking again until one is answered", .path.display())]
    Unanswered {
        path: PathBuf,
        port: u32,
        waiting: usize,
    },
    #[error("stopped waiting for the hybrid vsock backend {} to answer CONNECT {port}: the caller gave up on it (has its VM stopped?)", .path.display())]
    HandshakeGivenUp { path: PathBuf, port: u32 },
    #[error("{call} failed while connecting to {addr}: {source}")]
    Io {
        call: &'static str,
        addr: String,
        source: io::Error,
    },
    #[error("cannot set up the ttrpc client on the connection to {addr}: {detail}")]
    Ttrpc { addr: String, detail: String },
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

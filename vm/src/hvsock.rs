//! The host end of hybrid vsock (Firecracker, Cloud Hypervisor, vhost-device-vsock):
//! connect to the Unix socket, send `CONNECT <port>\n`, read `OK <n>\n`; the
//! stream is then the guest's port. Also a ttrpc `AgentClient` over it.

use std::io::{self, Read, Write};
use std::os::unix::io::IntoRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crust_protocols::crust_ttrpc::AgentClient;

/// Connects to guest port `port` through the hybrid-vsock socket `uds`.
/// Fails when the backend refuses or the guest has nobody listening (the
/// backend then closes the stream instead of answering `OK`).
pub fn connect(uds: &Path, port: u32, timeout: Duration) -> io::Result<UnixStream> {
    let mut s = UnixStream::connect(uds)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    // Byte by byte: whatever follows the newline belongs to the guest's stream.
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < 64 {
        match s.read(&mut b)? {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!(
                        "{} closed the stream: nothing listens on guest port {port} yet",
                        uds.display()
                    ),
                ))
            }
            _ if b[0] == b'\n' => break,
            _ => line.push(b[0]),
        }
    }
    let line = String::from_utf8_lossy(&line);
    if !line.starts_with("OK ") {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "{} answered {line:?} to CONNECT {port}, not OK",
                uds.display()
            ),
        ));
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok(s)
}

/// A ttrpc client for the agent on guest port `port` behind `uds`.
pub fn agent_client(uds: &Path, port: u32, timeout: Duration) -> io::Result<AgentClient> {
    let s = connect(uds, port, timeout)?;
    let client = crust_protocols::ttrpc::Client::new(s.into_raw_fd())
        .map_err(|e| io::Error::other(format!("ttrpc client: {e}")))?;
    Ok(AgentClient::new(client))
}

/// A ttrpc context that gives up after `d`.
pub fn ctx(d: Duration) -> crust_protocols::ttrpc::context::Context {
    crust_protocols::ttrpc::context::with_timeout(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

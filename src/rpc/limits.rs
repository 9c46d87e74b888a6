//! Every bound the transport keeps, whatever clients do (api.md §2.1).

use std::time::Duration;

/// Every bound the transport keeps, whatever clients do.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections open at once. At the limit a new connection closes the
    /// longest-idle one; if every connection is busy it is refused.
    pub max_connections: usize,
    /// Worker threads running requests.
    pub workers: usize,
    /// Extra workers that run only the quick methods.
    pub quick_workers: usize,
    /// Requests waiting for a worker; past it, RESOURCE_EXHAUSTED — except
    /// for a connection's only request, which always waits its turn (so the
    /// excess is bounded by the connections). Served round-robin by connection.
    pub queue: usize,
    /// The same for the quick methods' own queue.
    pub quick_queue: usize,
    /// Requests of one connection queued or running: past it the agent
    /// stops reading that connection until answers go out (back-pressure,
    /// not refusal: a pipelining client is slowed, not failed).
    pub in_flight_per_connection: usize,
    /// The largest request payload; a larger frame is answered
    /// RESOURCE_EXHAUSTED and its bytes discarded unread.
    pub max_request: usize,
    /// Pending answers of one connection above which its requests are no
    /// longer read.
    pub out_pause: usize,
    /// Pending answers of one connection above which it is closed.
    pub out_max: usize,
    /// How long a frame may stay half-received.
    pub frame_timeout: Duration,
    /// How long pending answers may go unread before the connection closes.
    pub stall_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 1024,
            workers: 16,
            quick_workers: 2,
            queue: 256,
            quick_queue: 64,
            in_flight_per_connection: 32,
            max_request: 64 << 10,
            out_pause: 64 << 10,
            out_max: 1 << 20,
            frame_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Descriptors kept free for the agent's own work (disks, mounts, the
/// ownership walk's directories) beyond one per connection.
pub(crate) const FD_RESERVE: u64 = 512;

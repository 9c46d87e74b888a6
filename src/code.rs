//! The error classes of the wire contract (api.md §2): every error the agent
//! answers says one of these. The bottom of the house: it imports nothing,
//! and every capability names its own errors' codes with it.

/// The error classes of the wire contract (api.md §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// A malformed request.
    InvalidArgument,
    /// The volume or subpath does not exist.
    NotFound,
    /// The id or target is taken by something with other parameters.
    AlreadyExists,
    /// The system is not in a state where the request can be honoured.
    FailedPrecondition,
    /// The device did not appear in time.
    DeadlineExceeded,
    /// The requested size is beyond the device.
    OutOfRange,
    /// An unexpected syscall failure.
    Internal,
    /// The operation is not implemented by this agent.
    Unimplemented,
    /// The caller went away; the work was stopped.
    Cancelled,
    /// A bound of the agent was reached (connections, requests in flight, request size).
    ResourceExhausted,
}

impl Code {
    /// The canonical upper-case name, as gRPC and `crustctl` print it.
    pub fn name(self) -> &'static str {
        match self {
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Internal => "INTERNAL",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Cancelled => "CANCELLED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        }
    }
}

//! The error classes of the wire contract (api.md §2): every error the agent
//! answers says one of these. The bottom of the house: it imports nothing of
//! the agent's, and every capability names its own errors' codes with it.
//! The table itself (numbers and names) is crust-protocols', the one the
//! host crates read the agent's answers with.

/// The gRPC status codes. The agent answers INVALID_ARGUMENT, NOT_FOUND,
/// ALREADY_EXISTS, FAILED_PRECONDITION, DEADLINE_EXCEEDED, OUT_OF_RANGE,
/// INTERNAL, UNIMPLEMENTED, CANCELLED and RESOURCE_EXHAUSTED (api.md §2).
pub use crust_protocols::code::Code;

/// The error enums of every capability say their codes with crust-protocols'
/// macro, the one crustd's modules use too.
pub(crate) use crust_protocols::coded_errors;

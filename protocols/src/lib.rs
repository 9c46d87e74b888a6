//! crust.v1, the wire contract of crust-agent: protobuf messages and the
//! ttrpc `Agent` service, generated from `crust.proto` at build time; and
//! [`names`], the rules for the names the contracts carry (a disk's serial,
//! a sandbox's id), [`code`], the gRPC status codes, and [`options`], the
//! mount option table, each written once for the agent and the host crates.

pub mod code;
pub mod names;
pub mod options;

/// The generated code, with the lints it was not written for turned off once.
#[allow(
    clippy::all,
    unused_imports,
    unused_qualifications,
    missing_docs,
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unused_mut,
    unused_results
)]
mod generated {
    pub mod crust {
        include!(concat!(env!("OUT_DIR"), "/gen/crust.rs"));
    }
    pub mod crust_ttrpc {
        include!(concat!(env!("OUT_DIR"), "/gen/crust_ttrpc.rs"));
    }
}

pub use generated::{crust, crust_ttrpc};
pub use protobuf;
pub use ttrpc;

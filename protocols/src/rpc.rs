//! The methods of crust.v1's `Agent` service as types, generated from
//! crust.proto's `service Agent` (build.rs): each request message names its
//! method and the message it answers with ([`Rpc`]), and [`METHODS`] lists
//! them in the contract's order. A server or client written against these
//! needs no list of methods of its own, and a method added to crust.proto
//! reaches it through the types.
//!
//! Each method takes a request message of its own (crust.proto's rule): a
//! message shared by two methods would be two impls of [`Rpc`] for one type,
//! which does not compile.

use ttrpc::context::Context;

use crate::crust_ttrpc::AgentClient;

/// A request message of the `Agent` service: the method it calls.
pub trait Rpc: protobuf::Message {
    /// The method's name, as a ttrpc request names it ("PublishVolume").
    /// (`NAME` is protobuf's: the message's own name.)
    const METHOD: &'static str;
    /// The message the method answers with.
    type Response: protobuf::Message;
    /// Calls the method through ttrpc's generated client.
    fn call(client: &AgentClient, ctx: Context, req: &Self) -> ttrpc::Result<Self::Response>;
}

include!(concat!(env!("OUT_DIR"), "/gen/agent_rpc.rs"));

/// Whether two method names are the same: `==` in a `const`, where a
/// server holds its table of methods to its .proto's list when it
/// compiles (the agent's to crust.proto's, crustd's to crust_runtime.proto's).
pub const fn same_method(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crust as pb;
    use crate::crust_ttrpc;
    use std::sync::Arc;

    /// The generated list names exactly the methods ttrpc serves, in the
    /// contract's order, and each request type names its own method.
    #[test]
    fn the_list_is_the_services() {
        struct Nothing;
        impl crust_ttrpc::Agent for Nothing {}
        let mut served: Vec<String> = crust_ttrpc::create_agent(Arc::new(Nothing))
            .into_keys()
            .collect();
        served.sort();
        let mut listed: Vec<String> = METHODS
            .iter()
            .map(|m| format!("/crust.v1.Agent/{m}"))
            .collect();
        listed.sort();
        assert_eq!(listed, served);
        assert_eq!(METHODS[0], "GetCapabilities");
        assert_eq!(<pb::PublishVolumeRequest as Rpc>::METHOD, "PublishVolume");
        assert_eq!(<pb::GetVolumeHealthRequest as Rpc>::METHOD, METHODS[14]);
    }
}

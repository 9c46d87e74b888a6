//! Generates the crust.runtime.v1alpha1 messages and the tonic server stubs
//! from protocols/crust_runtime.proto at build time. The .proto is parsed by
//! protox (pure Rust), so no protoc is needed on the build machine. From
//! the same parse, the service's methods in the contract's order
//! (`runtime_methods.rs`), which crustd's one list of methods is held to.

use std::path::Path;

fn main() {
    let proto = "../protocols/crust_runtime.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds =
        protox::compile([proto], ["../protocols"]).expect("protox parses crust_runtime.proto");
    let service = fds
        .file
        .iter()
        .flat_map(|f| &f.service)
        .find(|s| s.name() == "RuntimeAssistedStorageManagement")
        .expect("crust_runtime.proto has service RuntimeAssistedStorageManagement");
    let names: Vec<String> = service
        .method
        .iter()
        .map(|m| format!("{:?}", m.name()))
        .collect();
    let methods = format!(
        "/// Every method of the CRUST service, in crust_runtime.proto's order.\n\
         pub const CONTRACT: [&str; {}] = [{}];\n",
        names.len(),
        names.join(", ")
    );
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    std::fs::write(Path::new(&out).join("runtime_methods.rs"), methods)
        .expect("write runtime_methods.rs");
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_fds(fds)
        .expect("tonic-prost-build generates the server stubs");
}

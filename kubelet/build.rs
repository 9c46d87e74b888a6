//! Generates the crust.runtime.v1alpha1 messages and the tonic client stubs (independently of crustd, which generates its server half)
//! from protocols/crust_runtime.proto at build time. The .proto is parsed by
//! protox (pure Rust), so no protoc is needed on the build machine.

fn main() {
    let proto = "../protocols/crust_runtime.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds =
        protox::compile([proto], ["../protocols"]).expect("protox parses crust_runtime.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)
        .expect("tonic-prost-build generates the client stubs");
}

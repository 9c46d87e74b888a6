//! Generates the crust.v1 messages and ttrpc stubs from crust.proto at build
//! time with the pure-Rust protobuf parser, so no protoc is needed.
//! The generated files start with inner attributes and `//!` comments, which
//! cannot be `include!`d inside a module: they are dropped here.

use std::{fs, path::Path};

fn main() {
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let gen = Path::new(&out).join("gen");
    fs::create_dir_all(&gen).expect("create OUT_DIR/gen");
    println!("cargo:rerun-if-changed=crust.proto");
    ttrpc_codegen::Codegen::new()
        .out_dir(&gen)
        .inputs(["crust.proto"])
        .include(".")
        .rust_protobuf()
        .customize(ttrpc_codegen::Customize {
            ..Default::default()
        })
        .rust_protobuf_customize(ttrpc_codegen::ProtobufCustomize::default().gen_mod_rs(false))
        .run()
        .expect("ttrpc-codegen failed on crust.proto");
    for name in ["crust.rs", "crust_ttrpc.rs"] {
        let path = gen.join(name);
        let text = fs::read_to_string(&path).expect("read generated file");
        let kept: String = text
            .lines()
            .filter(|l| !l.starts_with("#![") && !l.starts_with("//!"))
            .map(|l| format!("{l}\n"))
            .collect();
        fs::write(&path, kept).expect("rewrite generated file");
    }
}

//! Generates the crust.v1 messages and ttrpc stubs from crust.proto, and the
//! Confidential Data Hub's GetResource from cdh.proto, at build time with
//! the pure-Rust protobuf parser, so no protoc is needed; and, from the same
//! parse, the `Agent` service's methods as types (`rpc.rs`: each request
//! message names its method and its answer), so that no program serving or
//! calling the service lists its methods by hand, and the names a ttrpc
//! request to the CDH carries (`cdh_rpc.rs`), so that they are the .proto's.
//! The generated files start with inner attributes and `//!` comments, which
//! cannot be `include!`d inside a module: they are dropped here.

use std::fmt::Write as _;
use std::{fs, path::Path};

fn main() {
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let gen = Path::new(&out).join("gen");
    fs::create_dir_all(&gen).expect("create OUT_DIR/gen");
    println!("cargo:rerun-if-changed=crust.proto");
    println!("cargo:rerun-if-changed=cdh.proto");
    ttrpc_codegen::Codegen::new()
        .out_dir(&gen)
        .inputs(["crust.proto", "cdh.proto"])
        .include(".")
        .rust_protobuf()
        .customize(ttrpc_codegen::Customize {
            ..Default::default()
        })
        .rust_protobuf_customize(ttrpc_codegen::ProtobufCustomize::default().gen_mod_rs(false))
        .run()
        .expect("ttrpc-codegen failed on crust.proto or cdh.proto");
    for name in ["crust.rs", "crust_ttrpc.rs", "cdh.rs", "cdh_ttrpc.rs"] {
        let path = gen.join(name);
        let text = fs::read_to_string(&path).expect("read generated file");
        let kept: String = text
            .lines()
            .filter(|l| !l.starts_with("#![") && !l.starts_with("//!"))
            .map(|l| format!("{l}\n"))
            .collect();
        fs::write(&path, kept).expect("rewrite generated file");
    }
    fs::write(gen.join("agent_rpc.rs"), agent_rpc()).expect("write agent_rpc.rs");
    fs::write(gen.join("cdh_rpc.rs"), cdh_rpc()).expect("write cdh_rpc.rs");
}

/// The names a ttrpc request for cdh.proto's one method carries: its
/// service (`package.Service`) and its method, as ttrpc-codegen's client
/// writes them.
fn cdh_rpc() -> String {
    let parsed = protobuf_parse::Parser::new()
        .pure()
        .include(".")
        .input("cdh.proto")
        .parse_and_typecheck()
        .expect("cdh.proto does not parse");
    let file = parsed
        .file_descriptors
        .iter()
        .find(|f| f.name() == "cdh.proto")
        .expect("cdh.proto is parsed");
    let [service] = &file.service[..] else {
        panic!("cdh.proto declares one service");
    };
    let [method] = &service.method[..] else {
        panic!("cdh.proto's service declares one method");
    };
    format!(
        "/// The service a GetResource request names (`package.Service`).\n\
         pub const SERVICE: &str = {:?};\n\n\
         /// The method a GetResource request names.\n\
         pub const METHOD: &str = {:?};\n",
        format!("{}.{}", file.package(), service.name()),
        method.name(),
    )
}

/// The `Agent` service's methods, from crust.proto: the list of their
/// names in its order, and an `Rpc` impl for each request message.
fn agent_rpc() -> String {
    let parsed = protobuf_parse::Parser::new()
        .pure()
        .include(".")
        .input("crust.proto")
        .parse_and_typecheck()
        .expect("crust.proto does not parse");
    let file = parsed
        .file_descriptors
        .iter()
        .find(|f| f.name() == "crust.proto")
        .expect("crust.proto is parsed");
    let package = format!(".{}.", file.package());
    let service = file
        .service
        .iter()
        .find(|s| s.name() == "Agent")
        .expect("crust.proto has service Agent");
    let message = |t: &str| -> String {
        t.strip_prefix(&package)
            .unwrap_or_else(|| panic!("{t} is not a message of crust.proto's own package"))
            .to_string()
    };
    let mut names = String::new();
    let mut impls = String::new();
    for m in &service.method {
        let (name, req, resp) = (m.name(), message(m.input_type()), message(m.output_type()));
        write!(names, "{name:?}, ").expect("a String takes writes");
        write!(
            impls,
            "impl Rpc for crate::crust::{req} {{\n    const METHOD: &'static str = {name:?};\n    \
             type Response = crate::crust::{resp};\n    \
             fn call(client: &AgentClient, ctx: Context, req: &Self) -> ttrpc::Result<Self::Response> {{\n        \
             client.{snake}(ctx, req)\n    }}\n}}\n\n",
            snake = snake_case(name),
        )
        .expect("a String takes writes");
    }
    format!(
        "/// Every method of the `Agent` service, in crust.proto's order.\n\
         pub const METHODS: [&str; {}] = [{names}];\n\n{impls}",
        service.method.len()
    )
}

/// `GetVolumeStats` → `get_volume_stats`, as ttrpc-codegen names the
/// client's methods (a name it spells otherwise fails to compile).
fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

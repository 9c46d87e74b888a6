//! crust.v1, the wire contract of crust-agent: protobuf messages and the
//! ttrpc `Agent` service, generated from `crust.proto` at build time; and
//! [`rpc`], the service's methods as types (its one list of methods, made
//! from the .proto too); [`names`], the rules for the names the contracts
//! carry (a disk's serial, a sandbox's id), [`code`], the gRPC status codes,
//! [`options`], the mount option table, [`labels`], what a disk's bytes say
//! it holds (for the rules that a disk is blank), [`key_uri`], how a volume
//! key is named by reference (`file:///`, `kbs:///`), and [`sync`], locks that
//! outlive a panic, each written once for the agent and the host crates;
//! and [`cdh`], the one method of the Confidential Data Hub the agent calls
//! (cdh.proto).

pub mod code;
pub mod key_uri;
pub mod labels;
pub mod names;
pub mod options;
pub mod rpc;
pub mod sync;

/// The vsock port the agent listens on by default, and the port the host
/// programs (crust-vm, crustctl, crustd) assume when an address names none.
///
/// 2857, after KEP-2857 (CRUST). Chosen to collide with no other guest
/// agent, so both can run in one guest: not 1024 (kata-agent's
/// `DEFAULT_AGENT_VSOCK_PORT`, and Apple's vminitd, `Vminitd.port`), 1025
/// (nerdbox's vminitd RPC port under libkrun, and a debug shell in some
/// libkrun sandboxes), 1026 (Kata's debug console, nerdbox's stream port),
/// 10789 (firecracker-containerd's agent), nor 2222 (SSH-over-vsock
/// helpers). microsandbox's agent speaks over a virtio-console port, not
/// vsock.
pub const DEFAULT_PORT: u32 = 2857;

/// The limits of a freeze, the agent's and crustd's alike (one group of
/// volumes, one timeout), written once.
pub mod freeze {
    /// A freeze's timeout when the request names none (0).
    pub const DEFAULT_TIMEOUT_MS: u32 = 60_000;
    /// The longest freeze: a pod's writes wait for all of it.
    pub const MAX_TIMEOUT_MS: u32 = 600_000;
    /// The most volumes one freeze or thaw names.
    pub const MAX_VOLUMES: usize = 64;
    /// The longest freeze id.
    pub const MAX_ID_LEN: usize = 128;
    /// How many ended freezes are remembered, so that a late thaw of one
    /// answers ABORTED with how it ended, not NOT_FOUND.
    pub const ENDED_KEPT: usize = 256;

    /// The rule for a freeze id, a caller's or one made: 1 to
    /// [`MAX_ID_LEN`] bytes of `[A-Za-z0-9._:-]`, starting with a letter
    /// or digit. It names a file of the agent's and crustd's state, and
    /// passes from crustd to the guests unchanged.
    pub fn check_id(id: &str) -> Result<(), String> {
        let ok = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-');
        match id.as_bytes() {
            [] => Err("freeze_id is empty".into()),
            b if b.len() > MAX_ID_LEN => Err(format!(
                "freeze_id is {} bytes long; at most {MAX_ID_LEN}",
                b.len()
            )),
            [first, ..] if !first.is_ascii_alphanumeric() => Err(format!(
                "freeze_id {id:?} must start with a letter or a digit"
            )),
            b if !b.iter().all(|&c| ok(c)) => Err(format!(
                "freeze_id {id:?} may hold only letters, digits and . _ : -"
            )),
            _ => Ok(()),
        }
    }

    /// A new freeze id: `<prefix>-<unix ms>-<16 hex digits of entropy>`, so
    /// that ids never repeat across restarts, processes or machines.
    pub fn new_id(prefix: &str, unix_ms: u64, entropy: u64) -> String {
        format!("{prefix}-{unix_ms}-{entropy:016x}")
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn freeze_ids_follow_one_rule() {
            for good in [
                "a",
                "freeze-1-00ff",
                "velero:backup.2026-11-27_1",
                &"x".repeat(128),
            ] {
                assert_eq!(check_id(good), Ok(()), "{good}");
            }
            for bad in [
                "",
                "-a",
                ".a",
                "a/b",
                "a b",
                "a\n",
                "\u{e9}",
                &"x".repeat(129),
            ] {
                assert!(check_id(bad).is_err(), "{bad:?}");
            }
            let made = new_id("freeze", 1_700_000_000_000, 0xab);
            assert_eq!(made, "freeze-1700000000000-00000000000000ab");
            assert_eq!(check_id(&made), Ok(()));
        }
    }
}

/// The generated code, with the lints it was not written for turned off once.
#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::restriction,
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
    /// The Confidential Data Hub's GetResource messages (cdh.proto), and the
    /// names its ttrpc requests carry.
    pub mod cdh {
        include!(concat!(env!("OUT_DIR"), "/gen/cdh.rs"));
        include!(concat!(env!("OUT_DIR"), "/gen/cdh_rpc.rs"));
    }
    /// Its ttrpc stubs: the stand-in CDH of the agent's tests serves them.
    pub mod cdh_ttrpc {
        include!(concat!(env!("OUT_DIR"), "/gen/cdh_ttrpc.rs"));
    }
}

pub use generated::{cdh, cdh_ttrpc, crust, crust_ttrpc};
pub use protobuf;
pub use ttrpc;

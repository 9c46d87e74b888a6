//! Fuzz targets for every parser a hostile host or a hostile disk feeds
//! crust-agent and crustd. Each target is a function of arbitrary bytes that
//! panics only on a defect: a panic in the parser, an answer or a record that
//! breaks a promise, or (through [`Bounded`]) an allocation no input of a few
//! kilobytes should cause. A hang is caught by libFuzzer's `-timeout`.
//!
//! The same functions run two ways: coverage-guided under libFuzzer
//! (`fuzz_targets/`, built by `run.sh` with stable rustc's SanitizerCoverage
//! flags), and as `cargo test` over the committed corpus in `corpus/<target>/`
//! (`tests/corpus.rs`), so an input that once found a defect is a regression
//! test for good.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;

pub use crust_agent::fuzz::{
    frames, freeze_record, luks2_header, mount_options, mountinfo, request, state_record,
    superblock, uevent,
};

/// A target: arbitrary bytes in, a panic on a defect.
pub type Target = fn(&[u8]);

/// Every target by name, as `corpus/<name>/` and `fuzz_targets/<name>.rs` are
/// named. A new parser of untrusted bytes gets an entry here, a binary in
/// fuzz_targets/ (and Cargo.toml), a test in tests/corpus.rs and seeds in
/// corpus/ (fuzz/seeds.py).
pub const TARGETS: &[(&str, Target)] = &[
    ("frames", frames),
    ("request", request),
    ("mountinfo", mountinfo),
    ("state_record", state_record),
    ("freeze_record", freeze_record),
    ("uevent", uevent),
    ("superblock", superblock),
    ("luks2_header", luks2_header),
    ("mount_options", mount_options),
    ("sandbox_json", sandbox_json),
    ("crustd_json", crustd_json),
    ("direct_volume", direct_volume),
];

/// A sandbox's `sandbox.json`, written by whoever starts the VM and read by
/// crustd on every call. What it accepts must name an agent address that
/// reads back the same when shown.
pub fn sandbox_json(data: &[u8]) {
    let dir = Path::new("/run/crust/sandboxes/pod-1");
    if let Ok((_qmp, agent)) = crustd::registry::parse(dir, data) {
        let shown = agent.to_string();
        let back: crust_client::Address = shown
            .parse()
            .unwrap_or_else(|e| panic!("the accepted address {shown:?} does not parse: {e}"));
        assert_eq!(back, agent, "{shown:?}");
    }
}

/// crustd's own record of a sandbox, `crustd.json`: a host with access to
/// the sandbox directory can write it. One that decodes must encode to a
/// record that decodes the same, since crustd rewrites it on every step.
pub fn crustd_json(data: &[u8]) {
    let Ok(state) = serde_json::from_slice::<crustd::state::State>(data) else {
        return;
    };
    let text = serde_json::to_vec_pretty(&state).expect("a decoded state encodes");
    let back: crustd::state::State = serde_json::from_slice(&text).unwrap_or_else(|e| {
        panic!(
            "crustd's own encoding does not decode ({e}): {}",
            String::from_utf8_lossy(&text)
        )
    });
    assert_eq!(back, state);
}

/// A Kata direct-volume record (`mountInfo.json`), filed by a CSI driver and
/// naming a host block device: what crustd accepts must name an absolute
/// device, a filesystem it mounts, a group id in range and options the
/// agent's table accepts, and a key only by a reference the agent takes;
/// what it refuses, it refuses as the caller's fault (INVALID_ARGUMENT, or
/// UNIMPLEMENTED for a key the agent cannot fetch: Kata's "ephemeral", a
/// sealed secret). The volume path's directory name (Go's
/// base64.URLEncoding) is checked on the side.
pub fn direct_volume(data: &[u8]) {
    use crustd::direct::{parse_record, RecordError, MAX_FS_GROUP};
    match parse_record(data) {
        Ok(r) => {
            assert!(
                r.device.starts_with('/') && !r.device.contains('\0'),
                "{r:?}"
            );
            assert!(["ext4", "xfs"].contains(&r.fstype.as_str()), "{r:?}");
            assert!(
                ["directvol", "block"].contains(&r.volume_type.as_str()),
                "{r:?}"
            );
            assert!(r.fs_group.is_none_or(|g| g <= MAX_FS_GROUP), "{r:?}");
            crust_agent::mount::options::parse_options(&r.options, false)
                .unwrap_or_else(|e| panic!("options the agent refuses were accepted: {e}"));
            if let Some(k) = &r.key_uri {
                crust_agent::keys::source::KeySource::from_request(Some(
                    crust_agent::keys::source::RequestKey::Uri(k.clone()),
                ))
                .unwrap_or_else(|e| panic!("a key URI the agent refuses was accepted: {e}"));
            }
        }
        Err(RecordError::Ephemeral | RecordError::Sealed) => {}
        Err(e) => assert_eq!(e.code(), crustd::error::Code::InvalidArgument, "{e}"),
    }
    let name = crustd::direct::encode(data);
    assert_eq!(name.len(), data.len().div_ceil(3) * 4);
    assert!(name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_=".contains(&b)));
}

/// The largest single allocation a target may make. The inputs are a few
/// kilobytes (a superblock region: 68 KiB), and a LUKS2 header reads at
/// most 4 MiB; a parser that asks for more than this is trusting a length
/// it read.
pub const MAX_ALLOCATION: usize = 32 << 20;

/// The system allocator, aborting on any allocation over [`MAX_ALLOCATION`]:
/// libFuzzer sees the abort as a crash and keeps the input. (libFuzzer's own
/// `-malloc_limit_mb` needs a sanitizer's allocator, which stable rustc does
/// not link.)
pub struct Bounded;

impl Bounded {
    fn check(size: usize) {
        if size > MAX_ALLOCATION {
            let msg =
                b"crust-fuzz: an allocation of more than 32 MiB (a length taken from the input?)\n";
            // SAFETY: writes a static buffer to stderr; nothing is allocated
            // inside the allocator, and the process ends just after.
            unsafe {
                libc::write(2, msg.as_ptr().cast(), msg.len());
            }
            std::process::abort();
        }
    }
}

// SAFETY: every call is passed to `System` unchanged; `check` only reads the
// size and may end the process.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Bounded::check(layout.size());
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Bounded::check(layout.size());
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Bounded::check(new_size);
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

//! Every input in `corpus/<target>/` through its target, as plain tests: the
//! seeds, and every input that once found a defect, stay regression tests
//! whether or not libFuzzer is at hand. An allocation over the bound aborts
//! the whole binary (the allocator cannot unwind); `run.sh` on the corpus
//! then names the input.

use std::path::{Path, PathBuf};

use crust_fuzz::TARGETS;

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

fn corpus(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(name)
}

fn replay(name: &str) {
    let target = TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no target {name}"))
        .1;
    let dir = corpus(name);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no inputs in {}", dir.display());
    let mut failed = Vec::new();
    for f in &files {
        let data = std::fs::read(f).unwrap();
        if std::panic::catch_unwind(|| target(&data)).is_err() {
            failed.push(f.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} inputs of {name} failed: {failed:#?}",
        failed.len(),
        files.len()
    );
}

#[test]
fn freeze_record() {
    replay("freeze_record");
}

#[test]
fn frames() {
    replay("frames");
}

#[test]
fn request() {
    replay("request");
}

#[test]
fn mountinfo() {
    replay("mountinfo");
}

#[test]
fn state_record() {
    replay("state_record");
}

#[test]
fn uevent() {
    replay("uevent");
}

#[test]
fn superblock() {
    replay("superblock");
}

#[test]
fn luks2_header() {
    replay("luks2_header");
}

#[test]
fn mount_options() {
    replay("mount_options");
}

#[test]
fn sandbox_json() {
    replay("sandbox_json");
}

#[test]
fn crustd_json() {
    replay("crustd_json");
}

#[test]
fn direct_volume() {
    replay("direct_volume");
}

/// Each target has its libFuzzer binary, its corpus and its test above (the
/// list of tests is checked against this file's own text).
#[test]
fn every_target_is_wired() {
    let here = include_str!("corpus.rs");
    for (name, _) in TARGETS {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz_targets")
            .join(format!("{name}.rs"));
        assert!(bin.is_file(), "{} is missing", bin.display());
        assert!(corpus(name).is_dir(), "corpus/{name}/ is missing");
        assert!(
            here.contains(&format!("replay(\"{name}\")")),
            "tests/corpus.rs does not replay {name}"
        );
    }
}

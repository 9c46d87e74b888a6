//! Programs of this workspace that a test runs but cargo does not build for
//! it (cargo builds a package's programs for that package's tests only):
//! built here with the test's own profile, into the same target directory.

use std::path::PathBuf;
use std::process::Command;

use crate::disks::succeeded;

/// The directory of this test's profile: `<target>[/<triple>]/<profile>`,
/// from the test binary's `…/<profile>/deps/<test>`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent().unwrap().to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// `cargo build -p <package> <what…>` with the test's profile. The nested
/// cargo finds the target directory as the outer one did
/// (CARGO_TARGET_DIR, the workspace's config).
#[track_caller]
pub fn cargo_build(package: &str, what: &[&str]) {
    let profile = match profile_dir().file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "-p", package])
        .args(what)
        .args(["--profile", &profile])
        .output()
        .unwrap_or_else(|e| panic!("cargo build -p {package}: {e}"));
    succeeded(
        &out,
        format_args!("cargo build -p {package} {}", what.join(" ")),
    );
}

//! `crustd-ctl`: see `crustd::ctl` (what it does lives in the library, so
//! tests drive the same code).

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let out = crustd::ctl::run_cli(std::env::args_os());
    let _ = std::io::stdout().write_all(out.stdout.as_bytes());
    let _ = std::io::stderr().write_all(out.stderr.as_bytes());
    ExitCode::from(out.code)
}

//! The allocator the targets run under ends the process on an allocation
//! over the bound, where libFuzzer sees it as a crash (and keeps the input).

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

#[test]
fn an_allocation_over_the_bound_aborts() {
    if let Some(n) = std::env::var_os("CRUST_FUZZ_ALLOCATE") {
        let n: usize = n.to_str().unwrap().parse().unwrap();
        let v: Vec<u8> = Vec::with_capacity(n);
        std::hint::black_box(&v);
        return;
    }
    let run = |n: usize| {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "an_allocation_over_the_bound_aborts",
                "--exact",
                "--nocapture",
            ])
            .env("CRUST_FUZZ_ALLOCATE", n.to_string())
            .output()
            .unwrap()
    };
    let at = run(crust_fuzz::MAX_ALLOCATION);
    assert!(at.status.success(), "{at:?}");
    let over = run(crust_fuzz::MAX_ALLOCATION + 1);
    assert_eq!(over.status.signal(), Some(libc::SIGABRT), "{over:?}");
    let err = String::from_utf8_lossy(&over.stderr);
    assert!(err.contains("more than 32 MiB"), "{err}");
}

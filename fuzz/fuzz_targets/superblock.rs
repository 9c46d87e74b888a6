//! libFuzzer's entry for the `superblock` target (crust_fuzz::superblock says what it checks).
#![no_main]

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| crust_fuzz::superblock(data));

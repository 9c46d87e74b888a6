//! libFuzzer's entry for the `mount_options` target (crust_fuzz::mount_options says what it checks).
#![no_main]

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| crust_fuzz::mount_options(data));

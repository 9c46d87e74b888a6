//! libFuzzer's entry for the `direct_volume` target (crust_fuzz::direct_volume says what it checks).
#![no_main]

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| crust_fuzz::direct_volume(data));

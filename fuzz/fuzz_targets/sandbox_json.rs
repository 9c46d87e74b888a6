//! libFuzzer's entry for the `sandbox_json` target (crust_fuzz::sandbox_json says what it checks).
#![no_main]

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| crust_fuzz::sandbox_json(data));

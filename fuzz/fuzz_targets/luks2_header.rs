//! libFuzzer's entry for the `luks2_header` target (crust_fuzz::luks2_header says what it checks).
#![no_main]

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| crust_fuzz::luks2_header(data));

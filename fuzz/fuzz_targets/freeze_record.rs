//! libFuzzer's entry for the `freeze_record` target (crust_fuzz::freeze_record says what it checks).
#![no_main]

#[global_allocator]
static ALLOC: crust_fuzz::Bounded = crust_fuzz::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| crust_fuzz::freeze_record(data));

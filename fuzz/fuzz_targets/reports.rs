#![no_main]
//! See `kvroute_fuzz::reports`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::reports::run(data));

#![no_main]
//! See `kvroute_fuzz::route`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::route::run(data));

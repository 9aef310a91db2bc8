#![no_main]
//! See `kvroute_fuzz::metrics`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::metrics::run(data));

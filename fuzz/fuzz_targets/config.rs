#![no_main]
//! See `kvroute_fuzz::config`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::config::run(data));

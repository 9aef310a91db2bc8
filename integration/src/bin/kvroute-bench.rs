//! `kvroute-bench`: see `kvroute_integration::bench`.

use clap::Parser;
use kvroute_integration::bench::{run, BenchArgs};

fn main() {
    let args = BenchArgs::parse();
    if let Err(e) = run(&args) {
        eprintln!("kvroute-bench: {e}");
        std::process::exit(1);
    }
}

//! `kvroute-replay`: replays a request trace against kvroute's routing core
//! and simulated pods, offline. See `kvroute_integration::replay`.

use clap::Parser;
use kvroute_integration::replay::{run, ReplayArgs};

fn main() {
    let args = ReplayArgs::parse();
    let stdout = std::io::stdout();
    if let Err(e) = run(&args, &mut stdout.lock()) {
        eprintln!("kvroute-replay: {e}");
        std::process::exit(1);
    }
}

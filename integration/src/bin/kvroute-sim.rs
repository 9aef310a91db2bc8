//! `kvroute-sim`: a simulated vLLM pod (see `kvroute_integration::sim`).

use clap::Parser;
use kvroute_integration::sim::{run, SimOptions};

#[tokio::main]
async fn main() {
    let options = SimOptions::parse();
    if let Err(e) = run(options).await {
        eprintln!("kvroute-sim: {e}");
        std::process::exit(2);
    }
}

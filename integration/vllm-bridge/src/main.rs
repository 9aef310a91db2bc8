//! `kvroute-vllm-bridge`: see the library's documentation.

use clap::Parser;
use kvroute_vllm_bridge::{start, Options};

#[tokio::main]
async fn main() {
    let options = Options::parse();
    let running = match start(options.clone()).await {
        Ok(running) => running,
        Err(e) => {
            eprintln!("kvroute-vllm-bridge: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "kvroute-vllm-bridge {} listening on {}, following {}",
        options.pod_id, running.addr, options.events
    );
    let _ = tokio::signal::ctrl_c().await;
}

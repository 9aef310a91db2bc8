//! Target `metrics`: vLLM `/metrics` pages through
//! [`parse_vllm_metrics`], on any bytes read as text (lossily, so invalid
//! UTF-8 still reaches the parser). A parsed page's running adapters are
//! non-empty names without commas, and `max_lora` comes with them.

use kvroute::report::parse_vllm_metrics;

pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(metrics) = parse_vllm_metrics(&text) else {
        return;
    };
    let adapters = metrics.running_adapters.as_deref().unwrap_or_default();
    assert!(adapters.iter().all(|a| !a.is_empty() && !a.contains(',')));
    assert!(metrics.max_lora.is_none() || metrics.running_adapters.is_some());
}

//! The floor of a body-routing wasm filter, `kvroute-bench overhead`'s
//! reference. It does only what any filter that routes on the request body
//! must do in Envoy: pause at the request headers, let Envoy buffer the
//! body, copy the body into the VM, set one routing header and resume. It
//! does none of kvroute's work (parsing, hashing, lookups, scoring,
//! in-flight accounting, metrics, logs, response callbacks). So Envoy with
//! this filter against plain Envoy is the cost no such filter avoids, and
//! kvroute against this filter is kvroute's own.
//!
//! Built for wasm32 only (`make wasm-floor`); on the host the crate is
//! empty.
#![cfg(target_arch = "wasm32")]

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Floor));
}}

/// The root context: one per VM, also the bootstrap singleton's, which
/// does nothing.
struct Floor;

impl Context for Floor {}

impl RootContext for Floor {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request;

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        // Pausing here (Envoy's `allow_on_headers_stop_iteration`) holds
        // the request until its body is in.
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            // Envoy buffers the body until its end.
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        // A router's one decision header, set before resuming.
        self.set_http_request_header("x-floor-body-bytes", Some(&body.len().to_string()));
        Action::Continue
    }
}

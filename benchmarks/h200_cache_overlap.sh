#!/usr/bin/env bash
# Knob embedding_cache_overlap on one GPU: checked, profiled and timed against the same configuration without it.
# Everything lands in $OUT.
#
# 1. gpu_tests.txt: the GPU tests of the caches, the store (overlap trains bitwise as without it) and overlap itself.
# 2. profile_{plain,overlap}.txt: `sg-opt profile` of BASE (a best_config.toml), without and with the knob.
# 3. bench_vs.txt: `sg-opt bench --vs`, BASE with the knob against BASE, BLOCKS interleaved blocks a side.
# PARTS picks and orders them (default "tests profile bench").
# Usage: OUT=/dir [BASE=docs/results/.../best_config.toml] [SIZE=large-cached] [BLOCKS=10] [PARTS=...] \
#        bash benchmarks/h200_cache_overlap.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-overlap}; SIZE=${SIZE:-large-cached}; BLOCKS=${BLOCKS:-10}
BASE=${BASE:-docs/results/2026-12-02-h200-large-cached-s20/best_config.toml}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
WITH="$OUT/with_overlap.toml"
{ cat "$BASE"; echo "embedding_cache_overlap = true"; } > "$WITH"

tests() {
    echo "== 1. GPU tests"
    timeout 300 python3 -m pytest -p no:cacheprovider -q tests/haste_rec/test_cache.py tests/haste_rec/test_embeddings.py \
        tests/haste_rec/test_cache_overlap.py > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
}

profile() {
    echo "== 2. profiles"
    for side in plain overlap; do
        config=$BASE; [ $side = overlap ] && config=$WITH
        timeout 200 python3 -m sg_opt.cli profile --size "$SIZE" --device cuda --config "$config" --steps 10 \
            --trace "$OUT/trace_$side.json" > "$OUT/profile_$side.txt" 2>&1
        head -3 "$OUT/profile_$side.txt"; gzip -f "$OUT/trace_$side.json"
    done
}

bench() {
    echo "== 3. bench --vs"
    timeout 400 python3 -m sg_opt.cli bench --size "$SIZE" --device cuda --config "$WITH" --vs "$BASE" \
        --blocks "$BLOCKS" > "$OUT/bench_vs.txt" 2>&1
    tail -15 "$OUT/bench_vs.txt"
}

for part in ${PARTS:-tests profile bench}; do "$part"; done

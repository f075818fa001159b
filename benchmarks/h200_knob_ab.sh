#!/usr/bin/env bash
# One knob on one GPU: checked, profiled and timed against the same configuration without it.
# Everything lands in $OUT.
#
# 1. gpu_tests.txt: the GPU tests TESTS names (pytest paths).
# 2. profile_{plain,with}.txt: `sg-opt profile` of BASE (a best_config.toml), without and with SET.
# 3. bench_vs.txt: `sg-opt bench --vs`, BASE with SET against BASE, BLOCKS interleaved blocks a side; its A/A runs
#    are BASE's noise.
# 4. aa_with.txt (part "aa", not run by default): the same with SET on both sides: its A/A runs are the noise of
#    the configuration with SET, for a knob that may steady the step itself (host_threads).
# PARTS picks and orders them (default "tests profile bench"). SET is one TOML line of the [knobs] table.
# Usage: OUT=/dir SET='host_threads = "half"' [BASE=docs/results/.../best_config.toml] [SIZE=large-cached] \
#        [BLOCKS=10] [TESTS="tests/haste_rec/test_host_threads.py"] [PARTS=...] bash benchmarks/h200_knob_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-knob}; SIZE=${SIZE:-large-cached}; BLOCKS=${BLOCKS:-10}; SET=${SET:?one knob line, e.g. SET=\'host_threads = \"half\"\'}
BASE=${BASE:-docs/results/2026-12-03-h200-large-cached-s22/best_config.toml}
TESTS=${TESTS:-}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
WITH="$OUT/with_knob.toml"
{ cat "$BASE"; echo "$SET"; } > "$WITH"

tests() {
    echo "== 1. GPU tests"
    [ -n "$TESTS" ] || { echo "no TESTS given"; return; }
    # shellcheck disable=SC2086  # TESTS is a list of paths
    timeout 300 python3 -m pytest -p no:cacheprovider -q $TESTS > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
}

profile() {
    echo "== 2. profiles"
    for side in plain with; do
        config=$BASE; [ $side = with ] && config=$WITH
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

aa() {
    echo "== 4. A/A with the knob"
    timeout 400 python3 -m sg_opt.cli bench --size "$SIZE" --device cuda --config "$WITH" --vs "$WITH" \
        --blocks "$BLOCKS" > "$OUT/aa_with.txt" 2>&1
    grep "A/A run" "$OUT/aa_with.txt"
}

for part in ${PARTS:-tests profile bench}; do "$part"; done

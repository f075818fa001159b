#!/usr/bin/env bash
# The dense CUDA graphs (knob dense_cuda_graph) on a GPU, in one call: their tests (with the fused tail's in
# the trainer, and the embeddings', whose updates must never sync with the device), then a `large`
# configuration side by side with and without them (`sg-opt bench --vs`, the same protocol as the agent's
# final measurement), then a profile with them (phases, host work and waits, launches).
# TESTS=0 leaves the tests out (the graphs' passed on an H200 on 2026-11-30: docs/results/2026-11-30-h200x2-large-graphs/).
# Usage: OUT=/dir [BEST=docs/results/2026-11-30-h200x2-large-graphs/best_config.toml] [TESTS=0] bash benchmarks/h200_graphs.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; BEST=${BEST:-docs/results/2026-11-30-h200x2-large-graphs/best_config.toml}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
if [ "${TESTS:-1}" = 1 ]; then
    echo "== tests"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning \
        tests/haste_rec/test_dense_graph.py tests/haste_rec/test_triton_tail_trainer.py \
        tests/haste_rec/test_embeddings.py > "$OUT/tests.txt" 2>&1
    echo "rc $?"; tail -5 "$OUT/tests.txt"
fi
graph="$OUT/best_graph.toml"
{ cat "$BEST"; echo "dense_cuda_graph = true"; } > "$graph"
echo "== large: $BEST, without (a) and with (b) the dense CUDA graphs"
timeout 300 python3 -m sg_opt.cli bench --target haste-rec --size large --device cuda --config "$BEST" --vs "$graph" \
    > "$OUT/bench_vs_graph.txt" 2>&1
echo "rc $?"; tail -4 "$OUT/bench_vs_graph.txt"
echo "== profile with the graphs"
timeout 240 python3 -m sg_opt.cli profile --target haste-rec --size large --device cuda --config "$graph" --json \
    > "$OUT/profile_graph.json" 2> "$OUT/profile_graph.err"
echo "rc $?"
python3 -m sg_opt.profile_view "$OUT/profile_graph.json" 2>/dev/null | sed -n '1,30p' || tail -5 "$OUT/profile_graph.err"

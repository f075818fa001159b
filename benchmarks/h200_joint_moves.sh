#!/usr/bin/env bash
# The GPU checks of the 2026-12-04 joint cache moves, which only a GPU can time or exercise, in one call (about seven
# minutes at large-cached), each into its own file under $OUT/joint_moves/; then the caller goes on (e.g.
# benchmarks/h200_resumable.sh):
# - the CUDA tests of the caches: the weights and the state riding in their slots moved together
#   (row_cache.move_rows_together), the prefetch, the overlap, bit for bit;
# - `sg-opt gate --ref-tree $BASE` at large-cached on the 2026-12-04 best configuration (prefetch, fused optimizer,
#   dense graphs): the tree before the joint moves (A) against this one (B), side by side in fresh processes;
# - benchmarks/embed_host.py on that configuration: where its host time goes now, per thread; and with pinned,
#   prefetched batches too (without pin_memory the batch's copy to the GPU is blocking: torch synchronises the
#   stream after it, so the main thread's data phase waits for every kernel queued before it, the prefetch
#   thread's row moves included);
# - benchmarks/batch_build.py and loader_handover.py: whether the loader workers' batches (build time over their
#   number) or the hand-over bound that step's 3 ms data phase (H200, 2026-12-04).
# BASE is a code tree of the commit before the change, made here and carried:
#   mkdir -p .carry/base && git archive 97b6909 sg_opt profilers state_machine validators targets benchmarks \
#       pyproject.toml | tar -x -C .carry/base
# Usage: OUT=/dir BASE=.carry/base [SIZE=large-cached] [CONFIG=...toml] bash benchmarks/h200_joint_moves.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; SIZE=${SIZE:-large-cached}; BASE=${BASE:-.carry/base}
CONFIG=${CONFIG:-docs/results/2026-12-04-h200-cached-headroom-s30/call4/best_plus.toml}
mkdir -p "$OUT/joint_moves"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
run() {  # run NAME LIMIT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/joint_moves/$name.txt" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - start )) s; $(tail -1 "$OUT/joint_moves/$name.txt")"
}
run tests 200 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/haste_rec/test_cache.py \
    tests/haste_rec/test_cache_prefetch.py tests/haste_rec/test_cache_overlap.py
run gate 330 python3 -m sg_opt.cli gate --size "$SIZE" --device cuda --config "$CONFIG" --ref-tree "$BASE" \
    --numerics-class exact --blocks 20 --block-steps 40 --json
run embed_host 120 python3 benchmarks/embed_host.py --size "$SIZE" --device cuda --config "$CONFIG"
run embed_host_pinned 120 python3 benchmarks/embed_host.py --size "$SIZE" --device cuda --config "$CONFIG" \
    --set pin_memory=true --set prefetch_to_device=true
run batch_build 60 python3 benchmarks/batch_build.py --size "$SIZE"
run loader_handover 90 python3 benchmarks/loader_handover.py --size "$SIZE"

#!/usr/bin/env bash
# What the knobs left untried at large-cached's best configuration (session 27's) still give, and where its embed
# host time goes: benchmarks/embed_host.py on the best configuration and on it with the fused optimizer, the dense
# CUDA graphs, both, and the Triton embeddings; then `sg-opt bench --vs` of the best against the best with both
# (a paired ratio). Files under $OUT/headroom/.
# Usage: OUT=/dir [BEST=docs/results/2026-12-03-h200-large-cached-s27/best_config.toml] bash benchmarks/h200_cached_headroom.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; BEST=${BEST:-docs/results/2026-12-03-h200-large-cached-s27/best_config.toml}
mkdir -p "$OUT/headroom"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
variant() {  # variant NAME [--set K=V ...]
    local name=$1; shift
    local start=$(date +%s)
    timeout 150 python3 benchmarks/embed_host.py --size large-cached --device cuda --config "$BEST" "$@" \
        > "$OUT/headroom/$name.txt" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - start )) s; $(grep '^step,' "$OUT/headroom/$name.txt")"
}
variant best
variant fused_optimizer --set optimizer_impl=fused
variant graphs --set dense_cuda_graph=true
variant fused_optimizer_graphs --set optimizer_impl=fused --set dense_cuda_graph=true
variant triton_embeddings --set embedding_backend=triton
sed "s/^\[knobs\]/[knobs]\noptimizer_impl = \"fused\"\ndense_cuda_graph = true/" "$BEST" > /tmp/best_plus.toml
start=$(date +%s)
timeout 300 python3 -m sg_opt.cli bench --size large-cached --device cuda --config "$BEST" --vs /tmp/best_plus.toml \
    > "$OUT/headroom/bench_vs.txt" 2>&1
echo "bench --vs: rc $? in $(( $(date +%s) - start )) s"; tail -4 "$OUT/headroom/bench_vs.txt"

#!/usr/bin/env bash
# What knobs still give at large-cached's best configuration (the 2026-12-03 run's), and where its embed host time goes:
# benchmarks/embed_host.py on the best configuration and on each variant (NAME=KNOB=VALUE,KNOB=VALUE), then
# `sg-opt bench --vs` of the best against the best with VS's knobs (a paired ratio). Files under $OUT/headroom/.
# Usage: OUT=/dir [BEST=...best_config.toml] [VS=KNOB=VALUE,...] bash benchmarks/h200_cached_headroom.sh [VARIANT...]
# The first call, 2026-12-04: the default variants and VS=optimizer_impl=fused,dense_cuda_graph=true.
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; BEST=${BEST:-docs/results/2026-12-03-h200-large-cached-s27/best_config.toml}
VS=${VS:-optimizer_impl=fused,dense_cuda_graph=true}
mkdir -p "$OUT/headroom"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
[ $# -gt 0 ] || set -- fused_optimizer=optimizer_impl=fused graphs=dense_cuda_graph=true \
    fused_optimizer_graphs=optimizer_impl=fused,dense_cuda_graph=true triton_embeddings=embedding_backend=triton
sets() { local IFS=,; for kv in $1; do printf -- '--set %s ' "$kv"; done; }
for variant in best= "$@"; do
    name=${variant%%=*}; knobs=${variant#*=}
    start=$(date +%s)
    timeout 150 python3 benchmarks/embed_host.py --size large-cached --device cuda --config "$BEST" $(sets "$knobs") \
        > "$OUT/headroom/$name.txt" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - start )) s; $(grep '^step,' "$OUT/headroom/$name.txt")"
done
{ sed -n '1,/^\[knobs\]/p' "$BEST"; IFS=,; for kv in $VS; do k=${kv%%=*}; v=${kv#*=}
    [[ $v =~ ^(true|false|-?[0-9.]+)$ ]] || v="\"$v\""; echo "$k = $v"; done; sed '1,/^\[knobs\]/d' "$BEST"; } \
    > "$OUT/headroom/best_plus.toml"
start=$(date +%s)
timeout 300 python3 -m sg_opt.cli bench --size large-cached --device cuda --config "$BEST" \
    --vs "$OUT/headroom/best_plus.toml" > "$OUT/headroom/bench_vs.txt" 2>&1
echo "bench --vs: rc $? in $(( $(date +%s) - start )) s"; tail -4 "$OUT/headroom/bench_vs.txt"

#!/usr/bin/env bash
# Issue 7's headline run, one GPU call: `sg-opt optimize --tier offline` on one workload, then the
# winning configuration re-measured against the baseline in a separate, fresh `sg-opt bench --vs`.
# The run directory comes back as one tarball (report.md/html, summary.json, profiles with floors).
# Usage: OUT=/some/dir SIZE=large MINUTES=5 [CONFIG=examples/haste_rec_large_cached.toml] [DEVICE=cuda] \
#        bash benchmarks/h200_headline.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; SIZE=${SIZE:-large}; MINUTES=${MINUTES:-5}; DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-}; ITERS=${ITERS:-25}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
[ "$DEVICE" = cuda ] && unset TRITON_INTERPRET
base_args=(--target haste-rec --size "$SIZE" --device "$DEVICE")
[ -n "$CONFIG" ] && base_args+=(--config "$CONFIG")
runs=$(mktemp -d)
echo "== $(date -u +%FT%TZ) sg-opt optimize ${base_args[*]} --tier offline --max-minutes $MINUTES --max-iters $ITERS"
start=$SECONDS
timeout $(python3 -c "print(int(float($MINUTES) * 60 + 240))") python3 -m sg_opt.cli optimize "${base_args[@]}" --tier offline \
    --max-minutes "$MINUTES" --max-iters "$ITERS" --out "$runs" > "$OUT/optimize_$SIZE.log" 2>&1
echo "rc $? after $((SECONDS - start)) s"; tail -4 "$OUT/optimize_$SIZE.log"
run=$(ls -d "$runs"/*/ 2>/dev/null | head -1)
if [ -n "$run" ] && [ -f "$run/best_config.toml" ] && [ -z "${SKIP_BENCH:-}" ]; then
    echo "== $(date -u +%FT%TZ) sg-opt bench ${base_args[*]} --vs best_config.toml (fresh processes)"
    timeout 200 python3 -m sg_opt.cli bench "${base_args[@]}" --vs "$run/best_config.toml" \
        > "$OUT/bench_vs_$SIZE.log" 2>&1
    echo "rc $?"; tail -8 "$OUT/bench_vs_$SIZE.log"
fi
[ -n "$run" ] && tar czf "$OUT/run_$SIZE.tgz" -C "$runs" . && sed -n '1,400p' "$run/report.md"
rm -rf "$runs"

#!/usr/bin/env bash
# Does a fast, host-bound step's block noise follow the worker's CPU threads? An A/A `sg-opt bench --vs` of one
# configuration against itself (its two A/A calibrations, then a third A/A measured as the A/B) at each thread
# count in THREADS, one after the other, each with its own log.
# Why: on the 16-CPU H200 a GPU worker takes 16 threads, one on every core (targets.worker.default_threads), the
# condition that made the 32-core host's step bimodal on 2026-11-29 (216 ms median with 32 threads, 117 ms with
# 16 or 8); on 2026-11-30 the 13.6 ms `large` incumbent's A/A block medians spread over 12.2-17.6 ms.
# Usage: OUT=/dir [CONFIG=docs/results/2026-11-30-h200-large-recalibrated/best_config.toml] [SIZE=large]
#        [THREADS="16 8"] [DEVICE=cuda] bash benchmarks/h200_threads.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; SIZE=${SIZE:-large}; DEVICE=${DEVICE:-cuda}; THREADS=${THREADS:-16 8}
CONFIG=${CONFIG:-docs/results/2026-11-30-h200-large-recalibrated/best_config.toml}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
[ "$DEVICE" = cuda ] && unset TRITON_INTERPRET
for n in $THREADS; do
    echo "== $SIZE, $CONFIG against itself, --threads $n"
    timeout "${LIMIT:-300}" python3 -m sg_opt.cli bench --target haste-rec --size "$SIZE" --device "$DEVICE" \
        --config "$CONFIG" --vs "$CONFIG" --threads "$n" --json > "$OUT/aa_threads$n.json" 2> "$OUT/aa_threads$n.err"
    echo "rc $?"
    python3 - "$OUT/aa_threads$n.json" 2>/dev/null <<'PY' || tail -3 "$OUT/aa_threads$n.err"
import json, sys
r = json.load(open(sys.argv[1]))
ms = lambda side: [round(1e3 * m, 2) for m in r[side]["block_medians"]]
print(f"floor {r['floor']:.4f}, A/A ratio {r['ratio']:.4f} ({r['ci_low']:.4f}-{r['ci_high']:.4f}); "
      f"blocks {min(ms('a') + ms('b'))}-{max(ms('a') + ms('b'))} ms")
PY
done

#!/usr/bin/env bash
# One GPU call: the baseline profile of haste-rec @ large with its top ops timed in situ, then
# `sg-opt optimize` (offline tier, $0) on the same workload for a few minutes.
# Usage: OUT=/some/dir MINUTES=4 bash benchmarks/h200_agent.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$OUT/cache"
unset TRITON_INTERPRET
SKIP_TESTS=1 bash benchmarks/h200_measurement.sh 2>&1 | tail -40
echo "== sg-opt optimize --size large --device cuda --tier offline --max-minutes ${MINUTES:-4}"
timeout 480 python3 -m sg_opt.cli optimize --target haste-rec --size large --device cuda --tier offline \
    --max-minutes "${MINUTES:-4}" --out "$OUT/runs" --json > "$OUT/optimize_large.json" 2> "$OUT/optimize_large.err"
echo "rc $?"; tail -5 "$OUT/optimize_large.err"
run=$(ls -d "$OUT"/runs/*/ 2>/dev/null | head -1)
[ -n "$run" ] && cp "$run/report.md" "$OUT/optimize_report.md" && cp "$run/events.jsonl" "$OUT/optimize_events.jsonl"
rm -rf "$OUT/runs"
cat "$OUT/optimize_report.md" 2>/dev/null | head -60

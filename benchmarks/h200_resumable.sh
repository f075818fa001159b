#!/usr/bin/env bash
# A long `sg-opt optimize` split over several GPU calls of at most ~10 minutes each.
#
# Each call runs the agent with --pause-after (SLICE less PAUSE_MARGIN seconds, default 25): it starts no step
# that it expects not to finish by then, and pauses at a checkpoint (exit 3). SLICE is the hard stop behind it
# (SIGTERM: the checkpoint of every finished node is already on disk; a worker in flight is killed, its stacks in
# optimize.log). Then it packs the run directory into $OUT/run.tgz. The next call
# finds the run under runs/ (kept on a warm machine) or unpacks the tarball carried back (CARRY=path),
# and continues it with --resume: --max-minutes counts across resumes, so MINUTES is the whole run.
# When the run has finished, the fresh `sg-opt bench --vs` re-measurement of the winner follows.
#
# BENCH_LIMIT (seconds, default 400) bounds the re-measurement.
# On a GPU, benchmarks/gpu_worker_checks.sh runs first: where the fork server's tests fail, workers start as
# plain subprocesses; where those of workers started during validation fail, they start when measured
# (FORK_CHECK=0 skips it, e.g. on a warm machine's resume). DEADLINE (epoch seconds; benchmarks/h200_pair.sh
# sets it) ends the slice earlier when that comes first.
# VS=0 leaves the re-measurement out (benchmarks/h200_pair.sh runs it after both of its runs have finished).
# SEARCH=tpe makes it the Optuna TPE oracle of benchmarks/search_vs_optuna.py (compare the two finished runs
# there with --rules-run/--tpe-run); GPUS=2 evaluates two candidates at a time (sg-opt optimize --gpus).
# Usage: OUT=/dir SIZE=large MINUTES=20 SLICE=540 [CONFIG=...] [SEARCH=rules|tpe] [GPUS=1] [CARRY=prev/run.tgz] \
#        bash benchmarks/h200_resumable.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; SIZE=${SIZE:-large}; MINUTES=${MINUTES:-20}; SLICE=${SLICE:-540}
DEVICE=${DEVICE:-cuda}; CONFIG=${CONFIG:-}; ITERS=${ITERS:-25}; RUNS=${RUNS:-runs/headline}
SEARCH=${SEARCH:-rules}; GPUS=${GPUS:-1}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
[ "$DEVICE" = cuda ] && unset TRITON_INTERPRET
if [ "${FORK_CHECK:-1}" = 1 ] && [ "$DEVICE" = cuda ]; then  # workers fork only where the fork server's tests pass
    eval "$(bash benchmarks/gpu_worker_checks.sh "$OUT/gpu_worker_checks.txt")"
fi
[ -n "${CARRY:-}" ] && [ -f "$CARRY" ] && [ -z "$(ls -A "$RUNS")" ] && tar xzf "$CARRY" -C "$RUNS"
run=$(ls -d "$RUNS"/*/ 2>/dev/null | head -1)
if [ -n "${DEADLINE:-}" ] && [ $(( DEADLINE - $(date +%s) )) -lt "$SLICE" ]; then
    SLICE=$(( DEADLINE - $(date +%s) )); [ "$SLICE" -lt 1 ] && SLICE=1
fi
args=(--target haste-rec --size "$SIZE" --device "$DEVICE")
[ -n "$CONFIG" ] && args+=(--config "$CONFIG")
if [ -n "$run" ]; then
    echo "== resuming $(basename "$run")"
    cmd=(python3 -m sg_opt.cli optimize --resume "$run" --out "$RUNS")
else
    echo "== starting: optimize ${args[*]} --tier offline --search $SEARCH --gpus $GPUS --max-minutes $MINUTES" \
         "--max-iters $ITERS"
    cmd=(python3 -m sg_opt.cli optimize "${args[@]}" --tier offline --search "$SEARCH" --max-minutes "$MINUTES"
         --max-iters "$ITERS" --out "$RUNS")
    [ "$GPUS" != 1 ] && cmd+=(--gpus "$GPUS")
fi
pause_s=$(( SLICE - ${PAUSE_MARGIN:-25} )); [ "$pause_s" -lt 0 ] && pause_s=0
cmd+=(--pause-after "$(python3 -c "print($pause_s / 60)")")
timeout "$SLICE" "${cmd[@]}" >> "$OUT/optimize.log" 2>&1
rc=$?
case $rc in
    0) echo "optimize rc 0 (finished)" ;;
    3) echo "optimize rc 3 (paused before a step that would not fit in the slice; resume next call)" ;;
    124) echo "optimize rc 124 (stopped at the slice; resume next call)" ;;
    *) echo "optimize rc $rc (stopped by an error; resumable once its cause is fixed):"; tail -3 "$OUT/optimize.log" ;;
esac
run=$(ls -d "$RUNS"/*/ | head -1)
tar czf "$OUT/run.tgz" -C "$RUNS" .
if [ $rc = 0 ] && [ -f "$run/best_config.toml" ] && [ "${VS:-1}" = 1 ]; then
    timeout "${BENCH_LIMIT:-400}" python3 -m sg_opt.cli bench "${args[@]}" --vs "$run/best_config.toml" > "$OUT/bench_vs.log" 2>&1
    tail -3 "$OUT/bench_vs.log"; grep -v '^$' "$run/report.md" | head -40
fi

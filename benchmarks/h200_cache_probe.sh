#!/usr/bin/env bash
# The large-cached device cache on one GPU, checked and timed before a long run; everything lands in $OUT.
#
# 1. gpu_tests.txt: the GPU tests of the caches (bookkeeping on the host and on the device), the store and the
#    loader's shared ring.
# 2. numerics.txt: a candidate's numerics request (placement cached, fused updates), as validation runs it
#    (benchmarks/session_build.py --numerics: deterministic algorithms, 20 steps, probe, digest), with every
#    thread's stack each STACKS seconds, and machine.txt: processes, memory and GPU every 20 s meanwhile.
#    On 2026-12-01 this request took over 511 s twice in the agent (and was killed) where a plain build
#    took 36 s and a step 110 ms.
# 3. cache_steady.txt: a step's cache bookkeeping once the caches are full, on the host and on the GPU
#    (benchmarks/cache_steady.py --index).
# 4. steps.txt: steps of the cached configuration with the fused tail, bookkeeping on the host, then on the GPU
#    (knob embedding_cache_index; benchmarks/session_build.py).
# 5. resumed.txt (with CARRY=path/run.tgz, a stopped run): that run resumed for RESUME_S seconds under the same
#    watch, its workers asked for their stacks at the end (the agent's own validation, workers started ahead).
# PARTS picks and orders them (default "tests numerics steady steps resume").
# Usage: OUT=/dir [PARTS=...] [STACKS=30] [NUMERICS_S=240] [CARRY=run.tgz RESUME_S=240] bash benchmarks/h200_cache_probe.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-probe}; STACKS=${STACKS:-30}; NUMERICS_S=${NUMERICS_S:-240}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
CACHED=(--size large-cached --set embedding_placement=cached --set embedding_grad_mode=fused)

watch_machine() {  # watch_machine FILE SECONDS: processes, memory and GPU every 20 s
    for _ in $(seq 1 $(( $2 / 20 ))); do
        sleep 20
        { echo "== $(date +%T)"; ps -eo pid,ppid,stat,pcpu,rss,etimes,args --sort=-pcpu | grep -v " \[" | head -12 \
            | cut -c1-200; free -g | head -2; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
        } >> "$1"
    done
}

tests() {
    echo "== 1. GPU tests"
    timeout 300 python3 -m pytest -p no:cacheprovider tests/haste_rec/test_cache.py tests/haste_rec/test_embeddings.py \
        tests/haste_rec/test_shared_ring.py tests/haste_rec/test_triton_embedding.py > "$OUT/gpu_tests.txt" 2>&1
    grep -E "passed|failed|error" "$OUT/gpu_tests.txt" | tail -3
}

numerics() {
    echo "== 2. a numerics request of the cache (at most $NUMERICS_S s)"
    watch_machine "$OUT/machine.txt" "$NUMERICS_S" &
    watcher=$!
    timeout -s INT "$NUMERICS_S" python3 benchmarks/session_build.py "${CACHED[@]}" --numerics --steps 20 \
        --stacks "$STACKS" > "$OUT/numerics.txt" 2>&1
    echo "rc $?" >> "$OUT/numerics.txt"
    kill $watcher 2>/dev/null
    grep -v "^  File" "$OUT/numerics.txt" | grep -E "numerics run|failed|rc " | head -3
}

steady() {
    echo "== 3. a step's cache bookkeeping, full caches"
    for index in cpu cuda; do
        timeout 240 python3 benchmarks/cache_steady.py --threads 16 --index $index >> "$OUT/cache_steady.txt" 2>&1
    done
    grep "prepares" "$OUT/cache_steady.txt"
}

steps() {
    echo "== 4. steps of cached + fused tail, bookkeeping on the host, then on the GPU"
    for index in host device; do
        echo "-- embedding_cache_index=$index" >> "$OUT/steps.txt"
        timeout 240 python3 benchmarks/session_build.py "${CACHED[@]}" --set tail_backend=triton-fused-loss \
            --set embedding_cache_index=$index --steps 60 --stacks 0 >> "$OUT/steps.txt" 2>&1
    done
    grep -E "^--|steps, ms" "$OUT/steps.txt" | cut -c1-400
}

resume() {
    [ -n "${CARRY:-}" ] && [ -f "$CARRY" ] || { echo "== 5. skipped: no CARRY"; return; }
    echo "== 5. the carried run resumed for ${RESUME_S:-240} s"
    mkdir -p runs/probe && tar xzf "$CARRY" -C runs/probe
    run=$(ls -d runs/probe/*/ | head -1)
    watch_machine "$OUT/resumed_machine.txt" "${RESUME_S:-240}" &
    watcher=$!
    timeout "${RESUME_S:-240}" python3 -m sg_opt.cli optimize --resume "$run" --out runs/probe > "$OUT/resumed.txt" 2>&1 &
    agent=$!
    sleep $(( ${RESUME_S:-240} - 15 ))
    for pid in $(pgrep python3); do  # every worker (forked ones keep the fork server's command line) that
        caught=$(awk '/^SigCgt/ {print $2}' "/proc/$pid/status" 2>/dev/null)  # answers SIGUSR1 (10) writes its
        [ -n "$caught" ] && (( (16#$caught >> 9) & 1 )) || continue          # stacks to its stderr file
        err=$(readlink "/proc/$pid/fd/2"); before=$(stat -c %s "$err" 2>/dev/null || echo 0)
        kill -USR1 "$pid"; sleep 2
        { echo "--- worker $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-160)"
          tail -c +$(( before + 1 )) "$err" 2>/dev/null | tail -c 8000; } >> "$OUT/resumed.txt"
    done
    wait $agent; kill $watcher 2>/dev/null
    tail -5 "$OUT/resumed.txt"
}

for part in ${PARTS:-tests numerics steady steps resume}; do
    "$part"
done

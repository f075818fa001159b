#!/usr/bin/env bash
# Two resumable agent runs at once on a two-GPU host, one GPU and half the CPUs each, so one call of
# device time advances both (e.g. `large` and `large-cached`, or the rules and the TPE oracle).
#
# A and B are the settings of benchmarks/h200_resumable.sh for each run (SIZE, CONFIG, SEARCH, ITERS,
# MINUTES...). Each run keeps its own runs directory (runs/pair-a, runs/pair-b) and results folder
# ($OUT/a, $OUT/b, each with optimize.log and run.tgz); CARRY_A / CARRY_B bring a run back on a cold machine
# (copy a fetched run.tgz under .carry/, which git ignores, and name that folder in the device call's carry).
# A run of many candidates (the TPE oracle: SEARCH=tpe ITERS=100 MINUTES=600) goes on over sessions that way.
# The two runs share the host (memory bandwidth, PCIe), so each one's A/A noise floor is calibrated under the
# other's load; the fresh `sg-opt bench --vs` re-measurement of each winner runs only after both runs have
# finished, one after the other, with the host otherwise idle, on its run's GPU and CPUs (on 2026-11-30 one
# `large` re-measurement ran on GPU 0 with all 32 CPUs allowed, its run on CPUs 0-15: 6% apart). $OUT/topology.txt
# records which CPUs sit near which GPU. Pair only device-bound runs: `large-cached`
# (13.3 GB of host tables updated every step) measured a 10.6% noise floor next to `large` on 2026-11-30,
# and its fresh re-measurement differed from the run's own by 13%.
#
# A lane's settings may hold its own SLICE (for a lane that first runs PRE_A / PRE_B, a command given its GPU,
# its CPUs and OUT=$OUT/a/pre, e.g. PRE_A="bash benchmarks/h200_graphs.sh"). A line `export SG_OPT_...=0` that the
# PRE_ command prints turns that switch off for its lane's run, e.g. a probe of a config that once hung:
#   PRE_B="python3 -m sg_opt.cli bench --size large --device cuda --config C.toml --timeout 150 --phase-steps 0 \
#          || echo export SG_OPT_LOADER_RING=0"
# Before the runs, benchmarks/gpu_worker_checks.sh tests on the GPU how workers start ($OUT/gpu_worker_checks.txt):
# where the fork server's tests fail, every worker starts as a plain subprocess (SG_OPT_FORK_SERVER=0); where those
# of timing workers started during validation fail, they start when measured (SG_OPT_PRESTART=0).
# SLICE counts from this script's start (DEADLINE, exported): the check and a lane's PRE_ command come out of it,
# so both runs are stopped and packed in time. Leave the device call about 30 s over it for the packing (and the
# wheels' install before the script): on 2026-11-30 a 540 s slice started after the check and the install
# overran a 600 s call, and lane b's checkpoint of that call was never packed.
# BENCH=0 leaves those re-measurements out (for a call whose limit the slices already fill; run `sg-opt bench --vs`
# in the next call).
# BENCH_LIMIT (seconds, default 400) bounds each re-measurement: keep it inside what is left of the call's limit
# (each one prints its measurements as they end, so one stopped early still shows how far it got).
# Usage: OUT=/dir SLICE=540 A="SIZE=large MINUTES=16" \
#        B="SIZE=large-cached CONFIG=examples/haste_rec_large_cached.toml MINUTES=16" bash benchmarks/h200_pair.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; SLICE=${SLICE:-540}
export DEADLINE=${DEADLINE:-$(( $(date +%s) + SLICE ))}  # every slice of this call ends by then
cpus=$(nproc); half=$((cpus / 2))
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}  # the runs' build cache, for the re-measurements too
lane() {  # lane NAME GPU FIRST_CPU SETTINGS CARRY PRE
    mkdir -p "$OUT/$1"
    if [ -n "$6" ]; then  # a command for this lane's GPU and CPUs first (its output in $OUT/NAME/pre)
        CUDA_VISIBLE_DEVICES="$2" OUT="$OUT/$1/pre" taskset -c "$3-$(($3 + half - 1))" bash -c "$6" \
            > "$OUT/$1/pre.log" 2>&1
        eval "$(grep -E '^export SG_OPT_[A-Z_]+=0$' "$OUT/$1/pre.log")"  # switches it printed, for this lane only
    fi
    env SLICE="$SLICE" $4 OUT="$OUT/$1" RUNS="runs/pair-$1" CARRY="$5" VS=0 CUDA_VISIBLE_DEVICES="$2" \
        taskset -c "$3-$(($3 + half - 1))" bash benchmarks/h200_resumable.sh > "$OUT/$1/lane.log" 2>&1
}
mkdir -p "$OUT"; { nvidia-smi topo -m; lscpu | grep -i numa; } > "$OUT/topology.txt" 2>&1  # which CPUs are near which GPU
# Workers fork, and start during validation, only where their tests pass on this machine's GPU (FORK_CHECK=0 skips them)
if [ "${FORK_CHECK:-1}" = 1 ]; then
    eval "$(bash benchmarks/gpu_worker_checks.sh "$OUT/gpu_worker_checks.txt")"
fi
export FORK_CHECK=0  # checked once for both lanes
lane a 0 0 "${A:?A= the settings of the first run}" "${CARRY_A:-}" "${PRE_A:-}" &
lane b 1 "$half" "${B:?B= the settings of the second run}" "${CARRY_B:-}" "${PRE_B:-}" &
wait
for name in a b; do
    echo "== run $name ($([ "$name" = a ] && echo "$A" || echo "$B"))"
    [ -f "$OUT/$name/pre.log" ] && tail -40 "$OUT/$name/pre.log"
    cat "$OUT/$name/lane.log"
    run=$(ls -d "runs/pair-$name"/*/ 2>/dev/null | head -1)
    if [ "${BENCH:-1}" = 1 ] && [ -n "$run" ] && [ -f "$run/best_config.toml" ] && [ -f "$run/report.md" ]; then
        settings=$([ "$name" = a ] && echo "$A" || echo "$B")
        read -r size device config < <(env $settings bash -c 'echo ${SIZE:-large} ${DEVICE:-cuda} ${CONFIG:-}')
        args=(--target haste-rec --size "$size" --device "$device"); [ -n "$config" ] && args+=(--config "$config")
        gpu=$([ "$name" = a ] && echo 0 || echo 1); first=$([ "$name" = a ] && echo 0 || echo "$half")
        CUDA_VISIBLE_DEVICES=$gpu taskset -c "$first-$((first + half - 1))" \
            timeout "${BENCH_LIMIT:-400}" python3 -m sg_opt.cli bench "${args[@]}" --vs "$run/best_config.toml" \
            > "$OUT/$name/bench_vs.log" 2>&1
        tail -3 "$OUT/$name/bench_vs.log"; grep -v '^$' "$run/report.md" | head -12
    fi
done

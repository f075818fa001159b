#!/usr/bin/env bash
# The GPU calls behind BENCHMARKS.md, one driver:  bash benchmarks/gpu.sh PART [VAR=value ...] [ARG ...]
# Run it from the tree on a CUDA machine; on an offline one, after `source benchmarks/device_env.sh`.
# Settings come from the environment or as VAR=value arguments (upper-case names; any other argument goes to the
# part). Everything lands under $OUT (default /tmp/sg-opt-out). Every part puts the tree on PYTHONPATH, keeps the
# compile cache in XDG_CACHE_HOME (default /tmp/sg-opt-cache, outside $OUT) and unsets TRITON_INTERPRET on cuda
# (DEVICE, default cuda). `bash benchmarks/gpu.sh help PART` prints a part's settings.
#
# Worker checks (resumable-agent and pair, on cuda): benchmarks/gpu_worker_checks.sh tests how workers start on this
# GPU ($OUT/gpu_worker_checks.txt), turns off whichever failed (SG_OPT_FORK_SERVER=0, SG_OPT_PRESTART=0,
# SG_OPT_LOADER_RING=0), and prints the seconds it took and the switches to pass on. It is skipped with FORK_CHECK=0,
# or when any of those three switches is already set: an earlier call's results on the same kind of GPU, e.g.
# SG_OPT_FORK_SERVER=1 SG_OPT_PRESTART=1 SG_OPT_LOADER_RING=0.
set -uo pipefail
DRIVER="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$DRIVER")/.." || exit 1
export GPU_SH_T0=${GPU_SH_T0:-$(date +%s)}  # the outermost driver's start (pair's lanes count from it too)
T0=$GPU_SH_T0  # DEADLINEs and elapsed times count from it
elapsed() { echo $(( $(date +%s) - T0 )); }

worker_checks() {  # the worker checks (see the header); their switches exported for what follows
    [ "${FORK_CHECK:-1}" = 1 ] && [ "${DEVICE:-cuda}" = cuda ] || return 0
    if [ -n "${SG_OPT_FORK_SERVER:-}${SG_OPT_PRESTART:-}${SG_OPT_LOADER_RING:-}" ]; then
        echo "== worker checks skipped, switches given: SG_OPT_FORK_SERVER=${SG_OPT_FORK_SERVER:-1}" \
             "SG_OPT_PRESTART=${SG_OPT_PRESTART:-1} SG_OPT_LOADER_RING=${SG_OPT_LOADER_RING:-1}"
        return 0
    fi
    local start switches
    start=$(date +%s)
    switches=$(bash benchmarks/gpu_worker_checks.sh "$OUT/gpu_worker_checks.txt")
    eval "$switches"
    echo "== worker checks: $(( $(date +%s) - start )) s (size SLICE with it); to skip them on this kind of GPU:" \
         "SG_OPT_FORK_SERVER=${SG_OPT_FORK_SERVER:-1} SG_OPT_PRESTART=${SG_OPT_PRESTART:-1}" \
         "SG_OPT_LOADER_RING=${SG_OPT_LOADER_RING:-1}"
}

timed() {  # timed DIR NAME LIMIT_S COMMAND...: COMMAND's output in $OUT/DIR/NAME.txt; its rc, seconds and last line
    # SKIP (names, space-separated) leaves steps out: the rest of a part that an earlier call began
    local dir=$1 name=$2 limit=$3 start
    shift 3
    if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "$name: skipped (SKIP)"; return 0; fi
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$dir/$name.txt" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - start )) s; $(tail -1 "$OUT/$dir/$name.txt")"
}

## resumable-agent: a long `sg-opt optimize` split over GPU calls of at most ~10 minutes each
# Each call runs the agent with --pause-after (SLICE less PAUSE_MARGIN seconds; defaults 540 and 25): it starts no
# step that it expects not to finish by then, and pauses at a checkpoint (exit 3). SLICE is the hard stop behind it
# (SIGTERM: the checkpoint of every finished node is already on disk; a worker in flight is killed, its stacks in
# optimize.log; SIGKILL KILL_GRACE s later, default 20). Then it packs the run directory into $OUT/run.tgz, however
# the slice ended (finished, paused, stopped at SLICE, an error); a TERM, INT or HUP to the driver itself (a call's
# hard limit) stops the agent and packs too, at once and again once the agent has exited. The next call finds the run
# under RUNS (default runs/headline; kept on a warm machine) or unpacks the tarball carried back (CARRY=path), and
# continues it with --resume: --max-minutes counts across resumes, so MINUTES (default 20) is the whole run.
# When the run has finished, the fresh `sg-opt bench --vs` re-measurement of the winner follows (bench_vs.log),
# bounded by BENCH_LIMIT seconds (default 400); VS=0 leaves it out (the pair part runs it after both of its runs).
# SIZE (default large), CONFIG, ITERS (default 25), DEVICE (default cuda). SEARCH=tpe makes it the Optuna TPE oracle
# of benchmarks/search_vs_optuna.py (compare two finished runs there with --rules-run/--tpe-run); GPUS=2 evaluates
# two candidates at a time (sg-opt optimize --gpus).
# The worker checks run first (FORK_CHECK=0 or the switches given skip them). SLICE counts from after them;
# DEADLINE (epoch seconds; the pair part sets it) ends the slice earlier when that comes first, so
# DEADLINE=$(( $(date +%s) + 570 )), set before the wheels' install, keeps a whole call within 600 s.
# It prints the seconds of each stage (the checks, the slice, the packing) for sizing SLICE.
# Usage: OUT=/dir SIZE=large MINUTES=20 SLICE=540 [CONFIG=...] [SEARCH=rules|tpe] [GPUS=1] [CARRY=prev/run.tgz] \
#        bash benchmarks/gpu.sh resumable-agent
part_resumable_agent() {
    SIZE=${SIZE:-large}; MINUTES=${MINUTES:-20}; SLICE=${SLICE:-540}; DEVICE=${DEVICE:-cuda}; CONFIG=${CONFIG:-}
    ITERS=${ITERS:-25}; RUNS=${RUNS:-runs/headline}; SEARCH=${SEARCH:-rules}; GPUS=${GPUS:-1}
    KILL_GRACE=${KILL_GRACE:-20}
    mkdir -p "$RUNS"
    worker_checks
    if [ -n "${CARRY:-}" ]; then
        if [ -n "$(ls -A "$RUNS")" ]; then echo "== CARRY left aside: $RUNS already holds a run"
        elif [ -f "$CARRY" ]; then tar xzf "$CARRY" -C "$RUNS"
        else echo "== CARRY=$CARRY is not a file: starting afresh"; fi
    fi
    local run rc start pause_s cmd args
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
    cmd+=(--pause-after "$(awk "BEGIN { print $pause_s / 60 }")")
    echo "== slice of $SLICE s (pausing after $pause_s s), from $(elapsed) s after the start"
    start=$(date +%s)
    trap stop_and_pack TERM INT HUP
    # in the background, so that a signal to the driver is handled at once (bash runs a trap only between commands)
    timeout -k "$KILL_GRACE" "$SLICE" "${cmd[@]}" >> "$OUT/optimize.log" 2>&1 &
    AGENT_PID=$!
    wait "$AGENT_PID"; rc=$?
    trap '' TERM INT HUP  # the packing finishes
    AGENT_PID=
    case $rc in
        0) echo "optimize rc 0 (finished)" ;;
        3) echo "optimize rc 3 (paused before a step that would not fit in the slice; resume next call)" ;;
        124) echo "optimize rc 124 (stopped at the slice; resume next call)" ;;
        137) echo "optimize rc 137 (killed $KILL_GRACE s after the slice's SIGTERM; resume next call)" ;;
        *) echo "optimize rc $rc (stopped by an error; resumable once its cause is fixed):"; tail -3 "$OUT/optimize.log" ;;
    esac
    echo "   after $(( $(date +%s) - start )) s of the slice, $(elapsed) s after the start"
    pack_run
    trap - TERM INT HUP
    run=$(ls -d "$RUNS"/*/ 2>/dev/null | head -1)
    if [ "$rc" = 0 ] && [ -n "$run" ] && [ -f "$run/best_config.toml" ] && [ "${VS:-1}" = 1 ]; then
        timeout "${BENCH_LIMIT:-400}" python3 -m sg_opt.cli bench "${args[@]}" --vs "$run/best_config.toml" \
            > "$OUT/bench_vs.log" 2>&1
        tail -3 "$OUT/bench_vs.log"; grep -v '^$' "$run/report.md" | head -40
    fi
}

pack_run() {  # RUNS into $OUT/run.tgz, whole or not at all
    if [ -z "$(ls -A "$RUNS" 2>/dev/null)" ]; then echo "nothing under $RUNS to pack"; return; fi
    local start rc
    start=$(date +%s)
    tar czf "$OUT/run.tgz.part" -C "$RUNS" . 2> "$OUT/tar.err"
    rc=$?  # 1: a file changed while it was read (the agent still stopping); the archive is whole
    if [ "$rc" -le 1 ] && [ -s "$OUT/run.tgz.part" ] && mv -f "$OUT/run.tgz.part" "$OUT/run.tgz"; then
        echo "packed $OUT/run.tgz ($(du -h "$OUT/run.tgz" | cut -f1)) in $(( $(date +%s) - start )) s," \
             "$(elapsed) s after the start"
    else
        echo "packing $RUNS failed (tar rc $rc): $(tail -2 "$OUT/tar.err")"
    fi
    [ -s "$OUT/tar.err" ] || rm -f "$OUT/tar.err"
}

stop_and_pack() {  # a TERM, INT or HUP while the agent runs: stop it, pack, and again once it has exited
    trap '' TERM INT HUP
    echo "== stopped by a signal $(elapsed) s after the start: stopping the agent, packing its run"
    kill -TERM "$AGENT_PID" 2>/dev/null  # timeout passes it on to the agent, and kills it KILL_GRACE s later
    pack_run  # at once, in case no more time is given
    wait "$AGENT_PID"  # at most KILL_GRACE s
    pack_run
    exit 143
}

## pair: two resumable agent runs at once on a two-GPU host, one GPU and half the CPUs each
# One call of device time advances both (e.g. `large` and `large-cached`, or the rules and the TPE oracle).
# A and B are the resumable-agent settings of each run (SIZE, CONFIG, SEARCH, ITERS, MINUTES...). Each run keeps its
# own runs directory (runs/pair-a, runs/pair-b) and results folder ($OUT/a, $OUT/b, each with optimize.log and
# run.tgz); CARRY_A / CARRY_B bring a run back on a cold machine (copy a fetched run.tgz under .carry/, which git
# ignores, and name that folder in the device call's carry). A run of many candidates (the TPE oracle: SEARCH=tpe
# ITERS=100 MINUTES=600) goes on over calls that way.
# The two runs share the host (memory bandwidth, PCIe), so each one's A/A noise floor is calibrated under the
# other's load; the fresh `sg-opt bench --vs` re-measurement of each winner runs only after both runs have
# finished, one after the other, with the host otherwise idle, on its run's GPU and CPUs (on 2026-11-30 one `large`
# re-measurement ran on GPU 0 with all 32 CPUs allowed, its run on CPUs 0-15: 6% apart). $OUT/topology.txt records
# which CPUs sit near which GPU. Pair only device-bound runs: `large-cached` (13.3 GB of host tables updated every
# step) measured a 10.6% noise floor next to `large` on 2026-11-30, and its fresh re-measurement differed from the
# run's own by 13%.
# A lane's settings may hold its own SLICE (for a lane that first runs PRE_A / PRE_B, a command given its GPU, its
# CPUs and OUT=$OUT/a/pre, e.g. PRE_A="bash benchmarks/gpu.sh graphs"). A line `export SG_OPT_...=0` that the PRE_
# command prints turns that switch off for its lane's run, e.g. a probe of a config that once hung:
#   PRE_B="python3 -m sg_opt.cli bench --size large --device cuda --config C.toml --timeout 150 --phase-steps 0 \
#          || echo export SG_OPT_LOADER_RING=0"
# The worker checks run once, before both runs. SLICE (default 540) counts from the driver's start (DEADLINE,
# exported): the checks and a lane's PRE_ command come out of it, so both runs are stopped and packed in time. Leave
# the device call about 30 s over it for the packing (and the wheels' install before the driver): on 2026-11-30 a
# 540 s slice started after the check and the install overran a 600 s call, and lane b's checkpoint of that call was
# never packed. A TERM, INT or HUP to the driver is passed on to both lanes, which pack their runs.
# BENCH=0 leaves the re-measurements out (for a call whose limit the slices already fill; run `sg-opt bench --vs` in
# the next call). BENCH_LIMIT (seconds, default 400) bounds each re-measurement: keep it inside what is left of the
# call's limit (each one prints its measurements as they end, so one stopped early still shows how far it got).
# Usage: OUT=/dir SLICE=540 A="SIZE=large MINUTES=16" \
#        B="SIZE=large-cached CONFIG=examples/haste_rec_large_cached.toml MINUTES=16" bash benchmarks/gpu.sh pair
part_pair() {
    SLICE=${SLICE:-540}
    export DEADLINE=${DEADLINE:-$(( T0 + SLICE ))}  # every slice of this call ends by then
    HALF=$(( $(nproc) / 2 ))
    : "${A:?A= the settings of the first run}" "${B:?B= the settings of the second run}"
    { nvidia-smi topo -m; lscpu | grep -i numa; } > "$OUT/topology.txt" 2>&1  # which CPUs are near which GPU
    worker_checks
    export FORK_CHECK=0  # checked once for both lanes
    LANES=()
    trap stop_lanes TERM INT HUP
    lane a 0 0 "$A" "${CARRY_A:-}" "${PRE_A:-}" &
    LANES+=($!)
    lane b 1 "$HALF" "$B" "${CARRY_B:-}" "${PRE_B:-}" &
    LANES+=($!)
    wait
    trap - TERM INT HUP
    local name settings size device config args gpu first run
    for name in a b; do
        settings=$([ "$name" = a ] && echo "$A" || echo "$B")
        echo "== run $name ($settings)"
        [ -f "$OUT/$name/pre.log" ] && tail -40 "$OUT/$name/pre.log"
        cat "$OUT/$name/lane.log"
        run=$(ls -d "runs/pair-$name"/*/ 2>/dev/null | head -1)
        if [ "${BENCH:-1}" = 1 ] && [ -n "$run" ] && [ -f "$run/best_config.toml" ] && [ -f "$run/report.md" ]; then
            # shellcheck disable=SC2086,SC2016  # settings are VAR=value words; the inner shell expands them
            read -r size device config < <(env $settings bash -c 'echo ${SIZE:-large} ${DEVICE:-cuda} ${CONFIG:-}')
            args=(--target haste-rec --size "$size" --device "$device"); [ -n "$config" ] && args+=(--config "$config")
            gpu=$([ "$name" = a ] && echo 0 || echo 1); first=$([ "$name" = a ] && echo 0 || echo "$HALF")
            CUDA_VISIBLE_DEVICES=$gpu taskset -c "$first-$((first + HALF - 1))" \
                timeout "${BENCH_LIMIT:-400}" python3 -m sg_opt.cli bench "${args[@]}" --vs "$run/best_config.toml" \
                > "$OUT/$name/bench_vs.log" 2>&1
            tail -3 "$OUT/$name/bench_vs.log"; grep -v '^$' "$run/report.md" | head -12
        fi
    done
}

stop_lanes() {  # a TERM, INT or HUP to the pair: passed on to both lanes, which pack their runs
    trap '' TERM INT HUP
    echo "== stopped by a signal $(elapsed) s after the start: stopping both runs"
    kill -TERM "${LANES[@]}" 2>/dev/null
    wait
    local name
    for name in a b; do echo "== run $name"; tail -8 "$OUT/$name/lane.log" 2>/dev/null; done
    exit 143
}

lane() {  # lane NAME GPU FIRST_CPU SETTINGS CARRY PRE, in a subshell of its own: one run of the pair
    local cpus="$3-$(($3 + HALF - 1))"
    mkdir -p "$OUT/$1"
    LANE_CHILD=; LANE_STOPPED=
    trap 'trap "" TERM INT HUP; LANE_STOPPED=1; [ -n "$LANE_CHILD" ] && kill -TERM "$LANE_CHILD" 2>/dev/null' \
        TERM INT HUP
    if [ -n "$6" ]; then  # a command for this lane's GPU and CPUs first (its output in $OUT/NAME/pre)
        CUDA_VISIBLE_DEVICES="$2" OUT="$OUT/$1/pre" taskset -c "$cpus" bash -c "$6" > "$OUT/$1/pre.log" 2>&1 &
        LANE_CHILD=$!; wait "$LANE_CHILD"; [ -n "$LANE_STOPPED" ] && wait "$LANE_CHILD"
        eval "$(grep -E '^export SG_OPT_[A-Z_]+=0$' "$OUT/$1/pre.log" 2>/dev/null)"  # switches it printed, this lane's
    fi
    [ -n "$LANE_STOPPED" ] && return
    # shellcheck disable=SC2086  # the settings are VAR=value words
    env SLICE="$SLICE" $4 OUT="$OUT/$1" RUNS="runs/pair-$1" CARRY="$5" VS=0 CUDA_VISIBLE_DEVICES="$2" \
        taskset -c "$cpus" bash "$DRIVER" resumable-agent > "$OUT/$1/lane.log" 2>&1 &
    LANE_CHILD=$!; wait "$LANE_CHILD"; [ -n "$LANE_STOPPED" ] && wait "$LANE_CHILD"
}

## kernels: the Triton kernels' CUDA tests, the kernel benchmarks and the meta-parameter sweeps
# The tests run bf16 and fp32 and the trainer's trajectories; the benchmarks time the HASTE tail at the paper's
# shapes and pooled embeddings at 26 x 1M x 128; the sweeps cover the tail kernels, the embedding kernels, and the
# fused loss in fp32 at each tl.dot precision (the knob matmul_precision).
# PARTS picks what runs: "tests", "bench", "tune", "profile", or several (default "tests bench"; TUNE=1 adds "tune";
# PART= is read too). "profile" runs benchmarks/kernel_profile.py under Nsight Compute (ncu, --set full): what bounds
# tail_forward and the fused loss ($OUT/ncu_details.txt). "tune" is "tune-tail tune-embedding tune-fused"; each can be named alone, so that two GPUs share the
# parts. Each step has its own timeout; "tests bench" and "tune" each fit one 10-minute device call, and each leaves
# at most 6 files under $OUT (stderr of every step in stderr.log).
# Usage: OUT=/some/dir [PARTS="tests bench" | PARTS=tune] bash benchmarks/gpu.sh kernels
part_kernels() {
    local parts=${PARTS:-${PART:-tests bench}} log="$OUT/stderr.log"
    [ "${TUNE:-0}" = 1 ] && parts="$parts tune"
    parts=" $parts "; [[ "$parts" == *" tune "* ]] && parts="$parts tune-tail tune-embedding tune-fused "
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    if [[ "$parts" == *" tests "* ]]; then
        echo "== CUDA tests of the Triton kernels and backends"
        timeout 280 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning \
            tests/haste_rec/tail/test_triton_tail.py tests/haste_rec/tail/test_triton_tail_fused.py \
            tests/haste_rec/tail/test_triton_tail_perlabel.py tests/haste_rec/tail/test_triton_tail_trainer.py \
            tests/haste_rec/tail/test_haste.py tests/haste_rec/embeddings/test_triton_embedding.py tests/benchmarks \
            > "$OUT/cuda_kernel_tests.txt" 2>&1
        tail -3 "$OUT/cuda_kernel_tests.txt"; grep -E "^(FAILED|ERROR)" "$OUT/cuda_kernel_tests.txt" | head -20
    fi
    if [[ "$parts" == *" bench "* ]]; then
        echo "== HASTE tail kernels"
        timeout 200 python3 -m benchmarks.kernels --out "$OUT/kernels.json" > "$OUT/kernels.md" 2>> "$log"
        grep -E "^#|triton tail_forward|fused bce|fwd \+ both|per-label /" "$OUT/kernels.md"
        echo "== embedding kernels"
        timeout 150 python3 -m benchmarks.embedding_kernels --out "$OUT/embedding_kernels.json" \
            > "$OUT/embedding_kernels.md" 2>> "$log"
        tail -25 "$OUT/embedding_kernels.md"
    fi
    if [[ "$parts" == *" tune-tail "* ]]; then
        echo "== tail kernel meta-parameter sweep at the main shape"
        timeout 240 python3 -m benchmarks.kernels --configs main --tune --out "$OUT/tune.json" > "$OUT/tune.md" \
            2>> "$log"
        grep -A 25 "knob sweep" "$OUT/tune.md"
    fi
    if [[ "$parts" == *" tune-embedding "* ]]; then
        echo "== embedding kernel knob sweep (tile, warps, stages) at 26 x 1M x 128"
        timeout 200 python3 -m benchmarks.embedding_kernels --tune --out "$OUT/embedding_tune.json" \
            2>> "$log" | grep -A 60 "knob sweep" | head -60
    fi
    if [[ "$parts" == *" tune-fused "* ]]; then
        echo "== the fused loss kernel in fp32 at each tl.dot precision (the knob matmul_precision), around the defaults"
        timeout 150 python3 -m benchmarks.fused_bce_sweep --dtypes float32 --precisions ieee tf32 tf32x3 --quick \
            --out "$OUT/fused_fp32.json" 2>> "$log" | tail -20
    fi
    if [[ "$parts" == *" profile "* ]]; then
        echo "== Nsight Compute profile of tail_forward and the fused loss at the main shape"
        PATH=$PATH:/usr/local/cuda/bin timeout 300 ncu --profile-from-start off --set full -f -o "$OUT/tail" \
            python3 -m benchmarks.kernel_profile >> "$log" 2>&1
        PATH=$PATH:/usr/local/cuda/bin ncu --import "$OUT/tail.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>> "$log"
        rm -f "$OUT/tail.ncu-rep"  # tens of MB: the details page is what comes back
        grep -E "^  _|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy" "$OUT/ncu_details.txt"
    fi
    [ -s "$log" ] && { echo "== stderr (last lines)"; grep -v Warning "$log" | tail -5; }
    true
}

## multi-gpu: scaling over 1 and 2 ranks, and the agent with --gpus 1 and 2, on a host of 2+ GPUs
# NCCL, with NVLink multicast off. PARTS (PART= is read too) picks:
#   scaling  benchmarks/scaling.py at SIZES (default large) over 1 and 2 ranks with the TUNED knobs, each of PLANS
#            (sharding plans), SCALING_FLAGS (default "--numerics --profile": the 2-rank numerics check at `small`
#            and a ranked profile of each 2-rank run); BASELINE_TOO=1 adds the baseline config (the default);
#   agent    `sg-opt optimize` at AGENT_SIZE (default medium) with --gpus 1, then --gpus 2 (AGENT_GPUS="1 2"; one of
#            them per call where a run takes most of a call), AGENT_ITERS (6) candidates in AGENT_MINUTES (4),
#            killed at AGENT_TIMEOUT s: the agent's wall time for each, run dirs in agent_runs.tgz.
# Usage: OUT=/dir PARTS="scaling agent" SIZES="large" bash benchmarks/gpu.sh multi-gpu
part_multi_gpu() {
    local parts=${PARTS:-${PART:-scaling}} size gpus runs start
    SIZES=${SIZES:-large}; TUNED=${TUNED:-"--set embedding_grad_mode=fused --set tail_backend=slots"}
    PLANS=${PLANS:-"table-wise/replicated row-wise/replicated table-wise/label-groups"}
    AGENT_SIZE=${AGENT_SIZE:-medium}; AGENT_ITERS=${AGENT_ITERS:-6}; AGENT_MINUTES=${AGENT_MINUTES:-4}
    SCALING_FLAGS=${SCALING_FLAGS:---numerics --profile}; AGENT_TIMEOUT=${AGENT_TIMEOUT:-$((AGENT_MINUTES * 60 + 200))}
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -4
    python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
    if [[ " $parts " == *" scaling "* ]]; then
        for size in $SIZES; do
            echo "== $(date -u +%FT%TZ) scaling $size tuned ($TUNED)"
            # shellcheck disable=SC2086  # PLANS, TUNED and SCALING_FLAGS are lists of words
            python3 benchmarks/scaling.py --sizes "$size" --ranks 1 2 --plans $PLANS $TUNED $SCALING_FLAGS \
                --steps 30 --out "$OUT/scaling_${size}_tuned.json" 2>&1 | tee "$OUT/scaling_${size}_tuned.log" \
                | tail -12
            if [ -n "${BASELINE_TOO:-}" ]; then
                echo "== $(date -u +%FT%TZ) scaling $size baseline config"
                python3 benchmarks/scaling.py --sizes "$size" --ranks 1 2 --plans table-wise/replicated --steps 20 \
                    --out "$OUT/scaling_${size}_baseline.json" 2>&1 | tee "$OUT/scaling_${size}_baseline.log" \
                    | tail -6
            fi
        done
    fi
    if [[ " $parts " == *" agent "* ]]; then
        for gpus in ${AGENT_GPUS:-1 2}; do
            runs="$OUT/agent_gpus$gpus"; mkdir -p "$runs"
            echo "== $(date -u +%FT%TZ) sg-opt optimize --size $AGENT_SIZE --gpus $gpus --max-iters $AGENT_ITERS"
            start=$SECONDS
            timeout "$AGENT_TIMEOUT" python3 -m sg_opt.cli optimize --target haste-rec --size "$AGENT_SIZE" \
                --device cuda --gpus "$gpus" --max-iters "$AGENT_ITERS" --max-minutes "$AGENT_MINUTES" \
                --out "$runs" --json > "$runs.json" 2> "$runs.err"
            echo "rc $? wall $((SECONDS - start)) s"
            python3 - "$runs.json" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no summary")
print("evaluated", s["evaluated"], "accepted", s["accepted"], "wall_s", round(s["wall_s"], 1), "gpus", s.get("gpus"),
      "final", (s.get("final") or {}).get("ratio"), "stop", s["stop_reason"])
for c in s["candidates"]:
    print(" ", c["id"], c["change"], c["accepted"], c.get("ratio"), (c.get("reason") or "")[:90])
EOF
            tail -3 "$runs.err"
        done
        (cd "$OUT" && tar czf agent_runs.tgz agent_gpus* && rm -rf agent_gpus[0-9] agent_gpus[0-9][0-9])
    fi
}

## cached-headroom: what knobs still give at large-cached's best configuration, and where its host time goes
# benchmarks/embed_host.py on the best configuration BEST (default: the 2026-12-03 run's) and on each VARIANT
# argument (NAME=KNOB=VALUE,KNOB=VALUE; by default fused_optimizer, graphs, fused_optimizer_graphs,
# triton_embeddings), then `sg-opt bench --vs` of the best against the best with VS's knobs (KNOB=VALUE,...; a paired
# ratio; default optimizer_impl=fused,dense_cuda_graph=true). Files under $OUT/headroom/.
# Usage: OUT=/dir [BEST=...best_config.toml] [VS=KNOB=VALUE,...] bash benchmarks/gpu.sh cached-headroom [VARIANT...]
part_cached_headroom() {
    BEST=${BEST:-docs/results/2026-12-03-h200-large-cached-1821/best_config.toml}
    VS=${VS:-optimizer_impl=fused,dense_cuda_graph=true}
    mkdir -p "$OUT/headroom"
    [ $# -gt 0 ] || set -- fused_optimizer=optimizer_impl=fused graphs=dense_cuda_graph=true \
        fused_optimizer_graphs=optimizer_impl=fused,dense_cuda_graph=true triton_embeddings=embedding_backend=triton
    local variant name knobs start kv k v
    for variant in best= "$@"; do
        name=${variant%%=*}; knobs=${variant#*=}
        start=$(date +%s)
        # shellcheck disable=SC2046  # one --set KNOB=VALUE pair of words a knob
        timeout 150 python3 benchmarks/embed_host.py --size large-cached --device cuda --config "$BEST" \
            $(IFS=,; for kv in $knobs; do printf -- '--set %s ' "$kv"; done) > "$OUT/headroom/$name.txt" 2>&1
        echo "$name: rc $? in $(( $(date +%s) - start )) s; $(grep '^step,' "$OUT/headroom/$name.txt")"
    done
    { sed -n '1,/^\[knobs\]/p' "$BEST"
      IFS=, read -ra kvs <<< "$VS"
      for kv in "${kvs[@]}"; do k=${kv%%=*}; v=${kv#*=}
          [[ $v =~ ^(true|false|-?[0-9.]+)$ ]] || v="\"$v\""; echo "$k = $v"; done
      sed '1,/^\[knobs\]/d' "$BEST"; } > "$OUT/headroom/best_plus.toml"
    start=$(date +%s)
    timeout 300 python3 -m sg_opt.cli bench --size large-cached --device cuda --config "$BEST" \
        --vs "$OUT/headroom/best_plus.toml" > "$OUT/headroom/bench_vs.txt" 2>&1
    echo "bench --vs: rc $? in $(( $(date +%s) - start )) s"; tail -4 "$OUT/headroom/bench_vs.txt"
}

## checks: the GPU checks of changes that only a GPU can time or exercise, before a long run
# About four minutes at large-cached, each into its own file under $OUT/checks/; then the caller goes on (e.g. with
# resumable-agent):
# - whether this kernel keeps pressure stall counts (validators.machine_pressure), and the first lines of them;
# - the CUDA tests of the host tables' staged copy, the spare pairs and the banked steps;
# - benchmarks/host_tables.py: the trainer's staged host tables against the old pageable copy;
# - benchmarks/compile_transient.py with inductor's compile threads at 16 and at 1 (what workers now use).
# Usage: OUT=/dir [SIZE=large-cached] [DEVICE=cuda] bash benchmarks/gpu.sh checks
part_checks() {
    SIZE=${SIZE:-large-cached}; DEVICE=${DEVICE:-cuda}
    mkdir -p "$OUT/checks"
    local threads
    # shellcheck disable=SC2016  # the inner shell expands $r
    timed checks pressure 5 bash -c 'for r in cpu memory io; do echo "$r: $(head -1 /proc/pressure/$r)"; done'
    timed checks tests 240 python3 -m pytest -o addopts="" -q -p no:cacheprovider \
        tests/haste_rec/embeddings/test_row_ops_staging.py tests/validators/test_prestart.py \
        tests/validators/test_banked_steps.py tests/validators/test_machine_pressure.py
    timed checks host_tables 150 python3 benchmarks/host_tables.py --size "$SIZE" --device "$DEVICE"
    for threads in 16 1; do
        timed checks "compile_transient_$threads" 120 env TORCHINDUCTOR_COMPILE_THREADS=$threads \
            python3 benchmarks/compile_transient.py --size "$SIZE" --device "$DEVICE" --steps 60 \
            --set embedding_placement=host --set embedding_grad_mode=sparse --set pin_memory=true
    done
}

## joint-moves: the GPU checks of the 2026-12-04 joint cache moves
# About seven minutes at large-cached, each into its own file under $OUT/joint_moves/; then the caller goes on
# (e.g. with resumable-agent):
# - the CUDA tests of the caches: the weights and the state riding in their slots moved together
#   (row_cache.move_rows_together), the prefetch, the overlap, bit for bit;
# - `sg-opt gate --ref-tree $BASE` at large-cached on the 2026-12-04 best configuration CONFIG (prefetch, fused
#   optimizer, dense graphs): the tree before the joint moves (A) against this one (B), side by side in fresh processes;
# - benchmarks/embed_host.py on that configuration: where its host time goes now, per thread; and with pinned,
#   prefetched batches too (without pin_memory the batch's copy to the GPU is blocking: torch synchronises the
#   stream after it, so the main thread's data phase waits for every kernel queued before it, the prefetch
#   thread's row moves included);
# - benchmarks/batch_build.py and loader_handover.py: whether the loader workers' batches (build time over their
#   number) or the hand-over bound that step's 3 ms data phase (H200, 2026-12-04).
# BASE is a code tree of the commit before the change, made here and carried:
#   mkdir -p .carry/base && git archive 97b6909 sg_opt profilers state_machine validators targets benchmarks \
#       pyproject.toml | tar -x -C .carry/base
# Usage: OUT=/dir BASE=.carry/base [SIZE=large-cached] [CONFIG=...toml] bash benchmarks/gpu.sh joint-moves
part_joint_moves() {
    SIZE=${SIZE:-large-cached}; BASE=${BASE:-.carry/base}
    CONFIG=${CONFIG:-docs/results/2026-12-04-h200-cached-headroom/call4/best_plus.toml}
    mkdir -p "$OUT/joint_moves"
    timed joint_moves tests 200 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/haste_rec/cache/test_cache.py \
        tests/haste_rec/cache/test_cache_prefetch.py tests/haste_rec/cache/test_cache_overlap.py
    timed joint_moves gate 330 python3 -m sg_opt.cli gate --size "$SIZE" --device cuda --config "$CONFIG" \
        --ref-tree "$BASE" --numerics-class exact --blocks 20 --block-steps 40 --json
    timed joint_moves embed_host 120 python3 benchmarks/embed_host.py --size "$SIZE" --device cuda --config "$CONFIG"
    timed joint_moves embed_host_pinned 120 python3 benchmarks/embed_host.py --size "$SIZE" --device cuda \
        --config "$CONFIG" --set pin_memory=true --set prefetch_to_device=true
    timed joint_moves batch_build 60 python3 benchmarks/batch_build.py --size "$SIZE"
    timed joint_moves loader_handover 90 python3 benchmarks/loader_handover.py --size "$SIZE"
}

## knob-ab: one knob on one GPU, checked, profiled and timed against the same configuration without it
# 1. gpu_tests.txt: the GPU tests TESTS names (pytest paths).
# 2. profile_{plain,with}.txt: `sg-opt profile` of BASE (a best_config.toml; default the 2026-12-03 large-cached
#    run's), without and with SET, and their traces.
# 3. bench_vs.txt: `sg-opt bench --vs`, BASE with SET against BASE, BLOCKS (default 10) interleaved blocks a side;
#    its A/A runs are BASE's noise.
# 4. aa_with.txt (step "aa", not run by default): the same with SET on both sides: its A/A runs are the noise of the
#    configuration with SET, for a knob that may steady the step itself (host_threads).
# PARTS picks and orders the steps (default "tests profile bench"). SET is one TOML line of the [knobs] table.
# Usage: OUT=/dir SET='host_threads = "half"' [BASE=docs/results/.../best_config.toml] [SIZE=large-cached] \
#        [BLOCKS=10] [TESTS="tests/haste_rec/test_host_threads.py"] [PARTS=...] bash benchmarks/gpu.sh knob-ab
part_knob_ab() {
    SIZE=${SIZE:-large-cached}; BLOCKS=${BLOCKS:-10}; SET=${SET:?one knob line, e.g. SET=\'host_threads = \"half\"\'}
    BASE=${BASE:-docs/results/2026-12-03-h200-large-cached-0245/best_config.toml}; TESTS=${TESTS:-}
    WITH="$OUT/with_knob.toml"
    { cat "$BASE"; echo "$SET"; } > "$WITH"
    local step side config
    for step in ${PARTS:-tests profile bench}; do
        case $step in
            tests)
                echo "== 1. GPU tests"
                if [ -z "$TESTS" ]; then echo "no TESTS given"; continue; fi
                # shellcheck disable=SC2086  # TESTS is a list of paths
                timeout 300 python3 -m pytest -p no:cacheprovider -q $TESTS > "$OUT/gpu_tests.txt" 2>&1
                tail -3 "$OUT/gpu_tests.txt" ;;
            profile)
                echo "== 2. profiles"
                for side in plain with; do
                    config=$BASE; [ $side = with ] && config=$WITH
                    timeout 200 python3 -m sg_opt.cli profile --size "$SIZE" --device cuda --config "$config" \
                        --steps 10 --trace "$OUT/trace_$side.json" > "$OUT/profile_$side.txt" 2>&1
                    head -3 "$OUT/profile_$side.txt"; gzip -f "$OUT/trace_$side.json"
                done ;;
            bench)
                echo "== 3. bench --vs"
                timeout 400 python3 -m sg_opt.cli bench --size "$SIZE" --device cuda --config "$WITH" --vs "$BASE" \
                    --blocks "$BLOCKS" > "$OUT/bench_vs.txt" 2>&1
                tail -15 "$OUT/bench_vs.txt" ;;
            aa)
                echo "== 4. A/A with the knob"
                timeout 400 python3 -m sg_opt.cli bench --size "$SIZE" --device cuda --config "$WITH" --vs "$WITH" \
                    --blocks "$BLOCKS" > "$OUT/aa_with.txt" 2>&1
                grep "A/A run" "$OUT/aa_with.txt" ;;
            *) echo "no step $step (tests, profile, bench, aa)" ;;
        esac
    done
}

## cache-overlap: knob-ab for embedding_cache_overlap
# The GPU tests of the caches, the store (overlap trains bitwise as without it) and overlap itself; profiles and
# `sg-opt bench --vs` of BASE (default: the 2026-12-02 large-cached run's best) without and with it.
# Usage: OUT=/dir [BASE=...] [SIZE=large-cached] [BLOCKS=10] [PARTS=...] bash benchmarks/gpu.sh cache-overlap
part_cache_overlap() {
    SET="embedding_cache_overlap = true"
    BASE=${BASE:-docs/results/2026-12-02-h200-large-cached-0118/best_config.toml}
    TESTS=${TESTS:-"tests/haste_rec/cache/test_cache.py tests/haste_rec/embeddings/test_embeddings.py tests/haste_rec/cache/test_cache_overlap.py"}
    part_knob_ab
}

## graphs: the dense CUDA graphs (knob dense_cuda_graph): tests, side by side, profile
# Their tests (with the fused tail's in the trainer, and the embeddings', whose updates must never sync with the
# device), then a `large` configuration BEST side by side with and without them (`sg-opt bench --vs`, the same
# protocol as the agent's final measurement), then a profile with them (phases, host work and waits, launches).
# TESTS=0 leaves the tests out (the graphs' passed on an H200 on 2026-11-30: docs/results/2026-11-30-h200x2-large-graphs/).
# Usage: OUT=/dir [BEST=docs/results/2026-11-30-h200x2-large-graphs/best_config.toml] [TESTS=0] bash benchmarks/gpu.sh graphs
part_graphs() {
    BEST=${BEST:-docs/results/2026-11-30-h200x2-large-graphs/best_config.toml}
    if [ "${TESTS:-1}" = 1 ]; then
        echo "== tests"
        timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning \
            tests/haste_rec/test_dense_graph.py tests/haste_rec/tail/test_triton_tail_trainer.py \
            tests/haste_rec/embeddings/test_embeddings.py > "$OUT/tests.txt" 2>&1
        echo "rc $?"; tail -5 "$OUT/tests.txt"
    fi
    local graph="$OUT/best_graph.toml"
    { cat "$BEST"; echo "dense_cuda_graph = true"; } > "$graph"
    echo "== large: $BEST, without (a) and with (b) the dense CUDA graphs"
    timeout 300 python3 -m sg_opt.cli bench --target haste-rec --size large --device cuda --config "$BEST" \
        --vs "$graph" > "$OUT/bench_vs_graph.txt" 2>&1
    echo "rc $?"; tail -4 "$OUT/bench_vs_graph.txt"
    echo "== profile with the graphs"
    timeout 240 python3 -m sg_opt.cli profile --target haste-rec --size large --device cuda --config "$graph" --json \
        > "$OUT/profile_graph.json" 2> "$OUT/profile_graph.err"
    echo "rc $?"
    python3 -m sg_opt.profile_view "$OUT/profile_graph.json" 2>/dev/null | sed -n '1,30p' \
        || tail -5 "$OUT/profile_graph.err"
}

## threads: A/A noise of a fast, host-bound step against the worker's CPU thread count
# An A/A `sg-opt bench --vs` of CONFIG against itself (its two A/A calibrations, then a third A/A measured as the
# A/B) at each thread count in THREADS (default "16 8"), one after the other, each with its own log, LIMIT s each.
# Why: on the 16-CPU H200 a GPU worker takes 16 threads, one on every core (targets.worker.default_threads), the
# condition that made the 32-core host's step bimodal on 2026-11-29 (216 ms median with 32 threads, 117 ms with
# 16 or 8); on 2026-11-30 the 13.6 ms `large` incumbent's A/A block medians spread over 12.2-17.6 ms.
# Usage: OUT=/dir [CONFIG=docs/results/2026-11-30-h200-large-recalibrated/best_config.toml] [SIZE=large]
#        [THREADS="16 8"] [DEVICE=cuda] bash benchmarks/gpu.sh threads
part_threads() {
    SIZE=${SIZE:-large}; DEVICE=${DEVICE:-cuda}; THREADS=${THREADS:-16 8}
    CONFIG=${CONFIG:-docs/results/2026-11-30-h200-large-recalibrated/best_config.toml}
    local n
    for n in $THREADS; do
        echo "== $SIZE, $CONFIG against itself, --threads $n"
        timeout "${LIMIT:-300}" python3 -m sg_opt.cli bench --target haste-rec --size "$SIZE" --device "$DEVICE" \
            --config "$CONFIG" --vs "$CONFIG" --threads "$n" --json > "$OUT/aa_threads$n.json" \
            2> "$OUT/aa_threads$n.err"
        echo "rc $?"
        python3 - "$OUT/aa_threads$n.json" 2>/dev/null <<'PY' || tail -3 "$OUT/aa_threads$n.err"
import json, sys
r = json.load(open(sys.argv[1]))
ms = lambda side: [round(1e3 * m, 2) for m in r[side]["block_medians"]]
print(f"floor {r['floor']:.4f}, A/A ratio {r['ratio']:.4f} ({r['ci_low']:.4f}-{r['ci_high']:.4f}); "
      f"blocks {min(ms('a') + ms('b'))}-{max(ms('a') + ms('b'))} ms")
PY
    done
}

## foundation: the trainer's CUDA tests, then step time per phase at `large` for the baseline and hand-set knobs
# Results and logs in $OUT (cuda_tests.txt, large_NAME.json). Usage: OUT=/some/dir bash benchmarks/gpu.sh foundation
part_foundation() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
        | tee -a "$OUT/gpu.txt"
    echo "== the trainer's tests, CUDA parametrisations included"
    timeout 400 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/haste_rec \
        > "$OUT/cuda_tests.txt" 2>&1
    tail -3 "$OUT/cuda_tests.txt"
    phases() {  # phases NAME --set ...
        local name=$1; shift
        echo "== large: $name"
        timeout 420 python3 -m benchmarks.trainer_phases --size large --device cuda --steps 30 --warmup 5 \
            --phase-steps 10 --json-out "$OUT/large_${name}.json" "$@" 2>&1
    }
    phases baseline
    phases fused --set embedding_grad_mode=fused
    phases fused_bf16 --set embedding_grad_mode=fused --set precision=bf16-autocast --set tail_backend=slots
    phases hand_tuned --set embedding_grad_mode=fused --set precision=bf16-autocast --set tail_backend=slots \
        --set data_workers=2 --set pin_memory=true --set prefetch_to_device=true
    phases cached_planned --set embedding_placement=cached --set embedding_grad_mode=fused \
        --set embedding_cache_plan=planned --set embedding_cache_fraction=0.1 --set pin_memory=true
}

## backends: the measurement part's profile, then the hand-set config's step time with each Triton backend
# The profile of haste-rec @ large with its top ops timed in situ (measurement, SKIP_TESTS=1), then
# benchmarks/trainer_phases.py at `large` with the hand-set knobs and each tail/embedding backend.
# Usage: OUT=/some/dir bash benchmarks/gpu.sh backends
part_backends() {
    SKIP_TESTS=1 part_measurement
    local extra hand=(--set embedding_grad_mode=fused --set precision=bf16-autocast --set data_workers=2
                      --set pin_memory=true --set prefetch_to_device=true)
    for extra in "--set tail_backend=slots" "--set tail_backend=triton" "--set tail_backend=triton-fused-loss" \
                 "--set tail_backend=triton --set embedding_backend=triton" \
                 "--set tail_backend=triton-fused-loss --set embedding_backend=triton"; do
        echo "== large, hand-set knobs $extra"
        # shellcheck disable=SC2086  # extra is --set pairs
        timeout 150 python3 -m benchmarks.trainer_phases --size large --device cuda --steps 30 --warmup 5 \
            --phase-steps 10 "${hand[@]}" $extra 2>&1 | tail -14
    done
}

## measurement: the validators' and profilers' CUDA tests, the device ceilings, and `sg-opt profile --fine` at large
# SKIP_TESTS=1 leaves the tests out. Usage: OUT=/some/dir bash benchmarks/gpu.sh measurement
part_measurement() {
    if [ "${SKIP_TESTS:-0}" != 1 ]; then
        echo "== validators and profilers tests (CUDA cases included)"
        timeout 300 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/validators \
            tests/profilers > "$OUT/cuda_measurement_tests.txt" 2>&1
        grep -E "passed|failed|error" "$OUT/cuda_measurement_tests.txt" | tail -3
        grep -E "^(FAILED|ERROR)" "$OUT/cuda_measurement_tests.txt" | head -20
    fi
    echo "== profile of haste-rec @ large, baseline, with the fine profile and the ceilings"
    timeout 400 python3 -m sg_opt.cli profile --size large --device cuda --fine --steps 10 --warmup 5 --json \
        > "$OUT/profile_large_baseline.json" 2> "$OUT/profile_large_baseline.err"
    python3 - "$OUT/profile_large_baseline.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if not r["ok"]:
    print("profile failed:", r["failure"]); sys.exit(0)
c = r["coarse"]
print(f"step {c['step_s']*1e3:.2f} ms profiled, {c['unprofiled_step_s']*1e3:.2f} ms unprofiled, overhead x{c['profiler_overhead']:.3f}")
print(f"attributed share {c['attributed_share']:.3f}, device attributed {c['device_attributed_share']}, idle {c['device_idle_fraction']}, launches/step {c['kernel_launches_per_step']:.0f}")
for name, p in c["phases"].items():
    print(f"  {name:10s} host {p['host_s']*1e3:8.2f} ms (waiting {p['host_wait_s']*1e3:7.2f})  device {(p['device_s'] or 0)*1e3:8.2f} ms  share {p['share']*100:5.1f}%")
ce = r["fine"]["ceilings"]
print("ceilings:", {k: f"{v/1e12:.1f} TFLOP/s" for k, v in ce["matmul_flops_per_s"].items()}, f"copy {ce['copy_bytes_per_s']/1e12:.2f} TB/s")
for s in r["fine"]["slots"]:
    print(f"  {s['slot']:22s} {s['dtype']:9s} {s['median_s']*1e3:8.3f} ms  {s['achieved_flops_per_s']/1e12:7.2f} TFLOP/s  {s['achieved_bytes_per_s']/1e9:8.1f} GB/s  {s['bound']:7s} {s['roofline_fraction']*100:5.1f}% of roof")
for o in r["fine"].get("op_timings", []):
    flops = f"{o['achieved_flops_per_s']/1e12:7.2f} TFLOP/s" if o.get("achieved_flops_per_s") else "      -       "
    roof = f"{o['roofline_fraction']*100:5.1f}%" if o.get("roofline_fraction") is not None else "  -  "
    print(f"  op {o['name'][:40]:40s} x{o['calls_per_step']:5.1f}/step {o['median_s']*1e6:9.1f} us/call (p10 {o['p10_s']*1e6:.1f}, p90 {o['p90_s']*1e6:.1f})  {flops}  {o['achieved_bytes_per_s']/1e9:8.1f} GB/s in  {roof} of roof  shapes {o['shapes'][:3]}")
for f in r["findings"]:
    print(f"  finding {f['category']:20s} share {f['share']*100:5.1f}%  gain x{f['amdahl_gain']:.2f}  {f['evidence']}")
PY
}

usage() {  # usage [PART]: the header and the parts, or one part's settings
    if [ -n "${1:-}" ]; then
        awk -v p="## $1:" 'index($0, p) == 1 { on = 1 } on && !/^#/ { exit } on { sub(/^##? ?/, ""); print }' "$DRIVER"
    else
        sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$DRIVER"
        echo; echo "Parts:"; sed -n 's/^## \([a-z-]*\): \(.*\)/  \1: \2/p' "$DRIVER"
    fi
}

part=${1:-help}
[ $# -gt 0 ] && shift
args=()
while [ $# -gt 0 ]; do  # VAR=value arguments into the environment; the rest (after --, all of it) for the part
    if [ "$1" = -- ]; then shift; args+=("$@"); break
    elif [[ $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; then export "${1?}"
    else args+=("$1"); fi
    shift
done
case $part in
    help|-h|--help) usage "${args[0]:-}"; exit 0 ;;
esac
fn=part_${part//-/_}
if ! [[ $part =~ ^[a-z-]+$ ]] || ! declare -F "$fn" > /dev/null; then
    echo "gpu.sh: no part '$part'" >&2; usage >&2; exit 2
fi

OUT=${OUT:-/tmp/sg-opt-out}
mkdir -p "$OUT"
case ":${PYTHONPATH:-}:" in
    *":$PWD:"*) ;;
    *) export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
[ "${DEVICE:-cuda}" = cuda ] && unset TRITON_INTERPRET
"$fn" ${args[@]+"${args[@]}"}

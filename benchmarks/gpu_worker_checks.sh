#!/usr/bin/env bash
# The tests of how workers start, on this machine's GPU, written to $1; prints the switches that turn off what
# failed, for the caller to apply:
#   eval "$(bash benchmarks/gpu_worker_checks.sh "$OUT/gpu_worker_checks.txt")"
# - the fork server and the parameter digest (tests/test_fork_server.py, tests/test_digest.py: a forked child
#   gets its own GPU; a device tensor digests as its host copy); on failure SG_OPT_FORK_SERVER=0, so every
#   worker starts as a plain subprocess;
# - timing workers started during validation (tests/validators/test_prestart.py: on the GPU, beside a numerics
#   run, then adopted by the measurement); on failure SG_OPT_PRESTART=0;
# - packed batches through the loader's shared slots (tests/haste_rec/data/test_shared_ring.py: pinned and prefetched
#   on the GPU with two and four workers, bitwise the training without workers, and timing workers that each
#   start a ring of four and measure); on failure SG_OPT_LOADER_RING=0.
set -uo pipefail
check() {  # check SWITCH TEST_FILE...
    local switch=$1; shift
    echo "== $*" >> "$OUT_FILE"
    # a hang fails the check too: its stacks after CHECK_STACKS_S, killed at CHECK_LIMIT_S
    if ! timeout "${CHECK_LIMIT_S:-240}" python3 -m pytest -q -p no:cacheprovider \
            -o faulthandler_timeout="${CHECK_STACKS_S:-180}" "$@" >> "$OUT_FILE" 2>&1; then
        echo "failed: $switch=0 from here on" | tee -a "$OUT_FILE" >&2
        echo "export $switch=0"
    fi
}
OUT_FILE=$1; : > "$OUT_FILE"
echo "== /dev/shm (the loader's shared slots live there): $(df -h /dev/shm 2>/dev/null | tail -1)" >> "$OUT_FILE"
check SG_OPT_FORK_SERVER tests/test_fork_server.py tests/test_digest.py
check SG_OPT_PRESTART tests/validators/test_prestart.py
check SG_OPT_LOADER_RING tests/haste_rec/data/test_shared_ring.py

#!/usr/bin/env bash
# The GPU checks of the changes that only a GPU can time or exercise, in one call (about four minutes at
# large-cached), each into its own file under $OUT/checks/; then the caller goes on (e.g. benchmarks/h200_resumable.sh):
# - the CUDA tests of the host tables' staged copy, the spare pairs and the banked steps;
# - benchmarks/host_tables.py: the trainer's staged host tables against the old pageable copy;
# - benchmarks/compile_transient.py with inductor's compile threads at 16 and at 1 (what workers now use);
# - whether this kernel keeps pressure stall counts (validators.machine_pressure), and the first lines of them.
# Usage: OUT=/dir [SIZE=large-cached] [DEVICE=cuda] bash benchmarks/h200_checks.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; SIZE=${SIZE:-large-cached}; DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT/checks"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
[ "$DEVICE" = cuda ] && unset TRITON_INTERPRET
run() {  # run NAME LIMIT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/checks/$name.txt" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - start )) s; $(tail -1 "$OUT/checks/$name.txt")"
}
run pressure 5 bash -c 'for r in cpu memory io; do echo "$r: $(head -1 /proc/pressure/$r)"; done'
run tests 240 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/haste_rec/test_row_ops_staging.py \
    tests/validators/test_prestart.py tests/validators/test_banked_steps.py tests/validators/test_machine_pressure.py
run host_tables 150 python3 benchmarks/host_tables.py --size "$SIZE" --device "$DEVICE"
for threads in 16 1; do
    run "compile_transient_$threads" 120 env TORCHINDUCTOR_COMPILE_THREADS=$threads python3 benchmarks/compile_transient.py \
        --size "$SIZE" --device "$DEVICE" --steps 60 --set embedding_placement=host --set embedding_grad_mode=sparse \
        --set pin_memory=true
done

#!/usr/bin/env bash
# Where `large-cached`'s step goes under the configurations its agent run weighs, one GPU call: the host
# tables (the baseline of examples/haste_rec_large_cached.toml), then the device cache over them, each with
# the fused Triton tail, alone and with the data knobs. Each line is one `sg-opt profile` (phases with their
# host time, waits, host ops and launches; findings), printed and kept as JSON.
# Usage: OUT=/some/dir bash benchmarks/h200_large_cached.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
data=(--set data_workers=2 --set pin_memory=true --set prefetch_to_device=true --set pack_batches=true)
cache=(--set embedding_placement=cached --set embedding_grad_mode=fused)
profile() {  # name, then --set args
    local name=$1; shift
    echo "== large-cached: $name ($*)"
    timeout 240 python3 -m sg_opt.cli profile --target haste-rec --size large-cached --device cuda \
        --config examples/haste_rec_large_cached.toml --steps 10 --warmup 5 "$@" --json > "$OUT/$name.json" \
        2> "$OUT/$name.err"
    echo "rc $?"
    python3 -m sg_opt.profile_view "$OUT/$name.json" 2>/dev/null | sed -n '1,40p' || tail -5 "$OUT/$name.err"
}
profile host_tail --set tail_backend=triton-fused-loss
profile host_tail_data --set tail_backend=triton-fused-loss "${data[@]}"
profile cache_tail --set tail_backend=triton-fused-loss "${cache[@]}"
profile cache_tail_data --set tail_backend=triton-fused-loss "${cache[@]}" "${data[@]}"
profile cache_tail_data_triton --set tail_backend=triton-fused-loss "${cache[@]}" "${data[@]}" \
    --set embedding_backend=triton
tar czf "$OUT/profiles.tgz" -C "$OUT" --exclude profiles.tgz . && rm -f "$OUT"/*.json "$OUT"/*.err

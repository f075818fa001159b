#!/usr/bin/env bash
# One GPU call: the profile of haste-rec @ large with its top ops timed in situ (issue 4), then the
# step time of the hand-set config with each Triton backend switched on (issue 3's end-to-end view).
# Usage: OUT=/some/dir bash benchmarks/h200_backends.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$OUT/cache"
unset TRITON_INTERPRET
SKIP_TESTS=1 bash benchmarks/h200_measurement.sh
HAND="--set embedding_grad_mode=fused --set precision=bf16-autocast --set data_workers=2 --set pin_memory=true --set prefetch_to_device=true"
for extra in "--set tail_backend=slots" "--set tail_backend=triton" "--set tail_backend=triton-fused-loss" \
             "--set tail_backend=triton --set embedding_backend=triton" \
             "--set tail_backend=triton-fused-loss --set embedding_backend=triton"; do
  echo "== large, hand-set knobs $extra"
  timeout 150 python3 -m benchmarks.trainer_phases --size large --device cuda --steps 30 --warmup 5 --phase-steps 10 \
      $HAND $extra 2>&1 | tail -14
done

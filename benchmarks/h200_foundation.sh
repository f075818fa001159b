#!/usr/bin/env bash
# One GPU session's worth of foundation measurements on a CUDA machine: CUDA smoke tests of the
# trainer's paths, then step time per phase at `large` for the baseline and a few knob settings.
# Usage: OUT=/some/dir bash benchmarks/h200_foundation.sh   (results and logs land in $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

echo "== the trainer's tests, CUDA parametrisations included"
timeout 400 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/haste_rec \
    > "$OUT/cuda_tests.txt" 2>&1
tail -3 "$OUT/cuda_tests.txt"

run() {  # name, then --set args
  local name=$1; shift
  echo "== large: $name"
  timeout 420 python3 -m benchmarks.trainer_phases --size large --device cuda --steps 30 --warmup 5 \
      --phase-steps 10 --json-out "$OUT/large_${name}.json" "$@" 2>&1
}
run baseline
run fused --set embedding_grad_mode=fused
run fused_bf16 --set embedding_grad_mode=fused --set precision=bf16-autocast --set tail_backend=slots
run hand_tuned --set embedding_grad_mode=fused --set precision=bf16-autocast --set tail_backend=slots \
    --set data_workers=2 --set pin_memory=true --set prefetch_to_device=true
run cached_planned --set embedding_placement=cached --set embedding_grad_mode=fused \
    --set embedding_cache_plan=planned --set embedding_cache_fraction=0.1 --set pin_memory=true

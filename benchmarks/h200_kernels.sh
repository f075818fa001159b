#!/usr/bin/env bash
# One GPU call: the Triton kernels' CUDA tests (bf16 and fp32, trainer trajectories) and the kernel
# benchmarks (HASTE tail at the paper's shapes, pooled embeddings at 26 x 1M x 128).
# TUNE=1 adds the meta-parameter sweeps (tail kernels; embedding kernels; the fused loss in fp32 at each
# tl.dot precision). Each step has its own timeout; split it over calls (run the steps inline) when a
# call's limit is near.
# Usage: OUT=/some/dir [TUNE=1] bash benchmarks/h200_kernels.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$OUT/cache"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== CUDA tests of the Triton kernels and backends"
timeout 280 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning \
    tests/haste_rec/test_triton_tail.py tests/haste_rec/test_triton_tail_fused.py \
    tests/haste_rec/test_triton_tail_perlabel.py tests/haste_rec/test_triton_tail_trainer.py \
    tests/haste_rec/test_haste.py tests/haste_rec/test_triton_embedding.py tests/benchmarks \
    > "$OUT/cuda_kernel_tests.txt" 2>&1
tail -3 "$OUT/cuda_kernel_tests.txt"; grep -E "^(FAILED|ERROR)" "$OUT/cuda_kernel_tests.txt" | head -20
echo "== HASTE tail kernels"
timeout 200 python3 -m benchmarks.kernels --out "$OUT/kernels.json" > "$OUT/kernels.md" 2> "$OUT/kernels.err"
cat "$OUT/kernels.md"; tail -5 "$OUT/kernels.err"
echo "== embedding kernels"
timeout 150 python3 -m benchmarks.embedding_kernels --out "$OUT/embedding_kernels.json" > "$OUT/embedding_kernels.md" 2>&1
cat "$OUT/embedding_kernels.md" | tail -40
if [ "${TUNE:-0}" = 1 ]; then
echo "== tail kernel meta-parameter sweep at the main shape"
timeout 240 python3 -m benchmarks.kernels --configs main --tune --out "$OUT/tune.json" > "$OUT/tune.md" 2> "$OUT/tune.err"
cat "$OUT/tune.md" | tail -40; tail -3 "$OUT/tune.err"
echo "== embedding kernel knob sweep (tile, warps, stages) at 26 x 1M x 128"
timeout 240 python3 -m benchmarks.embedding_kernels --tune --out "$OUT/embedding_tune.json" > "$OUT/embedding_tune.md" 2>&1
grep -A 60 "knob sweep" "$OUT/embedding_tune.md" | head -60
echo "== the fused loss kernel in fp32 at each tl.dot precision (the knob matmul_precision), around the defaults"
timeout 150 python3 -m benchmarks.fused_bce_sweep --dtypes float32 --precisions ieee tf32 tf32x3 --quick \
    --out "$OUT/fused_fp32.json" 2>&1 | grep -v Warning | tail -20
fi

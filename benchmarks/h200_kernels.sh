#!/usr/bin/env bash
# The Triton kernels on a GPU: their CUDA tests (bf16 and fp32, trainer trajectories), the kernel
# benchmarks (HASTE tail at the paper's shapes, pooled embeddings at 26 x 1M x 128) and, as a part of its
# own, the meta-parameter sweeps (tail kernels; embedding kernels; the fused loss in fp32 at each tl.dot
# precision, the knob matmul_precision).
#
# PART picks what runs: "tests", "bench", "tune", or several (default "tests bench"; TUNE=1 adds "tune").
# "tune" is "tune-tail tune-embedding tune-fused"; each can be named alone, so that two GPUs share the parts.
# Each step has its own timeout; "tests bench" and "tune" each fit one 10-minute device call, and each
# leaves at most 6 files under $OUT (stderr of every step in stderr.log; the compile cache stays outside).
# Usage: OUT=/some/dir [PART="tests bench" | PART=tune] bash benchmarks/h200_kernels.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; PART=${PART:-tests bench}
[ "${TUNE:-0}" = 1 ] && PART="$PART tune"
PART=" $PART "; [[ "$PART" == *" tune "* ]] && PART="$PART tune-tail tune-embedding tune-fused "
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
unset TRITON_INTERPRET
log="$OUT/stderr.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ "$PART" == *" tests "* ]]; then
    echo "== CUDA tests of the Triton kernels and backends"
    timeout 280 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning \
        tests/haste_rec/test_triton_tail.py tests/haste_rec/test_triton_tail_fused.py \
        tests/haste_rec/test_triton_tail_perlabel.py tests/haste_rec/test_triton_tail_trainer.py \
        tests/haste_rec/test_haste.py tests/haste_rec/test_triton_embedding.py tests/benchmarks \
        > "$OUT/cuda_kernel_tests.txt" 2>&1
    tail -3 "$OUT/cuda_kernel_tests.txt"; grep -E "^(FAILED|ERROR)" "$OUT/cuda_kernel_tests.txt" | head -20
fi
if [[ "$PART" == *" bench "* ]]; then
    echo "== HASTE tail kernels"
    timeout 200 python3 -m benchmarks.kernels --out "$OUT/kernels.json" > "$OUT/kernels.md" 2>> "$log"
    grep -E "^#|triton tail_forward|fused bce|fwd \+ both|per-label /" "$OUT/kernels.md"
    echo "== embedding kernels"
    timeout 150 python3 -m benchmarks.embedding_kernels --out "$OUT/embedding_kernels.json" \
        > "$OUT/embedding_kernels.md" 2>> "$log"
    tail -25 "$OUT/embedding_kernels.md"
fi
if [[ "$PART" == *" tune-tail "* ]]; then
    echo "== tail kernel meta-parameter sweep at the main shape"
    timeout 240 python3 -m benchmarks.kernels --configs main --tune --out "$OUT/tune.json" > "$OUT/tune.md" 2>> "$log"
    grep -A 25 "knob sweep" "$OUT/tune.md"
fi
if [[ "$PART" == *" tune-embedding "* ]]; then
    echo "== embedding kernel knob sweep (tile, warps, stages) at 26 x 1M x 128"
    timeout 200 python3 -m benchmarks.embedding_kernels --tune --out "$OUT/embedding_tune.json" \
        2>> "$log" | grep -A 60 "knob sweep" | head -60
fi
if [[ "$PART" == *" tune-fused "* ]]; then
    echo "== the fused loss kernel in fp32 at each tl.dot precision (the knob matmul_precision), around the defaults"
    timeout 150 python3 -m benchmarks.fused_bce_sweep --dtypes float32 --precisions ieee tf32 tf32x3 --quick \
        --out "$OUT/fused_fp32.json" 2>> "$log" | tail -20
fi
[ -s "$log" ] && { echo "== stderr (last lines)"; grep -v Warning "$log" | tail -5; }
true

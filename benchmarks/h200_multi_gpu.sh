#!/usr/bin/env bash
# Issue 8's multi-GPU measurements, one GPU call on a host of 2+ H200s (NCCL; NVLink multicast stays off):
#   PART=scaling  scaling.py at SIZES over 1 and 2 ranks: baseline and tuned configs, each sharding plan,
#                 with the 2-rank numerics check (size small) and a ranked profile of each 2-rank run;
#   PART=agent    `sg-opt optimize` at AGENT_SIZE with --gpus 1, then --gpus 2 (AGENT_GPUS="1 2"; one of them
#                 per call where a run takes most of a call), same candidate budget: the agent's wall
#                 time for each, run dirs tarred.
# Usage: OUT=/dir PART="scaling agent" SIZES="large" bash benchmarks/h200_multi_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}; PART=${PART:-scaling}; SIZES=${SIZES:-large}
TUNED=${TUNED:-"--set embedding_grad_mode=fused --set tail_backend=slots"}
PLANS=${PLANS:-"table-wise/replicated row-wise/replicated table-wise/label-groups"}
AGENT_SIZE=${AGENT_SIZE:-medium}; AGENT_ITERS=${AGENT_ITERS:-6}; AGENT_MINUTES=${AGENT_MINUTES:-4}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sg-opt-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

SCALING_FLAGS=${SCALING_FLAGS:---numerics --profile}; AGENT_TIMEOUT=${AGENT_TIMEOUT:-$((AGENT_MINUTES * 60 + 200))}
if [[ " $PART " == *" scaling "* ]]; then
    for size in $SIZES; do
        echo "== $(date -u +%FT%TZ) scaling $size tuned ($TUNED)"
        # shellcheck disable=SC2086
        python3 benchmarks/scaling.py --sizes "$size" --ranks 1 2 --plans $PLANS $TUNED $SCALING_FLAGS \
            --steps 30 --out "$OUT/scaling_${size}_tuned.json" 2>&1 | tee "$OUT/scaling_${size}_tuned.log" | tail -12
        if [ -n "${BASELINE_TOO:-}" ]; then
            echo "== $(date -u +%FT%TZ) scaling $size baseline config"
            python3 benchmarks/scaling.py --sizes "$size" --ranks 1 2 --plans table-wise/replicated --steps 20 \
                --out "$OUT/scaling_${size}_baseline.json" 2>&1 | tee "$OUT/scaling_${size}_baseline.log" | tail -6
        fi
    done
fi

if [[ " $PART " == *" agent "* ]]; then
    for gpus in ${AGENT_GPUS:-1 2}; do
        runs="$OUT/agent_gpus$gpus"; mkdir -p "$runs"
        echo "== $(date -u +%FT%TZ) sg-opt optimize --size $AGENT_SIZE --gpus $gpus --max-iters $AGENT_ITERS"
        start=$SECONDS
        timeout "$AGENT_TIMEOUT" python3 -m sg_opt.cli optimize --target haste-rec --size "$AGENT_SIZE" \
            --device cuda --gpus "$gpus" --max-iters "$AGENT_ITERS" --max-minutes "$AGENT_MINUTES" --out "$runs" \
            --json > "$runs.json" 2> "$runs.err"
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

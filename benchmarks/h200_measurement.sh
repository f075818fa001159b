#!/usr/bin/env bash
# One GPU call's worth of measurement-core checks on a CUDA machine: the validators' and profilers'
# tests with their CUDA cases, the device ceilings, and `sg-opt profile --fine` of haste-rec @ large.
# Usage: OUT=/some/dir bash benchmarks/h200_measurement.sh
set -uo pipefail
OUT=${OUT:-/tmp/sg-opt-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$OUT/cache"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
echo "== validators and profilers tests (CUDA cases included)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/validators tests/profilers \
    > "$OUT/cuda_measurement_tests.txt" 2>&1
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

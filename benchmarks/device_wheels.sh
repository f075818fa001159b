#!/usr/bin/env bash
# The project's Python dependencies as wheels for an offline GPU machine (Python 3.12, x86-64), into .whl/
# (gitignored). The H200 machines' image has torch, triton, numpy, rich and typer, but not pydantic, langgraph,
# openai or optuna. Run it where pip can download, once per checkout; copy .whl/ to the GPU machine with the
# tree, and start each call there with `source benchmarks/device_env.sh` (then `bash benchmarks/gpu.sh PART`).
# numpy is left out: the image's torch is built against its own.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    "openai>=1.40" "langgraph>=0.2" "langgraph-checkpoint-sqlite>=2.0" "pydantic>=2.6" "optuna==5.0.0"
rm -f .whl/numpy-*.whl
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1), in .whl/"

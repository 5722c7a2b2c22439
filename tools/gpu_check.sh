#!/usr/bin/env bash
# One prepared GPU check, for a session that is lent a CUDA machine (the `device` tool), run from the repo root:
#   bash tools/gpu_check.sh
# It builds the native copy kernel in place, runs the GPU-marked tests and the CUDA copy benchmark, and leaves
# logs in $OUT (or ./gpu-out). The device image has torch, pytest, hypothesis, uvloop, xxhash and rich but not
# pytest-asyncio: carry its wheel (see the device tool's README: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 ... -d .whl pytest-asyncio==1.5.0`, then name .whl in `carry`).
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_cuda.py 2>&1 | tee "$out/gpu_tests.log" | tail -15
python3 benchmarks/bench_copy_cuda.py 2>&1 | tee "$out/bench_copy_cuda.log" | tail -15
cp benchmarks/results/copy_cuda.json "$out/" 2>/dev/null || true

#!/usr/bin/env bash
# The one prepared GPU check, for a session that is lent a CUDA machine (the `device` tool), from the repo root:
#   bash tools/gpu_check.sh
# Exits non-zero if any check fails. Builds the native copy kernel in place, then runs tools/gpu_check.py (the
# `gpu` tests, the ordering/lag/staging/concurrency checks and benchmarks/bench_device.py on CUDA); logs and
# gpu_check.json land in $OUT (or ./gpu-out). The device image has torch, pytest, hypothesis, uvloop, xxhash
# and rich but not pytest-asyncio: carry its wheel (the device tool's README: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 ... -d .whl pytest-asyncio==1.5.0 pytest-timeout==2.4.0`, then name
# .whl in `carry`).
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export OUT="$out" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || exit 1
python3 tools/gpu_check.py --device cuda "$@" 2>&1 | tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
# Where the bandwidth goes (plain copies, the staged store by hand, aiokv's timeline): informational, every run.
timeout 300 python3 tools/gpu_diag.py 2>&1 | tee "$out/gpu_diag.log"
cp benchmarks/results/device.json "$out/" 2>/dev/null || true
exit "$rc"

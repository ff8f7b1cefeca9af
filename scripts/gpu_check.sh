#!/usr/bin/env bash
# The prepared device check of issue 25, one call on a lent GPU machine (python3 there holds a
# CUDA torch): the CUDA tests (every gate, the MoE layer, the training loop, the C.1 bank, the
# char-LM, Mixtral with our router, export; each against the CPU), then the benchmark suite on
# the GPU, then DSelect-k's formulations on the GPU (benchmarks/gpu_gate.py). Results land in
# $OUT (default /tmp/gpu_check): env.txt, gpu_tests.log, bench.log, history.jsonl (one line per
# suite run, as benchmarks/results/history.jsonl), gpu_gate.json and the logs.
# Usage: DSELECTK_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
# The CPU references use the NumPy host kernel: numba (in the device image) would compile its
# kernel in every test process, 20 s per dtype and direction, which cut an earlier run short.
export DSELECTK_KERNEL=${DSELECTK_KERNEL:-numpy}
PY=${PYTHON:-python3}
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c 'import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__, torch.cuda.get_device_name())'
    echo "cpus: $(nproc)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
} 2>&1 | tee "$OUT/env.txt"
timeout "${TESTS_S:-200}" "$PY" -m pytest -p no:cacheprovider -q -rs --durations=12 -m gpu tests/test_device.py \
    2>&1 | tee "$OUT/gpu_tests.log"
timeout "${BENCH_S:-240}" "$PY" -m benchmarks --device cuda --only small_batch gate moe train_step \
    --history "$OUT/history.jsonl" --out /tmp/gpu_check_json 2>&1 | tee "$OUT/bench.log"
if [ "${COMPILE_S:-0}" -gt 0 ]; then
    timeout "$COMPILE_S" "$PY" -m benchmarks --device cuda --quick --only train_step --compile \
        --history "$OUT/history.jsonl" --out /tmp/gpu_check_json 2>&1 | tee "$OUT/bench_compile.log"
fi
timeout "${GATE_S:-120}" "$PY" -m benchmarks.gpu_gate --out "$OUT/gpu_gate.json" 2>&1 \
    | grep -v USDT | tee "$OUT/gpu_gate.log"

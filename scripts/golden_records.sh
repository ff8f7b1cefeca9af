#!/usr/bin/env bash
# Small runs of every study, for comparing records before and after a change:
#
#     scripts/golden_records.sh OUT            # with the kernel DSELECTK_KERNEL picks (default auto)
#     DSELECTK_KERNEL=numpy scripts/golden_records.sh OUT
#     python scripts/compare_records.py OLD/recovery NEW/recovery   # for each study folder
#
# DSELECTK ?= the command to run (default `dselectk`); DATA ?= the data folder (MovieLens, MNIST).
set -euo pipefail
OUT=${1:?usage: golden_records.sh OUT}
DSELECTK=${DSELECTK:-dselectk}
DATA=${DATA:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data}
common=(--jobs 1 --threads 1 --no-progress)
$DSELECTK reproduce synthetic --out "$OUT/synthetic" "${common[@]}" --tasks 16 --reps 2 \
    --epochs 2 --n-train 2000 --n-eval 500
$DSELECTK reproduce recovery --out "$OUT/recovery" "${common[@]}" --reps 2 --epochs 3 --lrs 1e-2
$DSELECTK reproduce recovery --out "$OUT/recovery_8_2" "${common[@]}" --reps 2 --epochs 3 \
    --lrs 1e-2 --experts 8 --true-experts 2
$DSELECTK reproduce selection --out "$OUT/selection" "${common[@]}" --shapes 16/4 --reps 2 \
    --lrs 1e-2 --epochs 3 --tasks
$DSELECTK reproduce token-moe --out "$OUT/token_moe" "${common[@]}" --seeds 1 --steps 30 \
    --corpus-bytes 20000 --val-windows 8 --gates dselect_k topk
$DSELECTK reproduce movielens --out "$OUT/movielens" "${common[@]}" --data-dir "$DATA" \
    --variant ml-100k --reps 1 --epochs 1 --max-train 4000 --gates dselect_k_static topk_static
$DSELECTK reproduce multi-mnist --out "$OUT/multi_mnist" "${common[@]}" --data-dir "$DATA" \
    --reps 1 --epochs 1 --n-train 512 --n-val 128 --n-test 128 --gates dselect_k_static softmax

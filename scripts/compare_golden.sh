#!/usr/bin/env bash
# Compare two folders written by scripts/golden_records.sh, study by study; exit 1 when any differs.
set -uo pipefail
OLD=${1:?usage: compare_golden.sh OLD NEW}; NEW=${2:?usage: compare_golden.sh OLD NEW}
PY=${PYTHON:-python}
status=0
for d in synthetic recovery recovery_8_2 selection token_moe movielens multi_mnist; do
    printf '%-14s ' "$d"
    $PY "$(dirname "$0")/compare_records.py" "$OLD/$d" "$NEW/$d" | tail -1 || status=1
done
exit $status

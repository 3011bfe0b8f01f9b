#!/usr/bin/env bash
# Reproduce the "Computational Performance" chapter's experiments with mlcomp, on this machine.
#
#   [THREADS=1] benchmarks/textbook/run.sh [OUT_DIR] [extra `mlcomp bench` options, e.g. --min-repeats 2]
#
# Writes, under OUT_DIR (default benchmarks/textbook/results):
#   bench.txt/.json/.csv/.png     every zoo model, eager vs each target, batch 1 and 32
#   <study>.txt/.json/.png        hybridize, asynchrony, memory, parallelism, roofline
# THREADS sets the intra-op threads of torch and every compiled runtime (not for the parallelism
# study, which varies them itself). Every table states the machine, the thread count and the load
# average when it ran.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/textbook/results}
shift || true
MLCOMP=${MLCOMP:-.venv/bin/mlcomp}
THREADS_OPT=()
[[ -n "${THREADS:-}" ]] && THREADS_OPT=(--threads "$THREADS")
mkdir -p "$OUT"

"$MLCOMP" bench --zoo --targets eager,cpu,onnxruntime,tvm --batch 1,32 --budget 1 --progress \
    "${THREADS_OPT[@]}" --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plot "$OUT/bench.png" "$@" \
    | tee "$OUT/bench.txt"

for study in hybridize asynchrony memory parallelism roofline; do
    opts=("${THREADS_OPT[@]}")
    [[ $study == parallelism ]] && opts=()
    "$MLCOMP" study "$study" "${opts[@]}" --plot "$OUT/$study.png" --json "$OUT/$study.json" \
        | tee "$OUT/$study.txt"
done
echo "results in $OUT"

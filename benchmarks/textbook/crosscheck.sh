#!/usr/bin/env bash
# Whole-process cross-check of `mlcomp bench` with hyperfine (no in-process clock involved).
#
#   benchmarks/textbook/crosscheck.sh [MODEL] [TARGETS] [CALLS]     (defaults: mlp cpu,onnxruntime 20000)
#
# 1. `mlcomp compile` saves one artifact per target; `mlcomp bench` measures the in-process speedups.
# 2. hyperfine times whole processes: eager and each loaded artifact (crosscheck.py, under
#    torch.inference_mode like the bench) with 0 and CALLS calls, and each artifact through the
#    targets' own `mlcomp run DIR --repeat 1` and `--repeat CALLS+1`.
# 3. per call = (slow - fast) / CALLS removes start-up; the eager/artifact ratio is set beside the bench's.
# Every process runs with one intra-op thread (OMP_NUM_THREADS=1, --threads 1) so that all runtimes
# compete for the same single core.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-mlp}
TARGETS=${2:-cpu,onnxruntime}
CALLS=${3:-20000}
OUT=${OUT:-$(mktemp -d /tmp/mlcomp-crosscheck.XXXX)}
PY=.venv/bin/python
MLCOMP=.venv/bin/mlcomp
export OMP_NUM_THREADS=1
mkdir -p "$OUT"

"$MLCOMP" bench "$MODEL" --targets "eager,$TARGETS" --batch 1 --threads 1 --budget 2 --no-memory \
    --json "$OUT/bench.json" | tee "$OUT/bench.txt"

cmds=(-n "eager 0" "$PY benchmarks/textbook/crosscheck.py eager $MODEL --calls 0"
      -n "eager $CALLS" "$PY benchmarks/textbook/crosscheck.py eager $MODEL --calls $CALLS")
IFS=, read -ra targets <<< "$TARGETS"
for t in "${targets[@]}"; do
    "$MLCOMP" compile "$MODEL" --target "$t" --threads 1 -o "$OUT/$MODEL-$t" >/dev/null
    # like for like with the bench: the loaded artifact called under torch.inference_mode
    cmds+=(-n "$t 0" "$PY benchmarks/textbook/crosscheck.py artifact $OUT/$MODEL-$t --calls 0"
           -n "$t $CALLS" "$PY benchmarks/textbook/crosscheck.py artifact $OUT/$MODEL-$t --calls $CALLS")
    # and through the targets' own CLI, `mlcomp run --repeat` (one call is its baseline)
    cmds+=(-n "run:$t 1" "$MLCOMP run $OUT/$MODEL-$t --repeat 1"
           -n "run:$t $((CALLS + 1))" "$MLCOMP run $OUT/$MODEL-$t --repeat $((CALLS + 1))")
done
hyperfine --warmup 1 --min-runs ${RUNS:-6} --export-json "$OUT/hyperfine.json" "${cmds[@]}"
echo
echo "whole-process (hyperfine, median of runs):"
$PY benchmarks/textbook/crosscheck.py summarize "$OUT/hyperfine.json"
echo
echo "in-process (mlcomp bench, per call; the whole-process figure is a mean over every call):"
$PY - "$OUT/bench.json" <<'PY'
import json, sys
for res in json.load(open(sys.argv[1])):
    rows = {r["target"]: r for r in res["rows"] if r["status"] == "ok"}
    eager = rows["eager"]["timing"]
    for t, r in rows.items():
        tm = r["timing"]
        print(f"{t:<14} median {tm['median_s'] * 1e6:7.1f} µs (speedup {r['speedup']:.2f}x)   "
              f"mean {tm['mean_s'] * 1e6:7.1f} µs (speedup {eager['mean_s'] / tm['mean_s']:.2f}x)")
PY
echo "files in $OUT"

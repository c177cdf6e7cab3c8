#!/usr/bin/env bash
# Step time of the scripted GPT (examples/torchscript/gpt.py, --model torchscript:PATH) against the
# C++ GPT of the same dims (--model gpt-custom --dims D), both at 2x2 through hsdp-launch, in
# alternating rounds of one run. Prints the median ratio scripted / C++ (target <= 1.3).
#
#   bench/torchscript/run.sh [BUILD_DIR]   (env: DIMS d_model,n_layers,n_heads,seq_len,
#                                            STEPS, WARMUP, MICROBATCH_SIZE, ROUNDS)
# Needs a python3 with torch (Debian python3-torch): HSDP_TORCH_PYTHON, else /usr/bin/python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="$(realpath "${1:-build}")"
DIMS="${DIMS:-128,4,4,64}"
STEPS="${STEPS:-25}"
WARMUP="${WARMUP:-5}"
MICROBATCH_SIZE="${MICROBATCH_SIZE:-4}"
ROUNDS="${ROUNDS:-3}"
PYTHON="${HSDP_TORCH_PYTHON:-/usr/bin/python3}"
WORLD=4
MESH=2x2
RUN_DIR="$(mktemp -d /tmp/hsdp-bench-ts-XXXXXX)"

IFS=, read -r D L H T <<<"$DIMS"
"$PYTHON" examples/torchscript/gpt.py "$RUN_DIR/gpt.pt" --d-model "$D" --n-layers "$L" \
  --n-heads "$H" --seq-len "$T" >/dev/null

echo "bench: dims $DIMS, $WORLD processes x 1 thread, mesh $MESH, $STEPS steps ($WARMUP warm-up)," \
  "$ROUNDS alternating rounds; C++ GPT vs scripted GPT"
for round in $(seq 1 "$ROUNDS"); do
  "$BUILD_DIR/bin/hsdp-launch" --workers "$WORLD" --mesh "$MESH" --model gpt-custom \
    --steps "$STEPS" --run-dir "$RUN_DIR/cpp-$round" -- --dims "$DIMS" \
    --microbatch-size "$MICROBATCH_SIZE" --threads 1 2>"$RUN_DIR/cpp-$round.log"
  "$BUILD_DIR/bin/hsdp-launch" --workers "$WORLD" --mesh "$MESH" \
    --model "torchscript:$RUN_DIR/gpt.pt" --steps "$STEPS" --run-dir "$RUN_DIR/ts-$round" -- \
    --units 'layers.*' --microbatch-size "$MICROBATCH_SIZE" --threads 1 \
    2>"$RUN_DIR/ts-$round.log"
done

"$PYTHON" - "$RUN_DIR" "$WARMUP" "$WORLD" "$ROUNDS" <<'PY'
import json, statistics, sys
run, warmup, world, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def step_time(side, rnd):
    ranks = [[json.loads(l) for l in open(f"{run}/{side}-{rnd}/worker-{r}.jsonl")] for r in range(world)]
    steps = range(warmup, len(ranks[0]))
    return statistics.median(max(ranks[r][s]["step_seconds"] for r in range(world)) for s in steps)
ratios = []
for rnd in range(1, rounds + 1):
    c, t = step_time("cpp", rnd), step_time("ts", rnd)
    ratios.append(t / c)
    print(f"round {rnd}: median step time C++ GPT {c:.4f} s, scripted GPT {t:.4f} s, ratio {t / c:.3f}")
print(f"ratio scripted/C++ over {rounds} rounds: median {statistics.median(ratios):.3f} (target <= 1.3)")
PY
echo "bench: reports in $RUN_DIR"

#!/usr/bin/env bash
# Step time of the scripted GPT (examples/torchscript/gpt.py, --model torchscript:PATH) against the
# C++ GPT of the same dims (--model gpt-custom --dims D), both at 2x2 through hsdp-launch, in
# alternating rounds of one run. Prints the median ratio scripted / C++ (target <= 1.3), the same
# outside the collectives, and the single-process (--reference) ratio: the model's own cost.
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
  # The same steps in one process (--reference, no collectives): the model's own cost, with less
  # scheduling noise than 4 processes.
  "$BUILD_DIR/bin/hsdp-worker" --reference --world-size "$WORLD" --model gpt-custom --dims "$DIMS" \
    --steps "$STEPS" --microbatch-size "$MICROBATCH_SIZE" --threads 1 \
    --report-file "$RUN_DIR/cpp-ref-$round.jsonl" 2>>"$RUN_DIR/ref.log"
  "$BUILD_DIR/bin/hsdp-worker" --reference --world-size "$WORLD" --model "torchscript:$RUN_DIR/gpt.pt" \
    --units 'layers.*' --steps "$STEPS" --microbatch-size "$MICROBATCH_SIZE" --threads 1 \
    --report-file "$RUN_DIR/ts-ref-$round.jsonl" 2>>"$RUN_DIR/ref.log"
done

"$PYTHON" - "$RUN_DIR" "$WARMUP" "$WORLD" "$ROUNDS" <<'PY'
import json, statistics, sys
run, warmup, world, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def reports(side, rnd):
    return [[json.loads(l) for l in open(f"{run}/{side}-{rnd}/worker-{r}.jsonl")] for r in range(world)]
def median_over_steps(ranks, field):
    steps = range(warmup, len(ranks[0]))
    return statistics.median(max(field(ranks[r][s]) for r in range(world)) for s in steps)
step = lambda rec: rec["step_seconds"]
# What is not communication wait: the model's forward and backward, the optimizer, the engine.
compute = lambda rec: rec["step_seconds"] - rec["all_gather_seconds"] - rec["reduce_scatter_seconds"]
ratios, compute_ratios = [], []
for rnd in range(1, rounds + 1):
    cpp, ts = reports("cpp", rnd), reports("ts", rnd)
    c, t = median_over_steps(cpp, step), median_over_steps(ts, step)
    cc, tc = median_over_steps(cpp, compute), median_over_steps(ts, compute)
    ratios.append(t / c)
    compute_ratios.append(tc / cc)
    print(f"round {rnd}: median step time C++ GPT {c:.4f} s, scripted GPT {t:.4f} s, ratio {t / c:.3f}"
          f" (outside collectives: {cc:.4f} s vs {tc:.4f} s, ratio {tc / cc:.3f})")
ref_ratios = []
for rnd in range(1, rounds + 1):
    ref = lambda side: statistics.median(json.loads(l)["step_seconds"] for l in
                                         list(open(f"{run}/{side}-ref-{rnd}.jsonl"))[warmup:])
    c, t = ref("cpp"), ref("ts")
    ref_ratios.append(t / c)
    print(f"round {rnd}, one process (--reference, world {world}): C++ {c:.4f} s, scripted {t:.4f} s,"
          f" ratio {t / c:.3f}")
print(f"one process: median ratio scripted/C++ {statistics.median(ref_ratios):.3f}")
act = lambda side: max(r["activation_bytes"] for r in reports(side, 1)[0])
print(f"peak activation bytes rank 0: C++ {act('cpp')}, scripted {act('ts')}")
print(f"ratio scripted/C++ over {rounds} rounds: median {statistics.median(ratios):.3f} (target <= 1.3);"
      f" outside collectives median {statistics.median(compute_ratios):.3f}")
PY
echo "bench: reports in $RUN_DIR"

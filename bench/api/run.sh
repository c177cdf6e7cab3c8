#!/usr/bin/env bash
# The GPT through the generic runner (Task API) against the worker before it (the GPT wired into
# the training loop), on bench/ddp's shape: same launcher flags, alternating rounds, one run.
#
#   bench/api/run.sh [BUILD_DIR]   (env: BASELINE_REV (default db10041, the last commit before the
#                                   Task API), DIMS, STEPS, WARMUP, MICROBATCH_SIZE, MESH, ROUNDS)
# Builds the baseline's hsdp-launch/worker/coordinator once into /tmp/hsdp-bench-api-<rev>/build
# (ccache makes it quick when its objects are cached), then alternates baseline and current.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="$(realpath "${1:-build}")"
BASELINE_REV="${BASELINE_REV:-db10041}"
DIMS="${DIMS:-256,4,4,128}"
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-5}"
MICROBATCH_SIZE="${MICROBATCH_SIZE:-4}"
MESH="${MESH:-1x4}"
ROUNDS="${ROUNDS:-3}"
WORLD=4
BASE_DIR="/tmp/hsdp-bench-api-$BASELINE_REV"
RUN_DIR="$(mktemp -d /tmp/hsdp-bench-api-run-XXXXXX)"

if [ ! -x "$BASE_DIR/build/bin/hsdp-worker" ]; then
  rm -rf "$BASE_DIR"
  git worktree add --detach "$BASE_DIR/src" "$BASELINE_REV" >/dev/null
  cmake -S "$BASE_DIR/src" -B "$BASE_DIR/build" -G Ninja -DHSDP_BUILD_BENCH=OFF >/dev/null
  cmake --build "$BASE_DIR/build" -j "$(nproc)" --target hsdp-worker hsdp-launch hsdp-coordinator \
    >"$BASE_DIR/build.log"
  git worktree remove --force "$BASE_DIR/src"
fi

echo "bench: dims $DIMS, $WORLD processes x 1 thread, mesh $MESH, $STEPS steps ($WARMUP warm-up)," \
  "$ROUNDS alternating rounds; baseline $BASELINE_REV vs current $(git rev-parse --short HEAD)"
for round in $(seq 1 "$ROUNDS"); do
  for side in baseline current; do
    bin="$BUILD_DIR/bin"
    [ "$side" = baseline ] && bin="$BASE_DIR/build/bin"
    "$bin/hsdp-launch" --workers "$WORLD" --mesh "$MESH" --model gpt-small --steps "$STEPS" \
      --run-dir "$RUN_DIR/$side-$round" -- --dims "$DIMS" --microbatch-size "$MICROBATCH_SIZE" \
      --threads 1 2>"$RUN_DIR/$side-$round.log"
  done
done

/usr/bin/python3 - "$RUN_DIR" "$WARMUP" "$WORLD" "$ROUNDS" <<'PY'
import json, statistics, sys
run, warmup, world, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def step_time(side, rnd):
    ranks = [[json.loads(l) for l in open(f"{run}/{side}-{rnd}/worker-{r}.jsonl")] for r in range(world)]
    steps = range(warmup, len(ranks[0]))
    return statistics.median(max(ranks[r][s]["step_seconds"] for r in range(world)) for s in steps)
ratios = []
for rnd in range(1, rounds + 1):
    b, c = step_time("baseline", rnd), step_time("current", rnd)
    ratios.append(c / b)
    print(f"round {rnd}: median step time baseline {b:.4f} s, current {c:.4f} s, ratio {c / b:.3f}")
print(f"ratio current/baseline over {rounds} rounds: median {statistics.median(ratios):.3f} (target <= 1.02)")
PY
echo "bench: reports in $RUN_DIR"

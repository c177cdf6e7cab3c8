#!/usr/bin/env bash
# hsdp vs PyTorch DDP on Gloo: same GPT shape, same global batch (4 ranks x microbatch), same number
# of single-threaded CPU processes. Prints step-time ratio and per-rank peak memory from one run.
#
#   bench/ddp/run.sh [BUILD_DIR]   (env: DIMS, STEPS, WARMUP, MICROBATCH_SIZE, MESH, ROUNDS, HSDP_ARGS)
# Needs Debian's python3-torch (run with /usr/bin/python3) and a built hsdp-launch/worker/coordinator.
# The two sides run in alternation, ROUNDS times each (DDP, hsdp, DDP, hsdp, ...), so drift in the
# machine's load hits both; the ratio is taken per round and over all rounds. HSDP_ARGS are extra
# hsdp-worker flags (e.g. "--shared-memory=false" for Gloo TCP only).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${1:-build}"
DIMS="${DIMS:-256,4,4,128}"        # gpt-small
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-5}"
MICROBATCH_SIZE="${MICROBATCH_SIZE:-4}"
MESH="${MESH:-1x4}"
ROUNDS="${ROUNDS:-2}"
HSDP_ARGS="${HSDP_ARGS:-}"
WORLD=4
RUN_DIR="$(mktemp -d /tmp/hsdp-bench-ddp-XXXXXX)"

echo "bench: dims $DIMS, $WORLD processes x 1 thread, global batch $((WORLD * MICROBATCH_SIZE)) x seq," \
  "$STEPS steps ($WARMUP warm-up), hsdp mesh $MESH ${HSDP_ARGS}, $ROUNDS alternating rounds"
for round in $(seq 1 "$ROUNDS"); do
  /usr/bin/python3 bench/ddp/ddp_gpt.py --world "$WORLD" --dims "$DIMS" --steps "$STEPS" \
    --warmup "$WARMUP" --microbatch-size "$MICROBATCH_SIZE" >"$RUN_DIR/ddp-$round.json"
  # shellcheck disable=SC2086  # HSDP_ARGS is a list of flags
  "$BUILD_DIR/bin/hsdp-launch" --workers "$WORLD" --mesh "$MESH" --model gpt-small --steps "$STEPS" \
    --run-dir "$RUN_DIR/hsdp-$round" -- --dims "$DIMS" --microbatch-size "$MICROBATCH_SIZE" \
    --threads 1 $HSDP_ARGS 2>"$RUN_DIR/launch-$round.log"
done

/usr/bin/python3 - "$RUN_DIR" "$WARMUP" "$WORLD" "$ROUNDS" <<'PY'
import json, re, sys
run, warmup, world, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mib = 1 << 20
hsdp_all, ddp_all = [], []
for rnd in range(1, rounds + 1):
    ddp = json.load(open(f"{run}/ddp-{rnd}.json"))
    ranks = [[json.loads(l) for l in open(f"{run}/hsdp-{rnd}/worker-{r}.jsonl")] for r in range(world)]
    steps = range(warmup, len(ranks[0]))
    hsdp_step = sum(max(ranks[r][s]["step_seconds"] for r in range(world)) for s in steps) / len(steps)
    hsdp_all.append(hsdp_step)
    ddp_all.append(ddp["step_seconds"])
    print(f"round {rnd}: step time hsdp {hsdp_step:.4f} s, ddp {ddp['step_seconds']:.4f} s, "
          f"ratio hsdp/ddp {hsdp_step / ddp['step_seconds']:.3f}")
hsdp_mean, ddp_mean = sum(hsdp_all) / rounds, sum(ddp_all) / rounds
print(f"step time over {rounds} rounds: hsdp {hsdp_mean:.4f} s, ddp {ddp_mean:.4f} s, "
      f"ratio hsdp/ddp {hsdp_mean / ddp_mean:.3f} (target < 1)")
transport = "?"
for line in open(f"{run}/hsdp-{rounds}/worker-0.log"):
    m = re.search(r"communicators: (\S+), (\S+)", line)
    if m:
        transport = f"{m.group(1)} / {m.group(2)}"
print(f"hsdp communicators (shard / replicate group): {transport}")
hsdp_state = [max(x["peak_memory_bytes"] for x in ranks[r]) for r in range(world)]
hsdp_rss = [max(x["rss_peak_bytes"] for x in ranks[r]) for r in range(world)]
print("per-rank peak parameter+gradient+AdamW bytes (MiB), last round:")
for r in range(world):
    print(f"  rank {r}: hsdp {hsdp_state[r] / mib:.2f}, ddp {ddp['state_bytes_per_rank'][r] / mib:.2f}, "
          f"ratio {hsdp_state[r] / ddp['state_bytes_per_rank'][r]:.3f} (target < 0.5)")
print("per-rank peak RSS (MiB), last round:")
for r in range(world):
    print(f"  rank {r}: hsdp {hsdp_rss[r] / mib:.0f}, ddp {ddp['rss_peak_bytes_per_rank'][r] / mib:.0f}")
print(f"loss hsdp: step 0 {ranks[0][0]['loss']:.4f} -> step {ranks[0][-1]['step']} {ranks[0][-1]['loss']:.4f}")
PY
echo "bench: reports in $RUN_DIR"

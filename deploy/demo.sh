#!/usr/bin/env bash
# The main job, end to end: set up, build, then train a tiny GPT (gpt-tiny's width, 4 blocks) on a
# local 2x2 HSDP cluster (4 CPU worker processes + a coordinator) for about two minutes. Halfway through, the reshard
# policy is changed live with `hsdpctl policy set --reshard-after-forward=false`; the run ends with
# a summary: loss at start and end, step time and per-rank memory before and after the change
# (the allocated peak, the parameter state within it, the gathered units, RSS), and the step at
# which it took effect.
#
#   ./deploy/demo.sh                      # defaults below
#   HSDP_DEMO_STEPS=300 ./deploy/demo.sh  # shorter
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS="${HSDP_DEMO_STEPS:-1600}"
# gpt-tiny's shape with 4 blocks instead of 2: with reshard after forward and a prefetch depth of
# 1, backward holds the current and the next block unsharded (plus root); with 2 blocks that is
# every unit, so turning reshard off would not show in the peak.
DIMS="${HSDP_DEMO_DIMS:-64,4,4,64}"
MICROBATCH_SIZE="${HSDP_DEMO_MICROBATCH_SIZE:-8}"
BUILD_DIR="${HSDP_BUILD_DIR:-build}"

bash deploy/install-deps.sh
cmake -S . -B "$BUILD_DIR" -G Ninja
cmake --build "$BUILD_DIR"

BIN="$BUILD_DIR/bin"
RUN_DIR="$(mktemp -d /tmp/hsdp-demo-XXXXXX)"
echo "demo: 4 workers, mesh 2x2, gpt-tiny dims $DIMS, $STEPS steps; logs and reports in $RUN_DIR"

"$BIN/hsdp-launch" --workers 4 --mesh 2x2 --model gpt-tiny --steps "$STEPS" --run-dir "$RUN_DIR" \
  -- --dims "$DIMS" --microbatch-size "$MICROBATCH_SIZE" &
LAUNCH_PID=$!
# Ctrl-C / SIGTERM: the launcher forwards it to every process it started.
trap 'kill -TERM "$LAUNCH_PID" 2>/dev/null; wait "$LAUNCH_PID" 2>/dev/null; exit 130' INT TERM

steps_done() { [ -f "$RUN_DIR/worker-0.jsonl" ] && wc -l <"$RUN_DIR/worker-0.jsonl" || echo 0; }
while [ "$(steps_done)" -lt $((STEPS / 2)) ]; do
  if ! kill -0 "$LAUNCH_PID" 2>/dev/null; then
    wait "$LAUNCH_PID" || exit $?
    echo "demo: the run ended before the policy change" >&2
    exit 1
  fi
  sleep 0.5
done

PORT="$(cat "$RUN_DIR/coordinator.port")"
echo
echo "demo: step $(steps_done): hsdpctl policy set --reshard-after-forward=false"
"$BIN/hsdpctl" --coordinator "127.0.0.1:$PORT" policy set --reshard-after-forward=false |
  tee "$RUN_DIR/policy-set.txt"

wait "$LAUNCH_PID"
trap - INT TERM

python3 - "$RUN_DIR" <<'PY'
import glob, json, os, re, sys
run = sys.argv[1]
# Each launched worker's rows over all its processes: worker-R.jsonl, then
# worker-R.restart-K.jsonl for each restart the launcher made.
ranks = {}
for path in sorted(glob.glob(os.path.join(run, "worker-*.jsonl"))):
    worker = int(re.match(r"worker-(\d+)", os.path.basename(path)).group(1))
    rows = [json.loads(l) for l in open(path) if l.strip()]
    ranks.setdefault(worker, []).extend(rows)
for rows in ranks.values():
    rows.sort(key=lambda r: r["step"])
# The launcher notes each restart in the worker's log, with how the previous
# process ended.
restarts = []
for path in sorted(glob.glob(os.path.join(run, "worker-*.log"))):
    worker = int(re.match(r"worker-(\d+)", os.path.basename(path)).group(1))
    for line in open(path, errors="replace"):
        m = re.match(r"hsdp-launch: restart \d+ of \d+ \(the previous process (.*)\)", line)
        if m:
            restarts.append(f"worker {worker} ({m.group(1)})")
r0 = ranks[0]
changed = next((r["step"] for r in r0 if "1" not in r["reshard_after_forward"]), None)
if changed is None:
    sys.exit("demo: the policy change never took effect")
warm = 5  # first steps include start-up; keep them out of the step-time averages
def mean(xs): return sum(xs) / max(len(xs), 1)
before = [r for r in r0 if warm <= r["step"] < changed]
after = [r for r in r0 if r["step"] >= changed]
mib = 1 << 20
print()
print("=== hsdp demo summary ===")
print(f"loss: step 0 {r0[0]['loss']:.4f} -> step {r0[-1]['step']} {r0[-1]['loss']:.4f}")
print(f"policy change (reshard_after_forward=false) took effect at step {changed}"
      f" (policy version {after[0]['policy_version']})")
print(f"step time (rank 0, mean): before {mean([r['step_seconds'] for r in before]):.4f} s,"
      f" after {mean([r['step_seconds'] for r in after]):.4f} s")
print("memory per rank, before -> after the change (MiB, the largest over the steps):")
print("  allocated: every byte LibTorch allocated at the step's peak (parameter state, gathered")
print("  units, activations, temporaries); parameter state: this rank's shards, their reduced")
print("  gradients and AdamW's two moments; gathered: unsharded parameters alive at once; RSS: process")
def peak(rows, key, scale=mib):
    return max(r[key] for r in rows) / scale
for rank in sorted(ranks):
    rows = ranks[rank]
    b = [r for r in rows if r["step"] < changed]
    a = [r for r in rows if r["step"] >= changed]
    print(f"  rank {rank}: allocated {peak(b, 'peak_memory_bytes'):.2f} -> {peak(a, 'peak_memory_bytes'):.2f},"
          f" parameter state {peak(b, 'parameter_state_bytes'):.2f} -> {peak(a, 'parameter_state_bytes'):.2f},"
          f" gathered {peak(b, 'gathered_peak_bytes'):.2f} -> {peak(a, 'gathered_peak_bytes'):.2f},"
          f" RSS {peak(b, 'rss_peak_bytes'):.0f} -> {peak(a, 'rss_peak_bytes'):.0f}")
if restarts:
    print(f"failures: {len(restarts)}, each restarted by hsdp-launch: {', '.join(restarts)}")
if not r0[-1]["loss"] < r0[0]["loss"] - 1.0:
    sys.exit("demo: loss did not fall")
PY

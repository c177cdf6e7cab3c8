#!/usr/bin/env bash
# What a lost worker costs an elastic hsdp job: a 2x2 job (4 single-threaded CPU workers on this
# machine) loses one worker to SIGKILL; the survivors re-form on 1x2 in their processes; then a
# replacement joins and is healed from its peers. Prints, from one run:
#   - kill -> first step committed by the survivors on 1x2 (and the coordinator's own account:
#     detect / reform / recover, `hsdpctl status`);
#   - replacement start -> its first committed step, and the heal itself (worker log);
#   - the commit vote's share of the step time (report files' commit_seconds / step_seconds,
#     before the kill): the cost of "no partial step" on every step.
#
#   bench/elastic/run.sh [BUILD_DIR]   (env: DIMS, STEPS, KILL_AT, MICROBATCH_SIZE)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${1:-build}"
BIN="$BUILD_DIR/bin"
DIMS="${DIMS:-256,4,4,128}"  # gpt-small
STEPS="${STEPS:-80}"
KILL_AT="${KILL_AT:-20}"
MICROBATCH_SIZE="${MICROBATCH_SIZE:-4}"
RUN="$(mktemp -d /tmp/hsdp-bench-elastic-XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

now() { date +%s.%N; }
lines() { [ -f "$1" ] && wc -l <"$1" || echo 0; }
# Seconds until `cond` holds (polled every 20 ms), at most 300 s.
wait_for() {
  local start
  start=$(now)
  for _ in $(seq 1 15000); do
    if eval "$1"; then
      python3 -c "print(f'{$(now) - $start:.2f}')"
      return 0
    fi
    sleep 0.02
  done
  echo "timed out waiting for: $1" >&2
  exit 1
}

"$BIN/hsdp-coordinator" --job-id bench --world-size 4 --mesh 2x2 --listen 127.0.0.1:0 \
  --port-file "$RUN/port" --state-dir "$RUN/state" --metrics-listen "" \
  --heartbeat-timeout 10 --reform-window 2 --join-wait 30 >"$RUN/coordinator.log" 2>&1 &
pids+=($!)
wait_for "[ -s $RUN/port ]" >/dev/null
ADDR="127.0.0.1:$(cat "$RUN/port")"
worker() {  # rank-hint report-file log
  "$BIN/hsdp-worker" --coordinator "$ADDR" --job-id bench --rank-hint "$1" --model gpt-small \
    --dims "$DIMS" --steps "$STEPS" --microbatch-size "$MICROBATCH_SIZE" --threads 1 \
    --gloo-hostname 127.0.0.1 --report-file "$2" >"$3" 2>&1 &
  pids+=($!)
}
for r in 0 1 2 3; do worker "$r" "$RUN/worker-$r.jsonl" "$RUN/worker-$r.log"; done
victim=${pids[4]}  # rank 3

wait_for "[ \$(lines $RUN/worker-0.jsonl) -ge $KILL_AT ]" >/dev/null
kill -9 "$victim"
survive=$(wait_for "grep -q '\"world_size\":2' $RUN/worker-0.jsonl")

worker 3 "$RUN/replacement.jsonl" "$RUN/replacement.log"
healed=$(wait_for "[ \$(lines $RUN/replacement.jsonl) -ge 1 ]")
for p in "${pids[@]:1:3}" "${pids[5]}"; do wait "$p"; done

echo "bench: gpt-small ($DIMS), 2x2 on $(nproc) cores, microbatch $MICROBATCH_SIZE, $STEPS steps;" \
  "worker 3 killed (SIGKILL) after step $KILL_AT"
echo "kill -> survivors' first committed step on 1x2:   ${survive} s"
echo "replacement start -> its first committed step:    ${healed} s (process start, join, heal, step)"
grep -h "healed shard" "$RUN/replacement.log" | sed 's/.*\] /replacement: /' | head -2
"$BIN/hsdpctl" --coordinator "$ADDR" status 2>/dev/null | grep -i -E "failure|lost|cost" || true
python3 - "$RUN" "$KILL_AT" <<'EOF'
import json, sys
run, kill_at = sys.argv[1], int(sys.argv[2])
commit = step = 0.0
n = 0
for r in range(4):
    for line in open(f"{run}/worker-{r}.jsonl"):
        d = json.loads(line)
        if 2 <= d["step"] < kill_at:  # after warm-up, before the kill
            commit += d["commit_seconds"]
            step += d["step_seconds"]
            n += 1
print(f"commit vote: {commit / n * 1e3:.2f} ms of a {step / n * 1e3:.1f} ms step "
      f"= {100 * commit / step:.2f}% (mean over {n} rank-steps; includes waiting for the slowest rank)")
EOF
echo "run dir: $RUN"

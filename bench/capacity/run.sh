#!/usr/bin/env bash
# Capacity: the largest GPT that trains with 4 CPU ranks on this machine, hsdp (1x4, sharded
# initialisation) against PyTorch DDP on Gloo, each job inside a memory cgroup of BUDGET_GIB.
#
#   bench/capacity/run.sh [BUILD_DIR]
#     env: BUDGET_GIB (default 22), HSDP_SIZES / DDP_SIZES (space-separated d,L,H,T lists, smallest
#          first), STEPS (default 2), MICROBATCH_SIZE (default 1)
#
# Each size runs STEPS steps of AdamW with 4 single-threaded processes. A job "fits" when it exits 0
# inside the cgroup; a job over the budget is OOM-killed inside the cgroup only. For every job it
# prints the parameter count, whether it fit, the cgroup's peak (all 4 processes) and the largest
# per-rank peak RSS. Needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory,
# Debian's python3-torch, and a built hsdp-launch/worker/coordinator.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${1:-build}"
BUDGET_GIB="${BUDGET_GIB:-22}"
STEPS="${STEPS:-2}"
MICROBATCH_SIZE="${MICROBATCH_SIZE:-1}"
DDP_SIZES="${DDP_SIZES:-1024,16,16,128 1024,20,16,128 1024,24,16,128}"
HSDP_SIZES="${HSDP_SIZES:-1024,24,16,128 2048,16,16,128 2048,20,16,128 2048,24,16,128}"
CGROUP_ROOT=/sys/fs/cgroup/memory
RUN_DIR="$(mktemp -d /tmp/hsdp-bench-capacity-XXXXXX)"
GIB=$((1 << 30))

if [ ! -w "$CGROUP_ROOT" ]; then
  echo "capacity: needs a writable cgroup v1 memory controller at $CGROUP_ROOT" >&2
  exit 2
fi

params() {  # d,L,H,T -> GPT parameter count (vocab 256), as worker/models/gpt.cc counts it
  /usr/bin/python3 -c "
d, L, H, T = map(int, '$1'.split(','))
f = 4 * d
block = 2 * d + d * 3 * d + 3 * d + d * d + d + 2 * d + d * f + f + f * d + d
print(256 * d + T * d + L * block + 2 * d + 256 * d)"
}

# in_cgroup OUT LOG CMD...: runs CMD (stdout to OUT, stderr to LOG) inside a fresh memory cgroup
# limited to BUDGET_GIB; prints "rc peak_bytes".
in_cgroup() {
  local out="$1" log="$2"
  shift 2
  local cg="$CGROUP_ROOT/hsdp-capacity-$$-$RANDOM"
  mkdir "$cg"
  echo $((BUDGET_GIB * GIB)) >"$cg/memory.limit_in_bytes"
  # Swap would let a job exceed the budget: set memsw too where the kernel accounts it.
  echo $((BUDGET_GIB * GIB)) >"$cg/memory.memsw.limit_in_bytes" 2>/dev/null || true
  local rc=0
  (echo "$BASHPID" >"$cg/cgroup.procs" && exec "$@" >"$out" 2>"$log") || rc=$?
  local peak
  peak="$(cat "$cg/memory.max_usage_in_bytes")"
  rmdir "$cg" 2>/dev/null || true
  echo "$rc $peak"
}

row() {  # impl dims params rc job_peak rank_peak
  awk -v impl="$1" -v dims="$2" -v n="$3" -v rc="$4" -v peak="$5" -v rank="$6" -v gib="$GIB" \
    'BEGIN { printf "%-5s %-18s %7.0fM %5s %14.2f %16.2f\n", impl, dims, n / 1e6,
             (rc == 0 ? "yes" : "no"), peak / gib, rank / gib }'
}

max_rss_from_reports() {  # RUN_DIR of hsdp-launch -> largest rss_peak_bytes over ranks and steps
  /usr/bin/python3 -c "
import glob, json, sys
peaks = [json.loads(l)['rss_peak_bytes'] for f in glob.glob('$1/worker-*.jsonl') for l in open(f)]
print(max(peaks) if peaks else 0)"
}

echo "capacity: 4 ranks x 1 thread, budget ${BUDGET_GIB} GiB for all 4, $STEPS AdamW steps," \
  "microbatch $MICROBATCH_SIZE, machine memory $(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1048576)) GiB"
printf "%-5s %-18s %8s %5s %14s %16s\n" impl dims params fits "job peak GiB" "rank peak GiB"
best_hsdp=0
best_ddp=0
for dims in $DDP_SIZES; do
  n="$(params "$dims")"
  read -r rc peak < <(in_cgroup "$RUN_DIR/ddp-$dims.json" "$RUN_DIR/ddp-$dims.log" \
    /usr/bin/python3 bench/ddp/ddp_gpt.py --world 4 --dims "$dims" --steps "$STEPS" --warmup 0 \
    --microbatch-size "$MICROBATCH_SIZE" --port $((29600 + RANDOM % 300)))
  rank_peak=0
  if [ "$rc" = 0 ]; then
    rank_peak="$(/usr/bin/python3 -c "import json; print(max(json.load(open('$RUN_DIR/ddp-$dims.json'))['rss_peak_bytes_per_rank']))")"
    best_ddp="$n"
  fi
  row ddp "$dims" "$n" "$rc" "$peak" "$rank_peak"
done
for dims in $HSDP_SIZES; do
  n="$(params "$dims")"
  dir="$RUN_DIR/hsdp-$dims"
  read -r rc peak < <(in_cgroup "$RUN_DIR/hsdp-$dims.out" "$RUN_DIR/hsdp-$dims.log" \
    "$BUILD_DIR/bin/hsdp-launch" --workers 4 --mesh 1x4 --steps "$STEPS" --run-dir "$dir" -- \
    --dims "$dims" --microbatch-size "$MICROBATCH_SIZE" --threads 1 --collective-timeout 600)
  rank_peak=0
  if [ "$rc" = 0 ]; then
    rank_peak="$(max_rss_from_reports "$dir")"
    best_hsdp="$n"
  fi
  row hsdp "$dims" "$n" "$rc" "$peak" "$rank_peak"
done
if [ "$best_ddp" -gt 0 ]; then
  awk -v h="$best_hsdp" -v d="$best_ddp" \
    'BEGIN { printf "largest that fit: hsdp %.0fM, ddp %.0fM, ratio %.2f (target >= 3)\n", h / 1e6, d / 1e6, h / d }'
else
  echo "largest that fit: hsdp $((best_hsdp / 1000000))M, ddp: none of DDP_SIZES fit"
fi
echo "capacity: logs in $RUN_DIR"

#!/usr/bin/env bash
# hsdp vs PyTorch DDP on Gloo: same GPT shape, same global batch (4 ranks x microbatch), same number
# of single-threaded CPU processes. Prints step-time ratios and per-rank peak memory from one run.
#
#   bench/ddp/run.sh [BUILD_DIR]   (env: DIMS, STEPS, WARMUP, MICROBATCH_SIZE, MESH, ROUNDS,
#                                   VARIANTS, FUSION_BUCKET, HSDP_ARGS)
# Needs Debian's python3-torch (run with /usr/bin/python3) and a built hsdp-launch/worker/coordinator.
#
# Each round runs DDP (Gloo TCP) and then every hsdp variant, and the rounds alternate, so drift in
# the machine's load hits every side; ratios are taken per round and over all rounds. A variant
# (VARIANTS, space-separated) is a transport with optional suffixes:
#   shm       shared memory between the ranks
#   tcp       Gloo TCP only (--shared-memory=false): DDP's transport
#   -keep     reshard_after_forward=false (with tcp: the same bytes DDP moves)
#   -fused    comm fusion: Policy.comm_fusion_bucket_bytes = FUSION_BUCKET (default 8 MiB)
# e.g. shm, tcp-keep, tcp-keep-fused; the default runs the six of the targets printed at the end.
# Unit gathers per step are what the sealed schedule implies (every unit gathers once in forward,
# and again in backward when it was resharded after forward; one microbatch), which the engine
# tests (tests/worker/fsdp/fsdp_collective_order_test.cc) pin to the engine's own counts; with
# fusion, the units of a group share one collective. The summary also gives the time the ranks
# spent in all-gathers and reduce-scatters per step (from their reports), where fusion shows.
# HSDP_ARGS are extra hsdp-worker flags for every variant.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${1:-build}"
DIMS="${DIMS:-256,4,4,128}"        # gpt-small
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-5}"
MICROBATCH_SIZE="${MICROBATCH_SIZE:-4}"
MESH="${MESH:-1x4}"
ROUNDS="${ROUNDS:-2}"
VARIANTS="${VARIANTS:-shm shm-fused tcp tcp-fused tcp-keep tcp-keep-fused}"
FUSION_BUCKET="${FUSION_BUCKET:-$((8 << 20))}"
HSDP_ARGS="${HSDP_ARGS:-}"
WORLD=4
RUN_DIR="$(mktemp -d /tmp/hsdp-bench-ddp-XXXXXX)"

echo "bench: dims $DIMS, $WORLD processes x 1 thread, global batch $((WORLD * MICROBATCH_SIZE)) x seq," \
  "$STEPS steps ($WARMUP warm-up), hsdp mesh $MESH, variants: $VARIANTS (fusion bucket $FUSION_BUCKET B) ${HSDP_ARGS}," \
  "$ROUNDS alternating rounds"
for round in $(seq 1 "$ROUNDS"); do
  /usr/bin/python3 bench/ddp/ddp_gpt.py --world "$WORLD" --dims "$DIMS" --steps "$STEPS" \
    --warmup "$WARMUP" --microbatch-size "$MICROBATCH_SIZE" >"$RUN_DIR/ddp-$round.json"
  for variant in $VARIANTS; do
    flags=()
    case "$variant" in
      shm|shm-*) ;;
      tcp|tcp-*) flags=(--shared-memory=false) ;;
      *) echo "unknown variant $variant" >&2; exit 2 ;;
    esac
    fields=()
    [[ "$variant" == *-keep* ]] && fields+=('"reshardAfterForward": false')
    [[ "$variant" == *-fused* ]] && fields+=("\"commFusionBucketBytes\": \"$FUSION_BUCKET\"")
    policy=()
    if (( ${#fields[@]} > 0 )); then
      policy_file="$RUN_DIR/policy-$variant.json"
      (IFS=,; echo "{${fields[*]}}") >"$policy_file"
      policy=(--policy-file "$policy_file")
    fi
    # shellcheck disable=SC2086  # HSDP_ARGS is a list of flags
    "$BUILD_DIR/bin/hsdp-launch" --workers "$WORLD" --mesh "$MESH" --model gpt-small \
      --steps "$STEPS" "${policy[@]}" --run-dir "$RUN_DIR/$variant-$round" -- --dims "$DIMS" \
      --microbatch-size "$MICROBATCH_SIZE" --threads 1 "${flags[@]}" $HSDP_ARGS \
      2>"$RUN_DIR/launch-$variant-$round.log"
  done
done

/usr/bin/python3 - "$RUN_DIR" "$WARMUP" "$WORLD" "$ROUNDS" "$VARIANTS" <<'PY'
import json, re, sys
run, warmup, world, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
variants = sys.argv[5].split()
mib = 1 << 20

def reports(variant, rnd):
    return [[json.loads(l) for l in open(f"{run}/{variant}-{rnd}/worker-{r}.jsonl")]
            for r in range(world)]

def step_time(ranks):
    steps = range(warmup, len(ranks[0]))
    return sum(max(ranks[r][s]["step_seconds"] for r in range(world)) for s in steps) / len(steps)

def comm_ms(ranks):
    lines = [x for r in ranks for x in r[warmup:]]
    ag = sum(x.get("all_gather_seconds", 0) for x in lines) / len(lines)
    rs = sum(x.get("reduce_scatter_seconds", 0) for x in lines) / len(lines)
    return ag * 1e3, rs * 1e3

def all_gathers(line):
    # One microbatch: every unit gathers in forward, and again in backward when resharded.
    raf = line["reshard_after_forward"]
    return (len(raf) + raf.count("1")) * line.get("microbatches", 1)

ddp = [json.load(open(f"{run}/ddp-{rnd}.json"))["step_seconds"] for rnd in range(1, rounds + 1)]
print(f"{'variant':<14} {'round':>5} {'step_s':>8} {'ddp_s':>8} {'x DDP':>7} {'unit gathers/step':>18}")
summary = {}
for variant in variants:
    times, comms = [], []
    for rnd in range(1, rounds + 1):
        ranks = reports(variant, rnd)
        t = step_time(ranks)
        times.append(t)
        ag = all_gathers(ranks[0][-1])
        comms.append(comm_ms(ranks))
        print(f"{variant:<14} {rnd:>5} {t:>8.4f} {ddp[rnd - 1]:>8.4f} {t / ddp[rnd - 1]:>7.3f} {ag:>18}")
    summary[variant] = (sum(times) / rounds, ag,
                        sum(c[0] for c in comms) / rounds, sum(c[1] for c in comms) / rounds)
ddp_mean = sum(ddp) / rounds
print(f"over {rounds} rounds (DDP on Gloo TCP {ddp_mean:.4f} s):")
targets = {"shm": 0.85, "shm-fused": 0.85, "tcp": 1.10, "tcp-keep": 1.0, "tcp-fused": 1.0,
           "tcp-keep-fused": 0.9}
for variant, (t, ag, ag_ms, rs_ms) in summary.items():
    target = f" (target <= {targets[variant]:.2f}x)" if variant in targets else ""
    print(f"  {variant:<14} {t:.4f} s = {t / ddp_mean:.3f}x DDP, {ag} unit gathers/step, "
          f"all-gather {ag_ms:.1f} ms + reduce-scatter {rs_ms:.1f} ms per rank{target}")
last = variants[-1]
transport = "?"
for line in open(f"{run}/{last}-{rounds}/worker-0.log"):
    m = re.search(r"communicators: (\S+), (\S+)", line)
    if m:
        transport = f"{m.group(1)} / {m.group(2)}"
print(f"hsdp communicators of {last} (shard / replicate group): {transport}")
ranks = reports(last, rounds)
ddp_last = json.load(open(f"{run}/ddp-{rounds}.json"))
print(f"per-rank peak memory of {last} (MiB), last round (DDP: parameters + gradients + AdamW):")
for r in range(world):
    peak = max(x["peak_memory_bytes"] for x in ranks[r])
    rss = max(x["rss_peak_bytes"] for x in ranks[r])
    print(f"  rank {r}: hsdp peak {peak / mib:.2f}, ddp state {ddp_last['state_bytes_per_rank'][r] / mib:.2f};"
          f" RSS hsdp {rss / mib:.0f}, ddp {ddp_last['rss_peak_bytes_per_rank'][r] / mib:.0f}")
print(f"loss hsdp: step 0 {ranks[0][0]['loss']:.4f} -> step {ranks[0][-1]['step']} {ranks[0][-1]['loss']:.4f}")
PY
echo "bench: reports in $RUN_DIR"

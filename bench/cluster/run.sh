#!/usr/bin/env bash
# A small cluster on one machine: H "hosts" (network namespaces, default 2) of G ranks each
# (default 2), joined through a bridge by rate-limited links, trains gpt-small three ways with the
# same global batch, one after another:
#   hsdp     hsdp HSDP, mesh HxG: shard inside a host (shared memory), replicate across hosts
#   full     hsdp fully sharded, mesh 1x(H*G): one shard group across every rank (Gloo TCP)
#   full-hpz the same with hierarchical reshard (policy reshard_after_forward_within_host; run
#            only when asked, --configs "... full-hpz"): backward all-gathers stay inside a host
#   ddp      PyTorch DDP on Gloo (bench/ddp/ddp_gpt.py, one process per rank)
# and prints per configuration the step time and its ratios, the bytes per step on the inter-host
# links (counted on the interfaces) against each strategy's minimum, and per-rank peak memory.
# bench/cluster/README.md derives the minimums and holds measured tables. With --rounds N the
# configurations run N times alternating (hsdp full ddp hsdp full ddp ...), so a change in the
# machine's load hits each of them; the table shows means and every round's step time.
#
#   bench/cluster/run.sh [--build-dir DIR | --coordinator-bin F --worker-bin F] [--rate RATE[,RATE...]] [--hosts H] [--ranks-per-host G]
#                        [--steps N] [--warmup N] [--microbatch-size N] [--configs "hsdp full ddp"]
#                        [--rounds N] [--burst BYTES] [--latency MS] [--mtu N] [--smoke] [--keep]
#
# Needs root, `ip netns`, nsenter/unshare (util-linux), tc with the tbf qdisc, Debian's
# python3-torch (/usr/bin/python3) and built hsdp-coordinator and hsdp-worker. Exits 77 (ctest:
# skipped) when root or network namespaces are missing. --smoke turns the run into a check: every
# job finishes, the namespaces come up, and the inter-host links carried bytes (exit 1 otherwise);
# it leaves DDP out, saying so, where /usr/bin/python3 has no torch.
#
# Each host is a network namespace plus a mount and an IPC namespace of its own, with a private
# tmpfs on /dev/shm: the ranks of one host share it (hsdp's shared-memory transport works inside a
# host), ranks of different hosts cannot see each other's regions, as on separate machines. Each
# host's link is shaped in both directions with tbf (rate, burst, latency); inside a host traffic
# goes over loopback, unshaped. Where the kernel has netem the bench says so but still adds no
# delay: a delay would need a per-link figure the bench has no basis for.
#
# Traffic stays inside the namespaces it creates (no route off their /24, no link to the machine's
# network); every namespace and process it started is removed on exit, failure or interrupt.
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
skip() {
  echo "[  SKIPPED ] cluster bench: $*"
  exit 77
}

BUILD_DIR="$root/build"
COORD_BIN=""
WORKER_BIN=""
RATES="1gbit"
HOSTS=2
PER_HOST=2
STEPS=20
WARMUP=5
MICROBATCH_SIZE=4
CONFIGS="hsdp full ddp"
ROUNDS=1
BURST=""
LATENCY_MS=10
MTU=1500
SMOKE=""
KEEP=""
MODEL=gpt-small
DIMS="256,4,4,128" # gpt-small (worker/models/gpt.cc), for the DDP side
COLLECTIVE_TIMEOUT=120
usage() { sed -n '2,/^set -uo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift ;;
    --coordinator-bin) COORD_BIN="$2"; shift ;;
    --worker-bin) WORKER_BIN="$2"; shift ;;
    --rate) RATES="$2"; shift ;;
    --hosts) HOSTS="$2"; shift ;;
    --ranks-per-host) PER_HOST="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --warmup) WARMUP="$2"; shift ;;
    --microbatch-size) MICROBATCH_SIZE="$2"; shift ;;
    --configs) CONFIGS="$2"; shift ;;
    --rounds) ROUNDS="$2"; shift ;;
    --burst) BURST="$2"; shift ;;
    --latency) LATENCY_MS="$2"; shift ;;
    --mtu) MTU="$2"; shift ;;
    --smoke) SMOKE=1 ;;
    --keep) KEEP=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
for config in $CONFIGS; do
  case "$config" in
    hsdp | full | full-hpz | ddp) ;;
    *) echo "unknown config $config (hsdp, full, full-hpz, ddp)" >&2; exit 2 ;;
  esac
done
WORLD=$((HOSTS * PER_HOST))
((HOSTS >= 2 && PER_HOST >= 1 && STEPS > WARMUP && WARMUP >= 1 && ROUNDS >= 1)) || {
  echo "need --hosts >= 2, --ranks-per-host >= 1, --steps > --warmup >= 1, --rounds >= 1" >&2
  exit 2
}
((HOSTS <= 200)) || { echo "--hosts at most 200" >&2; exit 2; }

[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces (run as root)"
for tool in ip tc nsenter unshare; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done
COORD_BIN="${COORD_BIN:-$BUILD_DIR/bin/hsdp-coordinator}"
WORKER_BIN="${WORKER_BIN:-$BUILD_DIR/bin/hsdp-worker}"
for b in "$COORD_BIN" "$WORKER_BIN"; do
  [ -x "$b" ] || { echo "FAIL: $b not built (cmake --build $BUILD_DIR --target hsdp-coordinator hsdp-worker)"; exit 1; }
done
PY=/usr/bin/python3
case " $CONFIGS " in
  *" ddp "*)
    if ! "$PY" -c 'import torch' 2>/dev/null; then
      [ -n "$SMOKE" ] || { echo "FAIL: $PY has no torch (Debian's python3-torch runs the DDP side)"; exit 1; }
      echo "note: $PY has no torch (python3-torch): DDP left out of the smoke run"
      CONFIGS="${CONFIGS//ddp/}"
    fi ;;
esac

readonly SUBNET=10.251.9 # only ever assigned inside the namespaces below
readonly COORD_IP="$SUBNET.10"
readonly COORD_PORT=50051
tag="hsdpcl$$"
SW="$tag-sw"
CNS="$tag-c"
work="$(mktemp -d /tmp/hsdp-cluster.XXXXXX)"
namespaces=()
pids=()
holders=()

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  local p ns
  for p in "${pids[@]}" "${holders[@]}"; do kill -KILL "$p" 2>/dev/null; done
  for p in "${pids[@]}" "${holders[@]}"; do wait "$p" 2>/dev/null; done
  for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null; done
  if [ -n "$KEEP" ]; then echo "bench: run directory kept: $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Namespaces left by an earlier run that was killed before its trap ran (hsdpcl<pid>-..., that
# pid gone).
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^hsdpcl[0-9]+-' || true); do
  old_pid="${ns#hsdpcl}"
  old_pid="${old_pid%%-*}"
  kill -0 "$old_pid" 2>/dev/null || { ip netns del "$ns" 2>/dev/null && echo "removed stale namespace $ns"; }
done

ip netns add "$SW" 2>"$work/netns.err" || skip "ip netns unavailable here: $(cat "$work/netns.err")"
namespaces+=("$SW")

fail() {
  echo "FAIL: $*"
  local f
  for f in "$work"/*/*.log; do
    [ -f "$f" ] || continue
    echo "--- tail of ${f#"$work"/}"
    tail -n 8 "$f"
  done
  exit 1
}

host_ns() { echo "$tag-h$1"; }
host_ip() { echo "$SUBNET.$((20 + $1))"; }
host_of_rank() { echo $(($1 / PER_HOST)); }

# The switch: a bridge in its own namespace. Each host (and the coordinator) has eth0, a veth whose
# other end, a port of the bridge, sits in the switch namespace: the counters are read there.
ip -n "$SW" link add br0 type bridge || fail "cannot create a bridge"
ip -n "$SW" link set br0 up
ip -n "$SW" link set lo up
add_ns() { # name address port-name
  local ns="$1" addr="$2" port="$3"
  ip netns add "$ns" || fail "ip netns add $ns"
  namespaces+=("$ns")
  ip link add eth0 netns "$ns" type veth peer name "$port" netns "$SW" || fail "veth for $ns"
  ip -n "$ns" link set eth0 mtu "$MTU"
  ip -n "$SW" link set "$port" mtu "$MTU"
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "$SW" link set "$port" master br0
  ip -n "$SW" link set "$port" up
}
add_ns "$CNS" "$COORD_IP" pc
for ((h = 0; h < HOSTS; h++)); do
  add_ns "$(host_ns "$h")" "$(host_ip "$h")" "ph$h"
  # The host's own /dev/shm and IPC namespace, held open by a sleeping process that the ranks
  # of this host join (nsenter -t), so its ranks share memory and other hosts' ranks cannot.
  ip netns exec "$(host_ns "$h")" unshare --ipc --mount --propagation private \
    sh -c "mount -t tmpfs -o size=1g,mode=1777 hsdp-cluster-shm /dev/shm && exec sleep 1000000" \
    >"$work/holder-$h.log" 2>&1 &
  holders[h]=$!
done
sleep 0.5
for ((h = 0; h < HOSTS; h++)); do
  kill -0 "${holders[h]}" 2>/dev/null || fail "host $h: private /dev/shm: $(cat "$work/holder-$h.log")"
done
# Shared memory stays inside a host: a region made on host 0 is invisible on host 1.
nsenter -t "${holders[0]}" -m touch /dev/shm/hsdp-cluster-probe
nsenter -t "${holders[1]}" -m test -e /dev/shm/hsdp-cluster-probe &&
  fail "hosts 0 and 1 share /dev/shm: the shared-memory transport would bypass the links"
nsenter -t "${holders[0]}" -m rm -f /dev/shm/hsdp-cluster-probe

# Both directions of every host link: host eth0 egress (host -> switch) and the switch port's
# egress (switch -> host). tbf needs a burst of at least one timer tick of traffic; 1 ms at the
# rate, and never less than 32 KiB (a handful of full-size frames).
netem_note="netem not available in this kernel: rate limit only (tbf), no added delay"
if tc -n "$SW" qdisc add dev pc root netem delay 0ms 2>/dev/null; then
  tc -n "$SW" qdisc del dev pc root
  netem_note="netem available but unused: rate limit only (tbf), no added delay"
fi
rate_bps() { # tc rate text -> bits per second
  "$PY" - "$1" <<'PY'
import re, sys
m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", sys.argv[1].lower())
if not m:
    sys.exit(f"rate {sys.argv[1]!r}: want e.g. 1gbit, 200mbit")
v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
print(int(v * (8 if m.group(3) == "bps" else 1)))
PY
}
shape_links() { # rate
  local rate="$1" bps burst h
  bps="$(rate_bps "$rate")" || fail "bad --rate $rate"
  burst="${BURST:-$(((bps / 8 / 1000) > 32768 ? bps / 8 / 1000 : 32768))}"
  for ((h = 0; h < HOSTS; h++)); do
    tc -n "$(host_ns "$h")" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" \
      latency "${LATENCY_MS}ms" || fail "tc tbf on host $h"
    tc -n "$SW" qdisc replace dev "ph$h" root tbf rate "$rate" burst "$burst" \
      latency "${LATENCY_MS}ms" || fail "tc tbf on switch port of host $h"
  done
  shaping="tbf rate $rate burst $burst latency ${LATENCY_MS}ms on each host link, both directions,"
  shaping+=" MTU $MTU; $netem_note"
  echo "links: $shaping"
  tc -n "$SW" qdisc show dev ph0 | sed 's/^/  switch port ph0: /'
}

# The prefix that runs a command on host h: its network, mount (/dev/shm) and IPC namespaces.
# nsenter execs the command, so the pid `&` gives is the rank's own.
on_host() { # host
  echo nsenter -t "${holders[$1]}" -n -m -i --
}

# The watcher samples the switch ports' counters and the ranks' step progress (one line per
# finished step) and marks the moments every rank has finished the warm-up and the last step.
watch_job() { # run dir, progress files...
  local dir="$1"
  shift
  ip netns exec "$SW" "$PY" "$here/watch.py" --out "$dir/marks.json" --hosts "$HOSTS" \
    --warmup "$WARMUP" --steps "$STEPS" --timeout 900 --pids "${job_pids[*]}" "$@" \
    >"$dir/watch.log" 2>&1 &
  local watcher=$!
  pids+=("$watcher")
  # In the background and waited for: a SIGTERM to this script runs its trap now, not after
  # the job.
  wait "$watcher"
}

start_coordinator() { # run dir, mesh, policy file (optional)
  local dir="$1" mesh="$2" policy=()
  [[ -n "${3:-}" ]] && policy=(--policy-file "$3")
  ip netns exec "$CNS" "$COORD_BIN" --job-id "cluster-bench" --world-size "$WORLD" --mesh "$mesh" \
    --listen "0.0.0.0:$COORD_PORT" --state-dir "$dir/coordinator-state" --metrics-listen "" \
    "${policy[@]}" >"$dir/coordinator.log" 2>&1 &
  coord_pid=$!
  pids+=("$coord_pid")
  local deadline=$((SECONDS + 60))
  until ip netns exec "$CNS" bash -c "exec 3<>/dev/tcp/127.0.0.1/$COORD_PORT" 2>/dev/null; do
    kill -0 "$coord_pid" 2>/dev/null || fail "coordinator exited at start"
    ((SECONDS < deadline)) || fail "coordinator not listening after 60 s"
    sleep 0.2
  done
}

run_hsdp() { # run dir, mesh, policy file (optional)
  local dir="$1" mesh="$2" r h
  mkdir -p "$dir"
  start_coordinator "$dir" "$mesh" "${3:-}"
  job_pids=()
  local progress=()
  # Rank r on host r / G: with rank = replicate_index * shard + shard_index (hsdp/mesh.h) the
  # shard group of an HxG mesh is exactly one host's ranks; --rank-hint pins the placement.
  for ((r = 0; r < WORLD; r++)); do
    h="$(host_of_rank "$r")"
    # shellcheck disable=SC2046  # on_host is a list of words
    $(on_host "$h") env OPENBLAS_NUM_THREADS=1 "$WORKER_BIN" \
      --coordinator "$COORD_IP:$COORD_PORT" --job-id cluster-bench --rank-hint "$r" \
      --model "$MODEL" --steps "$STEPS" --microbatch-size "$MICROBATCH_SIZE" --threads 1 \
      --gloo-hostname "$(host_ip "$h")" --host-id "host$h" \
      --collective-timeout "$COLLECTIVE_TIMEOUT" \
      --report-file "$dir/worker-$r.jsonl" >"$dir/worker-$r.log" 2>&1 &
    job_pids+=($!)
    pids+=($!)
    progress+=("$dir/worker-$r.jsonl")
  done
  watch_job "$dir" "${progress[@]}" || fail "$(basename "$dir"): $(tail -n 1 "$dir/watch.log")"
  for ((r = 0; r < WORLD; r++)); do
    wait "${job_pids[r]}" || fail "$(basename "$dir"): rank $r exited with $?"
  done
  kill -TERM "$coord_pid" 2>/dev/null
  wait "$coord_pid" 2>/dev/null
}

run_ddp() { # run dir
  local dir="$1" r h
  mkdir -p "$dir"
  job_pids=()
  local progress=()
  for ((r = 0; r < WORLD; r++)); do
    h="$(host_of_rank "$r")"
    # Gloo binds the host's address (eth0): ranks of one host reach each other over loopback,
    # as hsdp's do.
    # shellcheck disable=SC2046
    $(on_host "$h") env OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 "$PY" "$root/bench/ddp/ddp_gpt.py" \
      --world "$WORLD" --rank "$r" --master-addr "$(host_ip 0)" --port 29517 --dims "$DIMS" \
      --steps "$STEPS" --warmup "$WARMUP" --microbatch-size "$MICROBATCH_SIZE" --threads 1 \
      --progress-file "$dir/progress-$r.jsonl" >"$dir/ddp-$r.json" 2>"$dir/ddp-$r.log" &
    job_pids+=($!)
    pids+=($!)
    progress+=("$dir/progress-$r.jsonl")
  done
  watch_job "$dir" "${progress[@]}" || fail "$(basename "$dir"): $(tail -n 1 "$dir/watch.log")"
  for ((r = 0; r < WORLD; r++)); do
    wait "${job_pids[r]}" || fail "$(basename "$dir"): DDP rank $r exited with $?"
  done
}

echo "cluster bench: $HOSTS hosts x $PER_HOST ranks (network namespaces on one machine," \
  "$(nproc) cores), $MODEL, global batch $((WORLD * MICROBATCH_SIZE)) sequences" \
  "($MICROBATCH_SIZE per rank), $STEPS steps of which $WARMUP warm-up; configs: $CONFIGS"
status=0
for rate in ${RATES//,/ }; do
  shape_links "$rate"
  load_before="$(uptime | sed 's/.*load average: //')"
  dirs=()
  for ((round = 1; round <= ROUNDS; round++)); do
    for config in $CONFIGS; do
      dir="$work/$rate-$config-$round"
      case "$config" in
        hsdp) run_hsdp "$dir" "${HOSTS}x${PER_HOST}" ;;
        full) run_hsdp "$dir" "1x${WORLD}" ;;
        full-hpz)
          echo '{"reshardAfterForwardWithinHost": true}' >"$work/hpz-policy.json"
          run_hsdp "$dir" "1x${WORLD}" "$work/hpz-policy.json"
          ;;
        ddp) run_ddp "$dir" ;;
      esac
      echo "  round $round $config: done ($(tail -n 1 "$dir/watch.log"))"
      dirs+=("$config=$dir")
    done
  done
  echo "load average (1, 5, 15 min) before: $load_before; after: $(uptime | sed 's/.*load average: //')"
  smoke=()
  [ -z "$SMOKE" ] || smoke=(--smoke)
  "$PY" "$here/report.py" --rate "$rate" --shaping "$shaping" --hosts "$HOSTS" \
    --ranks-per-host "$PER_HOST" --dims "$DIMS" --warmup "$WARMUP" --steps "$STEPS" \
    "${smoke[@]}" "${dirs[@]}" || status=1
done
exit "$status"

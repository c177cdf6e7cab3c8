#!/usr/bin/env bash
# A cluster on one machine: the coordinator and 4 workers, each in its own network namespace with
# its own address on a private bridge, started with the flags and environment the rendered cpu
# overlay gives their pods (tests/deploy/launch_spec.py), resolving the coordinator by its Service
# name (/etc/netns/<ns>/hosts).
#   Run 1: they train a few steps to completion; the coordinator then stops on SIGTERM within the
#          pod's termination grace period.
#   Run 2: mid-training one worker's link goes down: the coordinator marks that rank LOST within
#          the heartbeat timeout (+ one sweep period), and the complete replica group goes on
#          training as a 1x2 generation in the same processes (elastic training), without
#          waiting for the lost worker.
#
#   netns_e2e.sh RENDERED_CPU_YAML COORDINATOR_BIN WORKER_BIN HSDPCTL_BIN
#
# Needs root and `ip netns`; exits 77 (ctest: skipped) without them or without the binaries.
# Traffic stays inside the namespaces it creates: they have no route off their own /24 and no link
# to the host's network; every namespace, link and /etc/netns entry is removed on exit.
# Test sizing (not in the manifests): E2E_STEPS (run 1, default 8), HSDP_THREADS=1 (4 workers on 2
# cores), --collective-timeout=E2E_COLLECTIVE_TIMEOUT (default 30 instead of 300).
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
# The interpreter with PyYAML (CMake passes Debian's).
PYTHON="${PYTHON:-python3}"
skip() {
  echo "SKIP: $*"
  exit 77
}
rendered="${1:-}"
coord_bin="${2:-}"
worker_bin="${3:-}"
ctl_bin="${4:-}"

[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces (run as root, e.g. in CI)"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
for b in "$coord_bin" "$worker_bin" "$ctl_bin"; do
  [ -n "$b" ] && [ -x "$b" ] && continue
  skip "binaries not built (hsdp-coordinator, hsdp-worker, hsdpctl; got '${b:-<none>}');" \
    "build them (-DHSDP_BUILD_WORKER=ON) to run the namespace cluster"
done
[ -f "$rendered" ] || {
  echo "FAIL: rendered manifest $rendered missing (deploy.kustomize_render)"
  exit 1
}

readonly NWORKERS=4
readonly SUBNET=10.251.7 # only ever assigned inside the namespaces below
readonly COORD_IP="$SUBNET.10"
STEPS="${E2E_STEPS:-8}"
COLLECTIVE_TIMEOUT="${E2E_COLLECTIVE_TIMEOUT:-30}"
tag="hsdpe2e$$"
SW="$tag-sw"
CNS="$tag-c"
work="$(mktemp -d /tmp/hsdp-netns-e2e.XXXXXX)"
namespaces=()
pids=()
made_etc_netns=""
[ -d /etc/netns ] || made_etc_netns=1

cleanup() {
  local p ns
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  for ns in "${namespaces[@]}"; do
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  [ -z "$made_etc_netns" ] || rmdir /etc/netns 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Namespaces left by an earlier run of this script that was killed before its trap ran (named
# hsdpe2e<pid>-..., that pid gone).
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^hsdpe2e[0-9]+-' || true); do
  old_pid="${ns#hsdpe2e}"
  old_pid="${old_pid%%-*}"
  if ! kill -0 "$old_pid" 2>/dev/null; then
    ip netns del "$ns" 2>/dev/null && echo "removed stale namespace $ns"
    rm -rf "/etc/netns/$ns"
  fi
done

if ! ip netns add "$SW" 2>"$work/netns.err"; then
  skip "ip netns unavailable here: $(cat "$work/netns.err")"
fi
namespaces+=("$SW")

fail() {
  echo "FAIL: $*"
  local f
  for f in "$work"/run*/*.log; do
    [ -f "$f" ] || continue
    echo "--- tail of ${f#"$work"/}"
    tail -n 15 "$f"
  done
  exit 1
}

worker_ns() { echo "$tag-w$1"; }
worker_ip() { echo "$SUBNET.$((20 + $1))"; }

# One namespace per pod, each with eth0 on the bridge in the switch namespace.
ip -n "$SW" link add br0 type bridge || fail "cannot create a bridge"
ip -n "$SW" link set br0 up
ip -n "$SW" link set lo up
hosts="127.0.0.1 localhost"$'\n'"$COORD_IP hsdp-coordinator"$'\n'
for ((i = 0; i < NWORKERS; i++)); do hosts+="$(worker_ip "$i") hsdp-worker-$i"$'\n'; done
add_pod_ns() { # name address index
  local ns="$1" addr="$2" idx="$3"
  ip netns add "$ns" || fail "ip netns add $ns"
  namespaces+=("$ns")
  ip link add eth0 netns "$ns" type veth peer name "p$idx" netns "$SW" || fail "veth for $ns"
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "$SW" link set "p$idx" master br0
  ip -n "$SW" link set "p$idx" up
  # `ip netns exec` bind-mounts these over /etc/hosts and /etc/resolv.conf: the Service name
  # resolves as cluster DNS would; no query leaves the namespace.
  mkdir -p "/etc/netns/$ns"
  printf '%s' "$hosts" >"/etc/netns/$ns/hosts"
  echo "nameserver 127.0.0.1" >"/etc/netns/$ns/resolv.conf"
}
add_pod_ns "$CNS" "$COORD_IP" 9
for ((i = 0; i < NWORKERS; i++)); do add_pod_ns "$(worker_ns "$i")" "$(worker_ip "$i")" "$i"; done
echo "namespaces up: coordinator $COORD_IP, workers $(worker_ip 0)..$(worker_ip $((NWORKERS - 1)))"

# Reads the launch spec of one pod from the rendered manifest into SPEC_*.
spec() {
  local out
  out="$("$PYTHON" "$here/launch_spec.py" "$rendered" "$@")" || fail "launch_spec.py $*"
  eval "$out"
}

hb_timeout=""
token_file=""
start_coordinator() { # run dir
  local root="$1/pod-coordinator"
  spec coordinator "$root"
  [ "$SPEC_BINARY" = "$(basename "$coord_bin")" ] || fail "manifest runs $SPEC_BINARY"
  local kv
  for kv in "${SPEC_ENV[@]}"; do
    case "$kv" in
      HSDP_HEARTBEAT_TIMEOUT=*) hb_timeout="${kv#*=}" ;;
      HSDP_CONTROL_TOKEN_FILE=*) token_file="${kv#*=}" ;;
    esac
  done
  echo "coordinator: ${SPEC_ENV[*]} $coord_bin ${SPEC_ARGS[*]}" >"$1/coordinator.cmd"
  ip netns exec "$CNS" env "${SPEC_ENV[@]}" "$coord_bin" "${SPEC_ARGS[@]}" \
    >"$1/coordinator.log" 2>&1 &
  coord_pid=$!
  pids+=("$coord_pid")
}

ctl() { # hsdpctl inside the coordinator's namespace, as through `kubectl port-forward`
  ip netns exec "$CNS" "$ctl_bin" --coordinator 127.0.0.1:50051 --token-file "$token_file" "$@"
}

wait_serving() {
  local deadline=$((SECONDS + 60))
  until ctl status >/dev/null 2>&1; do
    kill -0 "$coord_pid" 2>/dev/null || fail "coordinator exited at start"
    ((SECONDS < deadline)) || fail "coordinator not serving after 60 s"
    sleep 0.5
  done
}

declare -a wpids
start_workers() { # run dir, steps
  local i ns
  for ((i = 0; i < NWORKERS; i++)); do
    ns="$(worker_ns "$i")"
    spec worker "$1/pod-worker-$i" --pod-name "hsdp-worker-$i" --pod-index "$i" \
      --pod-ip "$(worker_ip "$i")" --set "HSDP_STEPS=$2" --set HSDP_THREADS=1 \
      --arg="--collective-timeout=$COLLECTIVE_TIMEOUT"
    [ "$SPEC_BINARY" = "$(basename "$worker_bin")" ] || fail "manifest runs $SPEC_BINARY"
    echo "worker $i: ${SPEC_ENV[*]} $worker_bin ${SPEC_ARGS[*]}" >"$1/worker-$i.cmd"
    ip netns exec "$ns" env "${SPEC_ENV[@]}" "$worker_bin" "${SPEC_ARGS[@]}" \
      >"$1/worker-$i.log" 2>&1 &
    wpids[i]=$!
    pids+=("${wpids[i]}")
  done
}

report_lines() { # run dir, worker index
  local f="$1/pod-worker-$2/run/hsdp/report.jsonl"
  [ -f "$f" ] && wc -l <"$f" || echo 0
}

# Waits for pid up to $2 seconds; sets rc (124 on timeout).
wait_pid() {
  local pid="$1" deadline=$((SECONDS + $2))
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      rc=124
      return
    fi
    sleep 0.5
  done
  wait "$pid"
  rc=$?
}

# ---------------------------------------------------------------- run 1: train to completion
run="$work/run1"
mkdir -p "$run"
echo "run 1: coordinator + $NWORKERS workers, $STEPS steps"
start_coordinator "$run"
wait_serving
start_workers "$run" "$STEPS"
for ((i = 0; i < NWORKERS; i++)); do
  wait_pid "${wpids[i]}" 300
  ((rc == 0)) || fail "run 1: worker $i exited with $rc"
  n="$(report_lines "$run" "$i")"
  ((n >= STEPS)) || fail "run 1: worker $i reported $n of $STEPS steps"
done
"$PYTHON" - "$run" "$NWORKERS" <<'EOF' || fail "run 1: bad step reports"
import json, math, sys
run, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    rows = [json.loads(l) for l in open(f"{run}/pod-worker-{i}/run/hsdp/report.jsonl") if l.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    if not losses or not all(math.isfinite(x) for x in losses):
        sys.exit(f"worker {i}: no finite losses in {len(rows)} reports")
    print(f"  worker {i}: {len(rows)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
EOF
echo "  hsdpctl status after training:"
ctl status | sed 's/^/    /'
kill -TERM "$coord_pid"
grace="$("$PYTHON" -c '
import sys; sys.path.insert(0, sys.argv[2]); import manifests as m
d = m.one(m.load(sys.argv[1]), "Deployment", name="hsdp-coordinator")
print(m.pod_spec(d).get("terminationGracePeriodSeconds", 30))' "$rendered" "$here")"
t0=$SECONDS
wait_pid "$coord_pid" "$grace"
((rc != 124)) || fail "coordinator still running $grace s (terminationGracePeriodSeconds) after SIGTERM"
echo "run 1: passed (coordinator stopped $((SECONDS - t0)) s after SIGTERM, exit $rc)"

# ---------------------------------------------------------------- run 2: cut a worker's link
run="$work/run2"
mkdir -p "$run"
victim=2
echo "run 2: cut worker $victim's link mid-training"
start_coordinator "$run"
wait_serving
start_workers "$run" 1000000
deadline=$((SECONDS + 240))
for ((i = 0; i < NWORKERS; i++)); do
  until (($(report_lines "$run" "$i") >= 2)); do
    kill -0 "${wpids[i]}" 2>/dev/null || fail "run 2: worker $i exited before training"
    ((SECONDS < deadline)) || fail "run 2: worker $i did not train 2 steps in 240 s"
    sleep 0.5
  done
done
ip -n "$(worker_ns "$victim")" link set eth0 down || fail "cannot cut the link"
cut_at=$SECONDS
echo "  link of worker $victim down; heartbeat timeout ${hb_timeout}s"
# The coordinator sweeps heartbeats every timeout/4: a worker is LOST at most one sweep after its
# heartbeat age passes the timeout. Plus a few seconds for polling through hsdpctl on a busy
# machine.
lost_bound=$((hb_timeout + (hb_timeout + 3) / 4 + 5))
lost_at=""
while ((SECONDS - cut_at <= lost_bound)); do
  if ctl --json workers 2>/dev/null | "$PYTHON" -c '
import json, sys
lost = []
def walk(o):
    if isinstance(o, dict):
        if "LOST" in str(o.get("state", "")):
            rank = int(o.get("rank", 0))
            if rank < 0:  # no longer a member: its rank in its last generation
                for e in o.get("history", []):
                    if "MEMBER" in str(e.get("kind", "")):
                        rank = int(e.get("rank", 0))
            lost.append(rank)
        for v in o.values(): walk(v)
    elif isinstance(o, list):
        for v in o: walk(v)
walk(json.load(sys.stdin))
if lost and lost != [int(sys.argv[1])]:
    print(f"  unexpected LOST ranks {lost} (cut: rank {sys.argv[1]})")
    sys.exit(2)
sys.exit(0 if lost else 1)' "$victim"; then
    lost_at=$SECONDS
    break
  elif ((PIPESTATUS[1] == 2)); then
    fail "run 2: the wrong worker was marked LOST"
  fi
  sleep 0.5
done
[ -n "$lost_at" ] || fail "run 2: worker $victim not marked LOST within ${lost_bound}s of the cut"
echo "  coordinator marked rank $victim LOST $((lost_at - cut_at)) s after the cut (bound ${lost_bound}s)"
ctl --json workers >"$run/workers.json" 2>&1
# Elastic: the complete replica group (workers 0 and 1; worker 3 lost its partner and stands by)
# re-forms as a 1x2 generation and goes on training in the same processes.
survivors=(0 1)
bound=$((hb_timeout + 60))
for i in "${survivors[@]}"; do
  until grep -q '"world_size":2' "$run/pod-worker-$i/run/hsdp/report.jsonl" 2>/dev/null; do
    kill -0 "${wpids[i]}" 2>/dev/null || fail "run 2: worker $i exited instead of re-forming: $(tail -n 1 "$run/worker-$i.log")"
    ((SECONDS - cut_at <= bound)) || fail "run 2: worker $i did not train on 1x2 within ${bound}s of the cut"
    sleep 0.5
  done
  echo "  worker $i (same process) trains on 1x2 $((SECONDS - cut_at)) s after the cut"
done
before=$(report_lines "$run" 0)
sleep 3
(($(report_lines "$run" 0) > before)) || fail "run 2: the survivors stopped training after re-forming"
status_text="$(ctl status 2>&1)"
grep -qE 'generation' <<<"$status_text" || fail "run 2: status shows no generation: $status_text"
echo "  hsdpctl status:"
sed 's/^/    /' <<<"$status_text"
echo "run 2: passed"
echo "netns e2e: 2 passed, 0 failed"

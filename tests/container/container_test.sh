#!/usr/bin/env bash
# The CPU image, built and run for real with podman:
#   1. builds it with deploy/docker/build.sh (base images from the apt mirror, layer cache, the
#      host's ccache), unless HSDP_CONTAINER_IMAGE names an image to test instead;
#   2. checks what is in it: runs as uid/gid 10001 (image config and at run time); no compiler,
#      assembler, linker, build tool or C/C++ header; no -dev package; no source tree or control
#      token; every library the four binaries link resolves, and each answers --help;
#   3. runs the coordinator and 2 workers as containers on a podman network (workers find the
#      coordinator and each other by container name; Gloo over TCP between containers);
#   4. changes the policy with hsdpctl from the host through the published gRPC port, and checks
#      the step it names is sealed with it while the step before keeps the old one;
#   5. trains to completion: both workers exit 0 having reported the last step, the job is
#      FINISHED, the dashboard and /metrics answer through the published metrics port, and the
#      coordinator stops gracefully (exit 0) on SIGTERM.
#
#   container_test.sh HSDPCTL_BIN
#
# Exits 77 (ctest: skipped) with the reason where podman cannot run containers.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
hsdpctl="$1"
# shellcheck source=../../deploy/docker/podman-env.sh
. "$repo/deploy/docker/podman-env.sh"

if reason="$(hsdp_podman_check)"; then :; else
  echo "SKIP: $reason"
  exit 77
fi

steps=200
image="${HSDP_CONTAINER_IMAGE:-localhost/hsdp-cpu:dev}"
tag="hsdp-ctest-$$"
net="$tag"
coord="$tag-coordinator"
work="$(mktemp -d)"
started=$SECONDS

log() { echo "[$((SECONDS - started))s] $*"; }
fail() {
  echo "FAIL: $*"
  exit 1
}

cleanup() {
  local status=$?
  if ((status != 0)); then
    for c in "$coord" "$tag-worker-0" "$tag-worker-1"; do
      echo "--- podman logs $c (last 15 lines)"
      podman logs --tail 15 "$c" 2>&1 || true
    done
  fi
  podman rm -f -t 2 "$coord" "$tag-worker-0" "$tag-worker-1" >/dev/null 2>&1 || true
  podman network rm -f "$net" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# --- 1. the image -------------------------------------------------------------------------------
if [ -z "${HSDP_CONTAINER_IMAGE:-}" ]; then
  log "building $image (deploy/docker/build.sh)"
  "$repo/deploy/docker/build.sh" 2>&1 | tail -n 5
fi
podman image exists "$image" || fail "no image $image"
log "image $image: $(podman image inspect --format '{{.Size}}' "$image") bytes"

# --- 2. what is in it ---------------------------------------------------------------------------
run_in() { podman run --rm --network none --entrypoint "" "$image" "$@"; }
user="$(podman image inspect --format '{{.Config.User}}' "$image")"
[ "$user" = "10001:10001" ] || fail "image USER is '$user', not 10001:10001"
ids="$(run_in sh -c 'echo "$(id -u):$(id -g)"')"
[ "$ids" = "10001:10001" ] || fail "runs as $ids, not 10001:10001"
log "runs as uid:gid $ids"
# Controls: the probes below find what is there (an empty answer means absent, not a broken probe).
[ "$(run_in sh -c 'command -v hsdp-worker')" = /usr/local/bin/hsdp-worker ] ||
  fail "command -v does not work in the image"
[ -n "$(run_in sh -c 'find /usr/lib -name "libtorch.so*" | head -n 1')" ] ||
  fail "find does not work in the image"
[ -n "$(run_in sh -c "dpkg-query -W -f '\${Package}\n' | grep -x libtorch1.13")" ] ||
  fail "dpkg-query does not work in the image"
found="$(run_in sh -c 'for t in gcc g++ cc c++ cpp clang clang++ as ld ld.gold cmake ninja make \
  protoc grpc_cpp_plugin pip python3 npm node; do command -v "$t"; done; true')"
[ -z "$found" ] || fail "build tools in the image: $found"
headers="$(run_in sh -c 'find /usr/include /usr/local/include -type f \( -name "*.h" -o \
  -name "*.hpp" -o -name "*.hh" \) 2>/dev/null | head -n 5')"
[ -z "$headers" ] || fail "headers in the image: $headers"
dev="$(run_in sh -c "dpkg-query -W -f '\${Package}\n' | grep -E -- '-dev(:|\$)' || true")"
[ -z "$dev" ] || fail "development packages in the image: $dev"
extra="$(run_in sh -c 'ls -d /src /build /runtime 2>/dev/null; find / -xdev -name token.txt 2>/dev/null')" || true
[ -z "$extra" ] || fail "build leftovers in the image: $extra"
missing="$(run_in sh -c 'ldd /usr/local/bin/hsdp-coordinator /usr/local/bin/hsdp-worker \
  /usr/local/bin/hsdpctl /usr/local/bin/hsdp-relay | grep "not found" || true')"
[ -z "$missing" ] || fail "unresolved libraries: $missing"
for b in hsdp-coordinator hsdp-worker hsdpctl hsdp-relay; do
  run_in "$b" --help >/dev/null || fail "$b --help failed in the image"
done
log "contents: no compiler/linker/build tool/headers/-dev package/sources; binaries resolve"

# --- 3. a job of three containers ---------------------------------------------------------------
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
chmod 644 "$work/token"
podman network create "$net" >/dev/null
podman run -d --name "$coord" --hostname "$coord" --network "$net" \
  -p 127.0.0.1::50051 -p 127.0.0.1::9090 -v "$work/token:/etc/hsdp/token:ro,Z" \
  "$image" hsdp-coordinator --job-id ctest --world-size 2 --mesh 1x2 \
  --listen 0.0.0.0:50051 --metrics-listen 0.0.0.0:9090 --state-dir /tmp/state \
  --control-token-file /etc/hsdp/token >/dev/null
grpc_port="$(podman port "$coord" 50051/tcp | head -n 1)"
grpc_port="${grpc_port##*:}"
metrics_port="$(podman port "$coord" 9090/tcp | head -n 1)"
metrics_port="${metrics_port##*:}"
ctl() { "$hsdpctl" --coordinator "127.0.0.1:$grpc_port" --token-file "$work/token" "$@"; }
for _ in $(seq 1 100); do ctl status >/dev/null 2>&1 && break; sleep 0.2; done
ctl status >/dev/null || fail "the coordinator does not answer on 127.0.0.1:$grpc_port"
log "coordinator up: gRPC 127.0.0.1:$grpc_port, metrics 127.0.0.1:$metrics_port"

for r in 0 1; do
  name="$tag-worker-$r"
  podman run -d --name "$name" --hostname "$name" --network "$net" "$image" \
    hsdp-worker --coordinator "$coord:50051" --job-id ctest --rank-hint "$r" \
    --model gpt-tiny --steps "$steps" --gloo-hostname "$name" >/dev/null
done
log "2 workers started ($steps steps of gpt-tiny, 1x2 mesh)"

# --- 4. the policy, from the host ---------------------------------------------------------------
sealed_step() { ctl --json status | sed -n 's/.*"sealed_step":"\(-\?[0-9]*\)".*/\1/p'; }
for _ in $(seq 1 600); do
  s="$(sealed_step)"
  [ -n "$s" ] && ((s >= 10)) && break
  sleep 0.2
done
((s >= 10)) || fail "training did not start (sealed step '$s')"
answer="$(ctl policy set --reshard-after-forward=false --units 'layers.*')"
echo "$answer"
from="$(echo "$answer" | sed -n 's/^policy version 2 applies from step \([0-9]*\)$/\1/p')"
[ -n "$from" ] || fail "unexpected answer to policy set: $answer"
ctl policy get | grep -q 'override layers.\*: *reshard_after_forward=false' ||
  fail "hsdpctl policy get does not show the override"

# --- 5. to completion ---------------------------------------------------------------------------
for r in 0 1; do
  code="$(podman wait "$tag-worker-$r")"
  [ "$code" = 0 ] || fail "worker $r exited $code"
done
log "both workers exited 0"
ctl --json workers | grep -q "\"step\":\"$((steps - 1))\"" ||
  fail "the workers did not report step $((steps - 1))"
ctl status | grep -qE '^state +FINISHED' || fail "job not FINISHED: $(ctl status)"
ctl --json schedule --step "$from" | grep -q '"policy_version":"2"' ||
  fail "step $from was not sealed with policy version 2"
ctl --json schedule --step "$from" | grep -q '"unit_name":"layers.0","reshard_after_forward":false' ||
  fail "step $from does not keep layers.0 unsharded after forward"
ctl --json schedule --step "$((from - 1))" | grep -q '"policy_version":"1"' ||
  fail "step $((from - 1)) changed policy"
log "step $from sealed with version 2 (layers.* keep parameters after forward), step $((from - 1)) with version 1"
url="$(ctl status | sed -n 's/^dashboard *//p')"
[ "$url" = "http://$coord:9090/" ] || fail "hsdpctl status shows dashboard '$url'"
state="$(curl -sf "http://127.0.0.1:$metrics_port/api/state")" || fail "no dashboard on :$metrics_port"
echo "$state" | grep -q '"state":"JOB_STATE_FINISHED"' || fail "dashboard state: ${state:0:300}"
curl -sf "http://127.0.0.1:$metrics_port/metrics" | grep -q '^hsdp_workers{state="finished"} 2' ||
  fail "/metrics does not count 2 finished workers"
log "dashboard ($url inside the network) and /metrics answer through the published port"
podman stop -t 30 "$coord" >/dev/null
code="$(podman inspect --format '{{.State.ExitCode}}' "$coord")"
[ "$code" = 0 ] || fail "the coordinator exited $code on SIGTERM"
log "coordinator stopped gracefully"
echo "PASS"

#!/usr/bin/env bash
# The dashboard's browser test: starts a local job of 4 workers (hsdp-launch, gpt-tiny, 2x2 mesh,
# a control token) and runs dashboard_browser_test.cjs against its dashboard in Debian's chromium.
# Screenshots, the run directory (logs, reports) and the test's output land in ARTIFACTS_DIR.
#
#   run_browser_test.sh BIN_DIR ARTIFACTS_DIR
#
# Exits 77 (ctest: skipped) with the reason when chromium or node is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(cd "$1" && pwd)"
artifacts="$2"

chromium="${HSDP_CHROMIUM:-$(command -v chromium || true)}"
if [ -z "$chromium" ]; then
  echo "SKIP: chromium is not installed (apt-get install chromium)"
  exit 77
fi
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "SKIP: node/npm are not installed (deploy/install-deps.sh installs them)"
  exit 77
fi
for b in hsdp-launch hsdp-coordinator hsdp-worker hsdpctl; do
  [ -x "$bin/$b" ] || { echo "FAIL: $bin/$b is missing (build it)"; exit 1; }
done
"$here/../npm_ci.sh" "$here"

rm -rf "$artifacts"
mkdir -p "$artifacts"
run="$artifacts/run"
token_file="$artifacts/control.token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$token_file"

# Far more steps than the test needs: it drains the job when done.
"$bin/hsdp-launch" --workers 4 --mesh 2x2 --model gpt-tiny --steps 5000 --run-dir "$run" \
  --control-token-file "$token_file" >"$artifacts/launch.log" 2>&1 &
launcher=$!
cleanup() {
  if kill -0 "$launcher" 2>/dev/null; then
    kill -TERM "$launcher" 2>/dev/null || true
    wait "$launcher" 2>/dev/null || true
  fi
}
trap cleanup EXIT

for _ in $(seq 1 600); do
  [ -s "$run/dashboard.url" ] && [ -s "$run/coordinator.port" ] && break
  kill -0 "$launcher" 2>/dev/null || { echo "FAIL: hsdp-launch exited:"; cat "$artifacts/launch.log"; exit 1; }
  sleep 0.1
done
url="$(head -n 1 "$run/dashboard.url")"
coordinator="127.0.0.1:$(head -n 1 "$run/coordinator.port")"
echo "job: coordinator $coordinator, dashboard $url"

status=0
node "$here/dashboard_browser_test.cjs" --url "$url" --chromium "$chromium" \
  --hsdpctl "$bin/hsdpctl" --coordinator "$coordinator" --token-file "$token_file" \
  --artifacts "$artifacts" || status=$?

# The job ends the way an operator ends it: drain, then every worker finishes.
"$bin/hsdpctl" --coordinator "$coordinator" --token-file "$token_file" drain || status=1
for _ in $(seq 1 600); do
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$launcher" 2>/dev/null; then
  echo "FAIL: the job did not finish within 60 s of the drain"
  status=1
else
  wait "$launcher" || { echo "FAIL: hsdp-launch exited $?"; status=1; }
fi
tail -n 3 "$artifacts/launch.log"
echo "artifacts: $artifacts"
exit "$status"

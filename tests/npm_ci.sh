#!/usr/bin/env bash
# npm_ci.sh DIR: installs the npm packages DIR/package-lock.json pins into DIR/node_modules
# (`npm ci`) on first use or when the lockfile changed; a no-op otherwise, so tests run offline
# once installed. ctest may start two tests of one DIR at once: one installs, the other waits.
set -euo pipefail
dir="$(cd "$1" && pwd)"
stamp="$dir/node_modules/.hsdp-lock.sha256"
want="$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  exec 9>"${TMPDIR:-/tmp}/hsdp-npm-ci-$(echo "$dir" | sha256sum | cut -c1-12).lock"
  flock 9
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$want" >"$stamp"
  fi
  flock -u 9
fi

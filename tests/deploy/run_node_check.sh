#!/usr/bin/env bash
# Runs validate_schemas.cjs with the npm packages pinned by package-lock.json beside it, installing
# them (`npm ci`) into tests/deploy/node_modules on first use or when the lockfile changed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
stamp="$here/node_modules/.hsdp-lock.sha256"
want="$(sha256sum "$here/package-lock.json" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # ctest may start two node checks at once: one installs, the other waits.
  exec 9>"${TMPDIR:-/tmp}/hsdp-npm-ci-$(echo "$here" | sha256sum | cut -c1-12).lock"
  flock 9
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    (cd "$here" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$want" >"$stamp"
  fi
  flock -u 9
fi
exec node "$here/validate_schemas.cjs" "$@"

#!/usr/bin/env bash
# Runs validate_schemas.cjs with the npm packages pinned by package-lock.json beside it, installing
# them (`npm ci`) into tests/deploy/node_modules on first use or when the lockfile changed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/../npm_ci.sh" "$here"
exec node "$here/validate_schemas.cjs" "$@"

#!/usr/bin/env bash
# Lints the wire API with buf's STANDARD rules. buf comes from npm (@bufbuild/buf), pinned by the
# lockfile beside this script; installed into tests/proto/node_modules on first use.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
proto_dir="$1"
if [ ! -x "$here/node_modules/.bin/buf" ]; then
  (cd "$here" && npm ci --no-audit --no-fund --silent)
fi
cd "$proto_dir"
"$here/node_modules/.bin/buf" lint
echo "buf lint: clean"

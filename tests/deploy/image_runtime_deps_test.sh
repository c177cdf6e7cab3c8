#!/usr/bin/env bash
# Runs the images' runtime-deps.sh on the locally built binaries, as the Dockerfiles' build stage
# does: the final stage's package list must cover every linked library (the script fails on a
# missing one), contain no development package, and name only packages that exist here.
#   image_runtime_deps_test.sh RUNTIME_DEPS_SH BINARY...
set -euo pipefail
script="$1"
shift
for b in "$@"; do
  if [ ! -x "$b" ]; then
    echo "SKIP: $b is not built"
    exit 77
  fi
done
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$script" "$out" "$@"
n="$(wc -l <"$out/packages.txt")"
[ "$n" -gt 0 ] || { echo "FAIL: no runtime packages found"; exit 1; }
grep -qx libc6 "$out/packages.txt" || { echo "FAIL: libc6 missing from the list"; exit 1; }
while read -r pkg; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
    { echo "FAIL: $pkg is not an installed package"; exit 1; }
done <"$out/packages.txt"
extra="$(cd "$out/root" && find . -type f | wc -l)"
echo "final stage would install $n runtime packages: $(tr '\n' ' ' <"$out/packages.txt")"
echo "libraries copied outside packages: $extra"

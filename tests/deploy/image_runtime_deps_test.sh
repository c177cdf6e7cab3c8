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
mapfile -t pkgs <"$out/packages.txt"
installed="$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${pkgs[@]}" 2>/dev/null |
  awk '$2 == "installed" {print $1}' | sort -u)"
missing="$(comm -23 "$out/packages.txt" <(echo "$installed"))"
[ -z "$missing" ] || { echo "FAIL: not installed packages: $missing"; exit 1; }
extra="$(cd "$out/root" && find . -type f | wc -l)"
echo "final stage would install $n runtime packages: $(tr '\n' ' ' <"$out/packages.txt")"
echo "libraries copied outside packages: $extra"

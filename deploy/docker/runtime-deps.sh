#!/usr/bin/env bash
# Runs in an image's build stage, after the build: works out what the final stage needs to run the
# given binaries, from what they actually link (ldd), so the final stage carries runtime libraries
# and nothing else.
#   runtime-deps.sh OUT_DIR BINARY...
# Writes OUT_DIR/packages.txt: the Debian/Ubuntu packages owning each linked library (runtime
# library packages, never -dev ones: the linker resolved the versioned .so), and copies libraries
# that no package owns (e.g. a CUDA LibTorch from a Python wheel) under OUT_DIR/root/ at their
# absolute paths, so the binaries' RUNPATH still finds them after `COPY --from=build OUT/root/ /`.
# Fails when a library is missing, except the GPU driver's (the NVIDIA container runtime mounts
# it into the container at run time).
set -euo pipefail
out="$1"
shift
mkdir -p "$out/root"
: >"$out/packages.txt"
driver_libs='^(libcuda\.so|libnvidia-ml\.so|libnvidia-)'
declare -A seen=()
status=0
for bin in "$@"; do
  while read -r name path; do
    if [ "$path" = "not" ] || [ -z "$path" ]; then
      if [[ "$name" =~ $driver_libs ]]; then
        continue
      fi
      echo "runtime-deps: $bin needs $name, which is not found" >&2
      status=1
      continue
    fi
    [ -n "${seen[$path]:-}" ] && continue
    seen[$path]=1
    real="$(readlink -f "$path")"
    pkg=""
    for candidate in "$path" "$real" "/usr$path" "/usr$real" "${path#/usr}" "${real#/usr}"; do
      [ -n "$candidate" ] || continue
      if owner="$(dpkg-query -S "$candidate" 2>/dev/null | head -n1)"; then
        pkg="${owner%%:*}"
        break
      fi
    done
    if [ -n "$pkg" ]; then
      echo "$pkg" >>"$out/packages.txt"
    else
      # Keep the name the loader looks for (a symlink) and the file behind it.
      cp -a --parents "$path" "$out/root/"
      [ "$real" = "$path" ] || cp -a --parents "$real" "$out/root/"
    fi
  done < <(ldd "$bin" | awk '/=>/ {print $1, $3} !/=>/ && /^\t\// {print $1, $1}')
done
sort -u -o "$out/packages.txt" "$out/packages.txt"
if grep -E -- '-dev$' "$out/packages.txt" >&2; then
  echo "runtime-deps: development packages above would end up in the final stage" >&2
  status=1
fi
exit "$status"

#!/usr/bin/env bash
# Runs in an image's build stage, after the build: works out what the final stage needs to run the
# given binaries, from what they actually link (ldd), so the final stage carries runtime libraries
# and nothing else.
#   runtime-deps.sh OUT_DIR BINARY...
# Writes OUT_DIR/packages.txt: the Debian/Ubuntu packages owning each linked library (runtime
# library packages, never -dev ones: the loader resolved versioned .so files), and copies libraries
# that no package owns (e.g. a CUDA LibTorch from a Python wheel) under OUT_DIR/root/ at their
# absolute paths, so the binaries' RUNPATH still finds them after `COPY --from=build OUT/root/ /`.
# Fails when a library is missing, except the GPU driver's (the NVIDIA container runtime mounts
# it into the container at run time).
set -euo pipefail
out="$1"
shift
mkdir -p "$out/root"
driver_libs='^(libcuda\.so|libnvidia-)'
status=0

# Every library the loader resolves, once.
declare -A libs=()
for bin in "$@"; do
  while read -r name path; do
    if [ "$path" = "not" ] || [ -z "$path" ]; then
      [[ "$name" =~ $driver_libs ]] && continue
      echo "runtime-deps: $bin needs $name, which is not found" >&2
      status=1
      continue
    fi
    libs[$path]=1
  done < <(ldd "$bin" | awk '/=>/ {print $1, $3} !/=>/ && /^\t\// {print $1, $1}')
done

# Owners in one dpkg query (one call per library takes minutes for a LibTorch binary). With
# merged /usr a library may be registered under /lib or /usr/lib, by its link name or its target:
# ask for every spelling.
declare -A spellings=()
for path in "${!libs[@]}"; do
  real="$(readlink -f "$path")"
  for c in "$path" "$real"; do
    spellings[$c]=1
    spellings[/usr${c}]=1
    spellings[${c#/usr}]=1
  done
done
declare -A owner=()
while IFS= read -r line; do
  pkgs="${line%%: /*}"
  file="/${line#*: /}"
  owner[$file]="${pkgs%%,*}"
done < <(dpkg-query -S "${!spellings[@]}" 2>/dev/null || true)

: >"$out/packages.txt"
for path in "${!libs[@]}"; do
  real="$(readlink -f "$path")"
  pkg=""
  for c in "$path" "$real" "/usr$path" "/usr$real" "${path#/usr}" "${real#/usr}"; do
    if [ -n "${owner[$c]:-}" ]; then
      pkg="${owner[$c]}"
      break
    fi
  done
  if [ -n "$pkg" ]; then
    echo "${pkg%%:*}" >>"$out/packages.txt"
  else
    # Keep the name the loader looks for (a symlink) and the file behind it. tar, not
    # `cp --parents`, so a path through a symlinked folder (/usr/local/cuda -> cuda-13.0) works.
    tar -C / -cf - "${path#/}" | tar -C "$out/root" -xf -
    [ "$real" = "$path" ] || tar -C / -cf - "${real#/}" | tar -C "$out/root" -xf -
  fi
done
sort -u -o "$out/packages.txt" "$out/packages.txt"
if grep -E -- '-dev$' "$out/packages.txt" >&2; then
  echo "runtime-deps: development packages above would end up in the final stage" >&2
  status=1
fi
exit "$status"

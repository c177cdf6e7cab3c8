#!/usr/bin/env bash
# Builds hsdp's CPU image with podman from Debian base images made here, from the apt mirror
# (for machines that reach no image registry).
#
#   deploy/docker/build.sh            the base images when missing, then localhost/hsdp-cpu:dev
#   deploy/docker/build.sh base       only the base images
#
# Environment:
#   HSDP_IMAGE          image name (default localhost/hsdp-cpu:dev)
#   HSDP_APT_MIRROR     Debian mirror (default: the host's, else http://deb.debian.org/debian)
#   HSDP_APT_SECURITY   security mirror (default: the host's, else http://deb.debian.org/debian-security)
#   HSDP_REBUILD_BASE=1 make the base images again even when present
#   HSDP_BUILD_JOBS     parallel compile jobs in the build stage (default 2: ~1.5 GB per job)
#   HSDP_IMAGE_CCACHE   ccache directory lent to the build stage (default: the host's ccache
#                       directory, so unchanged sources compile from cache; "none": no cache)
#
# The bases: localhost/debian-base:bookworm (minbase: the build stage) and
# localhost/debian-base:bookworm-slim (minbase without docs, man pages and locales, as Docker's
# -slim images: the final stage). Dockerfile.cpu takes them through DEBIAN_IMAGE.
# Dockerfile.cuda cannot be built here; see deploy/README.md.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=podman-env.sh
. "$repo/deploy/docker/podman-env.sh"

image="${HSDP_IMAGE:-localhost/hsdp-cpu:dev}"
base=localhost/debian-base:bookworm
suite=bookworm

say() { echo "build.sh: $*" >&2; }

if reason="$(hsdp_podman_check)"; then :; else
  say "$reason"
  exit 1
fi
for tool in mmdebstrap; do
  command -v "$tool" >/dev/null || { say "$tool is not installed (apt-get install $tool)"; exit 1; }
done

# The host's Debian mirrors (deb822 or one-line sources), so the images see the same snapshot.
host_mirror() {
  local want="$1" uri
  uri="$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
           /etc/apt/sources.list.d/*.list 2>/dev/null |
         grep -oE 'https?://[^ ]+' | grep -E "$want" | head -n 1 || true)"
  echo "${uri%/}"
}
mirror="${HSDP_APT_MIRROR:-$(host_mirror '/debian$')}"
mirror="${mirror:-http://deb.debian.org/debian}"
security="${HSDP_APT_SECURITY:-$(host_mirror '/debian-security$')}"
security="${security:-http://deb.debian.org/debian-security}"

make_base() {
  local tag="$1"
  shift
  if [ "${HSDP_REBUILD_BASE:-0}" != 1 ] && podman image exists "$tag"; then
    say "$tag exists (HSDP_REBUILD_BASE=1 makes it again)"
    return
  fi
  local aptopts=()
  # A snapshot mirror's Release files are past their Valid-Until; the host accepts that, and so
  # must apt inside the images.
  if apt-config dump 2>/dev/null | grep -q 'Acquire::Check-Valid-Until "false"'; then
    aptopts+=(--aptopt='Acquire::Check-Valid-Until "false"')
  fi
  say "making $tag from $mirror"
  local start=$SECONDS
  mmdebstrap --quiet --variant=minbase "${aptopts[@]}" "$@" "$suite" - \
    "deb $mirror $suite main" "deb $mirror $suite-updates main" \
    "deb $security $suite-security main" |
    podman import --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
  say "$tag: $((SECONDS - start)) s, $(podman image inspect --format '{{.Size}}' "$tag") bytes"
}

make_base "$base"
# What Docker's debian:*-slim leaves out; the setting stays in the image, so packages installed
# on top of it leave them out as well.
make_base "$base-slim" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --dpkgopt='path-exclude=/usr/share/lintian/*'
[ "${1:-}" = base ] && exit 0

volumes=()
cache="${HSDP_IMAGE_CCACHE:-}"
if [ -z "$cache" ] && command -v ccache >/dev/null; then
  cache="$(ccache -k cache_dir 2>/dev/null || true)"
fi
if [ -n "$cache" ] && [ "$cache" != none ]; then
  mkdir -p "$cache"
  # The build stage's ccache looks in root's default place.
  volumes+=(--volume "$cache:/root/.cache/ccache")
  say "build stage uses the ccache in $cache"
fi

say "building $image"
start=$SECONDS
podman build --file "$repo/deploy/docker/Dockerfile.cpu" --tag "$image" \
  --build-arg "DEBIAN_IMAGE=$base" --build-arg "BUILD_JOBS=${HSDP_BUILD_JOBS:-2}" \
  "${volumes[@]}" "$repo"
say "$image built in $((SECONDS - start)) s: $(podman image inspect --format '{{.Size}}' "$image") bytes"

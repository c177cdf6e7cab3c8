# Sourced (bash) by deploy/docker/build.sh and tests/container: the podman settings these hosts
# need, in a containers.conf that CONTAINERS_CONF points at (unless the caller set one already).
#   - runc: the default runtime (crun) fails here with "setrlimit RLIMIT_NOFILE: Operation not
#     permitted", then "cgroups in hybrid mode not supported";
#   - explicit ulimits, the open-files one no higher than this shell's hard limit;
#   - netavark networks (name resolution between containers) when netavark is installed: the CNI
#     plugins are not.
# Also defines hsdp_podman_check, which says why podman cannot run containers here, if it cannot.

hsdp_podman_conf() {
  local nofile
  nofile="$(ulimit -Hn)"
  if [ "$nofile" = unlimited ] || ((nofile > 1048576)); then nofile=1048576; fi
  local conf="${TMPDIR:-/tmp}/hsdp-containers-$(id -u).conf"
  {
    echo '[containers]'
    echo "default_ulimits = [\"nofile=${nofile}:${nofile}\", \"nproc=32768:32768\"]"
    echo '[engine]'
    echo 'runtime = "runc"'
    if [ -x /usr/lib/podman/netavark ] || [ -x /usr/libexec/podman/netavark ]; then
      echo '[network]'
      echo 'network_backend = "netavark"'
    fi
  } >"$conf.tmp"
  mv "$conf.tmp" "$conf"
  echo "$conf"
}

if [ -z "${CONTAINERS_CONF:-}" ]; then
  CONTAINERS_CONF="$(hsdp_podman_conf)"
  export CONTAINERS_CONF
fi

# Prints nothing and returns 0 when podman can build and run containers here; otherwise prints
# the reason on stdout and returns 1.
hsdp_podman_check() {
  if ! command -v podman >/dev/null 2>&1; then
    echo "podman is not installed (apt-get install podman buildah mmdebstrap runc netavark" \
      "aardvark-dns iptables)"
    return 1
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "needs rootful podman (run as root): rootless podman lacks the user namespaces here"
    return 1
  fi
  if ! command -v runc >/dev/null 2>&1; then
    echo "runc is not installed (crun, podman's default, fails on this host)"
    return 1
  fi
  local out
  if ! out="$(podman info --format '{{.Host.OCIRuntime.Name}}' 2>&1)"; then
    echo "podman info failed: $(echo "$out" | tail -n 1)"
    return 1
  fi
  return 0
}

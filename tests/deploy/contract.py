"""The flags and environment variables each binary reads.

Two sources: the names every binary and manifest shares (the CONTRACT table below) and, when
the binaries are built, their own `--help` (CLI11 prints each option's env fallback as
"(Env:NAME)"). The manifests may only set names from these sets.
"""

import re
import subprocess

# The names every binary and manifest shares: a binary may read more, a manifest may set no other.
CONTRACT = {
    "hsdp-coordinator": {
        "flags": {
            "job-id", "world-size", "mesh", "policy-file", "job-file", "listen", "port-file",
            "state-dir", "metrics-listen", "heartbeat-timeout", "read-ahead", "tls-cert",
            "tls-key", "control-token-file", "shutdown-deadline", "validate-policy", "help",
            # The worker API's authentication and the configuration check.
            "job-token-file", "tls-client-ca", "check-config",
        },
        "env": {
            "HSDP_JOB_ID", "HSDP_WORLD_SIZE", "HSDP_MESH", "HSDP_POLICY_FILE", "HSDP_LISTEN",
            "HSDP_STATE_DIR", "HSDP_METRICS_LISTEN", "HSDP_HEARTBEAT_TIMEOUT", "HSDP_TLS_CERT",
            "HSDP_TLS_KEY", "HSDP_CONTROL_TOKEN_FILE", "HSDP_JOB_TOKEN_FILE", "HSDP_TLS_CLIENT_CA",
        },
    },
    "hsdp-worker": {
        "flags": {
            "coordinator", "job-id", "rank-hint", "device", "model", "dims", "data", "steps",
            "microbatch-size", "lr", "checkpoint-dir", "threads", "gloo-iface", "gloo-hostname",
            "host-id", "relay",
            "collective-timeout", "seed", "report-file", "help",
            # In hsdp-worker --help though not in the table.
            "coordinator-timeout",
        },
        "env": {
            "HSDP_COORDINATOR", "HSDP_JOB_ID", "HSDP_RANK_HINT", "HSDP_DEVICE", "HSDP_MODEL",
            "HSDP_DATA", "HSDP_STEPS", "HSDP_MICROBATCH_SIZE", "HSDP_LR", "HSDP_CHECKPOINT_DIR",
            "HSDP_THREADS", "HSDP_GLOO_IFACE", "HSDP_GLOO_HOSTNAME", "HSDP_HOST_ID",
            "HSDP_RELAY",
        },
    },
    "hsdp-relay": {
        "flags": {
            "coordinator", "listen", "job-token-file", "tls-ca", "tls-client-cert",
            "tls-client-key", "keep-messages", "help",
        },
        "env": {
            "HSDP_COORDINATOR", "HSDP_RELAY", "HSDP_TLS_CA", "HSDP_TLS_CLIENT_CERT",
            "HSDP_TLS_CLIENT_KEY",
        },
    },
}

# Variables a binary reads by itself rather than as an option's env fallback, so `--help` does not
# list them: the worker's rank-hint fallbacks (torchrun's RANK, a StatefulSet pod's name), and the
# job token, which the coordinator, the worker's agent (worker/agent) and the relay read from the
# environment (a file, HSDP_JOB_TOKEN_FILE, or the value, HSDP_JOB_TOKEN) so it never appears on
# argv.
AMBIENT_ENV = {
    "hsdp-coordinator": {"HSDP_JOB_TOKEN"},
    "hsdp-worker": {"RANK", "POD_NAME", "HOSTNAME", "HSDP_JOB_TOKEN_FILE", "HSDP_JOB_TOKEN"},
    "hsdp-relay": {"HSDP_JOB_TOKEN_FILE", "HSDP_JOB_TOKEN"},
}

# Defaults the contract states that the checks rely on.
COORDINATOR_DEFAULT_SHUTDOWN_DEADLINE_S = 10
COORDINATOR_DEFAULT_LISTEN = "0.0.0.0:50051"

_FLAG_RE = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")
_ENV_RE = re.compile(r"Env:\s*([A-Z][A-Z0-9_]*)")


def from_help(binary_path, timeout_s=20):
    """{"flags": set, "env": set} parsed from `BINARY --help`; raises on failure."""
    proc = subprocess.run([binary_path, "--help"], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{binary_path} --help exited {proc.returncode}: {text.strip()[:300]}")
    return {"flags": set(_FLAG_RE.findall(text)), "env": set(_ENV_RE.findall(text))}


def flag_name(arg):
    """'--steps=5' -> 'steps'; non-flag arguments -> None."""
    m = re.match(r"^--([a-z][a-z0-9-]*)(=.*)?$", arg)
    return m.group(1) if m else None

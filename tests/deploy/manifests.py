"""Helpers shared by the deploy checks: render the kustomize overlays and look objects up.

Python 3 stdlib + PyYAML (Debian's python3-yaml, installed by deploy/install-deps.sh).
"""

import os
import subprocess

import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
K8S_DIR = os.path.join(REPO, "deploy", "k8s")
# Every kustomization a user can apply. base is rendered too: it must stand on its own.
TARGETS = {
    "base": os.path.join(K8S_DIR, "base"),
    "cpu": os.path.join(K8S_DIR, "overlays", "cpu"),
    "gpu": os.path.join(K8S_DIR, "overlays", "gpu"),
}
# Name stem of the ConfigMap/Secret generators (kustomize appends a content hash).
JOB_CONFIGMAP = "hsdp-job"
POLICY_CONFIGMAP = "hsdp-policy"
POLICY_KEY = "policy.json"
TOKEN_SECRET = "hsdp-control-token"
JOB_TOKEN_SECRET = "hsdp-job-token"


def render(target_dir):
    """Returns the YAML text `kubectl kustomize` renders for a kustomization directory."""
    proc = subprocess.run(["kubectl", "kustomize", target_dir], capture_output=True, text=True,
                          timeout=120, check=False)
    if proc.returncode != 0:
        version = subprocess.run(["kubectl", "version", "--client"], capture_output=True,
                                 text=True, timeout=30, check=False).stdout.strip()
        raise RuntimeError(
            f"kubectl kustomize {target_dir} failed: {proc.stderr.strip()} [{version}; these "
            f"kustomizations use components and replacements: they need the kustomize >= v4.1 "
            f"built into kubectl >= 1.22]")
    return proc.stdout


def load(path):
    """Objects of a multi-document YAML file, empty documents dropped."""
    with open(path, encoding="utf-8") as f:
        return [o for o in yaml.safe_load_all(f) if o]


def find(objs, kind, name=None, stem=None):
    """Objects of `kind`, by exact name or by generator stem (name or name-<hash>)."""
    out = []
    for o in objs:
        if o.get("kind") != kind:
            continue
        n = o.get("metadata", {}).get("name", "")
        if name is not None and n != name:
            continue
        if stem is not None and n != stem and not (n.startswith(stem + "-") and
                                                   "-" not in n[len(stem) + 1:]):
            continue
        out.append(o)
    return out


def one(objs, kind, name=None, stem=None):
    """The single object of `kind` with that name/stem, or None."""
    found = find(objs, kind, name=name, stem=stem)
    return found[0] if len(found) == 1 else None


def name_of(o):
    return o.get("metadata", {}).get("name", "")


def pod_spec(workload):
    return workload.get("spec", {}).get("template", {}).get("spec", {})


def containers(workload):
    return pod_spec(workload).get("containers", []) or []


def binary_of(container):
    """Basename of the program a container runs (command[0])."""
    cmd = container.get("command") or []
    return os.path.basename(cmd[0]) if cmd else None


def job_config(objs):
    """data of the job ConfigMap (HSDP_* settings shared by coordinator and workers)."""
    cm = one(objs, "ConfigMap", stem=JOB_CONFIGMAP)
    return (cm or {}).get("data", {}) or {}

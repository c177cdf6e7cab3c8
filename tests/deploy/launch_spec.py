#!/usr/bin/env python3
"""Turns a rendered manifest's pod into a local process: what a kubelet would start.

  launch_spec.py RENDERED.yaml {coordinator|worker} ROOT [--pod-name N] [--pod-index I]
                 [--pod-ip IP] [--set NAME=VALUE]... [--arg=--flag=VALUE]...

Materialises the pod's volumes under ROOT (ConfigMap and Secret keys as files, emptyDir / PVC /
volumeClaimTemplate as directories), resolves its env (literal values, configMapKeyRef,
secretKeyRef, downward-API fieldRef and resourceFieldRef) and prefixes every env value and
argument that points into a mount with ROOT. Prints a bash snippet defining
  SPEC_BINARY (command[0]), SPEC_ENV (array of NAME=VALUE) and SPEC_ARGS (array)
for `eval`. --set overrides or adds one env variable and --arg appends or replaces (same flag) one
argument: test sizing (fewer steps, one thread), each listed by the caller.
"""

import argparse
import base64
import math
import os
import re
import shlex
import sys

import manifests as m

WORKLOADS = {"coordinator": ("Deployment", "hsdp-coordinator"),
             "worker": ("StatefulSet", "hsdp-worker")}


def quantity_to_float(q):
    """CPU/memory quantities as plain numbers ('500m' -> 0.5, '2' -> 2, '1Gi' -> 2**30)."""
    q = str(q)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for s, f in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if q.endswith(s):
            return float(q[:-len(s)]) * f
    return float(q)


def materialise_volumes(objs, workload, root):
    """Creates each mounted volume under root; returns the sorted mount paths."""
    spec = m.pod_spec(workload)
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    templates = {t["metadata"]["name"] for t in
                 workload.get("spec", {}).get("volumeClaimTemplates") or []}
    mounts = []
    for vm in (spec.get("containers") or [{}])[0].get("volumeMounts") or []:
        path = os.path.join(root, vm["mountPath"].lstrip("/"))
        os.makedirs(path, exist_ok=True)
        mounts.append(vm["mountPath"])
        vol = volumes.get(vm["name"], {})
        if "configMap" in vol:
            cm = m.one(objs, "ConfigMap", name=vol["configMap"]["name"])
            for key, value in ((cm or {}).get("data") or {}).items():
                with open(os.path.join(path, key), "w", encoding="utf-8") as f:
                    f.write(value)
        elif "secret" in vol:
            sec = m.one(objs, "Secret", name=vol["secret"]["secretName"]) or {}
            files = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
            files.update({k: v.encode() for k, v in (sec.get("stringData") or {}).items()})
            for key, value in files.items():
                fp = os.path.join(path, key)
                with open(fp, "wb") as f:
                    f.write(value)
                os.chmod(fp, vol["secret"].get("defaultMode", 0o644))
        elif vm["name"] not in templates and not any(
                k in vol for k in ("emptyDir", "persistentVolumeClaim")):
            raise ValueError(f"volume {vm['name']}: kind not supported locally: {vol}")
    return sorted(mounts, key=len, reverse=True)


def under_root(value, mounts, root):
    """Prefixes a path (or --flag=path) pointing into a mount with root."""
    prefix, _, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
    for mp in mounts:
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            path = os.path.join(root, path.lstrip("/"))
            break
    return f"{prefix}={path}" if prefix else path


def resolve_env(objs, container, args):
    env = {}
    for e in container.get("env") or []:
        src = e.get("valueFrom") or {}
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            env[e["name"]] = m.one(objs, "ConfigMap", name=ref["name"])["data"][ref["key"]]
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            sec = m.one(objs, "Secret", name=ref["name"])
            env[e["name"]] = ((sec.get("stringData") or {}).get(ref["key"]) or
                              base64.b64decode(sec["data"][ref["key"]]).decode())
        elif "fieldRef" in src:
            field = src["fieldRef"]["fieldPath"]
            value = {
                "metadata.name": args.pod_name,
                "metadata.namespace": "hsdp",
                "metadata.labels['apps.kubernetes.io/pod-index']": args.pod_index,
                "status.podIP": args.pod_ip,
                "spec.nodeName": args.node_name,
            }.get(field)
            if value is None:
                raise ValueError(f"env {e['name']}: no local value for fieldRef {field}")
            env[e["name"]] = str(value)
        elif "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            group, _, res = ref["resource"].partition(".")
            amount = quantity_to_float(container["resources"][group][res])
            env[e["name"]] = str(math.ceil(amount / quantity_to_float(ref.get("divisor", "1"))))
        else:
            raise ValueError(f"env {e['name']}: unsupported source {src}")
    return env


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("rendered")
    p.add_argument("component", choices=sorted(WORKLOADS))
    p.add_argument("root")
    p.add_argument("--pod-name", default="")
    p.add_argument("--pod-index", default="")
    p.add_argument("--pod-ip", default="")
    p.add_argument("--node-name", default="")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--arg", action="append", default=[])
    args = p.parse_args(argv)
    objs = m.load(args.rendered)
    kind, name = WORKLOADS[args.component]
    workload = m.one(objs, kind, name=name)
    container = m.containers(workload)[0]
    mounts = materialise_volumes(objs, workload, args.root)
    env = resolve_env(objs, container, args)
    for kv in args.set:
        k, _, v = kv.partition("=")
        env[k] = v
    cargs = list(container.get("args") or [])
    for extra in args.arg:
        flag = re.match(r"^(--[a-z0-9-]+)", extra).group(1)
        cargs = [a for a in cargs if a != flag and not a.startswith(flag + "=")] + [extra]
    env = {k: under_root(v, mounts, args.root) for k, v in env.items()}
    cargs = [under_root(a, mounts, args.root) for a in cargs]
    print(f"SPEC_BINARY={shlex.quote(container['command'][0])}")
    print("SPEC_ENV=(" + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + ")")
    print("SPEC_ARGS=(" + " ".join(shlex.quote(a) for a in cargs) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

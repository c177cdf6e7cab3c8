#!/usr/bin/env python3
"""Offline checks of deploy/k8s that no schema catches.

  check_manifests.py render OUTDIR
      kubectl kustomize every kustomization into OUTDIR/<name>.yaml (base, cpu, gpu).
  check_manifests.py cross RENDERED.yaml... [--coordinator-bin P] [--worker-bin P]
      Cross-object checks (names, selectors, ports, volumes, env/flags, job consistency).
      Env/flag names are checked against contract.CONTRACT, and also against the binaries'
      --help when their paths are given and exist.
  check_manifests.py selftest RENDERED.yaml
      Breaks a rendered overlay in one way at a time and asserts the cross checks notice each.
  check_manifests.py policy RENDERED.yaml... --coordinator-bin P --bad-policy F
      Feeds the policy in each rendered ConfigMap to `hsdp-coordinator --validate-policy`; the
      known-bad policy F must be refused (proves the check can fail).

Exit 0 = all good; 1 = problems (one line each); 2 = usage.
"""

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile

import contract
import manifests as m

NAMESPACE = "hsdp"
COORDINATOR = "hsdp-coordinator"
WORKER = "hsdp-worker"
RELAY = "hsdp-relay"
SERVICE_ACCOUNT = "hsdp"
MESH_RE = re.compile(r"^(\d+)x(\d+)$")


class Checker:
    """Collects problems for one rendered kustomization."""

    def __init__(self, label, objs, allowed):
        self.label = label
        self.objs = objs
        self.allowed = allowed  # binary -> {"flags": set, "env": set, "source": str}
        self.problems = []

    def fail(self, msg):
        self.problems.append(f"{self.label}: {msg}")

    # --- lookups -------------------------------------------------------------------------
    def workloads(self):
        return [o for o in self.objs
                if o.get("kind") in ("Deployment", "StatefulSet", "DaemonSet")]

    def configmap_data(self, name):
        cm = m.one(self.objs, "ConfigMap", name=name)
        return None if cm is None else (cm.get("data") or {})

    def secret_keys(self, name):
        s = m.one(self.objs, "Secret", name=name)
        if s is None:
            return None
        return set((s.get("data") or {}).keys()) | set((s.get("stringData") or {}).keys())

    # --- checks --------------------------------------------------------------------------
    def check_inventory(self):
        want = [("Namespace", NAMESPACE), ("ServiceAccount", SERVICE_ACCOUNT),
                ("Deployment", COORDINATOR), ("Service", COORDINATOR),
                ("PersistentVolumeClaim", None), ("StatefulSet", WORKER), ("Service", WORKER),
                ("NetworkPolicy", None), ("PodDisruptionBudget", COORDINATOR)]
        for kind, name in want:
            if not m.find(self.objs, kind, name=name):
                self.fail(f"missing {kind}{'/' + name if name else ''}")
        for kind, stem in [("ConfigMap", m.JOB_CONFIGMAP), ("ConfigMap", m.POLICY_CONFIGMAP),
                           ("Secret", m.TOKEN_SECRET), ("Secret", m.JOB_TOKEN_SECRET)]:
            if m.one(self.objs, kind, stem=stem) is None:
                self.fail(f"missing {kind} {stem}")
        for o in self.objs:
            if o.get("kind") != "Namespace" and o.get("metadata", {}).get("namespace") != NAMESPACE:
                self.fail(f"{o.get('kind')}/{m.name_of(o)} is not in namespace {NAMESPACE}")

    def check_selectors(self):
        for w in self.workloads():
            sel = w.get("spec", {}).get("selector", {}).get("matchLabels") or {}
            labels = w.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}
            if not sel:
                self.fail(f"{w['kind']}/{m.name_of(w)} has no selector.matchLabels")
            for k, v in sel.items():
                if labels.get(k) != v:
                    self.fail(f"{w['kind']}/{m.name_of(w)} selector {k}={v} does not match its "
                              f"pod template labels {labels}")

    def selected(self, selector):
        """Workloads whose pod template labels satisfy a matchLabels selector."""
        out = []
        for w in self.workloads():
            labels = w.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}
            if selector and all(labels.get(k) == v for k, v in selector.items()):
                out.append(w)
        return out

    def container_ports(self, w):
        ports = {}
        for c in m.containers(w):
            for p in c.get("ports") or []:
                ports[p.get("containerPort")] = p
                if p.get("name"):
                    ports[p["name"]] = p
        return ports

    def check_services(self):
        for svc in m.find(self.objs, "Service"):
            sel = svc.get("spec", {}).get("selector") or {}
            targets = self.selected(sel)
            if len(targets) != 1:
                self.fail(f"Service/{m.name_of(svc)} selector {sel} matches {len(targets)} "
                          f"workloads, want exactly 1")
                continue
            ports = self.container_ports(targets[0])
            for p in svc.get("spec", {}).get("ports") or []:
                tp = p.get("targetPort", p.get("port"))
                if tp not in ports:
                    self.fail(f"Service/{m.name_of(svc)} port {p.get('name')} targets {tp!r}, "
                              f"which no container of {m.name_of(targets[0])} declares")

    def check_statefulset(self):
        sts = m.one(self.objs, "StatefulSet", name=WORKER)
        if sts is None:
            return
        spec = sts.get("spec", {})
        svc = m.one(self.objs, "Service", name=spec.get("serviceName"))
        if svc is None:
            self.fail(f"StatefulSet/{WORKER} serviceName {spec.get('serviceName')!r} names no "
                      f"Service")
        else:
            if svc["spec"].get("clusterIP") != "None":
                self.fail(f"Service/{m.name_of(svc)} (StatefulSet serviceName) is not headless")
            if svc["spec"].get("publishNotReadyAddresses") is not True:
                self.fail(f"Service/{m.name_of(svc)} must publish not-ready addresses")
            if sts not in self.selected(svc["spec"].get("selector") or {}):
                self.fail(f"Service/{m.name_of(svc)} does not select the StatefulSet's pods")
        if spec.get("podManagementPolicy") != "Parallel":
            self.fail(f"StatefulSet/{WORKER} podManagementPolicy must be Parallel")
        for c in m.containers(sts):
            if "livenessProbe" in c:
                self.fail(f"worker container {c['name']} has a livenessProbe (kills the gang "
                          f"during long collectives)")
            for probe in ("readinessProbe", "startupProbe"):
                if probe not in c:
                    self.fail(f"worker container {c['name']} has no {probe}")

    def check_probes(self):
        for w in self.workloads():
            ports = self.container_ports(w)
            for c in m.containers(w):
                for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
                    probe = c.get(probe_name)
                    if not probe:
                        continue
                    for handler in ("grpc", "httpGet", "tcpSocket"):
                        if handler in probe:
                            port = probe[handler].get("port")
                            if port not in ports:
                                self.fail(f"{m.name_of(w)}/{c['name']} {probe_name} port {port!r} "
                                          f"is not a container port")
        dep = m.one(self.objs, "Deployment", name=COORDINATOR)
        if dep is not None:
            for c in m.containers(dep):
                for probe_name in ("readinessProbe", "livenessProbe"):
                    if "grpc" not in (c.get(probe_name) or {}):
                        self.fail(f"coordinator {probe_name} must be a native grpc probe")

    def check_policies(self):
        coord = m.one(self.objs, "Deployment", name=COORDINATOR)
        workers = m.one(self.objs, "StatefulSet", name=WORKER)
        for pdb in m.find(self.objs, "PodDisruptionBudget"):
            sel = pdb.get("spec", {}).get("selector", {}).get("matchLabels") or {}
            if len(self.selected(sel)) != 1:
                self.fail(f"PodDisruptionBudget/{m.name_of(pdb)} selects "
                          f"{len(self.selected(sel))} workloads")
        if coord is not None and not any(
                coord in self.selected(p.get("spec", {}).get("selector", {}).get("matchLabels"))
                for p in m.find(self.objs, "PodDisruptionBudget")):
            self.fail("no PodDisruptionBudget covers the coordinator")
        for np in m.find(self.objs, "NetworkPolicy"):
            spec = np.get("spec", {})
            if coord is None or self.selected(spec.get("podSelector", {}).get("matchLabels")) != [
                    coord]:
                self.fail(f"NetworkPolicy/{m.name_of(np)} does not select exactly the coordinator")
                continue
            if "Ingress" not in (spec.get("policyTypes") or []):
                self.fail(f"NetworkPolicy/{m.name_of(np)} does not restrict ingress")
            ports = self.container_ports(coord)
            admits_workers = False
            for rule in spec.get("ingress") or []:
                for peer in rule.get("from") or []:
                    if not peer:
                        self.fail(f"NetworkPolicy/{m.name_of(np)} has an empty peer (admits all)")
                    sel = (peer.get("podSelector") or {}).get("matchLabels")
                    if sel and "namespaceSelector" not in peer and workers in self.selected(sel):
                        admits_workers = True
                if not rule.get("from"):
                    self.fail(f"NetworkPolicy/{m.name_of(np)} has a rule without 'from' "
                              f"(admits everyone)")
                for p in rule.get("ports") or []:
                    if p.get("port") not in ports:
                        self.fail(f"NetworkPolicy/{m.name_of(np)} port {p.get('port')!r} is not a "
                                  f"coordinator container port")
            if not admits_workers:
                self.fail(f"NetworkPolicy/{m.name_of(np)} does not admit the worker pods")

    def check_service_account(self):
        sa = m.one(self.objs, "ServiceAccount", name=SERVICE_ACCOUNT)
        if sa is not None and sa.get("automountServiceAccountToken") is not False:
            self.fail("ServiceAccount hsdp must set automountServiceAccountToken: false")
        for o in self.objs:
            if o.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
                for s in o.get("subjects") or []:
                    if s.get("kind") == "ServiceAccount" and s.get("name") == SERVICE_ACCOUNT:
                        self.fail(f"{o['kind']}/{m.name_of(o)} grants rights to ServiceAccount "
                                  f"{SERVICE_ACCOUNT}")
        for w in self.workloads():
            ps = m.pod_spec(w)
            if ps.get("serviceAccountName") != SERVICE_ACCOUNT:
                self.fail(f"{m.name_of(w)} does not run as ServiceAccount {SERVICE_ACCOUNT}")
            if ps.get("automountServiceAccountToken") is not False:
                self.fail(f"{m.name_of(w)} mounts a ServiceAccount token")
            if (ps.get("securityContext") or {}).get("runAsNonRoot") is not True:
                self.fail(f"{m.name_of(w)} pods may run as root")
            for c in ps.get("containers") or []:
                sc = c.get("securityContext") or {}
                if sc.get("allowPrivilegeEscalation") is not False:
                    self.fail(f"{m.name_of(w)}/{c['name']} allows privilege escalation")

    def mounts_by_path(self, w):
        """mountPath -> (volume dict or claim template, container mount) for the first container."""
        ps = m.pod_spec(w)
        volumes = {v["name"]: v for v in ps.get("volumes") or []}
        for t in w.get("spec", {}).get("volumeClaimTemplates") or []:
            volumes[t["metadata"]["name"]] = {"name": t["metadata"]["name"],
                                              "volumeClaimTemplate": t}
        out = {}
        for c in ps.get("containers") or []:
            for vm in c.get("volumeMounts") or []:
                vol = volumes.get(vm.get("name"))
                if vol is None:
                    self.fail(f"{m.name_of(w)}/{c['name']} mounts undefined volume {vm.get('name')}")
                    continue
                out[vm["mountPath"]] = (vol, vm)
        return out

    def check_volumes(self):
        for w in self.workloads():
            for vol in m.pod_spec(w).get("volumes") or []:
                if "configMap" in vol and self.configmap_data(vol["configMap"]["name"]) is None:
                    self.fail(f"{m.name_of(w)} volume {vol['name']} names missing ConfigMap "
                              f"{vol['configMap']['name']}")
                if "secret" in vol and self.secret_keys(vol["secret"]["secretName"]) is None:
                    self.fail(f"{m.name_of(w)} volume {vol['name']} names missing Secret "
                              f"{vol['secret']['secretName']}")
                if "persistentVolumeClaim" in vol:
                    claim = vol["persistentVolumeClaim"]["claimName"]
                    if m.one(self.objs, "PersistentVolumeClaim", name=claim) is None:
                        self.fail(f"{m.name_of(w)} volume {vol['name']} names missing PVC {claim}")
            self.mounts_by_path(w)

    def file_source(self, w, path):
        """What backs a file or directory path inside the pod: (volume, subpath) or (None, None)."""
        best = None
        for mount_path, (vol, _) in self.mounts_by_path(w).items():
            if path == mount_path or path.startswith(mount_path.rstrip("/") + "/"):
                if best is None or len(mount_path) > len(best[0]):
                    best = (mount_path, vol)
        if best is None:
            return None, None
        return best[1], os.path.relpath(path, best[0])

    def resolved_env(self, c):
        """Container env as name -> literal value (configMapKeyRef resolved); refs checked."""
        env = {}
        seen = set()
        for e in c.get("env") or []:
            name = e.get("name")
            if name in seen:
                self.fail(f"container {c['name']} sets {name} twice")
            seen.add(name)
            value = e.get("value")
            ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
            if ref:
                data = self.configmap_data(ref["name"])
                if data is None or ref["key"] not in data:
                    self.fail(f"container {c['name']} env {name}: ConfigMap {ref['name']} has no "
                              f"key {ref['key']}")
                else:
                    value = data[ref["key"]]
            sref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if sref and sref["key"] not in (self.secret_keys(sref["name"]) or ()):
                self.fail(f"container {c['name']} env {name}: Secret {sref['name']} has no key "
                          f"{sref['key']}")
            env[name] = value
        for src in c.get("envFrom") or []:
            self.fail(f"container {c['name']} uses envFrom ({src}); set each variable explicitly "
                      f"so its name is checked")
        return env

    def check_env_and_flags(self):
        for w in self.workloads():
            for c in m.containers(w):
                binary = m.binary_of(c)
                if binary not in self.allowed:
                    self.fail(f"{m.name_of(w)}/{c['name']} runs {binary!r}, not an hsdp binary")
                    continue
                allowed = self.allowed[binary]
                for name in self.resolved_env(c):
                    if name not in allowed["env"]:
                        self.fail(f"{m.name_of(w)}/{c['name']} sets env {name}, which {binary} "
                                  f"does not read (per {allowed['source']})")
                for arg in c.get("args") or []:
                    flag = contract.flag_name(arg)
                    if flag is None or flag not in allowed["flags"]:
                        self.fail(f"{m.name_of(w)}/{c['name']} passes {arg!r}, not a flag of "
                                  f"{binary} (per {allowed['source']})")

    def check_coordinator(self):
        dep = m.one(self.objs, "Deployment", name=COORDINATOR)
        if dep is None:
            return
        if dep["spec"].get("replicas") != 1:
            self.fail("coordinator Deployment must have exactly 1 replica")
        c = m.containers(dep)[0]
        env = self.resolved_env(c)
        args = {contract.flag_name(a): a.split("=", 1)[1] for a in c.get("args") or []
                if "=" in a}
        deadline = int(args.get("shutdown-deadline",
                                contract.COORDINATOR_DEFAULT_SHUTDOWN_DEADLINE_S))
        grace = m.pod_spec(dep).get("terminationGracePeriodSeconds", 30)
        if grace <= deadline:
            self.fail(f"coordinator terminationGracePeriodSeconds {grace} must exceed "
                      f"--shutdown-deadline {deadline}")
        listen = env.get("HSDP_LISTEN", contract.COORDINATOR_DEFAULT_LISTEN)
        listen_port = int(listen.rsplit(":", 1)[1])
        ports = self.container_ports(dep)
        if listen_port not in ports:
            self.fail(f"coordinator listens on {listen_port} (HSDP_LISTEN) but declares no such "
                      f"container port")
        for probe_name in ("readinessProbe", "livenessProbe"):
            port = ((c.get(probe_name) or {}).get("grpc") or {}).get("port")
            if port is not None and port != listen_port:
                self.fail(f"coordinator {probe_name} probes port {port}, gRPC serves on "
                          f"{listen_port}")
        for var, kind, key_check in (("HSDP_POLICY_FILE", "configMap", True),
                                     ("HSDP_CONTROL_TOKEN_FILE", "secret", True),
                                     ("HSDP_JOB_TOKEN_FILE", "secret", True),
                                     ("HSDP_STATE_DIR", "persistentVolumeClaim", False)):
            path = env.get(var)
            if not path:
                self.fail(f"coordinator does not set {var}")
                continue
            vol, sub = self.file_source(dep, path)
            if vol is None or kind not in vol:
                self.fail(f"coordinator {var}={path} is not on a {kind} volume")
                continue
            if key_check:
                keys = (self.configmap_data(vol["configMap"]["name"]) if kind == "configMap"
                        else self.secret_keys(vol["secret"]["secretName"])) or {}
                if sub not in keys:
                    self.fail(f"coordinator {var}={path}: {kind} has no key {sub!r}")

    def check_job(self):
        data = m.job_config(self.objs)
        sts = m.one(self.objs, "StatefulSet", name=WORKER)
        try:
            world = int(data.get("HSDP_WORLD_SIZE", ""))
        except ValueError:
            self.fail(f"HSDP_WORLD_SIZE {data.get('HSDP_WORLD_SIZE')!r} is not an integer")
            return
        if sts is not None and sts["spec"].get("replicas") != world:
            self.fail(f"StatefulSet replicas {sts['spec'].get('replicas')} != HSDP_WORLD_SIZE "
                      f"{world}")
        mesh = data.get("HSDP_MESH")
        if mesh is not None:
            mm = MESH_RE.match(mesh)
            if not mm or int(mm.group(1)) * int(mm.group(2)) != world:
                self.fail(f"HSDP_MESH {mesh!r} does not multiply to HSDP_WORLD_SIZE {world}")

    def check_worker(self, overlay_kind):
        sts = m.one(self.objs, "StatefulSet", name=WORKER)
        if sts is None:
            return
        c = m.containers(sts)[0]
        env = self.resolved_env(c)
        fields = {e["name"]: ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
                  for e in c.get("env") or []}
        if not (fields.get("HSDP_RANK_HINT") == "metadata.labels['apps.kubernetes.io/pod-index']"
                or fields.get("POD_NAME") == "metadata.name"):
            self.fail("worker gets no rank hint from the pod index (HSDP_RANK_HINT from the "
                      "apps.kubernetes.io/pod-index label, or POD_NAME from metadata.name)")
        coord = env.get("HSDP_COORDINATOR", "")
        host, _, port = coord.rpartition(":")
        svc = m.one(self.objs, "Service", name=host)
        if svc is None:
            self.fail(f"HSDP_COORDINATOR {coord!r} does not name a Service")
        else:
            dep = m.one(self.objs, "Deployment", name=COORDINATOR)
            if dep is None or dep not in self.selected(svc["spec"].get("selector") or {}):
                self.fail(f"Service {host} (HSDP_COORDINATOR) does not select the coordinator")
            svc_ports = {str(p.get("port")): p for p in svc["spec"].get("ports") or []}
            if port not in svc_ports:
                self.fail(f"HSDP_COORDINATOR port {port} is not a port of Service {host}")
            elif dep is not None:
                target = svc_ports[port].get("targetPort")
                cport = self.container_ports(dep).get(target)
                listen = self.resolved_env(m.containers(dep)[0]).get(
                    "HSDP_LISTEN", contract.COORDINATOR_DEFAULT_LISTEN)
                if cport is None or str(cport["containerPort"]) != listen.rsplit(":", 1)[1]:
                    self.fail(f"HSDP_COORDINATOR {coord} reaches {target!r}, not the port the "
                              f"coordinator listens on ({listen})")
        self.check_job_token(sts, env)
        ckpt = env.get("HSDP_CHECKPOINT_DIR")
        vol, _ = self.file_source(sts, ckpt) if ckpt else (None, None)
        # Checkpoint format v1: every rank reads and writes one directory (rows of any shard are
        # read on resume at another mesh), so it must be one claim every pod mounts, ReadWriteMany.
        claim = ((vol or {}).get("persistentVolumeClaim") or {}).get("claimName")
        pvc = m.one(self.objs, "PersistentVolumeClaim", name=claim) if claim else None
        if pvc is None:
            self.fail(f"HSDP_CHECKPOINT_DIR {ckpt!r} is not on a volume every worker shares "
                      f"(a PersistentVolumeClaim)")
        elif "ReadWriteMany" not in (pvc.get("spec", {}).get("accessModes") or []):
            self.fail(f"HSDP_CHECKPOINT_DIR {ckpt!r} is on claim {claim}, which is not "
                      f"ReadWriteMany")
        limits = (c.get("resources") or {}).get("limits") or {}
        device = env.get("HSDP_DEVICE", "cpu")
        mounts = self.mounts_by_path(sts)
        if overlay_kind == "gpu":
            if not device.startswith("cuda"):
                self.fail(f"gpu overlay runs workers on {device!r}")
            if int(limits.get("nvidia.com/gpu", 0) or 0) < 1:
                self.fail("gpu overlay: worker has no nvidia.com/gpu limit")
            shm = mounts.get("/dev/shm")
            if shm is None or (shm[0].get("emptyDir") or {}).get("medium") != "Memory":
                self.fail("gpu overlay: /dev/shm is not a memory-backed emptyDir")
        else:
            if device != "cpu":
                self.fail(f"{self.label} runs workers on {device!r}, want cpu")
            if "nvidia.com/gpu" in limits:
                self.fail(f"{self.label} asks for GPUs")

    def secret_file(self, w, path):
        """(secret name, key) backing a file path in a workload's pod, or (None, None)."""
        vol, sub = self.file_source(w, path) if path else (None, None)
        if vol is None or "secret" not in vol:
            return None, None
        return vol["secret"]["secretName"], sub

    def check_job_token(self, sts, env):
        """Workers read the job token from the same Secret key as the coordinator, and from a file:
        a value in the pod spec (HSDP_JOB_TOKEN) would put the secret in the manifest."""
        if "HSDP_JOB_TOKEN" in env:
            self.fail("worker sets HSDP_JOB_TOKEN (the token itself) in its spec; mount the "
                      "Secret and set HSDP_JOB_TOKEN_FILE")
        path = env.get("HSDP_JOB_TOKEN_FILE")
        worker_src = self.secret_file(sts, path)
        if worker_src[0] is None:
            self.fail(f"worker HSDP_JOB_TOKEN_FILE={path!r} is not on a secret volume")
            return
        if worker_src[1] not in (self.secret_keys(worker_src[0]) or ()):
            self.fail(f"worker HSDP_JOB_TOKEN_FILE={path}: secret has no key {worker_src[1]!r}")
        dep = m.one(self.objs, "Deployment", name=COORDINATOR)
        if dep is None:
            return
        coord_path = self.resolved_env(m.containers(dep)[0]).get("HSDP_JOB_TOKEN_FILE")
        coord_src = self.secret_file(dep, coord_path)
        if coord_src != worker_src:
            self.fail(f"workers read the job token from {worker_src}, the coordinator from "
                      f"{coord_src}: they must share one Secret key")
        if worker_src[0] == m.one(self.objs, "Secret", stem=m.TOKEN_SECRET).get(
                "metadata", {}).get("name"):
            self.fail("the job token is the control token's Secret: workers would hold the "
                      "operator's credential")

    def check_relay(self):
        """With a relay per node (components/relay): the workers reach the relay of their own node,
        the relay reaches the coordinator as they do, with their job token, and is let in."""
        relay = m.one(self.objs, "DaemonSet", name=RELAY)
        sts = m.one(self.objs, "StatefulSet", name=WORKER)
        if sts is None:
            return
        worker_env = self.resolved_env(m.containers(sts)[0])
        address = worker_env.get("HSDP_RELAY")
        if relay is None:
            if address:
                self.fail(f"workers set HSDP_RELAY={address} but no DaemonSet/{RELAY} runs")
            return
        if not address:
            self.fail(f"DaemonSet/{RELAY} runs but the workers set no HSDP_RELAY")
            return
        host, _, port = address.rpartition(":")
        svc = m.one(self.objs, "Service", name=host)
        if svc is None or relay not in self.selected(svc["spec"].get("selector") or {}):
            self.fail(f"HSDP_RELAY {address!r} does not name a Service that selects the relay")
        else:
            if svc["spec"].get("internalTrafficPolicy") != "Local":
                self.fail(f"Service/{host} (HSDP_RELAY) is not node-local "
                          f"(internalTrafficPolicy: Local): workers would reach other nodes' "
                          f"relays")
            svc_ports = {str(p.get("port")): p for p in svc["spec"].get("ports") or []}
            c = m.containers(relay)[0]
            listen = next((a.split("=", 1)[1] for a in c.get("args") or []
                           if a.startswith("--listen=")), "")
            cport = (self.container_ports(relay).get(svc_ports[port].get("targetPort"))
                     if port in svc_ports else None)
            if cport is None or str(cport["containerPort"]) != listen.rsplit(":", 1)[-1]:
                self.fail(f"HSDP_RELAY {address} reaches no port the relay listens on "
                          f"(--listen={listen})")
        relay_env = self.resolved_env(m.containers(relay)[0])
        if relay_env.get("HSDP_COORDINATOR") != worker_env.get("HSDP_COORDINATOR"):
            self.fail(f"the relay's HSDP_COORDINATOR {relay_env.get('HSDP_COORDINATOR')!r} is not "
                      f"the workers' {worker_env.get('HSDP_COORDINATOR')!r}")
        relay_token = self.secret_file(relay, relay_env.get("HSDP_JOB_TOKEN_FILE"))
        worker_token = self.secret_file(sts, worker_env.get("HSDP_JOB_TOKEN_FILE"))
        if relay_token != worker_token:
            self.fail(f"the relay reads the job token from {relay_token}, the workers from "
                      f"{worker_token}: they must share one Secret key")
        for np in m.find(self.objs, "NetworkPolicy"):
            admitted = any(
                relay in self.selected((peer.get("podSelector") or {}).get("matchLabels"))
                for rule in np.get("spec", {}).get("ingress") or []
                for peer in rule.get("from") or [] if "namespaceSelector" not in peer)
            if not admitted:
                self.fail(f"NetworkPolicy/{m.name_of(np)} does not admit the relay pods")

    def run(self, overlay_kind):
        for check in (self.check_inventory, self.check_selectors, self.check_services,
                      self.check_statefulset, self.check_probes, self.check_policies,
                      self.check_service_account, self.check_volumes, self.check_env_and_flags,
                      self.check_coordinator, self.check_job, self.check_relay):
            check()
        self.check_worker(overlay_kind)
        return list(dict.fromkeys(self.problems))  # a helper may report one problem twice


def overlay_kind(path):
    return "gpu" if os.path.basename(path).startswith("gpu") else "cpu"


def allowed_names(args):
    """Per binary: allowed flags/env from the contract, narrowed by --help when built."""
    allowed = {}
    notes = []
    for binary, path in (("hsdp-coordinator", args.coordinator_bin),
                         ("hsdp-worker", args.worker_bin),
                         ("hsdp-relay", getattr(args, "relay_bin", None))):
        entry = {"flags": set(contract.CONTRACT[binary]["flags"]),
                 "env": set(contract.CONTRACT[binary]["env"]) | contract.AMBIENT_ENV[binary],
                 "source": "contract.CONTRACT"}
        if path and os.access(path, os.X_OK):
            helped = contract.from_help(path)
            entry = {"flags": helped["flags"],
                     "env": helped["env"] | contract.AMBIENT_ENV[binary],
                     "source": f"{binary} --help"}
            notes.append(f"{binary}: checked against its --help ({len(helped['flags'])} flags, "
                         f"{len(helped['env'])} env names)")
            missing = contract.CONTRACT[binary]["env"] - helped["env"]
            if missing:
                notes.append(f"{binary}: note: --help lists no env for {sorted(missing)}")
        else:
            notes.append(f"SKIP {binary} --help sub-check: binary not built "
                         f"({path or 'no path given'}); checked against contract.CONTRACT only")
        allowed[binary] = entry
    return allowed, notes


def cmd_render(args):
    os.makedirs(args.outdir, exist_ok=True)
    for name, target in m.TARGETS.items():
        text = m.render(target)
        out = os.path.join(args.outdir, f"{name}.yaml")
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        kinds = sorted({o.get("kind") for o in m.load(out)})
        print(f"rendered {name}: {len(m.load(out))} objects ({', '.join(kinds)}) -> {out}")
    return 0


def cmd_cross(args):
    allowed, notes = allowed_names(args)
    for n in notes:
        print(n)
    problems = []
    for path in args.rendered:
        label = os.path.splitext(os.path.basename(path))[0]
        problems += Checker(label, m.load(path), allowed).run(overlay_kind(path))
    for p in problems:
        print(p)
    print(f"cross checks: {len(problems)} problem(s) in {len(args.rendered)} renderings")
    return 1 if problems else 0


def _container(objs, kind, name):
    return m.containers(m.one(objs, kind, name=name))[0]


def _env(objs, kind, name, var):
    for e in _container(objs, kind, name).get("env"):
        if e["name"] == var:
            return e
    raise KeyError(var)


# Each mutation breaks one thing; the named substring must show up among the problems.
MUTATIONS = [
    ("serviceName names no Service",
     lambda o: m.one(o, "StatefulSet", name=WORKER)["spec"].update(serviceName="workers"),
     "names no Service"),
    ("headless Service hides not-ready pods",
     lambda o: m.one(o, "Service", name=WORKER)["spec"].update(publishNotReadyAddresses=False),
     "must publish not-ready addresses"),
    ("pod template label drifts from the selector",
     lambda o: m.one(o, "Deployment", name=COORDINATOR)["spec"]["template"]["metadata"]["labels"]
     .update({"app.kubernetes.io/component": "coord"}),
     "does not match its pod template labels"),
    ("probe on an undeclared port",
     lambda o: _container(o, "Deployment", COORDINATOR)["readinessProbe"]["grpc"]
     .update(port=50052),
     "is not a container port"),
    ("Service targets an unknown port name",
     lambda o: m.one(o, "Service", name=COORDINATOR)["spec"]["ports"][0].update(targetPort="rpc"),
     "which no container of"),
    ("liveness probe on workers",
     lambda o: _container(o, "StatefulSet", WORKER).update(
         livenessProbe={"exec": {"command": ["true"]}}),
     "has a livenessProbe"),
    ("env the worker does not read",
     lambda o: _container(o, "StatefulSet", WORKER)["env"].append(
         {"name": "HSDP_COORDINATOR_ADDR", "value": "x:1"}),
     "sets env HSDP_COORDINATOR_ADDR"),
    ("flag the coordinator does not have",
     lambda o: _container(o, "Deployment", COORDINATOR)["args"].append("--shutdown-timeout=5"),
     "passes '--shutdown-timeout=5'"),
    ("grace period shorter than the shutdown deadline",
     lambda o: m.pod_spec(m.one(o, "Deployment", name=COORDINATOR)).update(
         terminationGracePeriodSeconds=10),
     "must exceed --shutdown-deadline"),
    ("replicas out of step with the world size",
     lambda o: m.one(o, "StatefulSet", name=WORKER)["spec"].update(replicas=3),
     "!= HSDP_WORLD_SIZE"),
    ("coordinator address names no Service",
     lambda o: _env(o, "StatefulSet", WORKER, "HSDP_COORDINATOR").update(
         value="coordinator:50051"),
     "does not name a Service"),
    ("coordinator address on the metrics port",
     lambda o: _env(o, "StatefulSet", WORKER, "HSDP_COORDINATOR").update(
         value="hsdp-coordinator:9090"),
     "not the port the coordinator listens on"),
    ("policy file not on the policy ConfigMap",
     lambda o: _env(o, "Deployment", COORDINATOR, "HSDP_POLICY_FILE").update(
         value="/etc/hsdp/policy/policy.yaml"),
     "configMap has no key 'policy.yaml'"),
    ("NetworkPolicy admits everyone",
     lambda o: m.one(o, "NetworkPolicy", name=COORDINATOR)["spec"]["ingress"].append({}),
     "admits everyone"),
    ("ServiceAccount token mounted",
     lambda o: m.one(o, "ServiceAccount", name=SERVICE_ACCOUNT).update(
         automountServiceAccountToken=True),
     "automountServiceAccountToken: false"),
    ("worker job token from another Secret",
     lambda o: [v.update(secret={"secretName": m.name_of(m.one(o, "Secret", stem=m.TOKEN_SECRET))})
                for v in m.pod_spec(m.one(o, "StatefulSet", name=WORKER))["volumes"]
                if v["name"] == "job-token"],
     "must share one Secret key"),
    ("worker job token not from a Secret",
     lambda o: _env(o, "StatefulSet", WORKER, "HSDP_JOB_TOKEN_FILE").update(
         value="/tmp/job-token"),
     "is not on a secret volume"),
    ("job token value written into the worker spec",
     lambda o: _container(o, "StatefulSet", WORKER)["env"].append(
         {"name": "HSDP_JOB_TOKEN", "value": "s3cret"}),
     "sets HSDP_JOB_TOKEN (the token itself)"),
    ("coordinator without a job token",
     lambda o: _container(o, "Deployment", COORDINATOR).update(
         env=[e for e in _container(o, "Deployment", COORDINATOR)["env"]
              if e["name"] != "HSDP_JOB_TOKEN_FILE"]),
     "coordinator does not set HSDP_JOB_TOKEN_FILE"),
    ("ConfigMap key reference to nothing",
     lambda o: _env(o, "StatefulSet", WORKER, "HSDP_MODEL")["valueFrom"]["configMapKeyRef"]
     .update(key="MODEL"),
     "has no key MODEL"),
]

# Only meaningful on the gpu overlay.
GPU_MUTATIONS = [
    ("GPU workers without a GPU limit",
     lambda o: _container(o, "StatefulSet", WORKER)["resources"]["limits"].pop("nvidia.com/gpu"),
     "no nvidia.com/gpu limit"),
    ("GPU workers with a disk-backed /dev/shm",
     lambda o: [v.update(emptyDir={}) for v in m.pod_spec(m.one(o, "StatefulSet", name=WORKER))
                ["volumes"] if v["name"] == "dshm"],
     "/dev/shm is not a memory-backed emptyDir"),
    # The gpu overlay runs a relay per node (components/relay).
    ("relay Service not node-local",
     lambda o: m.one(o, "Service", name=RELAY)["spec"].pop("internalTrafficPolicy"),
     "is not node-local"),
    ("coordinator NetworkPolicy without the relay pods",
     lambda o: m.one(o, "NetworkPolicy", name=COORDINATOR)["spec"]["ingress"][0]["from"].pop(),
     "does not admit the relay pods"),
    ("relay on another job token",
     lambda o: m.pod_spec(m.one(o, "DaemonSet", name=RELAY))["volumes"][0]["secret"].update(
         secretName=m.one(o, "Secret", stem=m.TOKEN_SECRET)["metadata"]["name"]),
     "they must share one Secret key"),
    ("workers told of a relay Service that does not exist",
     lambda o: _env(o, "StatefulSet", WORKER, "HSDP_RELAY").update(value="relay:50052"),
     "does not name a Service that selects the relay"),
]


def cmd_selftest(args):
    allowed, _ = allowed_names(
        argparse.Namespace(coordinator_bin=None, worker_bin=None, relay_bin=None))
    base_objs = m.load(args.rendered)
    clean = Checker("clean", copy.deepcopy(base_objs), allowed).run(overlay_kind(args.rendered))
    mutations = MUTATIONS + (GPU_MUTATIONS if overlay_kind(args.rendered) == "gpu" else [])
    failures = 0
    if clean:
        print(f"FAIL unmodified rendering has problems: {clean}")
        failures += 1
    for desc, mutate, expect in mutations:
        objs = copy.deepcopy(base_objs)
        mutate(objs)
        problems = Checker("mutated", objs, allowed).run(overlay_kind(args.rendered))
        if any(expect in p for p in problems):
            print(f"ok   {desc}: caught ({expect!r})")
        else:
            print(f"FAIL {desc}: expected a problem containing {expect!r}, got {problems}")
            failures += 1
    cases = len(mutations) + 1  # + the unmodified rendering
    print(f"selftest: {cases - failures} of {cases} cases behaved")
    return 1 if failures else 0


def validate_policy(binary, path):
    proc = subprocess.run([binary, "--validate-policy", path], capture_output=True, text=True,
                          timeout=30, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def cmd_policy(args):
    if not (args.coordinator_bin and os.access(args.coordinator_bin, os.X_OK)):
        print(f"SKIP: hsdp-coordinator not built ({args.coordinator_bin}); policy not validated")
        return 77
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.rendered:
            label = os.path.splitext(os.path.basename(path))[0]
            cm = m.one(m.load(path), "ConfigMap", stem=m.POLICY_CONFIGMAP)
            policy = ((cm or {}).get("data") or {}).get(m.POLICY_KEY)
            if policy is None:
                print(f"FAIL {label}: no {m.POLICY_KEY} in ConfigMap {m.POLICY_CONFIGMAP}")
                failures += 1
                continue
            json.loads(policy)  # a JSON syntax error here is a clearer message than the binary's
            f = os.path.join(tmp, f"{label}-{m.POLICY_KEY}")
            with open(f, "w", encoding="utf-8") as out:
                out.write(policy)
            rc, text = validate_policy(args.coordinator_bin, f)
            if rc == 0:
                print(f"ok   {label}: policy accepted by hsdp-coordinator --validate-policy")
            else:
                print(f"FAIL {label}: policy refused (exit {rc}): {text}")
                failures += 1
    rc, text = validate_policy(args.coordinator_bin, args.bad_policy)
    if rc == 0:
        print(f"FAIL known-bad policy {args.bad_policy} was accepted: {text}")
        failures += 1
    else:
        print(f"ok   known-bad policy refused (exit {rc}): {text.splitlines()[-1] if text else ''}")
    return 1 if failures else 0


def main(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("outdir")
    c = sub.add_parser("cross")
    c.add_argument("rendered", nargs="+")
    c.add_argument("--coordinator-bin")
    c.add_argument("--worker-bin")
    c.add_argument("--relay-bin")
    s = sub.add_parser("selftest")
    s.add_argument("rendered")
    pol = sub.add_parser("policy")
    pol.add_argument("rendered", nargs="+")
    pol.add_argument("--coordinator-bin")
    pol.add_argument("--bad-policy", required=True)
    args = p.parse_args(argv)
    try:
        return {"render": cmd_render, "cross": cmd_cross, "selftest": cmd_selftest,
                "policy": cmd_policy}[args.cmd](args)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Static checks of deploy/docker/Dockerfile.* (no Docker engine on the build machines).

  check_dockerfiles.py                 check every deploy/docker/Dockerfile.*
  check_dockerfiles.py --self-test     each fixture in tests/deploy/fixtures/docker must be refused
                                       with the problems its "# expect: ..." lines name

What is checked: every COPY/ADD source from the build context exists and is not excluded by
.dockerignore; every --from and FROM names an earlier stage (or an image); scripts the RUN lines
call exist; the build stages run deploy/install-deps.sh and the README's cmake commands; the final
stage runs as the numeric non-root user the Kubernetes manifests expect, installs no development
packages and ships the four binaries the manifests run.
"""

import fnmatch
import glob
import os
import re
import shlex
import sys

import manifests as m

DOCKER_DIR = os.path.join(m.REPO, "deploy", "docker")
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "docker")
BINARIES = ("hsdp-coordinator", "hsdp-worker", "hsdpctl", "hsdp-relay")
# Packages that only a build needs.
BUILD_ONLY_RE = re.compile(r"(-dev$|^build-essential$|^cmake$|^ninja-build$|^g\+\+|^gcc$|"
                           r"^clang|^ccache$|^git$)")
SCRIPT_RE = re.compile(r"(?<![\w/.-])((?:deploy|tests|tools)/[\w./-]+\.(?:sh|py))")


def instructions(path):
    """[(lineno, KEYWORD, rest)] with continuation lines joined and comments dropped."""
    out = []
    buf, start = "", 0
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if buf and line.lstrip().startswith("#"):
                continue
            if not buf:
                start = n
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            buf += line
            kw, _, rest = buf.strip().partition(" ")
            out.append((start, kw.upper(), rest.strip()))
            buf = ""
    return out


def dockerignore_patterns():
    path = os.path.join(m.REPO, ".dockerignore")
    if not os.path.exists(path):
        return None
    pats = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                pats.append(line.rstrip("/"))
    return pats


def ignored(rel, patterns):
    """Whether a context-relative path (or a parent of it) is excluded by .dockerignore."""
    parts = rel.strip("/").split("/")
    excluded = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if fnmatch.fnmatchcase(prefix, pat) or (
                    pat.startswith("**/") and fnmatch.fnmatchcase(parts[i - 1], pat[3:])):
                excluded = not negate
                break
    return excluded


def readme_cmake_commands():
    """The cmake commands of the README's Developing section (how hsdp itself is built; other
    sections build users' projects against an installed hsdp), each '&&' part on its own."""
    with open(os.path.join(m.REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = re.search(r"^## Developing\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if section:
        text = section.group(1)
    cmds = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            for part in line.split("&&"):
                part = " ".join(part.split())
                if part.startswith("cmake ") and " --test-dir" not in part:
                    cmds.append(part)
    return cmds


def manifest_run_as_users():
    """runAsUser values the base manifests set (pod-level securityContext)."""
    users = set()
    for name in ("coordinator.yaml", "worker.yaml"):
        for o in m.load(os.path.join(m.K8S_DIR, "base", name)):
            sc = m.pod_spec(o).get("securityContext") or {}
            if "runAsUser" in sc:
                users.add(str(sc["runAsUser"]))
    return users


def check(path, readme_cmds, run_as_users):
    problems = []
    name = os.path.relpath(path, m.REPO)

    def fail(lineno, msg):
        problems.append(f"{name}:{lineno}: {msg}")

    ins = instructions(path)
    patterns = dockerignore_patterns()
    if patterns is None:
        fail(0, "no .dockerignore at the repository root")
        patterns = []
    args = {}
    stages = []  # [{"name":, "line":, "ins": [...]}]
    for lineno, kw, rest in ins:
        if kw == "ARG":
            k, _, v = rest.partition("=")
            if not stages:
                args[k.strip()] = v.strip().strip('"')
            if stages:
                stages[-1]["ins"].append((lineno, kw, rest))
            continue
        if kw == "FROM":
            toks = rest.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda mm: args.get(mm.group(1) or mm.group(2),
                                                                        ""), toks[0])
            stage_name = toks[2] if len(toks) >= 3 and toks[1].upper() == "AS" else None
            if not image or image.startswith(":") or image.endswith((":", "-")):
                fail(lineno, f"FROM {toks[0]} resolves to an empty image (ARG without default?)")
            stages.append({"name": stage_name, "line": lineno, "image": image, "ins": []})
            continue
        if not stages:
            fail(lineno, f"{kw} before the first FROM")
            continue
        stages[-1]["ins"].append((lineno, kw, rest))
    if not stages:
        fail(0, "no FROM")
        return problems

    for idx, st in enumerate(stages):
        earlier = {s["name"] for s in stages[:idx] if s["name"]}
        for lineno, kw, rest in st["ins"]:
            if kw in ("COPY", "ADD"):
                toks = shlex.split(rest)
                opts = [t for t in toks if t.startswith("--")]
                paths = [t for t in toks if not t.startswith("--")]
                if len(paths) < 2:
                    fail(lineno, f"{kw} needs a source and a destination")
                    continue
                src_from = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
                if src_from:
                    ref = src_from[0]
                    if ref not in earlier and not ref.isdigit() and ":" not in ref:
                        fail(lineno, f"{kw} --from={ref} names no earlier stage")
                    continue
                for src in paths[:-1]:
                    if src.startswith(("http://", "https://")):
                        continue
                    rel = os.path.normpath(src).lstrip("/")
                    matches = glob.glob(os.path.join(m.REPO, rel))
                    if rel in ("", "."):
                        continue
                    if not matches:
                        fail(lineno, f"{kw} source {src} does not exist in the build context")
                    elif ignored(rel, patterns):
                        fail(lineno, f"{kw} source {src} is excluded by .dockerignore")
            if kw == "RUN":
                for script in SCRIPT_RE.findall(rest):
                    if not os.path.exists(os.path.join(m.REPO, script)):
                        fail(lineno, f"RUN calls {script}, which does not exist")
                    elif ignored(script, patterns):
                        fail(lineno, f"RUN calls {script}, which .dockerignore excludes")

    build_stages, final = stages[:-1], stages[-1]
    if not build_stages:
        fail(final["line"], "not multi-stage: the final stage would carry the build tool chain")
    build_runs = " ".join(" ".join(r.split()) for s in build_stages for _, kw, r in s["ins"]
                          if kw == "RUN")
    if "deploy/install-deps.sh" not in build_runs:
        fail(stages[0]["line"], "the build stage does not run deploy/install-deps.sh")
    for cmd in readme_cmds:
        if cmd not in build_runs:
            fail(stages[0]["line"], f"the build stage does not run the README's `{cmd}`")

    users = [r for _, kw, r in final["ins"] if kw == "USER"]
    if not users:
        fail(final["line"], "the final stage sets no USER (runs as root)")
    else:
        uid = users[-1].split(":")[0]
        if uid in ("root", "0"):
            fail(final["line"], "the final stage runs as root")
        elif not uid.isdigit():
            fail(final["line"], f"USER {uid} is not numeric (runAsNonRoot cannot verify it)")
        elif run_as_users and uid not in run_as_users:
            fail(final["line"], f"USER {uid} differs from the manifests' runAsUser "
                                f"{sorted(run_as_users)}")
    for lineno, kw, rest in final["ins"]:
        if kw == "RUN":
            for mm in re.finditer(r"apt-get\s+install\s+([^&|;]*)", rest):
                for pkg in mm.group(1).split():
                    if not pkg.startswith("-") and BUILD_ONLY_RE.search(pkg):
                        fail(lineno, f"the final stage installs build-only package {pkg}")
        if kw in ("COPY", "ADD") and not any(t.startswith("--from=") for t in rest.split()):
            srcs = shlex.split(rest)[:-1]
            if any(os.path.normpath(s) == "." for s in srcs):
                fail(lineno, "the final stage copies the whole source tree")
    final_copies = " ".join(r for _, kw, r in final["ins"] if kw == "COPY")
    for binary in BINARIES:
        if not re.search(rf"/{re.escape(binary)}(\s|$)", final_copies):
            fail(final["line"], f"the final stage does not ship {binary}")
    return problems


def self_test():
    failures = 0
    fixtures = sorted(glob.glob(os.path.join(FIXTURES, "*.Dockerfile")))
    if not fixtures:
        print(f"FAIL no fixtures in {FIXTURES}")
        return 1
    for fx in fixtures:
        with open(fx, encoding="utf-8") as f:
            expects = [mm.group(1) for mm in re.finditer(r"^# expect: (.*)$", f.read(), re.M)]
        problems = check(fx, ["cmake -S . -B build -G Ninja"], {"10001"})
        for e in expects:
            if any(e in p for p in problems):
                print(f"ok   {os.path.basename(fx)}: refused with {e!r}")
            else:
                print(f"FAIL {os.path.basename(fx)}: expected {e!r}, got {problems}")
                failures += 1
    print(f"self-test: {failures} failure(s)")
    return 1 if failures else 0


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    files = sorted(glob.glob(os.path.join(DOCKER_DIR, "Dockerfile.*")))
    if not files:
        print("no Dockerfiles under deploy/docker")
        return 1
    readme_cmds = readme_cmake_commands()
    if not readme_cmds:
        print("README.md has no cmake command to compare with")
        return 1
    users = manifest_run_as_users()
    problems = []
    for f in files:
        problems += check(f, readme_cmds, users)
    for p in problems:
        print(p)
    print(f"Dockerfiles checked statically (no Docker engine here): "
          f"{', '.join(os.path.basename(f) for f in files)}; README cmake: {readme_cmds}; "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

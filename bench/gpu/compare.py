#!/usr/bin/env python3
"""Prints the GPU benchmark table and ratios from the JSON lines of one run.

Usage: compare.py ENGINE.json PLAIN.json FSDP2.json
Each file holds the one JSON line written by gpt_gpu_bench (--impl engine / plain) or
fsdp2_gpt_bench.py. A missing or empty file (that impl failed) is reported, not fatal, so the other
numbers still print. Exit status 1 when the engine's numbers are missing.
"""
import json
import sys

GIB = float(1 << 30)


def load(path):
    try:
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError) as e:
        print("compare: %s: %s" % (path, e), file=sys.stderr)
        return None


def fmt_bytes(n):
    return "n/a" if n is None or n < 0 else "%.2f GiB" % (n / GIB)


def ratio(a, b):
    if a is None or b is None or a <= 0 or b <= 0:
        return "n/a"
    return "%.3f" % (a / b)


def main(argv):
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    runs = {"engine": load(argv[1]), "plain": load(argv[2]), "fsdp2": load(argv[3])}
    print("%-8s %12s %12s %14s %14s %9s %10s %10s" % (
        "impl", "step_s(med)", "step_s(min)", "peak_alloc", "peak_reserved", "TFLOP/s",
        "loss[0]", "loss[-1]"))
    for name, r in runs.items():
        if r is None:
            print("%-8s %s" % (name, "FAILED / missing"))
            continue
        print("%-8s %12.4f %12.4f %14s %14s %9.1f %10.4f %10.4f" % (
            name, r["step_s_median"], r["step_s_min"], fmt_bytes(r["peak_allocated_bytes"]),
            fmt_bytes(r["peak_reserved_bytes"]), r["tflops"], r["loss_first"], r["loss_last"]))
    e, p, f = runs["engine"], runs["plain"], runs["fsdp2"]
    get = lambda r, k: None if r is None else r.get(k)
    print()
    print("ratios (from this one run; < 1 means the engine is faster / smaller):")
    print("  step time    engine/plain = %s   engine/fsdp2 = %s" % (
        ratio(get(e, "step_s_median"), get(p, "step_s_median")),
        ratio(get(e, "step_s_median"), get(f, "step_s_median"))))
    print("  peak memory  engine/plain = %s   engine/fsdp2 = %s" % (
        ratio(get(e, "peak_allocated_bytes"), get(p, "peak_allocated_bytes")),
        ratio(get(e, "peak_allocated_bytes"), get(f, "peak_allocated_bytes"))))
    shapes = {(r["model"], r["batch"], r["seq_len"], r.get("param_dtype")) for r in runs.values() if r}
    if len(shapes) > 1:
        print("WARNING: the runs differ in model/batch/dtype: %s" % sorted(shapes))
    return 0 if e is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""The FSDP2 side must train the same model as the C++ side: checks that fsdp2_gpt_bench.Gpt has
exactly the parameter count gpt_gpu_bench reports (GptParamCount, worker/models/gpt.cc) for each
named model, and that both sides count the same FLOPs per step. Runs on CPU.

Usage: check_model_parity.py PATH/TO/gpt_gpu_bench
Prints SKIP (exit 0) when this python3 has no torch.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import torch  # noqa: F401
except ImportError:
    print("SKIP: no torch in %s" % sys.executable)
    sys.exit(0)
import fsdp2_gpt_bench as fsdp2  # noqa: E402

BATCH = 2


def main(argv):
    failures = 0
    for name, (d, layers, heads, seq) in sorted(fsdp2.MODELS.items()):
        out = subprocess.run(
            [argv[1], "--impl", "plain", "--device", "cpu", "--model", name, "--dims",
             "%d,%d,%d,%d" % (d, 1, heads, 8), "--batch", "1", "--steps", "1", "--warmup", "0",
             "--param-dtype", "fp32"],
            check=True, capture_output=True, text=True).stdout
        cpp_one_layer = json.loads(out.strip().splitlines()[-1])["params"]
        # One block at seq 8 keeps this fast for every size; the formula is checked at full size.
        model = fsdp2.Gpt(d, 1, heads, 8)
        py_one_layer = sum(p.numel() for p in model.parameters())
        ok = py_one_layer == cpp_one_layer == fsdp2.param_count(d, 1, 8)
        print("%s (1 block, seq 8): python %d, C++ %d -> %s" % (
            name, py_one_layer, cpp_one_layer, "ok" if ok else "MISMATCH"))
        failures += not ok
    # FLOPs per step: same formula on both sides (C++ prints TFLOP/s = flops / step_s / 1e12).
    d, layers, heads, seq = fsdp2.MODELS["gpt-small"]
    out = subprocess.run(
        [argv[1], "--impl", "plain", "--device", "cpu", "--model", "gpt-small", "--batch",
         str(BATCH), "--steps", "1", "--warmup", "0", "--param-dtype", "fp32"],
        check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    cpp_flops = r["flops_per_step"]
    py_flops = fsdp2.model_flops_per_step(d, layers, seq, BATCH)
    ok = abs(cpp_flops - py_flops) <= 1e-9 * py_flops
    print("gpt-small flops/step: python %.4e, C++ %.4e -> %s" % (
        py_flops, cpp_flops, "ok" if ok else "MISMATCH"))
    failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

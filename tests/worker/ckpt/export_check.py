"""Reads an hsdp-ckpt export back in Python and compares it bitwise with the
training state the C++ test wrote as raw files.

usage: export_check.py MODEL.pt MODEL.safetensors EXPECTED_DIR
EXPECTED_DIR holds one <name>.raw (little-endian bytes) per tensor, names with
'/' replaced by '__'. Exit status 0 when every tensor matches in both files.
"""
import json
import os
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[base + begin:base + end])
        t = torch.frombuffer(raw, dtype=DTYPES[info["dtype"]]) if raw else \
            torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out, header["__metadata__"]


def main():
    pt, st, expected_dir = sys.argv[1:4]
    loaded = torch.load(pt)
    safe, meta = read_safetensors(st)
    expected = sorted(os.listdir(expected_dir))
    problems = []
    for file in expected:
        name = file[:-len(".raw")].replace("__", "/")
        with open(os.path.join(expected_dir, file), "rb") as f:
            want = f.read()
        for label, tensors in (("torch.load", loaded), ("safetensors", safe)):
            if name not in tensors:
                problems.append(f"{label}: no {name}")
                continue
            got = tensors[name].contiguous().numpy().tobytes()
            if got != want:
                problems.append(f"{label}: {name} differs")
    for label, tensors in (("torch.load", loaded), ("safetensors", safe)):
        if len(tensors) != len(expected):
            problems.append(f"{label}: {len(tensors)} tensors, "
                            f"expected {len(expected)}")
    if problems:
        print("\n".join(problems))
        return 1
    print(f"{len(expected)} tensors equal in torch.load and safetensors "
          f"(step {meta['hsdp_step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

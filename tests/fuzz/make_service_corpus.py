#!/usr/bin/env python3
"""Writes the seed corpus of coordinator_service_fuzz (tests/fuzz/corpus/coordinator_service_fuzz/).

Each seed is a sequence of calls in the fuzz target's format (see coordinator_service_fuzz.cc):
rpc byte, credentials byte, fix-up byte, 2-byte little-endian length, request in protobuf wire
format. The requests are encoded by hand (stdlib only) from the field numbers in proto/hsdp/v1.

  make_service_corpus.py [OUTDIR]
"""

import os
import struct
import sys

# RPC selectors, in the fuzz target's order.
JOIN, HEARTBEAT, GET_SCHEDULE, REPORT, STORE_SET, STORE_GET, STORE_WAIT = range(7)
SET_POLICY, CONTROL_SCHEDULE, CHECKPOINT, DRAIN, STATUS, WORKERS, SWEEP = range(7, 14)
RIGHT, NONE, WRONG = 0, 2, 3


def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def f_int(field, value):
    return varint(field << 3) + varint(value)


def f_bytes(field, value):
    if isinstance(value, str):
        value = value.encode()
    return varint(field << 3 | 2) + varint(len(value)) + value


def f_double(field, value):
    return varint(field << 3 | 1) + struct.pack("<d", value)


def unit(name, params):
    return f_bytes(1, name) + f_int(2, params) + f_int(3, params * 4)


def join(rank):
    units = [unit("root", 1000)] + [unit(f"layers.{i}", 400) for i in range(3)]
    return (f_bytes(1, "fuzz-job") + f_int(2, rank) + f_bytes(3, f"host-{rank}") +
            f_bytes(4, "cpu") + f_bytes(5, "gpt-fuzz") + b"".join(f_bytes(6, u) for u in units))


def heartbeat(rank, step):
    return f_bytes(1, "fuzz-job") + f_int(2, rank) + f_int(4, step)


def get_schedule(rank, step):
    return f_bytes(1, "fuzz-job") + f_int(2, rank) + f_int(3, step)


def report(rank, step, finished=False, saved=False):
    r = f_int(1, rank) + f_int(2, step) + f_double(3, 2.5) + f_double(4, 0.1) + f_int(6, 1 << 20)
    if saved:
        r += f_int(8, 1)
    return f_bytes(1, "fuzz-job") + f_bytes(2, r) + (f_int(3, 1) if finished else b"")


def store_set(key, value):
    return f_bytes(1, "fuzz-job") + f_bytes(3, key) + f_bytes(4, value)


def store_get(key, timeout_ms=0):
    return f_bytes(1, "fuzz-job") + f_bytes(3, key) + f_int(4, timeout_ms)


def store_wait(keys, timeout_ms=0):
    return f_bytes(1, "fuzz-job") + b"".join(f_bytes(3, k) for k in keys) + f_int(4, timeout_ms)


def policy(prefetch, microbatches, glob="layers.*"):
    override = f_bytes(1, glob) + f_int(2, 0)
    p = f_int(1, 1) + f_bytes(3, override) + f_int(4, prefetch) + f_int(6, microbatches)
    return f_bytes(1, p)


def call(rpc, request=b"", credentials=RIGHT, fix_job=False):
    return bytes([rpc, credentials, 1 if fix_job else 0]) + struct.pack("<H", len(request)) + request


def seeds():
    everyone = b"".join(call(JOIN, join(r)) for r in range(4))
    train = everyone
    for step in range(4):
        for r in range(4):
            train += call(GET_SCHEDULE, get_schedule(r, step))
            train += call(REPORT, report(r, step, saved=step == 2))
    train += call(CONTROL_SCHEDULE, f_int(1, 2)) + call(STATUS) + call(WORKERS)
    yield "train", train

    store = call(JOIN, join(0)) + call(STORE_SET, store_set("hsdp/fuzz-job/gen-0/addr/0", "10.0.0.1:1"))
    store += call(STORE_GET, store_get("hsdp/fuzz-job/gen-0/addr/0"))
    store += call(STORE_WAIT, store_wait(["hsdp/fuzz-job/gen-0/addr/0", "missing"]))
    store += call(STORE_GET, store_get(""))
    yield "store", store

    control = everyone + call(SET_POLICY, policy(2, 4)) + call(GET_SCHEDULE, get_schedule(0, 0))
    control += call(CHECKPOINT) + call(DRAIN) + call(GET_SCHEDULE, get_schedule(1, 5))
    control += call(HEARTBEAT, heartbeat(2, 1)) + call(SWEEP)
    yield "control", control

    strangers = call(JOIN, join(0), NONE) + call(JOIN, join(1), WRONG)
    strangers += call(JOIN, join(0)) + call(STORE_SET, store_set("k", "v"), WRONG)
    strangers += call(SET_POLICY, policy(1, 1), NONE) + call(DRAIN, b"", WRONG)
    strangers += call(REPORT, report(0, 0, finished=True), NONE)
    yield "strangers", strangers

    finish = everyone
    for r in range(4):
        finish += call(GET_SCHEDULE, get_schedule(r, 0)) + call(REPORT, report(r, 0, finished=True))
    finish += call(STATUS)
    yield "finish", finish


def main(argv):
    out = argv[1] if len(argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus", "coordinator_service_fuzz")
    os.makedirs(out, exist_ok=True)
    for name, data in seeds():
        with open(os.path.join(out, f"seed-{name}"), "wb") as f:
            f.write(data)
        print(f"{out}/seed-{name}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

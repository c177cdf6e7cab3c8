#!/usr/bin/python3
"""Marks where a job's measured steps begin and end, with the link counters at those moments.

Runs in the switch namespace of bench/cluster/run.sh, where every host's link ends in a bridge
port ph<h> (and the coordinator's in pc). Follows one progress file per rank (one JSON line per
finished step: hsdp's --report-file, ddp_gpt.py's --progress-file) and samples the ports'
counters every few milliseconds. Mark "begin": the first sample at which every rank has finished
WARMUP steps; mark "end": every rank has finished STEPS. Writes both marks (time and counters) as
JSON; exits non-zero when the ranks all exit, or TIMEOUT passes, before the end mark.

Counting on the switch side: rx_bytes of ph<h> is what host h sent, tx_bytes what it received;
pc likewise for the coordinator (control plane, subtracted by report.py).
"""
import argparse
import json
import os
import sys
import time

POLL_S = 0.005


def counters(ports):
    out = {}
    for p in ports:
        base = f"/sys/class/net/{p}/statistics"
        with open(f"{base}/rx_bytes") as f:
            rx = int(f.read())
        with open(f"{base}/tx_bytes") as f:
            tx = int(f.read())
        out[p] = {"rx": rx, "tx": tx}
    return out


class Progress:
    """Lines (finished steps) of a file that grows, read incrementally."""

    def __init__(self, path):
        self.path, self.offset, self.lines = path, 0, 0

    def poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.lines
        # Only whole lines count: a line is written once its step is over.
        end = data.rfind(b"\n")
        if end >= 0:
            self.lines += data[: end + 1].count(b"\n")
            self.offset += end + 1
        return self.lines


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--pids", default="", help="space-separated pids of the ranks")
    ap.add_argument("progress", nargs="+")
    a = ap.parse_args()
    ports = [f"ph{h}" for h in range(a.hosts)] + ["pc"]
    files = [Progress(p) for p in a.progress]
    pids = [int(p) for p in a.pids.split()]
    marks = {}
    start = time.monotonic()
    last_alive_check = 0.0
    while True:
        now = time.monotonic()
        done = min(f.poll() for f in files)
        if "begin" not in marks and done >= a.warmup:
            marks["begin"] = {"time": now, "steps_done": done, "counters": counters(ports)}
        if done >= a.steps:
            marks["end"] = {"time": now, "steps_done": done, "counters": counters(ports)}
            break
        if now - last_alive_check > 0.5:
            last_alive_check = now
            if pids and not any(alive(p) for p in pids):
                # One more look: the last lines may have landed just before exiting.
                if min(f.poll() for f in files) >= a.steps:
                    continue
                print(f"ranks exited after {done} of {a.steps} steps")
                return 1
        if now - start > a.timeout:
            print(f"timeout after {a.timeout:.0f} s at {done} of {a.steps} steps")
            return 1
        time.sleep(POLL_S)
    if marks["begin"]["steps_done"] != a.warmup or marks["end"]["steps_done"] != a.steps:
        # Polling skipped past a boundary (a step shorter than a poll): say so, report.py
        # divides by the steps actually between the marks.
        print(f"note: marks at {marks['begin']['steps_done']} and {marks['end']['steps_done']} steps")
    with open(a.out, "w") as f:
        json.dump(marks, f)
    steps = marks["end"]["steps_done"] - marks["begin"]["steps_done"]
    print(f"{steps} measured steps in {marks['end']['time'] - marks['begin']['time']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

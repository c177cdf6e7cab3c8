#!/usr/bin/python3
"""The table of one bench/cluster/run.sh rate: step time, inter-host bytes, peak memory.

Arguments after the options: CONFIG=RUN_DIR for each configuration run (hsdp, full, ddp). The
minimum bytes per configuration follow bench/cluster/README.md ("Minimum inter-host bytes").
With --smoke: exit 1 unless every configuration finished its steps and its inter-host links
carried bytes.
"""
import argparse
import json
import math
import os
import re
import sys

MIB = 1 << 20


def gpt_units(d, layers, seq, vocab):
    """Parameter shapes per unit of worker/models/gpt.cc (index 0 root, then layers.i)."""
    root = [(vocab, d), (seq, d), (d,), (d,), (vocab, d)]  # tok_emb, pos_emb, ln_f, head
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,),
             (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # ln1, qkv, proj, ln2, fc, out
    return [root] + [block] * layers


def padded_elements(shapes, shard):
    """Elements of a unit with every parameter padded on dim 0 to a multiple of `shard`."""
    total = 0
    for s in shapes:
        rows = math.ceil(s[0] / shard) * shard
        total += rows * math.prod(s[1:])
    return total


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def link_bytes(marks, hosts):
    """Bytes the hosts sent to each other between the marks, and the control-plane bytes."""
    b, e = marks["begin"]["counters"], marks["end"]["counters"]
    d = lambda port, k: e[port][k] - b[port][k]
    sent = sum(d(f"ph{h}", "rx") for h in range(hosts))
    received = sum(d(f"ph{h}", "tx") for h in range(hosts))
    to_coord, from_coord = d("pc", "tx"), d("pc", "rx")
    return sent - to_coord, received - from_coord, to_coord + from_coord


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", required=True)
    ap.add_argument("--shaping", default="")
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--ranks-per-host", type=int, required=True)
    ap.add_argument("--dims", required=True)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("runs", nargs="+", help="CONFIG=RUN_DIR")
    a = ap.parse_args()
    H, G = a.hosts, a.ranks_per_host
    N = H * G
    d, layers, _heads, seq = (int(v) for v in a.dims.split(","))
    units = gpt_units(d, layers, seq, a.vocab)
    P = padded_elements([s for u in units for s in u], 1)
    runs = {}
    for r in a.runs:
        config, run = r.split("=", 1)
        runs.setdefault(config, []).append(run)
    problems = []

    def measure(config, run):
        row = {"config": config}
        try:
            marks = json.load(open(f"{run}/marks.json"))
        except (OSError, ValueError) as e:
            problems.append(f"{config}: no marks ({e})")
            return row
        steps = marks["end"]["steps_done"] - marks["begin"]["steps_done"]
        row["wall_step_s"] = (marks["end"]["time"] - marks["begin"]["time"]) / steps
        inter, inter_rx, control = link_bytes(marks, H)
        row["bytes_step"] = inter / steps
        row["bytes_step_rx"] = inter_rx / steps
        row["control_step"] = control / steps
        if config in ("hsdp", "full", "full-hpz"):
            R, S = (H, G) if config == "hsdp" else (1, N)
            row["mesh"] = f"{R}x{S}"
            ranks = [read_jsonl(f"{run}/worker-{r}.jsonl") for r in range(N)]
            if any(len(x) < a.steps for x in ranks):
                problems.append(f"{config}: a rank reported fewer than {a.steps} steps")
                return row
            measured = range(a.warmup, a.steps)
            row["step_s"] = sum(max(ranks[r][s]["step_seconds"] for r in range(N))
                                for s in measured) / len(measured)
            row["tensor_peak"] = [max(x["peak_memory_bytes"] for x in rk) for rk in ranks]
            row["rss_peak"] = [max(x["rss_peak_bytes"] for x in rk) for rk in ranks]
            raf = ranks[0][-1]["reshard_after_forward"]
            padded = [padded_elements(u, S) for u in units]
            if config == "hsdp":
                # Replicate all-reduce (ring over R) of each rank's gradient shard, all of it
                # across hosts: N * 2 * (P_S / S) * (R - 1) / R.
                row["min_elems"] = N * 2 * (sum(padded) / S) * (R - 1) / R
            elif config == "full":
                # Unit all-gathers in forward (every unit), again in backward (units resharded
                # after forward), one reduce-scatter: each rank sends its shard to each of the
                # N - G ranks on other hosts: (N - G) * P_N per collective.
                gathered = 2 * sum(padded) - sum(p for p, f in zip(padded, raf) if f == "0")
                row["min_elems"] = (N - G) * (gathered + sum(padded))
                row["all_gathers"] = len(raf) + raf.count("1")
            else:
                # Hierarchical reshard: the backward all-gathers run over each host's ranks, so
                # only the forward all-gathers and the reduce-scatter cross hosts.
                row["min_elems"] = (N - G) * 2 * sum(padded)
                row["host_all_gathers"] = ranks[0][-1].get("host_all_gathers", 0)
            comm = "?"
            for line in open(f"{run}/worker-0.log"):
                m = re.search(r"communicators: (.+)$", line)
                if m:
                    comm = m.group(1).strip().replace(", ", " ")
            row["comm"] = comm
            row["loss"] = (ranks[0][0]["loss"], ranks[0][-1]["loss"])
        elif config == "ddp":
            row["mesh"] = f"{N} replicas"
            outs = [json.load(open(f"{run}/ddp-{r}.json")) for r in range(N)]
            row["step_s"] = outs[0]["step_seconds"]
            row["rss_peak"] = [o["rss_peak_bytes"] for o in outs]
            # Parameters, gradients, AdamW's two moments, plus the activations autograd saved:
            # a floor under DDP's tensor peak (its gradient buckets and backward's temporaries
            # come on top).
            row["tensor_peak"] = [o["state_bytes"] + o.get("activation_bytes", 0) for o in outs]
            # Ring all-reduce in rank order, ranks placed host by host: H ring edges cross hosts,
            # each carrying 2 * P * (N - 1) / N.
            row["min_elems"] = H * 2 * P * (N - 1) / N
            row["comm"] = "gloo ring all-reduce"
        row["min_bytes"] = row["min_elems"] * 4  # fp32
        if row["bytes_step"] <= 0:
            problems.append(f"{config}: no bytes counted on the inter-host links")

        return row

    rows = {}
    for config, dirs in runs.items():
        rounds = [measure(config, d) for d in dirs]
        done = [r for r in rounds if "step_s" in r]
        if len(done) < len(rounds):
            rows[config] = {"config": config}
            continue
        # Means over the rounds; memory: the largest of any round.
        row = dict(done[-1])
        for key in ("wall_step_s", "step_s", "bytes_step", "bytes_step_rx", "control_step"):
            row[key] = sum(r[key] for r in done) / len(done)
        for key in ("tensor_peak", "rss_peak"):
            row[key] = [max(v) for v in zip(*(r[key] for r in done))]
        row["rounds"] = [r["wall_step_s"] for r in done]
        rows[config] = row

    print(f"\n=== {H} hosts x {G} ranks, links {a.rate}: {a.shaping}")
    print(f"gpt dims {a.dims} (vocab {a.vocab}): P = {P} parameters ({P * 4 / MIB:.2f} MiB fp32);"
          f" {a.steps - a.warmup} measured steps after {a.warmup} warm-up")
    hdr = (f"{'config':<8} {'mesh':<10} {'wall s/step':>11} {'rep s/step':>10} "
           f"{'MB/step':>8} {'min MB':>7} {'x min':>6} {'ctl kB':>6} "
           f"{'tensor MiB':>10} {'RSS MiB':>8}  communicators")
    print(hdr)
    for config, row in rows.items():
        if "wall_step_s" not in row or "step_s" not in row:
            print(f"{config:<8} (failed)")
            continue
        print(f"{config:<8} {row['mesh']:<10} {row['wall_step_s']:>11.3f} {row['step_s']:>10.3f} "
              f"{row['bytes_step'] / 1e6:>8.2f} {row['min_bytes'] / 1e6:>7.2f} "
              f"{row['bytes_step'] / row['min_bytes']:>6.3f} {row['control_step'] / 1e3:>6.1f} "
              f"{max(row['tensor_peak']) / MIB:>10.1f} {max(row['rss_peak']) / MIB:>8.0f}  "
              f"{row['comm']}")
    print("  wall s/step: measured steps over the time between the marks (same clock for all);"
          " rep s/step: the ranks' own step times (slowest rank per step, mean)")
    print("  MB/step: bytes (1e6) the hosts put on their links for each other per step, frames"
          " included, control plane (coordinator, ctl kB) left out; x min: against the minimum")
    print("  tensor MiB: hsdp's measured tensor peak (counting allocator); DDP: parameters +"
          " gradients + AdamW + saved activations, a floor under its peak. Largest rank shown.")
    def ok(*configs):
        return all(c in rows and "step_s" in rows[c] for c in configs)

    def ratio(x, y, key="wall_step_s"):
        return rows[x][key] / rows[y][key]

    print("targets:")
    if ok("hsdp", "full"):
        r = ratio("hsdp", "full")
        print(f"  HSDP / 1x{N} step time  {r:.3f}  (target <= 0.80: {'met' if r <= 0.8 else 'NOT met'})"
              f"; by the ranks' step times {ratio('hsdp', 'full', 'step_s'):.3f}")
    if ok("full-hpz", "full"):
        b = rows["full-hpz"]["bytes_step"] / rows["full"]["bytes_step"]
        print(f"  1x{N} with / without hierarchical reshard: step time {ratio('full-hpz', 'full'):.3f},"
              f" inter-host bytes {b:.3f}, tensor peak"
              f" {max(rows['full-hpz']['tensor_peak']) / max(rows['full']['tensor_peak']):.3f}"
              f" ({rows['full-hpz'].get('host_all_gathers', 0)} host all-gathers per step)")
    if ok("hsdp", "ddp"):
        r = ratio("hsdp", "ddp")
        print(f"  HSDP / DDP step time   {r:.3f}  (target <= 0.90: {'met' if r <= 0.9 else 'NOT met'})"
              f"; by the ranks' step times {ratio('hsdp', 'ddp', 'step_s'):.3f}")
    if ok("hsdp"):
        r = rows["hsdp"]["bytes_step"] / rows["hsdp"]["min_bytes"]
        print(f"  HSDP inter-host bytes  {r:.3f}x its minimum (target <= 1.10: {'met' if r <= 1.1 else 'NOT met'})")
    if ok("hsdp", "ddp"):
        t = max(rows["hsdp"]["tensor_peak"]) / max(rows["ddp"]["tensor_peak"])
        m = max(rows["hsdp"]["rss_peak"]) / max(rows["ddp"]["rss_peak"])
        print(f"  HSDP / DDP memory      tensors {t:.3f} (target <= 0.60: {'met' if t <= 0.6 else 'NOT met'}),"
              f" RSS {m:.3f} (runtimes included: C++ vs Python)")
        # What sharding divides: parameters, gradients and AdamW's two moments (fp32), per rank.
        state_hsdp = 16 * padded_elements([s for u in units for s in u], G) / G
        print(f"  model state per rank   hsdp {state_hsdp / MIB:.1f} MiB vs DDP {16 * P / MIB:.1f} MiB"
              f" = {state_hsdp / (16 * P):.3f}; the activations (not sharded) make the rest")
    if any(len(r.get("rounds", [])) > 1 for r in rows.values()):
        print("  wall s/step per round (alternating): " + "; ".join(
            f"{c} " + " ".join(f"{t:.3f}" for t in r.get("rounds", [])) for c, r in rows.items()))
    for config, row in rows.items():
        if "loss" in row:
            print(f"  {config} loss: step 0 {row['loss'][0]:.4f} -> step {a.steps - 1} {row['loss'][1]:.4f}")
    for p in problems:
        print(f"problem: {p}")
    if a.smoke:
        if problems or not all("step_s" in r for r in rows.values()):
            print("smoke: FAILED")
            return 1
        print(f"smoke: passed ({', '.join(rows)} finished; inter-host bytes counted on every run)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""PyTorch DDP on Gloo training the same GPT shape as hsdp's worker/models/gpt.cc.

Spawns WORLD CPU processes (one thread each), trains STEPS steps of AdamW on a global batch of
WORLD * MICROBATCH_SIZE sequences, and prints one JSON line: mean step time (after warm-up,
slowest rank per step) and per-rank peak memory (parameter + gradient + AdamW state bytes, and
process max RSS).

With --rank R this process is rank R alone and the caller starts the others (one per network
namespace in bench/cluster): rendezvous at --master-addr, one JSON line for this rank, and with
--progress-file one line per finished step, so a watcher can tell where the job is.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, self.heads, hd).transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v
        h = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, d, layers, heads, seq, vocab=256):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t)).unsqueeze(0)
        for block in self.layers:
            x = block(x)
        return self.head(self.ln_f(x))


def run(rank, args, port, results):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    d, layers, heads, seq = (int(v) for v in args.dims.split(","))
    model = nn.parallel.DistributedDataParallel(Gpt(d, layers, heads, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(rank)
    times = []
    progress = open(args.progress_file, "a") if args.progress_file else None
    param_storages = {p.storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        # Bytes of the activations autograd keeps for backward: distinct storages, parameters
        # left out (they are counted in the state).
        key = t.storage().data_ptr()
        if key not in param_storages:
            saved[key] = t.storage().nbytes()
        return t

    for step in range(args.steps):
        tokens = torch.randint(0, 256, (args.microbatch_size, seq + 1), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        if step == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = model(tokens[:, :-1])
        else:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
        if progress:
            progress.write(json.dumps({"step": step, "step_seconds": t.item(),
                                       "unix_time": time.time()}) + "\n")
            progress.flush()
    n_params = sum(p.numel() for p in model.parameters())
    # fp32 parameters + gradients + two AdamW moments, all replicated on every rank.
    state_bytes = n_params * 4 * 4
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results[rank] = (state_bytes, rss, times, sum(saved.values()))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--dims", default="256,4,4,128")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--rank", type=int, default=-1, help="run only this rank (default: spawn all)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--progress-file", default="")
    args = p.parse_args()
    # torch.set_num_threads does not reach OpenBLAS's own pthread pool (one thread
    # per core by default); the spawned ranks read this when they load it.
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    if args.rank >= 0:
        # OpenBLAS has already read its environment here (import torch): the caller sets
        # OPENBLAS_NUM_THREADS for this mode.
        results = {}
        run(args.rank, args, args.port, results)
        state, rss, times, activations = results[args.rank]
        times = times[args.warmup:]
        print(json.dumps({
            "impl": "ddp",
            "rank": args.rank,
            "step_seconds": sum(times) / max(len(times), 1),
            "state_bytes": state,
            "rss_peak_bytes": rss,
            "activation_bytes": activations,
        }))
        return
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(run, args=(args, args.port, results), nprocs=args.world, join=True)
        times = results[0][2][args.warmup:]
        print(json.dumps({
            "impl": "ddp",
            "step_seconds": sum(times) / len(times),
            "state_bytes_per_rank": [results[r][0] for r in range(args.world)],
            "rss_peak_bytes_per_rank": [results[r][1] for r in range(args.world)],
        }))


if __name__ == "__main__":
    sys.exit(main())

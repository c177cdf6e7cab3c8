#!/usr/bin/env python3
"""PyTorch FSDP2 side of the GPU benchmark (tests/gpu/run.sh).

Trains the same GPT as worker/models/gpt.cc (pre-norm blocks, manual causal attention, exact GELU,
byte vocabulary, learned positions, bias-free head) with torch.distributed.fsdp.fully_shard: one
unit per block plus the root, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), AdamW on
the fp32 sharded parameters — the configuration bench/gpu/gpt_gpu_bench.cc runs our engine in.
Prints one JSON line (and writes it to --json-out) with median step time, peak CUDA memory and
achieved TFLOP/s, counted with the same formula as the C++ driver (see model_flops_per_step).

World size 1 by default (run.sh); under torchrun it shards over WORLD_SIZE ranks.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# d_model, n_layers, n_heads, seq_len — keep in sync with NamedConfigs() in worker/models/gpt.cc.
MODELS = {
    "gpt-tiny": (64, 2, 4, 64),
    "gpt-small": (256, 4, 4, 128),
    "gpt-medium": (512, 8, 8, 256),
    "gpt-1b": (2048, 20, 16, 1024),
}
VOCAB = 256
INIT_STD = 0.02


class Block(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d_ff)
        self.out = nn.Linear(d_ff, d)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, self.heads, hd).transpose(1, 2) for y in (q, k, v))
        # Same math as the C++ block (no fused SDPA kernel), so the comparison measures the
        # sharding machinery, not different attention kernels.
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        attn = torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(attn)
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, d, n_layers, heads, seq_len, vocab=VOCAB):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)
        self.layers = nn.ModuleList(Block(d, heads, 4 * d) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        residual_std = INIT_STD / math.sqrt(2.0 * n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
                elif "ln" in name:
                    p.fill_(1.0)
                elif name.endswith("proj.weight") or name.endswith("out.weight"):
                    p.normal_(0.0, residual_std)
                else:
                    p.normal_(0.0, INIT_STD)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos).unsqueeze(0)
        for block in self.layers:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_count(d, n_layers, seq_len, vocab=VOCAB):
    """Mirrors GptParamCount() in worker/models/gpt.cc."""
    f = 4 * d
    ln = 2 * d
    block = ln + (d * 3 * d + 3 * d) + (d * d + d) + ln + (d * f + f) + (f * d + d)
    return vocab * d + seq_len * d + n_layers * block + ln + vocab * d


def model_flops_per_step(d, n_layers, seq_len, batch, vocab=VOCAB):
    """Training FLOPs of one step (forward + backward = 3x forward), matmuls only:
    6 * (matmul parameters) * tokens + 12 * n_layers * seq_len * d * tokens (QK^T and AV).
    Embedding lookups are not matmuls and are excluded; the head is included. Same formula as
    ModelFlopsPerStep() in bench/gpu/gpt_gpu_bench.cc."""
    tokens = batch * seq_len
    matmul_params = n_layers * (12 * d * d) + vocab * d
    return 6 * matmul_params * tokens + 12 * n_layers * seq_len * d * tokens


def import_fully_shard():
    try:  # torch >= 2.6
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-1b", choices=sorted(MODELS))
    parser.add_argument("--dims", default="", help="d_model,n_layers,n_heads,seq_len (overrides --model)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--json-out", default="")
    args = parser.parse_args()

    if args.dims:
        d, n_layers, heads, seq_len = (int(x) for x in args.dims.split(","))
    else:
        d, n_layers, heads, seq_len = MODELS[args.model]
    if not torch.cuda.is_available():
        print("fsdp2_gpt_bench: no CUDA device (torch %s)" % torch.__version__, file=sys.stderr)
        return 2

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device if world == 1 else "cuda:%d" % local_rank)
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=rank, world_size=world)

    fully_shard, MixedPrecisionPolicy = import_fully_shard()
    torch.manual_seed(1234)
    with torch.device(device):
        model = Gpt(d, n_layers, heads, seq_len)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    gen = torch.Generator(device=device)
    gen.manual_seed(7 + rank)
    tokens = torch.randint(0, VOCAB, (args.batch, seq_len), device=device, generator=gen)
    targets = torch.roll(tokens, shifts=-1, dims=1)

    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())

    step_s = statistics.median(times)
    flops = model_flops_per_step(d, n_layers, seq_len, args.batch)
    result = {
        "impl": "fsdp2",
        "model": args.dims or args.model,
        "params": param_count(d, n_layers, seq_len),
        "world_size": world,
        "batch": args.batch,
        "seq_len": seq_len,
        "param_dtype": "bf16",
        "steps": args.steps,
        "step_s_median": step_s,
        "step_s_min": min(times),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "flops_per_step": flops,
        "tflops": flops / step_s / 1e12,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device),
    }
    line = json.dumps(result)
    if rank == 0:
        print(line)
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A GPT-like model written in PyTorch, scripted and saved for hsdp-worker.

    python3 examples/torchscript/gpt.py model.pt [--d-model 64 --n-layers 4 ...]

The module follows the convention hsdp-worker expects of a scripted model
(examples/torchscript/README.md):

  vocab_size: int, seq_len: int            attributes
  embed(tokens) -> x                       int64 [b, t] -> [b, t, d]
  layers.<i>.forward(x) -> x               the units (--units 'layers.*')
  head_loss(x, targets) -> loss            mean cross entropy, a scalar
  forward(tokens, targets) -> loss         the same loss, for Python callers

The worker calls embed, then each unit in model order, then head_loss, and
gathers each unit's parameters around that unit's call alone. It checks once at
start that forward() gives the same loss on one sample.

The architecture is the C++ GPT's (worker/models/gpt.cc): pre-norm blocks with
causal self-attention and a GELU MLP, no dropout (runs must be deterministic).
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_ff)
        self.out = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.size(0), x.size(1), x.size(2)
        hd = d // self.n_heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.n_heads, hd).transpose(1, 2)
        v = v.view(b, t, self.n_heads, hd).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        # Built per call, not a buffer: cheap, and nothing to move or shard.
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        attn = torch.matmul(torch.softmax(scores, -1), v)
        attn = attn.transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(attn)
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    vocab_size: int
    seq_len: int

    def __init__(self, vocab_size: int = 256, d_model: int = 64,
                 n_layers: int = 4, n_heads: int = 4, seq_len: int = 64,
                 d_ff: int = 0):
        super().__init__()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        d_ff = d_ff if d_ff > 0 else 4 * d_model
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList(
            [Block(d_model, n_heads, d_ff) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init(n_layers)

    def _init(self, n_layers: int) -> None:
        # GPT-2 style, as the C++ GPT: N(0, 0.02), residual projections scaled
        # by 1/sqrt(2 n_layers), LayerNorm weight 1, biases 0.
        residual_std = 0.02 / math.sqrt(2.0 * n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
                elif "ln" in name:
                    p.fill_(1.0)
                elif name.endswith("proj.weight") or name.endswith("out.weight"):
                    p.normal_(0.0, residual_std)
                else:
                    p.normal_(0.0, 0.02)

    @torch.jit.export
    def embed(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.size(1), dtype=torch.long,
                           device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(pos).unsqueeze(0)

    @torch.jit.export
    def head_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                               targets.reshape(-1))

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head_loss(x, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where to save the scripted model (.pt)")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-ff", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = GPT(args.vocab_size, args.d_model, args.n_layers, args.n_heads,
                args.seq_len, args.d_ff)
    torch.jit.script(model).save(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: scripted GPT, {n} parameters, "
          f"{args.n_layers} units layers.0..layers.{args.n_layers - 1}")


if __name__ == "__main__":
    main()

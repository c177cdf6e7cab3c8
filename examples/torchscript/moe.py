#!/usr/bin/env python3
"""A mixture-of-experts language model in PyTorch, scripted for hsdp-worker.

    python3 examples/torchscript/moe.py model.pt [--d-model 16 --n-layers 2 --experts 8]

Each layer (a unit, --units 'layers.*') holds `experts` small feed-forward
experts; each token goes to one expert chosen by hashing its token id (top-1
hash routing), and a learned gate scales that expert's output. With a few
tokens per microbatch, some experts get no token on some ranks and tokens on
others: hsdp reduces their gradients with zeros standing in on the ranks
without one, so every parameter gets the gradient single-process training
gives it.

The units only see activations (the convention's unit forward takes one
tensor), so embed() appends each token's expert id as a last channel that the
layers read and carry along; head_loss() drops it.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def expert_of(tokens: Tensor, experts: int) -> Tensor:
    """A fixed hash of the token id: the same expert on every rank and run."""
    return (tokens * 5 + torch.div(tokens, experts, rounding_mode="floor")
            ).remainder(experts)


class MoeLayer(nn.Module):
    """x + gate(x) * expert_e(x) for each token's expert e."""

    def __init__(self, d_model: int, d_ff: int, experts: int):
        super().__init__()
        self.router = nn.Linear(d_model, 1)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(),
                           nn.Linear(d_ff, d_model)) for _ in range(experts)])

    def forward(self, x: Tensor) -> Tensor:
        h = x[..., :-1]
        route = x[..., -1:]
        flat = h.reshape(-1, h.size(-1))
        which = route.reshape(-1).long()
        y = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (which == e).nonzero().reshape(-1)
            if idx.numel() > 0:
                y = y.index_add(0, idx, expert(flat.index_select(0, idx)))
        out = flat + torch.sigmoid(self.router(flat)) * y
        return torch.cat([out.reshape(h.shape), route], -1)


class Moe(nn.Module):
    def __init__(self, vocab_size: int = 32, d_model: int = 16, d_ff: int = 32,
                 n_layers: int = 2, experts: int = 8, seq_len: int = 8):
        super().__init__()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.n_experts = experts
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            [MoeLayer(d_model, d_ff, experts) for _ in range(n_layers)])
        self.head = nn.Linear(d_model, vocab_size)

    @torch.jit.export
    def embed(self, tokens: Tensor) -> Tensor:
        route = expert_of(tokens, self.n_experts).to(torch.float32)
        return torch.cat([self.tok_emb(tokens), route.unsqueeze(-1)], -1)

    @torch.jit.export
    def head_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.head(x[..., :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab_size),
                               targets.reshape(-1))

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head_loss(x, targets)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--vocab-size", type=int, default=32)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--d-ff", type=int, default=32)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    model = Moe(a.vocab_size, a.d_model, a.d_ff, a.n_layers, a.experts,
                a.seq_len)
    torch.jit.script(model).save(a.out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Scripted models for the TorchScript task tests: good and deliberately bad.

    make_scripted_models.py OUT_DIR

gpt.pt            examples/torchscript/gpt.py's GPT, small dims
no_head_loss.pt   no head_loss method
bad_signature.pt  head_loss(self, x: Tensor, targets: int)
bad_unit.pt       a unit whose forward takes two tensors
state_dict.pt     torch.save(model.state_dict()): a pickle, not TorchScript
one_arg_forward.pt  forward(self, tokens: Tensor): no targets
moe.pt            examples/torchscript/moe.py's mixture of experts
moe_reference.pt  a batch for it (tokens, targets: 8 samples; sample s only
                  reaches experts 2*(s//2) and 2*(s//2)+1, and never expert
                  7) and PyTorch's own gradients of its mean loss
                  (eager, not scripted), as buffers: grad__<name with . as
                  __> for each parameter that got one
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "..", "examples", "torchscript"))
import gpt  # noqa: E402
import moe  # noqa: E402


class Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x))


class TwoInputs(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.fc(x) + y


class NoHeadLoss(nn.Module):
    vocab_size: int
    seq_len: int

    def __init__(self):
        super().__init__()
        self.vocab_size = 256
        self.seq_len = 8
        self.emb = nn.Embedding(256, 8)
        self.layers = nn.ModuleList([Mlp(8), Mlp(8)])

    @torch.jit.export
    def embed(self, tokens: Tensor) -> Tensor:
        return self.emb(tokens)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


class BadSignature(NoHeadLoss):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 256)

    @torch.jit.export
    def head_loss(self, x: Tensor, targets: int) -> Tensor:
        return self.head(x).sum() * targets


class BadUnit(NoHeadLoss):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([TwoInputs(8), TwoInputs(8)])
        self.head = nn.Linear(8, 256)

    @torch.jit.export
    def head_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, x)
        return x


class OneArgForward(NoHeadLoss):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 256)

    @torch.jit.export
    def head_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


class Tensors(nn.Module):
    """Named tensors as buffers: a file LibTorch's torch::jit::load reads."""

    def __init__(self, tensors):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)

    def forward(self) -> Tensor:
        return torch.zeros(1)


def moe_reference(model: "moe.Moe") -> Tensors:
    by_expert = {}
    for t in range(model.vocab_size):
        e = int(moe.expert_of(torch.tensor(t), model.n_experts))
        by_expert.setdefault(e, []).append(t)
    tokens = torch.empty(8, model.seq_len, dtype=torch.long)
    for s in range(8):
        experts = [e for e in (2 * (s // 2), 2 * (s // 2) + 1) if e != 7]
        for i in range(model.seq_len):
            choices = by_expert[experts[(i + s) % len(experts)]]
            tokens[s, i] = choices[(i * 3 + s) % len(choices)]
    targets = (tokens * 3 + 1) % model.vocab_size
    model(tokens, targets).backward()
    tensors = {"tokens": tokens, "targets": targets}
    for name, p in model.named_parameters():
        if p.grad is not None:
            tensors["grad__" + name.replace(".", "__")] = p.grad.detach()
    model.zero_grad(set_to_none=True)
    return Tensors(tensors)


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    # Uneven over 2 and 4 shards: 24 positional rows, d_model 20.
    model = gpt.GPT(vocab_size=256, d_model=20, n_layers=3, n_heads=2,
                    seq_len=24)
    torch.jit.script(model).save(os.path.join(out, "gpt.pt"))
    torch.save(model.state_dict(), os.path.join(out, "state_dict.pt"))
    torch.jit.script(NoHeadLoss()).save(os.path.join(out, "no_head_loss.pt"))
    torch.jit.script(BadSignature()).save(os.path.join(out, "bad_signature.pt"))
    torch.jit.script(BadUnit()).save(os.path.join(out, "bad_unit.pt"))
    torch.jit.script(OneArgForward()).save(
        os.path.join(out, "one_arg_forward.pt"))
    torch.manual_seed(1)
    mixture = moe.Moe(vocab_size=256, d_model=6, d_ff=10, n_layers=2, experts=8,
                      seq_len=8)
    torch.jit.script(mixture).save(os.path.join(out, "moe.pt"))
    torch.jit.script(moe_reference(mixture)).save(
        os.path.join(out, "moe_reference.pt"))


if __name__ == "__main__":
    main()

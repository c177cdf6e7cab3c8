#!/usr/bin/env python3
"""Loads hsdp-worker's --final-params back into the Python model.

    python3 examples/torchscript/load_final_params.py final.pt [--check]
        [--save trained.pt] [gpt.py model flags: --d-model 64 ...]

--final-params is a LibTorch archive of named tensors ("layers.0.qkv.weight",
...): the names of the model's own state_dict. This builds the GPT of gpt.py
with the given dims, load_state_dict()s the archive into it (strict: every name
and shape must match), and with --check verifies every value arrived exactly.
--save writes the trained model scripted again, to train further or serve.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402


def read_archive(path: str) -> dict:
    """The named tensors of a torch::serialize::OutputArchive file."""
    archive = torch.jit.load(path, map_location="cpu")
    state = {name: t.detach().clone() for name, t in archive.named_parameters()}
    state.update({name: t.detach().clone()
                  for name, t in archive.named_buffers()})
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("final_params")
    parser.add_argument("--check", action="store_true",
                        help="fail unless every tensor loaded bit for bit")
    parser.add_argument("--save", help="save the trained model, scripted")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-ff", type=int, default=0)
    args = parser.parse_args()
    model = gpt.GPT(args.vocab_size, args.d_model, args.n_layers, args.n_heads,
                    args.seq_len, args.d_ff)
    state = read_archive(args.final_params)
    model.load_state_dict(state, strict=True)
    if args.check:
        loaded = model.state_dict()
        for name, t in state.items():
            if not torch.equal(loaded[name], t):
                sys.exit(f"{name}: differs after load_state_dict")
        print(f"{len(state)} tensors loaded exactly")
    if args.save:
        torch.jit.script(model).save(args.save)


if __name__ == "__main__":
    main()

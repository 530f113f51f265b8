"""Positional embedding built with torch.arange inside forward(), without device=.

Source: https://github.com/mattroz/diffusion-ddpm/issues/5 (tensor made in forward stays on the CPU)
"""
# case: {"kind": "failure", "exit": 1, "module": "pos", "cause": "tensor_created_in_forward", "fix": ["device="]}
import torch
import torch.nn as nn

from gpudoctor.virtual import VirtualGPUs, fake_place


class TinyEncoder(nn.Module):
    def __init__(self, vocab=100, dim=32, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])  # <- line
        hidden = self.tok(ids) + self.pos(positions)
        return self.out(hidden.mean(1))


def main():
    model = TinyEncoder()
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        ids = torch.randint(0, 100, (4, 12), device="gpu:0")
        print(model(ids).shape)


if __name__ == "__main__":
    main()

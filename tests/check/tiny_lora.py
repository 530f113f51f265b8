"""A two-layer module with a ``q_proj`` for LoRA truth tests (peft wraps it like a transformers model)."""

import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.q_proj(x))


def lora(model=None):
    import peft

    return peft.get_peft_model(model if model is not None else Tiny(), peft.LoraConfig(r=2, target_modules=["q_proj"]))

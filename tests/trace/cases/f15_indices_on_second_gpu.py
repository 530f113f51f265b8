"""Two-GPU box: the model is on gpu:0, the collate function sends the batch to gpu:1.

Source: https://github.com/davmacario/MDI-LLM/issues/21 (tensors placed on cuda:0 while training on cuda:1)
"""
# case: {"kind": "failure", "exit": 1, "module": "transformer.wte", "cause": "batch_not_moved", "fix": ["model.device"]}
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gpudoctor.virtual import VirtualGPUs, fake_place


def collate(rows, device):
    return {"input_ids": torch.stack(rows).to(device)}


def main():
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64))
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        batch = collate([torch.randint(0, 128, (12,)) for _ in range(4)], "gpu:1")
        logits = model(**batch, use_cache=False).logits  # <- line
        print(logits.shape)


main()

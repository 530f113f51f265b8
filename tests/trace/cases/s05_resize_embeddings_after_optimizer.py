"""New special tokens: resize_token_embeddings runs after the optimizer was built, so it updates the old matrix.

Source: https://github.com/huggingface/transformers/pull/3532 (resize the embedding matrix before the optimizer)
"""
# case: {"kind": "silent", "exit": 0, "cause": "optimizer_orphans", "fix": ["optimizer", "resize_token_embeddings"], "rule": "GD413"}
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build(vocab):
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, n_positions=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # <- line
    return model, optimizer


def main():
    torch.manual_seed(0)
    model, optimizer = build(128)
    model.resize_token_embeddings(132)  # added <sep>, <cls>, ...
    for _ in range(3):
        ids = torch.randint(0, 132, (2, 12))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


main()

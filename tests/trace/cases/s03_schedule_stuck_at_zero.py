"""num_training_steps computed as len(batches) // accumulation = 0: the linear schedule keeps the LR at 0.

Source: https://github.com/huggingface/transformers/pull/5316 ("All learning rates will end at 0")
and https://github.com/huggingface/transformers/issues/34754 (warmup schedulers start from LR=0)
"""
# case: {"kind": "silent", "exit": 0, "cause": "stepped_but_unchanged", "fix": ["learning rate", "schedul"]}
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup


def main():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64))
    batches = [torch.randint(0, 128, (2, 16)) for _ in range(6)]
    accumulation = 8
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    total_steps = len(batches) // accumulation
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=total_steps)  # <- line
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    print("final loss", float(loss))


main()

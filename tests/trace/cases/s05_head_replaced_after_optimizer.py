"""A new classification head (5 labels instead of 2) replaces the old one after the optimizer was built: the optimizer
keeps stepping the old head, the new one never trains. (transformers 5's resize_token_embeddings keeps the Parameter
object, so that variant of this bug no longer happens; replacing a module still does.)

Source: https://github.com/microsoft/nni/issues/4521 (layers replaced after the optimizer was built are not updated)
"""
# case: {"kind": "silent", "exit": 0, "cause": "optimizer_orphans", "fix": ["optimizer", "after"], "rule": "GD413"}
import torch
import torch.nn as nn
from transformers import BertConfig, BertForSequenceClassification


def build():
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=64, vocab_size=128, num_labels=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # <- line
    return model, optimizer


def main():
    torch.manual_seed(0)
    model, optimizer = build()
    model.classifier = nn.Linear(32, 5)  # the label set grew
    model.num_labels = model.config.num_labels = 5
    for _ in range(3):
        ids, labels = torch.randint(0, 128, (4, 12)), torch.randint(0, 5, (4,))
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


main()

"""Gradual unfreezing done backwards: the embeddings are frozen after a backward, their .grad stays, AdamW keeps moving them.

Source: https://github.com/open-mmlab/OpenPCDet/issues/845 (frozen module's weights still change)
"""
# case: {"kind": "silent", "exit": 0, "module": "bert.embeddings", "cause": "frozen_but_updated", "fix": ["set_to_none"], "rule": "GD414"}
import torch
from transformers import BertConfig, BertForSequenceClassification


def main():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=64, vocab_size=128, num_labels=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(4):
        ids, labels = torch.randint(0, 128, (4, 10)), torch.randint(0, 2, (4,))
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if step == 1:
            model.bert.embeddings.requires_grad_(False)  # <- line
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


main()

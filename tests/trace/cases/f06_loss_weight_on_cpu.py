"""Class-weighted CrossEntropyLoss: logits and labels are on the GPU, the class weights are not.

Source: https://github.com/pytorch/pytorch/issues/122757 (CrossEntropyLoss weights on a different device)
"""
# case: {"kind": "failure", "exit": 1, "module": "CrossEntropyLoss", "cause": "loss_weight_on_cpu", "fix": ["loss_fn", ".to("]}
import torch
import torch.nn as nn
from transformers import BertConfig, BertForSequenceClassification

from gpudoctor.virtual import VirtualGPUs, fake_place


def main():
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=64, vocab_size=128, num_labels=3))
    class_counts = torch.tensor([500.0, 120.0, 30.0])
    loss_fn = nn.CrossEntropyLoss(weight=class_counts.sum() / class_counts)  # <- line
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        ids = torch.randint(0, 128, (4, 16), device="gpu:0")
        labels = torch.randint(0, 3, (4,), device="gpu:0")
        logits = model(input_ids=ids).logits
        loss = loss_fn(logits, labels)
        loss.backward()


if __name__ == "__main__":
    main()

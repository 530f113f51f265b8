"""Linear probing: the backbone is frozen, but the optimizer is built over the backbone instead of the new head.

Source: https://github.com/facebookresearch/fairseq/issues/4702 (which parameters does the optimizer really update)
and https://github.com/amdegroot/ssd.pytorch/issues/109 (freezing layers vs the optimizer's parameter list)
"""
# case: {"kind": "silent", "exit": 0, "module": "classifier", "cause": "optimizer_misses_trainable", "fix": ["requires_grad"]}
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, vocab_size=128))
        self.classifier = nn.Linear(32, 4)

    def forward(self, input_ids):
        return self.classifier(self.backbone(input_ids=input_ids).pooler_output)


def main():
    torch.manual_seed(0)
    model = Probe()
    model.backbone.requires_grad_(False)
    optimizer = torch.optim.SGD(model.backbone.parameters(), lr=0.1, momentum=0.9)  # <- line
    for _ in range(3):
        ids, labels = torch.randint(0, 128, (4, 10)), torch.randint(0, 4, (4,))
        loss = nn.functional.cross_entropy(model(ids), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


main()

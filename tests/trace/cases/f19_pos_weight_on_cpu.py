"""Multi-label classification with BCEWithLogitsLoss(pos_weight=...) built from CPU label statistics.

Source: https://github.com/sacdallago/biotrainer/issues/67 (class weights must be sent to the device)
"""
# case: {"kind": "failure", "exit": 1, "module": "BCEWithLogitsLoss", "cause": "loss_weight_on_cpu", "fix": ["criterion", ".to("]}
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

from gpudoctor.virtual import VirtualGPUs, fake_place


class Tagger(nn.Module):
    def __init__(self, n_tags=6):
        super().__init__()
        self.encoder = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=64, vocab_size=128))
        self.out = nn.Linear(32, n_tags)

    def forward(self, input_ids):
        return self.out(self.encoder(input_ids=input_ids).pooler_output)


def main():
    model = Tagger()
    positives = torch.tensor([40.0, 5.0, 12.0, 3.0, 30.0, 8.0])
    criterion = nn.BCEWithLogitsLoss(pos_weight=(100 - positives) / positives)  # <- line
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        ids = torch.randint(0, 128, (4, 10), device="gpu:0")
        targets = torch.randint(0, 2, (4, 6), device="gpu:0").float()
        criterion(model(ids), targets).backward()


main()

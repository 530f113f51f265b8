"""Multi-task heads kept in a Python list: model.to() and model.parameters() never see them.

Source: https://github.com/rish-16/tokenlearner-pytorch/issues/4 (layers in a list are not moved to cuda)
"""
# case: {"kind": "failure", "exit": 1, "module": "heads[0]", "cause": "submodule_in_python_list", "fix": ["nn.ModuleList"]}
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

from gpudoctor.virtual import VirtualGPUs, fake_place


class MultiTask(nn.Module):
    def __init__(self, tasks=(3, 5)):
        super().__init__()
        self.encoder = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=64, vocab_size=128, max_position_embeddings=64))
        self.heads = [nn.Linear(32, n) for n in tasks]  # <- line

    def forward(self, input_ids):
        pooled = self.encoder(input_ids=input_ids).pooler_output
        return [head(pooled) for head in self.heads]


def main():
    model = MultiTask()
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        print([o.shape for o in model(torch.randint(0, 128, (2, 10), device="gpu:0"))])


main()

"""A classification head keeps its label prior as a plain tensor attribute; model.to() leaves it behind.

Source: https://github.com/huggingface/transformers/issues/22234 (tensor attribute not moved with the model)
"""
# case: {"kind": "failure", "exit": 1, "module": "head", "cause": "plain_tensor_attribute", "fix": ["register_buffer", "log_prior"]}
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

from gpudoctor.virtual import VirtualGPUs, fake_place


class PriorHead(nn.Module):
    def __init__(self, dim, n_labels):
        super().__init__()
        self.proj = nn.Linear(dim, n_labels)
        self.log_prior = torch.log(torch.full((n_labels,), 1.0 / n_labels))  # <- line

    def forward(self, hidden):
        return self.proj(hidden) + self.log_prior


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, vocab_size=128, max_position_embeddings=64))
        self.head = PriorHead(32, 3)

    def forward(self, input_ids):
        return self.head(self.bert(input_ids=input_ids).pooler_output)


def main():
    model = Classifier()
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        print(model(torch.randint(0, 128, (2, 10), device="gpu:0")).shape)


main()

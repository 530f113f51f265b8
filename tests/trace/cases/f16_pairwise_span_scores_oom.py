"""Span extraction head scores every (start, end) pair at once: one (B, L, L, D) activation of 64 GiB.

Source: https://github.com/thunlp/PL-Marker/issues/7 (CUDA OOM with batch size 1 from span pairs)
and https://github.com/kentonl/e2e-coref/issues/64 (span-pair memory on long documents)
"""
# case: {"kind": "failure", "exit": 1, "module": "scorer", "cause": "dominant_activation", "fix": ["chunk"], "oom_first": ["chunk", "sequence", "micro_batch"]}
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

from gpudoctor.virtual import VirtualGPUs, fake_place


class PairScorer(nn.Module):
    def __init__(self, dim, inner=512):
        super().__init__()
        self.start = nn.Linear(dim, inner)
        self.end = nn.Linear(dim, inner)
        self.score = nn.Linear(inner, 1)

    def forward(self, hidden):
        pairs = self.start(hidden).unsqueeze(2) + self.end(hidden).unsqueeze(1)  # <- line
        return self.score(torch.relu(pairs)).squeeze(-1)


class SpanModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, vocab_size=128, max_position_embeddings=4096))
        self.scorer = PairScorer(32)

    def forward(self, input_ids):
        return self.scorer(self.encoder(input_ids=input_ids).last_hidden_state)


def main():
    model = SpanModel()
    with VirtualGPUs(memory_cap="15GiB"):  # a 16 GB T4
        fake_place(model, "gpu:0")
        ids = torch.randint(0, 128, (2, 4096), device="gpu:0")
        model(ids).sum().backward()


main()

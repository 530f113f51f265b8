"""Pipeline split by hand over two GPUs; the custom loss meets logits on the last GPU with labels on the first.

Source: https://github.com/shuxueslpi/chatGLM-6B-QLoRA/issues/38 (labels and logits on cuda:1 and cuda:0)
and https://github.com/unslothai/unsloth/issues/4059
"""
# case: {"kind": "failure", "exit": 1, "module": null, "cause": "user_code_mismatch", "fix": ["labels", "logits.device"]}
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaModel

from gpudoctor.virtual import VirtualGPUs, fake_place


def main():
    backbone = LlamaModel(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128))
    head = nn.Linear(32, 128, bias=False)
    with VirtualGPUs():
        fake_place(backbone, "gpu:0")
        fake_place(head, "gpu:1")
        input_ids = torch.randint(0, 128, (2, 12), device="gpu:0")
        labels = input_ids.clone()
        hidden = backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = head(hidden.to("gpu:1"))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1))  # <- line
        loss.backward()


main()

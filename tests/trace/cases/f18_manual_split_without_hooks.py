"""Naive model parallelism: the second half of the layers is moved to gpu:1, nothing moves the activations.

Source: https://github.com/huggingface/transformers/issues/35763 (modelling code mixes devices across layers)
"""
# case: {"kind": "failure", "exit": 1, "module": "model.layers.2.input_layernorm", "cause": "manual_split_without_hooks", "fix": ["dispatch_model"]}
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, fake_place


def main():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128))
    with VirtualGPUs():
        placement = {"": "gpu:0", "model.layers.2": "gpu:1", "model.layers.3": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}
        fake_place(model, placement)
        ids = torch.randint(0, 128, (2, 8), device="gpu:0")
        out = model(input_ids=ids, labels=ids, use_cache=False)  # <- line
        out.loss.backward()


main()

"""LoRA adapters put on a layer that accelerate offloads: backward fails on the meta placeholder.

Source: https://github.com/huggingface/peft/issues/2129 (offloaded base with peft)
and https://github.com/huggingface/accelerate/issues/1325
"""
# case: {"kind": "failure", "exit": 1, "cause": "trainable_offloaded", "fix": ["resident"]}
import tempfile

import torch
from accelerate import dispatch_model
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.norm": "cpu", "lm_head": "cpu"}


def main():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128))
    with tempfile.TemporaryDirectory() as offload:
        model = dispatch_model(model, device_map=DEVICE_MAP, main_device="cpu", offload_dir=offload)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        ids = torch.randint(0, 128, (2, 8))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()  # <- line


main()

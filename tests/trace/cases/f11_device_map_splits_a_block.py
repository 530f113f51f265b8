"""A hand-written device_map puts the attention and the MLP of one decoder layer on different GPUs.

Source: https://github.com/bigcode-project/starcoder/issues/29 (residual add across cuda:0 and cuda:1)
and https://github.com/huggingface/accelerate/issues/1730
"""
# case: {"kind": "failure", "exit": 1, "module": "model.layers.0", "cause": "split_no_split_module", "fix": ["no_split_module_classes"]}
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, dispatch

DEVICE_MAP = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0.self_attn": "gpu:0",
              "model.layers.0.input_layernorm": "gpu:0", "model.layers.0.post_attention_layernorm": "gpu:0",
              "model.layers.0.mlp": "gpu:1", "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}

model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128))
with VirtualGPUs():
    dispatch(model, DEVICE_MAP)
    ids = torch.randint(0, 128, (1, 8))
    out = model(input_ids=ids, use_cache=False)  # <- line

"""A model loaded with a device_map is then moved with .to(): accelerate's hooks still route activations by the map.

Source: https://github.com/huggingface/accelerate/issues/1613 (unable to change model device after device_map="auto")
"""
# case: {"kind": "failure", "exit": 1, "module": "model.layers.1.input_layernorm", "cause": "moved_after_dispatch", "fix": ["remove_hook_from_module"]}
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, dispatch, fake_place

DEVICE_MAP = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0": "gpu:0",
              "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}


def main():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128))
    with VirtualGPUs():
        dispatch(model, DEVICE_MAP)
        fake_place(model, "gpu:0")  # what model.to("cuda:0") does to the weights; the hooks stay
        ids = torch.randint(0, 128, (1, 8), device="gpu:0")
        model(input_ids=ids, use_cache=False)  # <- line


main()

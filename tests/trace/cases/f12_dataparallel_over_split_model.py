"""nn.DataParallel wrapped around a model already split over two GPUs by a device_map.

Source: https://github.com/huggingface/accelerate/issues/1300 (DataParallel on a model loaded with device_map)
"""
# case: {"kind": "failure", "exit": 1, "module": "DataParallel", "cause": "dataparallel_split_model", "fix": ["DataParallel"]}
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, dispatch

DEVICE_MAP = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0": "gpu:0",
              "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}


def main():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128))
    with VirtualGPUs():
        dispatch(model, DEVICE_MAP)
        parallel = nn.DataParallel(model)
        ids = torch.randint(0, 128, (2, 8), device="gpu:0")
        parallel(input_ids=ids, use_cache=False)  # <- line


main()

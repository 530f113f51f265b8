"""A model dispatched over two GPUs; labels stay on the CPU because the HF causal-LM loss moves them (correct).

Source: https://github.com/huggingface/transformers/issues/29144 (multi-GPU device_map training loss placement)
"""
# case: {"kind": "clean", "exit": 0}
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, dispatch

DEVICE_MAP = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0": "gpu:0",
              "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}


def main():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128))
    with VirtualGPUs():
        dispatch(model, DEVICE_MAP)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        for _ in range(2):
            ids = torch.randint(0, 128, (2, 8))
            loss = model(input_ids=ids.to("gpu:0"), labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


main()

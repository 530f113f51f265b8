"""Custom training loop: the model is moved to the GPU, the tokenized batch is not.

Source: https://github.com/pytorch/tutorials/issues/1657 (model on cuda, inputs left on cpu)
"""
# case: {"kind": "failure", "exit": 1, "module": "model.embed_tokens", "cause": "batch_not_moved", "fix": ["batch", ".to("]}
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, fake_place


def main():
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(config)
    with VirtualGPUs():
        fake_place(model, "gpu:0")  # model.to("cuda")
        batch = {"input_ids": torch.randint(0, 128, (2, 16)), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
        out = model(**batch, use_cache=False)  # <- line
        print(out.logits.shape)


main()

"""Long-context fine-tuning with eager attention: the 16k x 16k attention scores of one layer exhaust the GPU.

Source: https://github.com/vllm-project/speculators/issues/881 (eager attention memory at long sequence length)
"""
# case: {"kind": "failure", "exit": 1, "module": "model.layers.0.self_attn", "cause": "dominant_activation", "fix": ["sdpa"], "oom_first": ["attention", "sequence", "chunk", "micro_batch"]}
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, fake_place

SEQ = 16384


def main():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=SEQ)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    model.train()
    with VirtualGPUs(memory_cap="7GiB"):
        fake_place(model, "gpu:0")
        ids = torch.randint(0, 128, (1, SEQ), device="gpu:0")
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # <- line
        loss.backward()


main()

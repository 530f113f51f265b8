"""generate() on a model whose embedding is offloaded: inputs sent to `model.device`, which is `meta`.

Source: https://github.com/huggingface/transformers/issues/34076 (model.device is the first parameter's device)
and https://github.com/huggingface/transformers/pull/16935 (PreTrainedModel.device is wrong with offload)
"""
# case: {"kind": "failure", "exit": 1, "module": null, "cause": "inputs_to_meta_device", "fix": ["model.device"]}
import tempfile

import torch
from accelerate import dispatch_model
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128, pad_token_id=0, eos_token_id=2))
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                  "lm_head": "cpu"}
    with tempfile.TemporaryDirectory() as offload:
        model = dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=offload)
        prompt = torch.randint(3, 128, (1, 6))
        prompt = prompt.to(model.device)  # <- line
        out = model.generate(input_ids=prompt, max_new_tokens=4)
        print(out)


main()

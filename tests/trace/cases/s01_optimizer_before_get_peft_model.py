"""The optimizer is built over the base model, then get_peft_model adds the LoRA weights it never sees.

Source: https://github.com/huggingface/peft/issues/793 (LoRA model after fine-tuning identical to the base model)
"""
# case: {"kind": "silent", "exit": 0, "cause": "optimizer_misses_trainable", "fix": ["optimizer", "get_peft_model"], "rule": "GD413"}
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # <- line
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.train()
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 12))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print("loss", float(loss))


if __name__ == "__main__":
    main()

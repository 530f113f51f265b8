"""Distillation with the teacher moved to the student's GPU and run without grad (correct).

Source: https://github.com/huggingface/optimum-intel/pull/182 (set the teacher model to the right device)
"""
# case: {"kind": "clean", "exit": 0}
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, fake_place


def tiny(layers):
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


def main():
    student, teacher = tiny(2), tiny(4)
    teacher.eval().requires_grad_(False)
    with VirtualGPUs():
        fake_place(student, "gpu:0")
        fake_place(teacher, "gpu:0")
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, foreach=False)
        for _ in range(2):
            batch = {"input_ids": torch.randint(0, 128, (2, 12), device="gpu:0")}
            with torch.no_grad():
                target = F.softmax(teacher(**batch, use_cache=False).logits / 2.0, -1)
            loss = F.kl_div(F.log_softmax(student(**batch, use_cache=False).logits / 2.0, -1), target, reduction="batchmean")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


main()

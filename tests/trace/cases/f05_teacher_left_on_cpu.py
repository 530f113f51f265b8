"""Distillation: the student is moved to the GPU with the batch, the teacher never is.

Source: https://github.com/nlp-with-transformers/notebooks/issues/61 (DistillationTrainer: cuda:0 and cpu)
and https://github.com/JDAI-CV/fast-reid/issues/690 (teacher model not on the student's device)
"""
# case: {"kind": "failure", "exit": 1, "module": "model.embed_tokens", "cause": "model_not_moved", "fix": ["teacher", ".to("]}
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.virtual import VirtualGPUs, fake_place


def tiny(layers):
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


def distill_step(student, teacher, batch, temperature=2.0):
    student_logits = student(**batch, use_cache=False).logits
    with torch.no_grad():
        teacher_logits = teacher(**batch, use_cache=False).logits
    return F.kl_div(F.log_softmax(student_logits / temperature, -1), F.softmax(teacher_logits / temperature, -1),
                    reduction="batchmean")


def main():
    student = tiny(2)
    teacher = tiny(4)  # <- line
    teacher.eval()
    with VirtualGPUs():
        fake_place(student, "gpu:0")
        batch = {"input_ids": torch.randint(0, 128, (2, 12), device="gpu:0")}
        loss = distill_step(student, teacher, batch)
        loss.backward()


main()

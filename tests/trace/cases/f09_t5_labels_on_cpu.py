"""T5 fine-tuning: input_ids are moved, labels are not; T5 shifts labels into decoder inputs before any loss.

Source: https://github.com/renatoviolin/Bart_T5-summarization/issues/2 (T5: expected device cuda but got cpu, index_select)
"""
# case: {"kind": "failure", "exit": 1, "module": "decoder.embed_tokens", "cause": "batch_not_moved", "fix": ["labels", ".to("], "fix_not": ["HF loss moves"]}
import torch
from transformers import T5Config, T5ForConditionalGeneration

from gpudoctor.virtual import VirtualGPUs, fake_place


def main():
    model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                decoder_start_token_id=0))
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        source = torch.randint(0, 128, (2, 10))
        labels = torch.randint(0, 128, (2, 6))
        loss = model(input_ids=source.to("gpu:0"), labels=labels).loss  # <- line
        loss.backward()


main()

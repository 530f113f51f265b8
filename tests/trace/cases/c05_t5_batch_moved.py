"""T5 fine-tuning step with the whole batch (labels included) moved to the model's GPU (correct).

Source: https://github.com/huggingface/transformers/pull/12742 (T5 inputs cast to the model's device)
"""
# case: {"kind": "clean", "exit": 0}
import torch
from transformers import T5Config, T5ForConditionalGeneration

from gpudoctor.virtual import VirtualGPUs, fake_place


def main():
    model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                decoder_start_token_id=0))
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        model.tie_weights()  # fake_place re-creates each module's parameters, which unties shared/embed_tokens
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        batch = {"input_ids": torch.randint(0, 128, (2, 10)), "labels": torch.randint(0, 128, (2, 6))}
        batch = {k: v.to("gpu:0") for k, v in batch.items()}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()


main()

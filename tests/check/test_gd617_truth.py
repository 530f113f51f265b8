"""GD617 checked against the installed torch 2.13, transformers 5.24 and accelerate 1.16: accelerate's automatic map
for two GPUs puts the embedding on the first and ``lm_head`` on the last device, so the logits come out on the last
GPU; a hand-written loss between those logits and labels on the first GPU raises torch's device-mismatch error (virtual
``gpu:0``/``gpu:1``, see gpudoctor.virtual), and runs once the labels follow the logits' device."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
import torch.nn.functional as F  # noqa: E402

from gpudoctor.check.engine import check_source  # noqa: E402
from gpudoctor.virtual import VirtualGPUs  # noqa: E402

MISMATCH = "Expected all tensors to be on the same device, but found at least two devices"


def test_auto_map_puts_the_head_on_the_last_gpu():
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4000, tie_word_embeddings=False)
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    size = sum(p.numel() * 4 for p in model.parameters())
    device_map = infer_auto_device_map(model, max_memory={0: size // 2, 1: size}, no_split_module_classes=["LlamaDecoderLayer"])
    assert device_map["model.embed_tokens"] == 0 and device_map["lm_head"] == 1


def test_loss_between_devices_raises_and_the_move_fixes_it():
    with VirtualGPUs():
        logits = torch.randn(2, 12, 128, device="gpu:1")
        labels = torch.randint(0, 128, (2, 12), device="gpu:0")
        with pytest.raises(RuntimeError, match=MISMATCH):
            F.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1))
        F.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].to(logits.device).reshape(-1))


SOURCE = """
# CUDA_VISIBLE_DEVICES=0,1 python train.py
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2-7B", device_map={device_map})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
for batch in loader:
    input_ids = batch["input_ids"].to("cuda:0")
    labels = {labels}
    logits = model(input_ids).logits
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
    loss.backward()
"""


@pytest.mark.parametrize(
    "device_map, labels, flagged",
    [
        ('"auto"', 'batch["labels"].to("cuda:0")', True),
        ('"auto"', 'batch["labels"].to(model.device)', True),  # a dispatched model's device is its first GPU
        ('{"model": 0, "lm_head": 1}', 'batch["labels"].cuda()', True),
        ('"auto"', 'batch["labels"].to(logits.device)', False),
        ('{"": 0}', 'batch["labels"].to("cuda:0")', False),  # one GPU
    ],
)
def test_rule_matches_the_library(device_map, labels, flagged):
    source = SOURCE.format(device_map=device_map, labels=labels)
    codes = [f.code for f in check_source(source, "t.py") if f.code == "GD617"]
    assert bool(codes) == flagged

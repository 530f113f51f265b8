"""GD204 (a cast of the peft model after ``get_peft_model``) checked against the installed torch 2.13 and peft 0.21:
get_peft_model upcasts the LoRA adapters of a float16 base to float32, but ``.half()`` on the wrapped model casts them
back to float16, and a GradScaler then refuses to unscale their gradients; cast before the wrap, they stay float32."""

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tiny_lora import Tiny, lora  # noqa: E402

from gpudoctor.check.engine import check_source  # noqa: E402


def _unscale(model):
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 8, dtype=next(model.parameters()).dtype)
    loss = model(x).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    return trainable


def test_half_after_wrap_makes_adapters_fp16_and_unscale_raises():
    model = lora()
    model.half()
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float16}
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _unscale(model)


def test_half_before_wrap_keeps_adapters_fp32():
    model = lora(Tiny().half())
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert _unscale(model)  # no error


SOURCE = """
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from peft import LoraConfig, get_peft_model

model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2-0.5B"{load})
model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"], task_type="CAUSAL_LM"))
{after}
trainer = Trainer(model=model, args=TrainingArguments(output_dir="o", fp16=True))
"""


@pytest.mark.parametrize(
    "load, after, flagged",
    [
        ("", "model.half()", True),
        ("", "model = model.to(torch.float16)", True),
        (", dtype=torch.float16", "model = model.cuda()", False),  # adapters upcast by the wrap, only moved after
        ("", "model = model.to(torch.bfloat16)", False),  # bf16 gradients: the scaler does not refuse them
        ("", "model = model.half().float()", False),  # the latest cast wins
    ],
)
def test_rule_matches_the_library(load, after, flagged):
    codes = [f.code for f in check_source(SOURCE.format(load=load, after=after), "t.py") if f.code == "GD204"]
    assert bool(codes) == flagged

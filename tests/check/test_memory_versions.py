"""GD506 reads the installed (or targeted) transformers version: 4.x loads float32 by default, 5.x the
checkpoint's dtype."""

from __future__ import annotations

from gpudoctor.check import versions
from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import rule_by_code

SOURCE = '''# Hardware: 2x A100 (80 GB each)
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-2-13b-hf")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
'''


def _findings(target: str | None):
    versions.set_targets({"transformers": target} if target else {})
    try:
        return check_source(SOURCE, "x.py", rules=[rule_by_code("GD506")])
    finally:
        versions.set_targets({})


def test_float32_default_in_transformers_4() -> None:
    [finding] = _findings("4.46.0")
    assert "4 x 4 B/param" in finding.message and "transformers 4.46.0 loads float32" in finding.message
    assert "~208 GB" in finding.message


def test_checkpoint_dtype_in_transformers_5() -> None:
    # 13e9 x 8 B = 104 GB > 80 GB per GPU: still flagged, with 16-bit weights assumed.
    [finding] = _findings("5.24.0")
    assert "4 x 2 B/param" in finding.message and 'dtype="auto"' in finding.message
    assert "~104 GB" in finding.message


# GD203: moving an 8-bit model with .to(device) is refused only by bitsandbytes < 0.48 (4-bit always moves).
MOVE_SOURCE = '''import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

dev = torch.device("cuda:0")
q8 = BitsAndBytesConfig(load_in_8bit=True)
model = AutoModelForCausalLM.from_pretrained("m", quantization_config=q8)
model.to(dev)
model4 = AutoModelForCausalLM.from_pretrained("m", load_in_4bit=True)
model4.to(dev)
'''


def _move_findings(bnb: str | None):
    versions.set_targets({"bitsandbytes": bnb} if bnb else {})
    try:
        return check_source(MOVE_SOURCE, "x.py", rules=[rule_by_code("GD203")])
    finally:
        versions.set_targets({})


def test_8bit_move_refused_by_old_bitsandbytes() -> None:
    [finding] = _move_findings("0.45.5")
    assert finding.line == 7 and "bitsandbytes>=0.48.0" in finding.message and "0.45.5" in finding.message


def test_8bit_move_allowed_by_new_bitsandbytes() -> None:
    assert _move_findings("0.48.2") == []


# GD506 with the checkpoint from a dataclass option default and no dtype, hardware unknown (FastChat-style):
# transformers 4.x loads float32 (7B x 16 B = ~112 GB > 80 GB); 5.x loads the checkpoint's 16-bit (~56 GB).
OPTION_SOURCE = '''from dataclasses import dataclass, field
import transformers


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="huggyllama/llama-7b")


def train():
    parser = transformers.HfArgumentParser((ModelArguments, transformers.TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    transformers.Trainer(model=model, args=training_args).train()
'''


def _option_findings(target: str):
    versions.set_targets({"transformers": target})
    try:
        return check_source(OPTION_SOURCE, "x.py", rules=[rule_by_code("GD506")])
    finally:
        versions.set_targets({})


def test_option_default_name_is_version_aware() -> None:
    [finding] = _option_findings("4.46.0")
    assert "`huggyllama/llama-7b`" in finding.message and "4 x 4 B/param" in finding.message
    assert "~112 GB" in finding.message and "--deepspeed" in finding.message
    assert _option_findings("5.24.0") == []

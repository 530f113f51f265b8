"""GD116 checked against the installed peft 0.21 / safetensors: DeepSpeed ZeRO-3 (not installed here) partitions each
parameter and leaves ``param.data = torch.empty(0)`` in the module (``deepspeed/runtime/zero/partition_parameters.py``
``free_param``); ``PeftModel.save_pretrained`` on such a model writes zero-size LoRA tensors, and loading that adapter
into a fresh model fails with a size mismatch. transformers 5.24's ``Trainer.save_model`` gathers the shards under
ZeRO-3 instead (``trainer.py``: ``_zero3_consolidated_16bit_state_dict`` / ``accelerator.get_state_dict``)."""

import inspect
import os

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

from tiny_lora import Tiny, lora  # noqa: E402

from gpudoctor.check.engine import check_source  # noqa: E402


def test_partitioned_parameters_save_an_empty_adapter(tmp_path):
    model = lora()
    for param in model.parameters():
        param.data = torch.empty(0, dtype=param.dtype)  # what ZeRO-3 leaves after partitioning
    model.save_pretrained(tmp_path)
    saved = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    assert saved and all(t.numel() == 0 for t in saved.values())
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft.PeftModel.from_pretrained(Tiny(), tmp_path)


def test_trainer_save_model_gathers_under_zero3():
    from transformers import Trainer

    source = inspect.getsource(Trainer.save_model)
    assert "_zero3_consolidated_16bit_state_dict" in source and "get_state_dict" in source


SOURCE = """
# deepspeed --num_gpus 8 sft.py --deepspeed {config}
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from peft import LoraConfig, get_peft_model

model = AutoModelForCausalLM.from_pretrained("internlm/internlm2-chat-7b")
model = get_peft_model(model, LoraConfig(r=8, target_modules=["wqkv"], task_type="CAUSAL_LM"))
trainer = Trainer(model=model, args=TrainingArguments(output_dir="out"), train_dataset=ds)
trainer.train()
{save}
"""


@pytest.mark.parametrize(
    "config, save, flagged",
    [
        ("ds_z3_config.json", 'model.save_pretrained("out")', True),
        ("ds_config_zero3.json", 'torch.save(model.state_dict(), "out/adapter.bin")', True),
        ("ds_z2_config.json", 'model.save_pretrained("out")', False),  # ZeRO-2 keeps whole parameters
        ("ds_z3_config.json", 'trainer.save_model("out")', False),  # the Trainer gathers the shards
        ("ds_z3_config.json", 'model.save_pretrained("out", state_dict=trainer.accelerator.get_state_dict(trainer.deepspeed))', False),
    ],
)
def test_rule_matches_the_library(config, save, flagged):
    source = SOURCE.format(config=config, save=save)
    codes = [f.code for f in check_source(source, "t.py") if f.code == "GD116"]
    assert bool(codes) == flagged

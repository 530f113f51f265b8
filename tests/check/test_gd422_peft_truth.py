"""GD422's peft freezes, checked against the installed peft (0.21) on a tiny Llama: an adapter loaded with
``PeftModel.from_pretrained`` without ``is_trainable=True`` has no trainable parameter and the first backward
fails; ``prepare_model_for_kbit_training`` given the model *with* its adapters freezes the adapters too, while
the documented order (prepare the base, then attach the adapters) keeps them trainable."""

import pytest

from gpudoctor.check.engine import check_source

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


def _lora():
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _trainable(model) -> int:
    return sum(p.requires_grad for p in model.parameters())


def _backward(model):
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.fixture()
def adapter_dir(tmp_path):
    base = _tiny_llama()
    base.save_pretrained(tmp_path / "base")
    peft.get_peft_model(base, _lora()).save_pretrained(tmp_path / "adapter")
    return tmp_path


def test_adapter_loaded_without_is_trainable_is_frozen(adapter_dir):
    base = transformers.LlamaForCausalLM.from_pretrained(adapter_dir / "base")
    model = peft.PeftModel.from_pretrained(base, adapter_dir / "adapter")
    assert _trainable(model) == 0
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        _backward(model)
    base = transformers.LlamaForCausalLM.from_pretrained(adapter_dir / "base")
    trainable = peft.PeftModel.from_pretrained(base, adapter_dir / "adapter", is_trainable=True)
    assert _trainable(trainable) > 0
    _backward(trainable)


def test_prepare_after_adapters_freezes_them():
    model = peft.get_peft_model(_tiny_llama(), _lora())
    assert _trainable(model) > 0
    model = peft.prepare_model_for_kbit_training(model)
    assert _trainable(model) == 0
    ordered = peft.get_peft_model(peft.prepare_model_for_kbit_training(_tiny_llama()), _lora())
    assert _trainable(ordered) > 0


def test_gd422_reports_both_and_not_the_fixed_order():
    bug = (
        "import torch\n"
        "from peft import PeftModel, prepare_model_for_kbit_training\n"
        "from transformers import AutoModelForCausalLM, Trainer\n"
        "base = AutoModelForCausalLM.from_pretrained('m')\n"
        "model = PeftModel.from_pretrained(base, 'adapter')\n"
        "Trainer(model=model, train_dataset=ds).train()\n"
        "m2 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('m'), 'a', is_trainable=True)\n"
        "m2 = prepare_model_for_kbit_training(m2)\n"
        "opt = torch.optim.AdamW(m2.parameters())\n"
        "m2(**batch).loss.backward()\n"
    )
    lines = sorted(f.line for f in check_source(bug, "bug.py") if f.code == "GD422")
    assert lines == [5, 8]
    fixed = bug.replace("'adapter')", "'adapter', is_trainable=True)").replace(
        "m2 = prepare_model_for_kbit_training(m2)\n", ""
    )
    assert not [f for f in check_source(fixed, "fixed.py") if f.code == "GD422"]

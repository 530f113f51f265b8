"""GD425 checked against the installed peft (0.21) on a tiny BERT classifier: without ``task_type`` the fresh
classification head is frozen (only LoRA trains) and not part of the saved adapter; ``task_type="SEQ_CLS"`` puts
it in ``modules_to_save``."""

import pytest

from gpudoctor.check.engine import check_source

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _classifier():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=3
    )
    return transformers.BertForSequenceClassification(config)


def _trainable_outside_lora(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]


def test_no_task_type_freezes_the_head():
    model = peft.get_peft_model(_classifier(), peft.LoraConfig(r=4, target_modules=["query", "value"]))
    assert _trainable_outside_lora(model) == []
    saved = peft.get_peft_model_state_dict(model)
    assert not any("classifier" in k for k in saved)


def test_seq_cls_trains_and_saves_the_head():
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    model = peft.get_peft_model(_classifier(), config)
    assert any("classifier" in n for n in _trainable_outside_lora(model))
    assert any("classifier" in k for k in peft.get_peft_model_state_dict(model))


def test_gd425_reports_the_config_only_without_task_type():
    bug = (
        "from peft import LoraConfig, get_peft_model\n"
        "from transformers import AutoModelForSequenceClassification, Trainer\n"
        "model = AutoModelForSequenceClassification.from_pretrained('bert-base-uncased', num_labels=3)\n"
        "cfg = LoraConfig(r=4, target_modules=['query', 'value'])\n"
        "model = get_peft_model(model, cfg)\n"
        "Trainer(model=model, train_dataset=ds).train()\n"
    )
    assert [f.line for f in check_source(bug, "bug.py") if f.code == "GD425"] == [4]
    fixed = bug.replace("['query', 'value'])", "['query', 'value'], task_type='SEQ_CLS')")
    assert not [f for f in check_source(fixed, "fixed.py") if f.code == "GD425"]

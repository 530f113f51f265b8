"""GD422 checked against the installed peft (0.21) and transformers (5.24) on the CPU: an adapter loaded with
``PeftModel.from_pretrained`` (``is_trainable`` left at its default) and a peft model passed through
``prepare_model_for_kbit_training`` after ``get_peft_model`` have no trainable parameter; a ``Trainer`` given such a
model fails at the first ``backward()`` without gradient checkpointing, and with it runs to the end without changing
the adapter. ``is_trainable=True`` / preparing the base model first leaves the LoRA matrices trainable."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

NO_GRAD = "element 0 of tensors does not require grad and does not have a grad_fn"


def _base():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.fixture()
def adapter_dir(tmp_path):
    peft.get_peft_model(_base(), _lora()).save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def _trainer(model, tmp_path, checkpointing):
    data = torch.randint(0, 64, (4, 8)).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": data, "labels": data})
    args = transformers.TrainingArguments(str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                                          report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2,
                                          gradient_checkpointing=checkpointing)
    return transformers.Trainer(model=model, args=args, train_dataset=ds)


def test_adapter_loaded_for_inference_is_frozen(adapter_dir):
    assert _trainable(peft.PeftModel.from_pretrained(_base(), adapter_dir)) == 0
    assert _trainable(peft.PeftModel.from_pretrained(_base(), adapter_dir, is_trainable=True)) > 0


def test_prepare_for_kbit_after_get_peft_model_freezes_the_adapters():
    assert _trainable(peft.prepare_model_for_kbit_training(peft.get_peft_model(_base(), _lora()))) == 0
    assert _trainable(peft.get_peft_model(peft.prepare_model_for_kbit_training(_base()), _lora())) > 0


def test_trainer_with_frozen_adapter_raises_without_checkpointing(adapter_dir, tmp_path):
    model = peft.PeftModel.from_pretrained(_base(), adapter_dir)
    with pytest.raises(RuntimeError, match=NO_GRAD):
        _trainer(model, tmp_path, checkpointing=False).train()


def test_trainer_with_frozen_adapter_changes_nothing_with_checkpointing(tmp_path):
    model = peft.prepare_model_for_kbit_training(peft.get_peft_model(_base(), _lora()), use_gradient_checkpointing=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    _trainer(model, tmp_path, checkpointing=True).train()  # runs to the end, no error
    assert before and all(torch.equal(before[n], p) for n, p in model.named_parameters() if "lora_" in n)

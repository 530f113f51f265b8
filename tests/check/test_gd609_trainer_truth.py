"""GD609's Trainer case checked against the installed transformers (5.24) on the CPU: the batch a ``Trainer`` subclass's
``compute_loss`` receives has gone through ``_prepare_inputs`` (the move to the training device), and the trainer
never moves a second model the subclass only stores (``self.teacher``): it places its ``model`` argument alone.
With the teacher's weights on the CPU and the batch on an accelerator (a virtual ``gpu:0``), the teacher's forward
raises torch's device-mismatch error."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from gpudoctor.virtual import VirtualGPUs, fake_place  # noqa: E402

MISMATCH = "Expected all tensors to be on the same device, but found at least two devices"


def _tiny_lm():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def test_compute_loss_gets_prepared_batch_and_teacher_is_not_moved(tmp_path):
    seen = {"prepared": [], "compute_loss": [], "teacher_moves": 0}
    teacher = _tiny_lm()
    original_to = teacher.to

    def spy_to(*args, **kwargs):
        seen["teacher_moves"] += 1
        return original_to(*args, **kwargs)

    teacher.to = spy_to

    class KDTrainer(transformers.Trainer):
        def __init__(self, *args, teacher=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.teacher = teacher

        def _prepare_inputs(self, inputs):
            prepared = super()._prepare_inputs(inputs)
            seen["prepared"].append(id(prepared))
            return prepared

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen["compute_loss"].append(id(inputs))
            out = model(**inputs)
            with torch.no_grad():
                self.teacher(input_ids=inputs["input_ids"])
            return (out.loss, out) if return_outputs else out.loss

    data = torch.randint(0, 64, (4, 8)).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": data, "labels": data})
    args = transformers.TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[],
                                          use_cpu=True, save_strategy="no")
    KDTrainer(model=_tiny_lm(), args=args, train_dataset=ds, teacher=teacher).train()
    assert seen["compute_loss"] and seen["compute_loss"] == seen["prepared"]  # the very batch _prepare_inputs moved
    assert seen["teacher_moves"] == 0  # the trainer never places the stored teacher


def test_unplaced_teacher_fed_a_placed_batch_raises():
    embed = _tiny_lm().get_input_embeddings()  # the teacher's first layer, where its forward fails
    with VirtualGPUs():
        batch = torch.randint(0, 64, (2, 8)).to("gpu:0")  # what the trainer's _prepare_inputs did
        with pytest.raises(RuntimeError, match=MISMATCH):
            embed(batch)
        fake_place(embed, {"": "gpu:0"})  # the fix: place the teacher on the trainer's device
        assert embed(batch).device.type == "gpu"

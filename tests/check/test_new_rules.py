"""The failures behind the rules added for issue 9 (GD114, GD306, GD415, GD613), reproduced with the
installed libraries where that is possible on CPU."""

from __future__ import annotations

import pytest


def _linear_lrs(prepare_scheduler: bool) -> list[float]:
    torch = pytest.importorskip("torch")
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = torch.utils.data.DataLoader(torch.randn(32, 2), batch_size=1)  # 32 micro-batches = 8 updates
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, num_training_steps=len(loader) // 4)
    if prepare_scheduler:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    lrs = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return lrs


@pytest.mark.filterwarnings("ignore")
def test_gd114_unprepared_scheduler_reaches_zero_early():
    unprepared = _linear_lrs(False)
    prepared = _linear_lrs(True)
    assert unprepared.index(0.0) == 7  # after 8 of 32 micro-batches: 2 of the 8 updates
    assert prepared.index(0.0) == 31  # at the very end


def _word_tokenizer():
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def test_gd306_lm_collator_discards_masked_labels():
    pytest.importorskip("transformers")
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(_word_tokenizer(), mlm=False)
    same_length = [{"input_ids": [2, 3, 4], "labels": [-100, -100, 4]}, {"input_ids": [2, 2, 3], "labels": [-100, 2, 3]}]
    assert collator(same_length)["labels"].tolist() == [[2, 3, 4], [2, 2, 3]]  # the prompt mask is gone
    different = [{"input_ids": [2, 3, 4], "labels": [-100, -100, 4]}, {"input_ids": [2, 3], "labels": [-100, 3]}]
    with pytest.raises(ValueError, match="Unable to create tensor"):
        collator(different)


def test_gd613_cpu_tensor_into_offloaded_parameter_raises(tmp_path):
    torch = pytest.importorskip("torch")
    accelerate = pytest.importorskip("accelerate")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model = accelerate.dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, main_device="cpu", offload_dir=str(tmp_path))
    assert model[1].weight.device.type == "meta"  # offloaded: accelerate's hook loads it for each forward
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        model[1].weight.data = torch.zeros(2, 2)

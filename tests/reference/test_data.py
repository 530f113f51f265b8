from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpudoctor.reference.data import (  # noqa: E402
    BUNDLED_DATA,
    IGNORE_INDEX,
    Dialog,
    PadToLongest,
    build_tokenizer,
    encode_dialog,
    load_dialogs,
    prompt_ids,
)


@pytest.fixture(scope="module")
def tokenizer(dialogs):
    return build_tokenizer([d.prompt + d.response for d in dialogs])


def test_bundled_data_has_the_field_report_format():
    rows = json.loads(BUNDLED_DATA.read_text(encoding="utf-8"))
    assert 40 <= len(rows) <= 60
    assert all(set(row) == {"Description", "Patient", "Doctor"} for row in rows)
    first = load_dialogs()[0]
    assert first.prompt == f"Description: {rows[0]['Description']} Patient: {rows[0]['Patient']} Doctor:"
    assert first.response.strip() == rows[0]["Doctor"]


def test_load_dialogs_names_the_missing_key(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"Description": "d", "Patient": "p"}]))
    with pytest.raises(ValueError, match="Doctor"):
        load_dialogs(path)


def test_tokenizer_pad_is_distinct_from_eos(tokenizer):
    assert tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    # Byte-level: text never seen in training still round-trips.
    text = "Zebra xylophone 42°C!"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_labels_copy_input_ids_with_prompt_masked_and_eos_kept(tokenizer):
    dialog = Dialog("Description: a Patient: b Doctor:", " Drink water.")
    example = encode_dialog(tokenizer, dialog, max_length=256)
    n_prompt = len(prompt_ids(tokenizer, dialog.prompt))
    ids, labels = example["input_ids"], example["labels"]
    assert len(ids) == len(labels)
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert ids[-1] == labels[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[n_prompt:], skip_special_tokens=True) == " Drink water."


def test_example_without_response_tokens_is_dropped(tokenizer):
    dialog = Dialog("Description: " + "long " * 100 + "Patient: b Doctor:", " Rest.")
    assert encode_dialog(tokenizer, dialog, max_length=16) is None


def test_collator_pads_to_longest_and_masks_prompt_and_padding():
    features = [
        {"input_ids": [1, 10, 11, 12, 2], "labels": [-100, -100, 11, 12, 2]},
        {"input_ids": [1, 20, 21], "labels": [-100, 21, 2]},
    ]
    batch = PadToLongest(pad_token_id=0)(features)
    assert batch["input_ids"].shape == (2, 5)  # the longest row, not a fixed max_length
    assert batch["input_ids"][1].tolist() == [1, 20, 21, 0, 0]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 11, 12, 2], [-100, 21, 2, -100, -100]]


def test_collator_keeps_eos_labels_when_pad_equals_eos():
    # The pitfall: pad = eos plus masking by id would also erase the real EOS labels.
    eos = 2
    features = [{"input_ids": [1, 5, eos], "labels": [-100, 5, eos]}, {"input_ids": [1, eos], "labels": [-100, eos]}]
    batch = PadToLongest(pad_token_id=eos)(features)
    assert batch["labels"].tolist() == [[-100, 5, eos], [-100, eos, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_dynamic_padding_varies_with_the_batch(tokenizer, dialogs):
    from gpudoctor.reference.data import DialogDataset

    data = DialogDataset(dialogs[:8], tokenizer, max_length=256)
    collate = PadToLongest(tokenizer.pad_token_id)
    widths = {collate([data[i], data[i + 1]])["input_ids"].shape[1] for i in range(0, 8, 2)}
    lengths = sorted(len(data[i]["input_ids"]) for i in range(8))
    assert len(widths) > 1 and max(widths) == lengths[-1] < 256

"""Dialog data: the field report's JSON format, a tokenizer built offline, labels and dynamic padding.

The JSON is a list of objects with ``Description``, ``Patient`` and ``Doctor`` (the format of
the medical-dialog set in the third field report). The prompt is the description and the
patient's message; the response, the only part the loss is computed on, is the doctor's answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

BUNDLED_DATA = Path(__file__).with_name("data") / "medical_dialog_sample.json"

# Label value ignored by the causal-LM loss (``ignore_index`` of ``F.cross_entropy``).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Dialog:
    prompt: str
    response: str


def format_prompt(description: str, patient: str) -> str:
    # "Doctor:" cues where the answer starts, so generate() continues with an answer.
    return f"Description: {description} Patient: {patient} Doctor:"


def load_dialogs(path: str | Path = BUNDLED_DATA) -> list[Dialog]:
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of {{Description, Patient, Doctor}} objects")
    dialogs = []
    for i, row in enumerate(rows):
        missing = {"Description", "Patient", "Doctor"} - set(row)
        if missing:
            raise ValueError(f"{path}: entry {i} lacks {sorted(missing)}")
        dialogs.append(Dialog(format_prompt(row["Description"], row["Patient"]), " " + row["Doctor"].strip()))
    return dialogs


def build_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on ``texts``, with a pad token distinct from EOS.

    Byte-level means any prompt can be encoded, even words never seen in training.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a prompt, with BOS when the tokenizer has one: the same for training and generate()."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def encode_dialog(tokenizer, dialog: Dialog, max_length: int) -> dict[str, list[int]] | None:
    """input_ids = prompt + response + EOS; labels are the same ids with IGNORE_INDEX on the prompt.

    Labels are a copy of input_ids, not a separate tokenization of the target: the model shifts
    them internally. EOS stays a label so the model learns to stop. Returns None when truncation
    leaves no response token to learn from (such a row would make the loss NaN).
    """
    prompt = prompt_ids(tokenizer, dialog.prompt)
    response = tokenizer(dialog.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt + response)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt) + response)[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return {"input_ids": input_ids, "labels": labels}


class DialogDataset(torch.utils.data.Dataset):
    def __init__(self, dialogs: list[Dialog], tokenizer, max_length: int):
        encoded = [encode_dialog(tokenizer, d, max_length) for d in dialogs]
        self.examples = [e for e in encoded if e is not None]
        self.dropped = len(encoded) - len(self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, idx: int) -> dict[str, list[int]]:
        return self.examples[idx]


class PadToLongest:
    """Collate: pad each batch to its own longest row (dynamic padding), right side.

    Padding is masked by position (attention_mask 0, label IGNORE_INDEX), never by comparing ids
    with ``pad_token_id``: with ``pad = eos`` that comparison would also erase every real EOS label.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            input_ids[row, :n] = torch.tensor(f["input_ids"])
            labels[row, :n] = torch.tensor(f["labels"])
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

"""GD303's encoder-decoder case checked against the installed transformers (5.24) on the CPU: ``DataCollatorForSeq2Seq``
leaves pad ids that are already in the labels (it uses ``label_pad_token_id`` only for the padding it adds), and a
T5 model's loss scores those pad positions (its ``CrossEntropyLoss`` ignores -100 only)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_collator_keeps_pre_padded_label_ids():
    class Tok:  # the collator only needs pad() and the padding side
        padding_side = "right"
        pad_token_id = 0
        model_input_names = ["input_ids", "attention_mask"]

        def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors=None, **kw):
            width = max(len(f["input_ids"]) for f in features)
            ids = [f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]
            mask = [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
            return transformers.BatchEncoding({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)})

    collator = transformers.DataCollatorForSeq2Seq(Tok(), label_pad_token_id=-100)
    batch = collator([{"input_ids": [5, 6], "labels": [7, 8, 0, 0]}, {"input_ids": [5], "labels": [9, 0]}])
    assert batch["labels"].tolist() == [[7, 8, 0, 0], [9, 0, -100, -100]]  # the pad ids it did not add stay 0


def test_t5_loss_counts_pad_ids_but_not_minus_100():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    inputs = torch.tensor([[5, 6, 7, 1]])
    padded = torch.tensor([[8, 9, 1, 0, 0, 0]])
    masked = padded.masked_fill(padded == 0, -100)
    with torch.no_grad():
        with_pads = model(input_ids=inputs, labels=padded).loss
        without = model(input_ids=inputs, labels=masked).loss
        logits = model(input_ids=inputs, labels=padded).logits
    ce = torch.nn.functional.cross_entropy(logits[0], padded[0])  # every position, pads included
    assert torch.allclose(with_pads, ce) and not torch.allclose(with_pads, without)

"""GD413's resize_token_embeddings trigger, checked against the installed transformers (5.24): resizing after
the optimizer is built keeps the input embedding's Parameter object (its data is swapped), but with untied
input/output embeddings the resized output head is a *new* Parameter the optimizer does not hold, so the
output layer never trains. Tied models (GPT-2) keep every Parameter: a warning, the file cannot show which."""

import pytest

from gpudoctor.check.engine import check_source
from gpudoctor.check.finding import Severity
from gpudoctor.check.registry import rule_by_code

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_model(tied: bool):
    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, n_positions=16, vocab_size=10, tie_word_embeddings=tied,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _held(optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _step(model, optimizer):
    ids = torch.tensor([[1, 11, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def test_untied_resize_after_optimizer_leaves_the_new_head_out():
    torch.manual_seed(0)
    model = _tiny_model(tied=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.resize_token_embeddings(12)
    head = model.get_output_embeddings().weight
    assert head.shape[0] == 12
    assert id(head) not in _held(optimizer)
    before = head.detach().clone()
    _step(model, optimizer)
    assert torch.equal(before, model.get_output_embeddings().weight.detach())  # the head never trains


def test_tied_resize_keeps_the_parameters():
    model = _tiny_model(tied=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.resize_token_embeddings(12)
    assert id(model.get_input_embeddings().weight) in _held(optimizer)
    assert id(model.get_output_embeddings().weight) in _held(optimizer)


def test_gd413_reports_resize_as_warning():
    source = (
        "import torch\n"
        "def resize(net, tokenizer):\n"
        "    opt = torch.optim.AdamW(net.parameters())\n"
        "    net.resize_token_embeddings(len(tokenizer))\n"
        "    return opt\n"
    )
    findings = check_source(source, "t.py", rules=[rule_by_code("GD413")])
    assert [f.severity for f in findings] == [Severity.WARNING]

"""``PARAMETERLESS_MODULES`` is true for the installed torch: each listed ``torch.nn`` class, built as people
build it, holds no parameter and no buffer (so it runs on its inputs' device and needs no placement), and the
weighted losses do hold a buffer once given a weight (so ``holds_no_tensors`` must not excuse them then)."""

from __future__ import annotations

import pytest

import libcst as cst

from gpudoctor.check.facts import collect
from gpudoctor.check.rules.placement._common import PARAMETERLESS_MODULES, TENSOR_ARGUMENTS, holds_no_tensors

torch = pytest.importorskip("torch")
nn = torch.nn

# Constructor arguments the classes need (the smallest usual ones).
REQUIRED = {
    "Threshold": (0.1, 0.0), "Unflatten": (1, (2, 2)), "MaxPool1d": (2,), "MaxPool2d": (2,), "MaxPool3d": (2,),
    "AvgPool1d": (2,), "AvgPool2d": (2,), "AvgPool3d": (2,), "AdaptiveAvgPool1d": (1,), "AdaptiveAvgPool2d": (1,),
    "AdaptiveAvgPool3d": (1,), "AdaptiveMaxPool1d": (1,), "AdaptiveMaxPool2d": (1,), "AdaptiveMaxPool3d": (1,),
    "PixelShuffle": (2,), "PixelUnshuffle": (2,), "ZeroPad2d": (1,),
}


@pytest.mark.parametrize("name", sorted(PARAMETERLESS_MODULES))
def test_listed_module_holds_no_tensors(name: str) -> None:
    module = getattr(nn, name)(*REQUIRED.get(name, ()))
    assert not list(module.parameters()), f"nn.{name} has parameters"
    assert not list(module.buffers()), f"nn.{name} has buffers"


@pytest.mark.parametrize("name", sorted(TENSOR_ARGUMENTS))
def test_weighted_loss_holds_its_weight(name: str) -> None:
    assert name in PARAMETERLESS_MODULES
    for keyword in TENSOR_ARGUMENTS[name]:
        module = getattr(nn, name)(**{keyword: torch.ones(3)})
        assert list(module.buffers()), f"nn.{name}({keyword}=...) registers no buffer"


def test_modules_with_tensors_are_not_listed() -> None:
    for name in ("PReLU", "Linear", "Embedding", "LayerNorm", "BatchNorm1d", "Conv2d", "Sequential", "ModuleList"):
        assert name not in PARAMETERLESS_MODULES


CASES = [
    ("criterion = nn.CrossEntropyLoss()", True),
    ("criterion = nn.CrossEntropyLoss(ignore_index=-100, reduction='mean')", True),
    ("criterion = nn.CrossEntropyLoss(weight=None)", True),
    ("criterion = nn.CrossEntropyLoss(weight=class_weights)", False),
    ("criterion = nn.CrossEntropyLoss(class_weights)", False),
    ("criterion = nn.BCEWithLogitsLoss(pos_weight=pw)", False),
    ("criterion = nn.MSELoss(**loss_kwargs)", True),
    ("criterion = nn.BCELoss(**loss_kwargs)", False),
    ("criterion = nn.ReLU()", True),
    ("criterion = nn.PReLU()", False),
    ("criterion = nn.Linear(3, 3)", False),
]


@pytest.mark.parametrize("line,expected", CASES)
def test_holds_no_tensors_query(line: str, expected: bool) -> None:
    source = f"import torch.nn as nn\n{line}\nout = criterion(x)\n"
    facts = collect(cst.parse_module(source), source)
    site = next(s for s in facts.calls if getattr(s.node.func, "value", None) == "criterion")
    assert holds_no_tensors(facts, site.node.func, site.order, site.scope) is expected

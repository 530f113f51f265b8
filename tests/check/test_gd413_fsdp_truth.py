"""GD413's FSDP trigger, checked against the installed torch (2.13) on one gloo CPU rank: FSDP1 with the default
use_orig_params=False and FSDP2's fully_shard swap the module's Parameter objects, so an optimizer built before
the wrap holds tensors that never get a gradient and never change; FSDP1 with use_orig_params=True keeps the
objects (not flagged). Run in a subprocess: the process group must not leak into other tests."""

import textwrap

import pytest

from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import rule_by_code
from gloo_probe import run_on_one_gloo_rank

pytest.importorskip("torch")

_PROBE = """
import torch, torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard

for kind in ("fsdp1", "fsdp1_orig_params", "fsdp2"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    held = list(model.parameters())
    before = [p.detach().clone() for p in held]
    if kind == "fsdp1":
        wrapped = FSDP(model, device_id=torch.device("cpu"))
    elif kind == "fsdp1_orig_params":
        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        fully_shard(model)
        wrapped = model
    wrapped(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    print(kind, any(not torch.equal(b, p.detach()) for b, p in zip(before, held)))
"""


@pytest.mark.slow  # a subprocess that imports torch and starts a process group (~25 s)
def test_optimizer_built_before_the_fsdp_wrap_updates_nothing():
    changed = dict(line.split() for line in run_on_one_gloo_rank(_PROBE))
    assert changed == {"fsdp1": "False", "fsdp1_orig_params": "True", "fsdp2": "False"}


def test_rule_follows_the_measured_cases():
    source = textwrap.dedent(
        """
        import torch, torch.nn as nn
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard

        def default_wrap():
            model = nn.Linear(4, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            model = FSDP(model)
            return model, optimizer

        def orig_params():
            model = nn.Linear(4, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            model = FSDP(model, use_orig_params=True)
            return model, optimizer

        def fsdp2():
            model = nn.Linear(4, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            fully_shard(model)
            return model, optimizer
        """
    )
    findings = check_source(source, "probe.py", rules=[rule_by_code("GD413")])
    assert sorted(f.line for f in findings) == [7, 19]

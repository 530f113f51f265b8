"""GD115 checked against the installed torch (2.13) on one gloo CPU rank: DistributedDataParallel and DataParallel
do not forward a model's own methods (``generate``), while ``.module`` reaches them. Subprocess: the process group
must not leak into other tests."""

import pytest

from gloo_probe import run_on_one_gloo_rank

pytest.importorskip("torch")

_PROBE = """
import torch.nn as nn


class Model(nn.Linear):
    def generate(self):
        return "generated"


for wrapper in (nn.parallel.DistributedDataParallel(Model(2, 2)), nn.DataParallel(Model(2, 2))):
    try:
        wrapper.generate()
        print("forwarded")
    except AttributeError as error:
        print(error)
    print(wrapper.module.generate())
"""


@pytest.mark.slow  # a subprocess that imports torch and starts a process group
def test_wrappers_do_not_forward_generate():
    assert run_on_one_gloo_rank(_PROBE) == [
        "'DistributedDataParallel' object has no attribute 'generate'",
        "generated",
        "'DataParallel' object has no attribute 'generate'",
        "generated",
    ]

"""GD615 checked against the installed torch (2.13): the worker command torchrun builds carries no ``--local-rank``
(only the LOCAL_RANK variable), the legacy ``torch.distributed.launch`` appends the dashed ``--local-rank=<rank>``
(not with ``--use-env``), and an argparse parser that only declares ``--local_rank`` rejects the dashed form."""

import argparse

import pytest

pytest.importorskip("torch")
from torch.distributed import launch, run  # noqa: E402


def _worker_args(parsed):
    return run.config_from_args(parsed)[2]


def test_torchrun_passes_no_local_rank_argument():
    assert not any("local" in a for a in _worker_args(run.parse_args(["--nproc_per_node", "2", "train.py", "--x", "1"])))


def test_legacy_launcher_passes_the_dashed_option():
    args = _worker_args(launch.parse_args(["--nproc_per_node", "2", "train.py"]))
    assert "--local-rank=${local_rank}" in args
    with_env = _worker_args(launch.parse_args(["--nproc_per_node", "2", "--use-env", "train.py"]))
    assert not any("local" in a for a in with_env)


def test_underscored_option_rejects_the_dashed_spelling():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--local-rank=0"])
    both = argparse.ArgumentParser()
    both.add_argument("--local-rank", "--local_rank", type=int, default=-1)
    assert both.parse_args(["--local-rank=3"]).local_rank == 3
